"""The `--update` grammar: 'sync', 'delayed:T', 'delayed-nocomp:T', 'sparse:P[,outer=LR]',
'async:TAU[,fetch=F][,push=Q]' -> an `UpdateSpec` (what the rule is, not how it runs)."""

from __future__ import annotations

from dataclasses import dataclass

from dpjax.errors import UserError

HELP = ("how workers agree on an update: 'sync' (gradient average every step); 'delayed:T' (DTAW: apply "
        "the own gradient now, the average T steps late with the stale own gradient swapped out); "
        "'delayed-nocomp:T' (only the T-step-old average); 'sparse:P[,outer=LR]' (local SGD, parameters "
        "averaged every P steps; outer=LR: DiLoCo outer Nesterov with that lr); "
        "'async:TAU[,fetch=F][,push=Q]' (parameter server; gradients on copies up to TAU versions old, "
        "seeded; Downpour: fetch every F, push accumulated gradients every Q steps)")


@dataclass(frozen=True)
class UpdateSpec:
    """A parsed `--update` value. `n` is T (delayed), P (sparse) or TAU (async)."""

    kind: str = "sync"  # sync | delayed | delayed-nocomp | sparse | async
    n: int = 0
    outer_lr: float = 0.0  # sparse: 0 means a plain parameter average
    fetch: int = 1
    push: int = 1

    @property
    def is_sync(self) -> bool:
        return (self.kind == "sync" or (self.kind.startswith("delayed") and self.n == 0)
                or (self.kind == "sparse" and self.n == 1 and not self.outer_lr)
                or (self.kind == "async" and self.n == 0 and self.fetch == 1 and self.push == 1))

    def __str__(self) -> str:
        if self.kind == "sync":
            return "sync"
        opts = {"sparse": [f"outer={self.outer_lr:g}"] if self.outer_lr else [],
                "async": [f"fetch={self.fetch}"] * (self.fetch > 1) + [f"push={self.push}"] * (self.push > 1)}
        return ",".join([f"{self.kind}:{self.n}", *opts.get(self.kind, [])])


_OPTIONS = {"sparse": {"outer": float}, "async": {"fetch": int, "push": int}}


def parse_update(text: str) -> UpdateSpec:
    """'delayed:4' -> UpdateSpec('delayed', 4). Raises UserError (one line) for bad specs."""
    head, *opts = str(text).strip().split(",")
    kind, _, num = head.partition(":")

    def bad(why):
        return UserError(f"bad --update {text!r}: {why}")

    if kind == "sync" and not num and not opts:
        return UpdateSpec()
    what = {"delayed": "the delay T", "delayed-nocomp": "the delay T", "sparse": "the period P",
            "async": "the staleness bound TAU"}
    if kind not in what:
        raise bad("choose sync, delayed:T, delayed-nocomp:T, sparse:P or async:TAU")
    low = 1 if kind == "sparse" else 0
    try:
        n = int(num)
    except ValueError:
        n = -1
    if n < low:
        raise bad(f"{what[kind]} must be an integer >= {low}")
    kw = {}
    for opt in opts:
        key, eq, val = opt.partition("=")
        conv = _OPTIONS.get(kind, {}).get(key.strip())
        if conv is None or not eq:
            allowed = ", ".join(f"{k}=..." for k in _OPTIONS.get(kind, {})) or "none"
            raise bad(f"unknown option {opt!r} (options of {kind}: {allowed})")
        try:
            kw[key.strip()] = conv(val)
        except ValueError:
            raise bad(f"option {key.strip()} needs a number, got {val!r}") from None
    if kw.get("outer", 1) <= 0 or min(kw.get("fetch", 1), kw.get("push", 1)) < 1:
        raise bad("outer must be positive, fetch and push at least 1")
    return UpdateSpec(kind, n, kw.get("outer", 0.0), kw.get("fetch", 1), kw.get("push", 1))
