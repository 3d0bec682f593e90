"""A compiled program's ops, read from its HLO text: what names a profile's ops.

A profile records each executed op by its HLO name only (`hlo_op`); the compiled
program's text gives that op its opcode and its `op_name` metadata, in which dpjax's
named scopes (`dpjax.scopes`) say which phase, collective call and point-to-point step
it belongs to. `compiled_text(fn, *args)` is the text of the executable a jitted
function runs at those arguments; `Program.from_text` parses it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax

from dpjax.timeline.spans import is_collective

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*.*?\s(?P<opcode>[a-z][\w\-]*)\((?P<rest>.*)$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_MODULE = re.compile(r"^HloModule\s+([^\s,]+)", re.M)


@dataclass(frozen=True)
class Program:
    """A compiled program's ops: hlo op name -> (opcode, op_name)."""

    module: str
    ops: dict

    @classmethod
    def from_text(cls, hlo_text: str) -> "Program":
        m = _MODULE.search(hlo_text)
        if m is None:
            raise ValueError("not compiled HLO text: no 'HloModule' line")
        ops = {}
        for line in hlo_text.splitlines():
            i = _INSTR.match(line)
            if i:
                name = _OP_NAME.search(i.group("rest"))
                ops[i.group("name")] = (i.group("opcode"), name.group(1) if name else "")
        return cls(m.group(1), ops)

    def collective_ops(self) -> list[str]:
        """The collective instructions (the ops that move data between devices)."""
        return [n for n, (opc, _) in self.ops.items() if is_collective(opc)]


def compiled_text(fn, *args, **kwargs) -> str:
    """The compiled HLO of jitted `fn` at these arguments (arrays or ShapeDtypeStructs).
    After a call with the same shapes and shardings this is JAX's cached executable:
    its op names are the ones a profile of those calls records."""

    shapes = abstract((args, kwargs))
    return fn.lower(*shapes[0], **shapes[1]).compile().as_text()


def abstract(tree):
    """The abstract values (shape, dtype, sharding) of a tree of arrays: what a compiled
    program is looked up by, kept once the arrays themselves are donated."""
    return jax.tree.map(_abstract, tree)


def _abstract(x):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return x
