"""The names dpjax gives its phases and collectives in the compiled program, and their parser.

`jax.named_scope` changes nothing but the `op_name` metadata of the ops traced inside
it, so naming every phase and every collective costs no op, no callback and no time
(`tests/test_timeline.py` compiles a step with the names and without them and
compares). `dpjax.timeline` joins a profile's executed ops (`hlo_op`) to the compiled
program's metadata and reads these names back:

    dpjax:phase(forward_backward)                   a phase of the step (PHASES)
    dpjax:bucket(index=0,of=2,tensors=12,bytes=N)   one tensor-fusion bucket of a grouped collective
    dpjax:allreduce(algorithm=ring,axis=data,n=8,bytes=S,call=k)
                                                    one call of a public collective (COLLECTIVES);
                                                    S is nccl-tests' size: the whole buffer
                                                    (allreduce, broadcast, reduce_scatter's input,
                                                    all_gather's output, all_to_all's input); k
                                                    numbers the calls of one traced step
                                                    (`numbered_calls`), so that two calls with the
                                                    same arguments stay apart even when XLA
                                                    interleaves their steps
    dpjax:send(name=activations,axis=stage,n=S,bytes=B)
                                                    one point-to-point send (`collectives.p2p`:
                                                    a pipeline's activations or gradients)
    dpjax:step(index=3,bytes=B)                     the 3rd point-to-point step (one ppermute, B
                                                    bytes from each sender) of the enclosing call
    dpjax:compression(start=S), dpjax:average(period=P)
                                                    a lax.cond whose branches run on some steps
                                                    only (`dpjax.train.comm_bytes` charges each
                                                    step the branch it runs)

Autodiff wraps names (`jvp(dpjax:phase(forward_backward))`, `transpose(jvp(...))`), so
`parse` finds them anywhere in an op_name, outermost first.
"""

from __future__ import annotations

import contextlib
import contextvars
import re

import jax

PHASES = ("forward_backward", "exchange", "optimizer", "loss")
HOST_PHASES = ("data", "dispatch", "host_wait", "checkpoint", "eval", "generate", "score")  # the last two: GRPO
COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send")

_TOKEN = re.compile(r"dpjax:(\w+)(?:\(([^()]*)\))?")

# The point-to-point steps of the collective being traced, counted so that each one is
# named by its place in the schedule. A context variable (not module state): set for
# the duration of one public call's tracing and restored after it.
_STEPS: contextvars.ContextVar[list | None] = contextvars.ContextVar("dpjax_p2p_steps", default=None)
_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("dpjax_calls", default=None)


def name(kind: str, label: str | None = None, **args) -> str:
    """'dpjax:kind(label)' or 'dpjax:kind(k=v,...)' (or 'dpjax:kind')."""
    if label is not None:
        return f"dpjax:{kind}({label})"
    if not args:
        return f"dpjax:{kind}"
    return f"dpjax:{kind}(" + ",".join(f"{k}={_text(v)}" for k, v in args.items()) + ")"


def _text(v) -> str:
    if isinstance(v, (tuple, list)):
        return "+".join(map(str, v))
    return str(v)


def scope(kind: str, label: str | None = None, **args):
    """`jax.named_scope` with a dpjax name (looked up at call time, so a test can swap it)."""
    return jax.named_scope(name(kind, label, **args))


def phase(which: str):
    """The named scope of a phase of the step (one of PHASES)."""
    assert which in PHASES, which
    return scope("phase", which)


@contextlib.contextmanager
def numbered_calls():
    """While a step is traced inside (`dpjax.step.build` does), its public collective
    calls are numbered 1, 2, ... in their names."""
    token = _CALLS.set([0])
    try:
        yield
    finally:
        _CALLS.reset(token)


@contextlib.contextmanager
def collective(kind: str, **args):
    """The named scope of one public collective call; the point-to-point steps traced
    inside are numbered from 1 (`p2p_step`)."""
    calls = _CALLS.get()
    if calls is not None:
        calls[0] += 1
        args = {**args, "call": calls[0]}
    token = _STEPS.set([0])
    try:
        with scope(kind, **args):
            yield
    finally:
        _STEPS.reset(token)


def p2p_step(nbytes: int):
    """The named scope of the next point-to-point step of the collective being traced."""
    count = _STEPS.get()
    if count is None:  # a ppermute outside any public call (an algorithm called directly)
        return scope("step", index=0, bytes=nbytes)
    count[0] += 1
    return scope("step", index=count[0], bytes=nbytes)


def parse(op_name: str) -> list[tuple[str, dict]]:
    """The dpjax names in an op_name, outermost first: [(kind, args)]; a label such as a
    phase's comes back as {"name": label}. Integer values are ints."""
    out = []
    for kind, body in _TOKEN.findall(op_name):
        args: dict = {}
        if body and "=" not in body:
            args["name"] = body
        elif body:
            for item in body.split(","):
                k, _, v = item.partition("=")
                args[k] = int(v) if v.lstrip("-").isdigit() else v
        out.append((kind, args))
    return out
