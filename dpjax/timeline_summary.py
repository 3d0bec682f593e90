"""Old path of `dpjax.timeline.summary`, kept only while dpjax/train.py imports
`summarize` from here; remove it once train.py imports `from dpjax.timeline import summarize`."""

from dpjax.timeline.summary import summarize

__all__ = ["summarize"]
