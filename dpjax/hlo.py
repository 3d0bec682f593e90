"""Reading a compiled XLA program's text: its computations, the call graph between them
(fusions, calls, async wrappers, conditionals, while loops with their trip counts) and each
instruction's shape; from them, how many times each computation runs in one execution and
the matrix FLOPs the program executes on one device.

XLA's own `cost_analysis()` is not used for FLOPs: on GPU it counts the cuBLAS and cuDNN
custom calls that hold the matmuls and the attention as no FLOPs, and it counts a while
loop's body once. Here a FLOP count is the matrix work, what a device's peak is quoted
for (MaxText's and PaLM's hardware FLOPs, Chowdhery et al. 2022, appendix B):

    dot, gemm custom call   2 x (result elements) x (contracted elements), from the operand
                            shapes and the dimension numbers (a cuBLAS call's are in its
                            backend_config's `dot_dimension_numbers`)
    convolution             2 x (output elements) x (kernel elements / output features)
    cuDNN flash attention   4 B N T S H forward (Q K^T and P V over the intermediate B x N
                            x T x S scores, H the head size), 10 B N T S H backward (the
                            scores recomputed, then dV, dP, dQ, dK: 2.5 x the forward, Dao
                            2023, "FlashAttention-2"); a causal mask is counted as is, the
                            full T x S, like the model's own count

each times the trip counts of the loops it sits in (`backend_config={"known_trip_count":
{"n":"8"}}` on a scanned loop); a conditional costs its dearest branch. A custom call whose
FLOPs cannot be read (a Pallas / Triton kernel, a cuDNN convolution) and a loop with FLOPs
but no known trip count make the count unknown (`Flops.value` is None) rather than short.
Elementwise arithmetic (softmax, norms, the optimizer) is left out: it is not matrix work.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
SHAPE_RE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
_ARRAY = re.compile(r"\b[a-z][a-z0-9]*\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEAD = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)")
_OP = re.compile(r"([\w\-]+)\(")
_CALL = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALL_LIST = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# custom calls that do no matrix work: host callbacks, sharding marks, placement, RNG, sort, norms
NO_MATMUL = ("xla_python_", "xla_ffi_python_", "Sharding", "SPMD", "annotate_device_placement", "MoveTo",
             "AllocateBuffer", "PadToStatic", "SliceToDynamic", "LayoutConstraint", "cu_threefry", "__cub$",
             "__cudnn$norm")


def dims(shape: str) -> list[list[int]]:
    """The dimensions of each array in a shape's text ('(f32[2,3]{1,0}, s8[8]{0})' -> [[2, 3], [8]])."""
    return [[int(d) for d in m.group(1).split(",") if d] for m in _ARRAY.finditer(shape)]


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a shape's text."""
    return sum(DTYPE_BYTES[t] * math.prod(int(d) for d in ds.split(",") if d) for t, ds in SHAPE_RE.findall(shape))


def _close(text: str, i: int) -> int:
    """Index of the parenthesis that closes the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j
    return len(text) - 1


def _split(text: str) -> list[str]:
    """Top-level comma-separated pieces of an operand list."""
    out, depth, start = [], 0, 0
    for j, ch in enumerate(text):
        depth += 1 if ch in "({[" else -1 if ch in ")}]" else 0
        if ch == "," and depth == 0:
            out.append(text[start:j])
            start = j + 1
    return [p.strip() for p in out + [text[start:]] if p.strip()]


@dataclass
class Instruction:
    """One line `%name = SHAPE op(operands), attrs`; `operand_shapes[i]` is None where the
    text names the operand without its shape (as compiled HLO does)."""

    name: str
    shape: str
    op: str
    operands: list
    operand_shapes: list
    attrs: str

    @classmethod
    def parse(cls, line: str) -> Instruction | None:
        m = _INSTR.match(line)
        if not m:
            return None
        rest = m.group(2)
        if rest.startswith("("):
            end = _close(rest, 0)
            shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
        else:
            shape, _, rest = rest.partition(" ")
        op = _OP.match(rest)
        if not op:
            return None
        end = _close(rest, op.end() - 1)
        names, shapes = [], []
        for piece in _split(re.sub(r"/\*.*?\*/", "", rest[op.end():end])):
            *typed, name = piece.split()
            names.append(name.lstrip("%"))
            shapes.append(" ".join(typed) or None)
        return cls(m.group(1), shape, op.group(1), names, shapes, rest[end + 1:])

    def backend_config(self) -> dict:
        """The instruction's backend_config JSON ({} if none or unreadable)."""
        at = self.attrs.find("backend_config={")
        if at < 0:
            return {}
        text, depth = self.attrs[at + len("backend_config="):], 0
        for j, ch in enumerate(text):
            depth += 1 if ch == "{" else -1 if ch == "}" else 0
            if depth == 0:
                try:
                    return json.loads(text[:j + 1])
                except ValueError:
                    return {}
        return {}


@dataclass
class Computation:
    name: str
    instructions: list
    shapes: dict  # instruction name -> its shape's text

    def operand_shape(self, ins: Instruction, i: int) -> str | None:
        return ins.operand_shapes[i] or self.shapes.get(ins.operands[i]) if i < len(ins.operands) else None


@dataclass(frozen=True)
class Flops:
    """A program's matrix FLOPs: `total` of what could be counted, `unknown` what could not
    (custom-call targets, loops without a trip count); `value` is None where anything is unknown."""

    total: float
    unknown: tuple = ()

    @property
    def value(self) -> float | None:
        return None if self.unknown else self.total


class Module:
    """A compiled module's text as computations and their call graph. Lines outside any
    computation (a fragment of a program) form one computation of their own, run once."""

    def __init__(self, text: str):
        self.computations: dict[str, Computation] = {}
        self.entry, cur = None, self._computation("")
        for line in text.splitlines():
            if line and not line[0].isspace() and line.rstrip().endswith("{") and not line.startswith("HloModule"):
                head = _HEAD.match(line)
                cur = self._computation(head.group(2))
                self.entry = head.group(2) if head.group(1) else self.entry
            elif line.startswith("}"):
                cur = self.computations[""]
            else:
                ins = Instruction.parse(line)
                if ins is not None:
                    cur.instructions.append(ins)
                    cur.shapes[ins.name] = ins.shape
        if not self.computations[""].instructions:
            del self.computations[""]

    def _computation(self, name: str) -> Computation:
        return self.computations.setdefault(name, Computation(name, [], {}))

    def callees(self, ins: Instruction, follow=None) -> list[tuple[str, int | None]]:
        """(computation, runs per run of `ins`) for each computation `ins` calls: a while
        loop's body its trip count (None if unknown), its condition one more; `follow(ins)`
        may name the branches of a conditional to follow (None: all of them)."""
        if ins.op.endswith(("-done", "-update")):  # an async op's computation is the -start's
            return []
        names = [m.group(2) for m in _CALL.finditer(ins.attrs)]
        names += [n.strip().lstrip("%") for m in _CALL_LIST.finditer(ins.attrs) for n in m.group(2).split(",")]
        names = [n for n in names if n in self.computations]
        if ins.op == "conditional" and follow is not None:
            taken = follow(ins)
            names = names if taken is None else [n for n in names if n in taken]
        if ins.op != "while":
            return [(n, 1) for n in names]
        trips = _TRIPS.search(ins.attrs)
        n = int(trips.group(1)) if trips else None
        body = re.search(r"\bbody=%?([\w.\-]+)", ins.attrs).group(1)
        return [(c, n if c == body else (None if n is None else n + 1)) for c in names]

    def roots(self) -> set:
        """The computations a run starts from: the entry, or in a fragment those nothing calls."""
        if self.entry:
            return {self.entry}
        called = {c for comp in self.computations.values() for ins in comp.instructions for c, _ in self.callees(ins)}
        return {c for c in self.computations if c not in called}

    def times(self, follow=None) -> dict[str, int | None]:
        """How many times each computation runs in one run of the program (None: inside a
        loop of unknown trip count), every branch of a conditional counted unless `follow`
        (see `callees`) names the ones taken."""
        callers = defaultdict(list)
        for comp in self.computations.values():
            for ins in comp.instructions:
                for callee, n in self.callees(ins, follow):
                    callers[callee].append((comp.name, n))
        roots, memo = self.roots(), {}

        def runs(name):
            if name not in memo:
                memo[name] = 0  # a cycle (malformed text) adds nothing
                total = 1 if name in roots else 0
                for caller, n in callers.get(name, ()):
                    r = runs(caller)
                    total = None if total is None or (r and n is None) or r is None else total + r * (n or 0)
                memo[name] = total
            return memo[name]

        return {name: runs(name) for name in self.computations}

    def flops(self) -> Flops:
        """The matrix FLOPs of one run of the program on one device (see the module's docstring)."""
        memo: dict = {}

        def cost(name) -> tuple[float, frozenset]:
            if name in memo:
                return memo[name]
            memo[name] = (0.0, frozenset())
            comp, total, unknown = self.computations[name], 0.0, set()
            for ins in comp.instructions:
                own = instruction_flops(comp, ins)
                if isinstance(own, str):
                    unknown.add(own)
                else:
                    total += own
                calls = [(cost(c), n) for c, n in self.callees(ins)]
                if ins.op == "conditional" and calls:  # one branch runs: the dearest
                    unknown.update(*(u for (_, u), _ in calls))
                    calls = [max(calls, key=lambda c: c[0][0])]
                for (f, u), n in calls:
                    if n is None and (f or u):
                        unknown.add(f"while loop {ins.name} without a known trip count")
                    else:
                        total, unknown = total + (n or 0) * f, unknown | u
            memo[name] = (total, frozenset(unknown))
            return memo[name]

        parts = [cost(r) for r in sorted(self.roots())]
        return Flops(sum(f for f, _ in parts), tuple(sorted(set().union(*(u for _, u in parts)))))


def _dot(result: list[int], lhs: list[int] | None, contracting) -> float | None:
    if lhs is None or any(int(c) >= len(lhs) for c in contracting):
        return None
    return 2.0 * math.prod(result) * math.prod(lhs[int(c)] for c in contracting)


def _first(shape: str | None) -> list[int] | None:
    arrays = dims(shape) if shape else []
    return arrays[0] if arrays else None


def instruction_flops(comp: Computation, ins: Instruction) -> float | str:
    """The matrix FLOPs of one instruction, not counting the computations it calls; a
    string saying why where they cannot be read."""
    if ins.op == "dot":
        lhs = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        f = _dot(_first(ins.shape), _first(comp.operand_shape(ins, 0)), lhs.group(1).split(",") if lhs else [])
        return f"dot {ins.name} without its operand's shape" if f is None else f
    if ins.op == "convolution":
        labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
        kernel = _first(comp.operand_shape(ins, 1))
        if not labels or kernel is None or len(kernel) != len(labels.group(1)):
            return f"convolution {ins.name} without its kernel's shape"
        return 2.0 * math.prod(_first(ins.shape)) * math.prod(kernel) / kernel[labels.group(1).index("o")]
    if ins.op != "custom-call":
        return 0.0
    named = _TARGET.search(ins.attrs)
    target = named.group(1) if named else "?"
    if target.startswith(NO_MATMUL):
        return 0.0
    config = ins.backend_config()
    if target.startswith("__cublas$") and ("matmul" in target or "gemm" in target):
        dnums = (config.get("gemm_backend_config") or config).get("dot_dimension_numbers")
        f = dnums and _dot(_first(ins.shape), _first(comp.operand_shape(ins, 0)),
                           dnums.get("lhs_contracting_dimensions", []))
        return f if f else f"custom-call {target} without its dimensions"
    if target.startswith("__cudnn$fmha"):
        fmha = config.get("cudnn_fmha_backend_config", {})
        scores = [int(d) for d in fmha.get("intermediate_tensor_shape", {}).get("dimensions", [])]  # B N T S
        q = _first(comp.operand_shape(ins, 0))
        if len(scores) != 4 or q is None or math.prod(q) % math.prod(scores[:3]):
            return f"custom-call {target} without its dimensions"
        head = math.prod(q) // math.prod(scores[:3])
        return (10.0 if "Backward" in target else 4.0) * math.prod(scores) * head
    return f"custom-call {target}"


def matmul_operand_types(text: str) -> list[tuple[str, ...]]:
    """The element types of each dot's and convolution's operands in a compiled program's
    text, e.g. ("f8e5m2", "f8e4m3fn") for an fp8 gradient matmul (`--dtype fp8`); one
    entry per instruction, wherever it sits (a fusion, a loop body)."""
    out = []
    for comp in Module(text).computations.values():
        for ins in comp.instructions:
            if ins.op in ("dot", "convolution"):
                shapes = [comp.operand_shape(ins, i) or "?" for i in range(len(ins.operands))]
                out.append(tuple(s.split("[")[0] for s in shapes))
    return out
