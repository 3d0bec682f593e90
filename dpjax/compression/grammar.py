"""The `--compression` grammar: `name[:N][,key=VALUE]...`, e.g. `powersgd:4,start=100,ef=0`
(`dpjax.registry.Spelling`, the grammar `--update` is written in too).

    name      a registered method (`registry.names()`), or none
    N         the method's number when it takes one (`Method.number`): PowerSGD's rank R,
              top-k's and random-k's fraction F of the values sent
    ef=0|1    error feedback (default 1): what compression drops is added to the next
              exchange's input (Seide et al. 2014; Karimireddy et al. 2019); 0 turns it
              off (the experiments' ablation)
    start=S   the first S exchanges are exact, the uncompressed allreduce bit for bit
              (PowerSGD's start_powerSGD_iter; default 0)
    refresh=R with --optimizer onebit_adam only: after the S exact steps, the exchanges
              S R, S R^2, S R^3, ... are exact too, and Adam's variance is updated from
              them (0/1 Adam's exponentially sparser variance updates; default 0: frozen
              after step S, as 1-bit Adam freezes it)
    bound=C   with --optimizer onebit_adam only: after the freeze, no coordinate of the
              exchanged momentum goes beyond C sqrt(v) (Adam's own per-coordinate scale);
              the excess is held and sent with the next step's, not lost (default 0: none)

Only methods with error feedback (`Method.stateful`) take options. Every message is one
line (a `ValueError`; `dpjax.plan.check` turns it into a `UsageError`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dpjax.compression import registry
from dpjax.registry import Spelling

OPTIONS = ("ef", "start", "refresh", "bound")
_OPTIONS_TEXT = "ef=0|1, start=S, refresh=R and bound=C"


@dataclass(frozen=True)
class Spec:
    """A parsed compression: the method, its number (None if it takes none), error
    feedback on or off, and the exchanges before it starts."""

    method: registry.Method
    number: float | int | None = None
    ef: bool = True
    start: int = 0
    refresh: int = 0
    bound: float = 0.0

    def refreshes(self, limit: int = 2**31 - 1) -> tuple:
        """The exchanges after the start that run exact again (refresh=R: S R, S R^2, ...
        below `limit`); () without refresh."""
        out, at = [], self.start * self.refresh
        while self.refresh and at < limit:
            out.append(at)
            at *= self.refresh
        return tuple(out)

    def exact_at(self, t: int) -> bool:
        """Whether exchange t (0-based) is exact: before the start, or a refresh."""
        return t < self.start or t in self.refreshes(t + 1)

    @property
    def name(self) -> str:
        return self.method.name

    def __str__(self) -> str:
        out = self.name if self.number is None else f"{self.name}:{self.number}"
        return out + ("" if self.ef else ",ef=0") + (f",start={self.start}" if self.start else "") + \
            (f",refresh={self.refresh}" if self.refresh else "") + (f",bound={self.bound:g}" if self.bound else "")


def parse(text) -> Spec | None:
    """The spec of `text` (None for no compression, None or "none"); a `Spec` passes
    through. Raises a one-line ValueError."""
    if isinstance(text, Spec) or text in registry.NONE:
        return text if isinstance(text, Spec) else None
    if not isinstance(text, str):
        raise ValueError(f"compression must be a name such as 'powersgd:4', got {text!r}")
    spelling = Spelling.of(text)
    name, number = spelling.name, spelling.number
    method = registry.get(name)
    if method is None:
        choices = ("none", *registry.names())
        raise ValueError(f"unknown compression {text!r}; choose {', '.join(choices[:-1])} or {choices[-1]}")
    if method.number is None and number is not None:
        raise ValueError(f"compression {name!r} takes no number, got {text!r}")
    value = None
    if method.number is not None:
        if not number:
            raise ValueError(f"compression {name!r} needs {method.number}: e.g. {name}:{_example(method)}")
        try:
            value = method.number_type(number)
        except ValueError:
            raise ValueError(f"compression {text!r}: {method.number} must be a {method.number_type.__name__}, "
                             f"got {number!r}") from None
        if not method.number_ok(value):
            raise ValueError(f"compression {text!r}: {method.number} must be {method.number_must}, got {number}")
    if spelling.options and not method.stateful:
        raise ValueError(f"compression {name!r} takes no options (it keeps no state), got {text!r}")
    got = {}
    given = spelling.given(OPTIONS, lambda opt: ValueError(f"compression {text!r}: unknown option {opt!r}; options "
                                                           f"are {_OPTIONS_TEXT}"),
                           lambda key: ValueError(f"compression {text!r}: option {key!r} given twice"))
    for key, val in given.items():
        if key == "bound":
            got[key] = _positive(text, val)
            continue
        if not val.isdigit() or (key == "ef" and val not in ("0", "1")):
            raise ValueError(f"compression {text!r}: {key} takes {'0 or 1' if key == 'ef' else 'an integer >= 0'}, "
                             f"got {val!r}")
        got[key] = int(val)
    if got.get("refresh", 0) == 1 or (got.get("refresh") and not got.get("start")):
        raise ValueError(f"compression {text!r}: refresh=R makes exchanges S R, S R^2, ... exact after start=S: it "
                         "needs start=S >= 1 and R >= 2 (0: no refresh)")
    if got.get("bound") and not got.get("start"):
        raise ValueError(f"compression {text!r}: bound=C limits the momentum after the variance is frozen at "
                         "start=S: it needs start=S >= 1")
    return Spec(method, value, bool(got.get("ef", 1)), got.get("start", 0), got.get("refresh", 0),
                got.get("bound", 0.0))


def _positive(text: str, val: str) -> float:
    try:
        out = float(val)
    except ValueError:
        out = float("nan")
    if not (out >= 0 and out < float("inf")):
        raise ValueError(f"compression {text!r}: bound takes a number >= 0, got {val!r}")
    return out


def check(name) -> registry.Method | None:
    """The method of `name` (a method's name or a spec such as "powersgd:4,ef=0",
    `grammar.parse`), None for no compression (None or "none"); else a one-line ValueError."""
    spec = parse(name)
    return None if spec is None else spec.method


def summable(name) -> registry.Method | None:
    """`check(name)`, for an exchange that sums the encoded values on the wire (an
    allreduce, a reduce-scatter): the method must be linear and keep no state."""
    method = check(name)
    if method is not None and method.stateful:
        raise ValueError(f"compression {name!r} keeps error-feedback state across steps: a one-off reduction "
                         "cannot carry it (use DistributedOptimizer, an update rule or dpjax.compression.exchange)")
    if method is not None and not method.linear:
        raise ValueError(f"compression {name!r} is not linear: a reduction cannot sum it on the wire")
    return method


def _example(method) -> str:
    return "0.01" if method.number_type is float else "4"


def spell(name: str, number=None, **options) -> str:
    """The spec of method `name` with its number and options as keywords (`ef=False`,
    `start=S`; the defaults left out), checked: this grammar's keyword form, as Horovod's
    `hvd.Compression.powersgd(4, start=100)` writes "powersgd:4,start=100"."""
    defaults = {"ef": True, "start": 0, "refresh": 0, "bound": 0.0}
    opts = tuple((f"{k}={int(v) if isinstance(v, bool) else v}", k, str(v)) for k, v in options.items()
                 if v != defaults.get(k))
    text = str(Spelling(name, None if number is None else str(number), opts))
    parse(text)  # a bad number or option is refused here, in one line
    return text


def stateful(text) -> bool:
    """Whether the compression `text` keeps state (error feedback, PowerSGD's Q)."""
    spec = parse(text)
    return spec is not None and spec.method.stateful
