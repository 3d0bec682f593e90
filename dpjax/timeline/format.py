"""The timeline file's format tag, written by `build` and checked by `summary.load`."""

FORMAT = "dpjax-timeline/1"
