"""Every reduce op x dtype x algorithm x axis size 1-8 against numpy, as Horovod's own
suite checks them (test_torch.py: allreduce and reducescatter with sum, average, min,
max, product over every dtype; prescale and postscale factors).

The cases run inside test_collectives' programs, one compiled program per (algorithm,
axis): its `OP_CATALOGUE` holds every (op, dtype) pair that the float sum and mean
cases there do not, the bool ops and scaled cases, dealt out so that every algorithm
runs the whole catalogue over the axis sizes 1-8 (hierarchical over its node x data
meshes and over one axis). Here each case is checked against numpy.

References. min, max, bool ops and integer ops are exact (integer sums and products
wrap the same way in any order), so they must match numpy bit for bit; integer mean is
the sum divided by n, truncated toward zero. A float product of n factors, in any
order, is within gamma_{n-1} * |exact product| of it (Higham, "Accuracy and Stability
of Numerical Algorithms", 2nd ed., section 3.1), as long as nothing underflows (the
inputs keep every partial product normal). Float sums use test_collectives' bound.
Scaled cases are chosen so the reference applies the factors as dpjax documents them
(`ops.py`): prescale 0.5 and postscale 4 are exact on floats; an integer mean with
postscale 2 multiplies the integer sum by float32(2 / n) and truncates (Horovod does
the same in double), and prescale 3 on integers is exact in float32.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from collectives_harness import (DTYPES, FLAT_VARIANTS, HIERARCHICAL, OP_CATALOGUE, OP_SLOTS, primitives, program,
                                 sum_bound)

VARIANTS = {v[0]: v for v in FLAT_VARIANTS + [HIERARCHICAL]}


def reference(x: np.ndarray, case):
    """(want, bound) of the op over axis 0 of x (per-rank inputs); bound None: exact."""
    n, dtype = x.shape[0], x.dtype
    floating = case.dtype in ("f32", "bf16", "f16")
    if case.pre != 1:
        x = (x * np.asarray(case.pre, dtype)).astype(dtype) if floating else \
            np.trunc(x.astype(np.float32) * np.float32(case.pre)).astype(dtype)
    if case.dtype == "bool":
        return {"min": x.all(0), "max": x.any(0), "product": x.all(0)}[case.op], None
    if case.op in ("min", "max"):
        return getattr(x, case.op)(0), None
    if not floating:
        total = x.prod(0, dtype=dtype) if case.op == "product" else x.sum(0, dtype=dtype)
        if case.op != "mean":
            return total, None
        if case.post == 1:
            return (np.sign(total) * (np.abs(total) // n)).astype(dtype), None  # toward zero
        return np.trunc(total.astype(np.float32) * np.float32(case.post / n)).astype(dtype), None
    if case.op == "product":
        want = x.astype(np.float64).prod(0)
        u = float(ml_dtypes.finfo(dtype).eps) / 2
        return want, (n - 1) * u / (1 - (n - 1) * u) * np.abs(want)
    want = x.astype(np.float64).sum(0) / (n if case.op == "mean" else 1)
    return want * case.post, sum_bound(x, dtype, case.op) * case.post  # post: 1 or 4, exact


PARAMS = [pytest.param(primitive, name, mc, id=f"{primitive}-{name}-{mc.id}")
          for primitive in OP_CATALOGUE for name, mc in OP_SLOTS if primitive in primitives(VARIANTS[name][1])]


@pytest.mark.parametrize("primitive, name, mc", PARAMS)
def test_every_op_and_dtype(cache, mesh_of, primitive, name, mc):
    inputs, outputs = program(cache, mesh_of, mc, VARIANTS[name])
    n, checked = mc.n, 0
    catalogue = {f"{primitive}/{c.id}": c for c in OP_CATALOGUE[primitive][0]}
    for key, case in catalogue.items():
        if key not in inputs:  # dealt to another program
            continue
        x, got = inputs[key], outputs[key]
        want, bound = reference(x, case)
        if primitive == "allreduce":
            want = np.broadcast_to(want, x.shape)
            bound = None if bound is None else np.broadcast_to(bound, x.shape)
        else:  # rank r ends with block r of the reduced rows
            want = want.reshape(n, *case.shape)
            bound = None if bound is None else bound.reshape(want.shape)
        what = f"{name} {primitive} n={n} {case.id}"
        assert got.dtype == DTYPES[case.dtype] and got.shape == want.shape, (what, got.dtype, got.shape)
        if bound is None:
            np.testing.assert_array_equal(got, want, err_msg=what)
        else:
            err = np.abs(got.astype(np.float64) - want)
            assert np.all(err <= bound), f"{what}: worst error {np.max(err - bound):.3g} over the bound"
        checked += 1
    # (psum_scatter only sums: some of the XLA baseline's programs hold no scatter case here)
    assert checked >= 1 or (name, primitive) == ("psum", "reduce_scatter"), f"{name} {primitive} n={n}: no case"
