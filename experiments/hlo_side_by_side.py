"""dpjax's train step against the plain-JAX yardstick's, compiled side by side for one device.

    python experiments/hlo_side_by_side.py                      # d_model 256, 2 layers, seq 128 (CPU, ~1 min)
    python experiments/hlo_side_by_side.py --dpjax-remat dots   # both with the yardstick's remat
    python experiments/hlo_side_by_side.py --smoke              # tiny sizes: what the tests run

On one H200 dpjax's 405M step took 0.0943 s against `../shared/gpu/ref_gpt.py`'s 0.0902 s
(experiments/RESULTS.md, "On one GPU"). This script says, without a GPU, what one step of
each computes and moves: the same GPT (pre-LN blocks, GELU MLP, learned positions, tied
head, byte vocabulary; AdamW b2=0.95 after a global-norm clip of 1.0), bfloat16 compute
over float32 master weights, the layers scanned, the same attention kernel on both sides
(`--attention`: on CPU cuDNN is not there, so both take `jax.nn.dot_product_attention`'s
XLA kernel). dpjax's step is the one `python -m dpjax.train --mesh 1x1` runs (Settings ->
`dpjax.plan.resolve` -> `dpjax.step.for_plan`), with the remat the H200 run's `auto`
chose (`none`) unless `--dpjax-remat` says otherwise; the yardstick is `ref_gpt.py`'s
`bf16-cudnn-remat` variant written out below (`yardstick_step`: its 40 lines, kept here
so that a clone without `../shared/` runs this), remat `dots` as there.

Each program is traced and compiled on abstract arguments (nothing is run). Printed:

- the traced program's operations by kind (the jaxpr, before XLA optimises; an op inside
  the layer scan counted once per layer), with the bytes of their results;
- the matmuls by operand and result dtypes with their FLOPs, and the dtype conversions;
- "passes over the parameters": the bytes of every result shaped like a parameter (a
  layer's leaf inside the scan, a whole leaf outside), in units of the parameters' float32
  bytes, split into float32 and bfloat16: the optimizer's and the casts' traffic;
- XLA's `cost_analysis()` of the compiled step (flops, bytes accessed) and how many of
  the step's outputs alias its inputs (donation: `input_output_alias`).

On CPU XLA fuses differently from a GPU, and computes bfloat16 dots in float32: the
compiled figures say where the programs differ, not a GPU's time. The time a difference
costs on the H200 is estimated from its bytes at 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import sys

import _bench

_bench.simulate(1)  # before jax starts: one device, as the yardstick has

import jax  # noqa: E402
import jax.extend  # noqa: E402,F401  (jax.extend.core: the jaxpr types walked below)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dpjax import step as S  # noqa: E402
from dpjax.plan import resolve  # noqa: E402
from dpjax.settings import Settings  # noqa: E402

H200_BYTES_S = 4.8e12
SMOKE = dict(d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16, batch=2)


# ---------------------------------------------------------------------------------------
# The yardstick: ../shared/gpu/ref_gpt.py's bf16 + flash + remat variant, one device


def yardstick_init(key, V, D, L, H, F, T):
    K = D // H
    ks = jax.random.split(key, 6)
    n = lambda k, s, std=0.02: std * jax.random.normal(k, s, jnp.float32)  # noqa: E731
    o = 0.02 / math.sqrt(2 * L)
    return {"embed": n(ks[0], (V, D)), "pos": n(ks[1], (T, D)),
            "blocks": {"ln1s": jnp.ones((L, D)), "ln1b": jnp.zeros((L, D)), "ln2s": jnp.ones((L, D)),
                       "ln2b": jnp.zeros((L, D)), "wqkv": n(ks[2], (L, D, 3, H, K)), "wo": n(ks[3], (L, H, K, D), o),
                       "w1": n(ks[4], (L, D, F)), "b1": jnp.zeros((L, F)), "w2": n(ks[5], (L, F, D), o),
                       "b2": jnp.zeros((L, D))},
            "lnfs": jnp.ones((D,)), "lnfb": jnp.zeros((D,))}


def _ln(x, s, b):
    xf = x.astype(jnp.float32)
    m = xf.mean(-1, keepdims=True)
    v = ((xf - m) ** 2).mean(-1, keepdims=True)
    return ((xf - m) * jax.lax.rsqrt(v + 1e-5) * s + b).astype(x.dtype)


def yardstick_loss(attention: str, remat: str, T: int, dtype=jnp.bfloat16):
    """ref_gpt.py's `make_loss(bf16, cudnn|xla, scan=True, remat)`, line for line."""
    def att(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)

    def block(x, w):
        h = _ln(x, w["ln1s"], w["ln1b"])
        qkv = jnp.einsum("btd,dchk->cbthk", h, w["wqkv"].astype(dtype))
        x = x + jnp.einsum("bthk,hkd->btd", att(qkv[0], qkv[1], qkv[2]), w["wo"].astype(dtype))
        h = _ln(x, w["ln2s"], w["ln2b"])
        h = jax.nn.gelu(h @ w["w1"].astype(dtype) + w["b1"].astype(dtype))
        return x + h @ w["w2"].astype(dtype) + w["b2"].astype(dtype)

    if remat == "dots":
        block = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)

    def loss(params, tok):
        x = (params["embed"][tok[:, :-1]] + params["pos"][:T]).astype(dtype)
        x, _ = jax.lax.scan(lambda c, w: (block(c, w), None), x, params["blocks"])
        x = _ln(x, params["lnfs"], params["lnfb"])
        logits = (x @ params["embed"].T.astype(dtype)).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(lp, tok[:, 1:, None], -1).mean()
    return loss


def yardstick_step(size: dict, attention: str, remat: str = "dots"):
    """(the jitted step as ref_gpt.py writes it: no donation; abstract params, state, batch)."""
    V, D, L, H, F, T, B = 256, size["d_model"], size["n_layers"], size["n_heads"], size["d_ff"], size["seq_len"], \
        size["batch"]
    loss = yardstick_loss(attention, remat, T)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.0))

    @jax.jit
    def step(params, state, tok):
        value, g = jax.value_and_grad(loss)(params, tok)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, value

    params = jax.eval_shape(lambda k: yardstick_init(k, V, D, L, H, F, T), jax.random.key(0))
    state = jax.eval_shape(opt.init, params)
    return step, (params, state, jax.ShapeDtypeStruct((B, T + 1), jnp.int32))


def dpjax_step(size: dict, attention: str, remat: str, dtype: str = "bfloat16"):
    """(dpjax's train program on mesh 1x1, as `python -m dpjax.train` builds it; its abstract arguments)."""
    from compile_depth import abstract_args  # the Trainer's values' shapes and shardings

    s = Settings(mesh="1x1", model="gpt", batch_size=size["batch"], seq_len=size["seq_len"], dtype=dtype,
                 attention=attention, remat=remat, device_memory="1000GiB",  # the step is compiled, never run
                 model_options={k: size[k] for k in ("n_layers", "d_model", "n_heads", "d_ff")})
    plan = resolve(s, jax.devices()[:1])
    step = S.for_plan(plan)
    return step.train, abstract_args(step, plan), plan.policy.remat


# ---------------------------------------------------------------------------------------
# What a program computes: its jaxpr walked, scans counted once per iteration


def _nbytes(aval) -> int:
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None or not hasattr(dtype, "itemsize"):
        return 0
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def walk(jaxpr, times: int = 1, in_scan: bool = False):
    """(eqn, times it runs, inside a layer scan?) for every leaf operation of `jaxpr`."""
    for eqn in jaxpr.eqns:
        subs = list(_subjaxprs(eqn))
        if not subs:
            yield eqn, times, in_scan
            continue
        n = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in subs:
            yield from walk(sub, times * n, in_scan or eqn.primitive.name == "scan")


def _stacked(eqn, stacked_params, T: int) -> collections.Counter:
    """dtype -> bytes of the per-layer outputs a layer scan stacks (its `ys`) that are not a
    stacked gradient: what the forward keeps for the backward pass (the remat policy's
    choice), written once and read back once. Looked for inside the step's shard_map."""
    out = collections.Counter()
    if eqn.primitive.name == "scan":
        for v in eqn.outvars[eqn.params["num_carry"]:]:
            if (tuple(v.aval.shape), v.aval.dtype.name) not in stacked_params:
                scores = tuple(v.aval.shape).count(T) >= 2  # an XLA attention's T x T (flash keeps none)
                out[v.aval.dtype.name + (" T x T" if scores else "")] += _nbytes(v.aval)
        return out
    for sub in _subjaxprs(eqn):
        for inner in sub.eqns:
            out.update(_stacked(inner, stacked_params, T))
    return out


def dot_flops(eqn) -> int:
    (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
    lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
    contract = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
    return 2 * int(np.prod(out.shape, dtype=np.int64)) * contract


def profile(fn, args, params, T: int, compile: bool = True) -> dict:
    """The figures of one program: ops by kind, dots, converts, parameter-shaped results,
    and the compiled step's cost analysis and aliasing."""
    traced = fn.trace(*args)
    leaves = jax.tree.leaves(params)
    whole = {(tuple(x.shape), x.dtype.name) for x in leaves}
    stacked_shapes = {tuple(x.shape[1:]) for x in leaves if x.ndim > 1}  # a layer's leaves inside the scan
    whole_shapes = {s for s, _ in whole}
    param_bytes = sum(_nbytes(x) for x in leaves)
    kinds, dots, converts = collections.Counter(), collections.Counter(), collections.Counter()
    kind_bytes, dot_fl, conv_bytes = collections.Counter(), collections.Counter(), collections.Counter()
    passes = collections.Counter()  # (dtype, kind) -> bytes of parameter-shaped results
    stacked_params = {(tuple(x.shape), x.dtype.name) for x in leaves if x.ndim > 1}
    residuals = collections.Counter()  # dtype -> bytes the layer scans stack that are not parameter-shaped
    for eqn in traced.jaxpr.jaxpr.eqns:
        residuals.update(_stacked(eqn, stacked_params, T))
    for eqn, times, in_scan in walk(traced.jaxpr.jaxpr):
        name = eqn.primitive.name
        out = sum(_nbytes(v.aval) for v in eqn.outvars)
        kinds[name] += times
        kind_bytes[name] += times * out
        if name == "dot_general":
            a, b, o = (v.aval.dtype.name for v in (*eqn.invars[:2], eqn.outvars[0]))
            key = f"{a} x {b} -> {o}"
            dots[key] += times
            dot_fl[key] += times * dot_flops(eqn)
        if name == "convert_element_type":
            key = f"{eqn.invars[0].aval.dtype.name} -> {eqn.outvars[0].aval.dtype.name}"
            converts[key] += times
            conv_bytes[key] += times * out
        for v in eqn.outvars:
            shape = tuple(getattr(v.aval, "shape", ()))
            if len(shape) and (shape in whole_shapes or (in_scan and shape in stacked_shapes)):
                if int(np.prod(shape)) >= 64:  # not a scalar-like leaf of the norms
                    passes[(v.aval.dtype.name, name)] += times * _nbytes(v.aval)
    figures = {"flops": math.nan, "bytes": math.nan, "aliased": 0, "hlo_ops": 0, "all_reduces": 0,
               "compiled": (collections.Counter(), collections.Counter())}
    if compile:
        figures = compiled_figures(traced.lower().compile())
    return {**figures, "outputs": len(jax.tree.leaves(traced.out_info)), "kinds": kinds, "kind_bytes": kind_bytes,
            "dots": dots, "dot_flops": dot_fl, "converts": converts, "convert_bytes": conv_bytes,
            "passes": passes, "residuals": residuals, "param_bytes": param_bytes}


_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_OP = re.compile(r"(?<=[\]\})]) ([a-z][a-z0-9-]*)\(")
_BITS = {"pred": 8, "bf16": 16}
_BOOKKEEPING = {"tuple", "parameter", "get-tuple-element", "bitcast", "constant", "while"}  # no kernel, no bytes


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(shape):
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype)[:2] or 8)  # f32 -> 32, f8e4m3fn -> 8
        total += int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * bits // 8
    return total


def compiled_kinds(hlo: str) -> tuple[collections.Counter, collections.Counter]:
    """(count, bytes written) by kind of the compiled module's instructions that run: the
    entry's and, times their known trip count, the while loops' (a fusion is one kernel,
    named by its kind; a custom call by its target: cuBLAS, cuDNN)."""
    bodies, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            current = bodies.setdefault(("ENTRY " if line.startswith("ENTRY") else "") + head.group(1), [])
        elif current is not None and " = " in line:
            current.append(line)
    count, written = collections.Counter(), collections.Counter()

    def visit(name: str, times: int):
        for line in bodies.get(name, []):
            rhs = line.split(" = ", 1)[1]
            op = _OP.search(rhs)
            if op is None:
                continue
            kind = op.group(1)
            detail = {"fusion": r"kind=(\w+)", "custom-call": r'custom_call_target="([^"]+)"'}.get(kind)
            if detail and re.search(detail, rhs):
                kind += " " + re.search(detail, rhs).group(1)
            if kind not in _BOOKKEEPING:
                count[kind] += times
                written[kind] += times * _shape_bytes(rhs[:op.start()])
            if op.group(1) == "while":
                trips = re.search(r'known_trip_count":\{"n":"(\d+)"', rhs)
                visit(re.search(r"body=%([\w.-]+)", rhs).group(1), times * (int(trips.group(1)) if trips else 1))
            elif op.group(1) in ("call", "conditional"):
                for callee in re.findall(r"(?:to_apply|branch_computations=\{|calls)=?%([\w.-]+)", rhs):
                    visit(callee, times)

    visit(next(n for n in bodies if n.startswith("ENTRY ")), 1)
    return count, written


def compiled_figures(compiled) -> dict:
    """XLA's cost analysis of the compiled step, its instruction count and its donated outputs."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    hlo = compiled.as_text()
    header = hlo.splitlines()[0]  # HloModule ..., input_output_alias={ {0}: (0, {}, may-alias), ... }
    return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0)),
            "aliased": len(re.findall(r"may-alias|must-alias", header)),
            "hlo_ops": len(re.findall(r"^\s+(?:ROOT )?%\S+ = ", hlo, re.M)),
            "all_reduces": len(re.findall(r"^\s*(?:ROOT )?%\S+ = [^%]*? all-reduce(?:-start)?\(", hlo, re.M)),
            "compiled": compiled_kinds(hlo)}


# ---------------------------------------------------------------------------------------
# The tables


def _mb(x) -> str:
    return f"{x / 1e6:,.2f}"


def tables(a: dict, b: dict, names=("dpjax", "yardstick"), only_diff: bool = False) -> str:
    na, nb = names
    out = [f"| op kind (jaxpr, x layers) | {na} count | {nb} count | {na} MB out | {nb} MB out |",
           "|---|---:|---:|---:|---:|"]
    for k in sorted(set(a["kinds"]) | set(b["kinds"]), key=lambda k: -(a["kind_bytes"][k] + b["kind_bytes"][k])):
        if only_diff and a["kinds"][k] == b["kinds"][k] and a["kind_bytes"][k] == b["kind_bytes"][k]:
            continue
        out.append(f"| {k} | {a['kinds'][k]} | {b['kinds'][k]} | {_mb(a['kind_bytes'][k])} | "
                   f"{_mb(b['kind_bytes'][k])} |")
    out += ["", f"| matmul dtypes | {na} count | {nb} count | {na} GFLOP | {nb} GFLOP |", "|---|---:|---:|---:|---:|"]
    for k in sorted(set(a["dots"]) | set(b["dots"])):
        out.append(f"| {k} | {a['dots'][k]} | {b['dots'][k]} | {a['dot_flops'][k] / 1e9:.3f} | "
                   f"{b['dot_flops'][k] / 1e9:.3f} |")
    out += ["", f"| conversion | {na} count | {nb} count | {na} MB out | {nb} MB out |", "|---|---:|---:|---:|---:|"]
    for k in sorted(set(a["converts"]) | set(b["converts"])):
        out.append(f"| {k} | {a['converts'][k]} | {b['converts'][k]} | {_mb(a['convert_bytes'][k])} | "
                   f"{_mb(b['convert_bytes'][k])} |")
    out += ["", f"| parameter-shaped results (dtype, op) | {na} passes | {nb} passes |", "|---|---:|---:|"]
    for dt in sorted({d for d, _ in a["passes"]} | {d for d, _ in b["passes"]}):
        pa = sum(v for (d, _), v in a["passes"].items() if d == dt) / a["param_bytes"]
        pb = sum(v for (d, _), v in b["passes"].items() if d == dt) / b["param_bytes"]
        out.append(f"| all {dt} | {pa:.2f} | {pb:.2f} |")
    for key in sorted(set(a["passes"]) | set(b["passes"]), key=lambda k: (k[0], k[1])):
        pa, pb = a["passes"][key] / a["param_bytes"], b["passes"][key] / b["param_bytes"]
        if round(pa, 2) != round(pb, 2):
            out.append(f"| {key[0]} {key[1]} | {pa:.2f} | {pb:.2f} |")
    out += ["", f"| kept for the backward (layer scans' stacked outputs) | {na} MB | {nb} MB |", "|---|---:|---:|"]
    for dt in sorted(set(a["residuals"]) | set(b["residuals"])):
        out.append(f"| {dt} | {_mb(a['residuals'][dt])} | {_mb(b['residuals'][dt])} |")
    (ca, wa), (cb, wb) = a["compiled"], b["compiled"]
    if ca or cb:
        out += ["", f"| compiled instruction (x trip count) | {na} count | {nb} count | {na} MB written | "
                    f"{nb} MB written |", "|---|---:|---:|---:|---:|"]
        for k in sorted(set(ca) | set(cb), key=lambda k: -(wa[k] + wb[k])):
            if only_diff and ca[k] == cb[k] and wa[k] == wb[k]:
                continue
            out.append(f"| {k} | {ca[k]} | {cb[k]} | {_mb(wa[k])} | {_mb(wb[k])} |")
    out += ["", f"| compiled (XLA cost_analysis) | {na} | {nb} | {na} - {nb} |", "|---|---:|---:|---:|"]
    for label, key, fmt in (("GFLOP", "flops", 1e9), ("bytes accessed (MB)", "bytes", 1e6)):
        out.append(f"| {label} | {a[key] / fmt:,.2f} | {b[key] / fmt:,.2f} | {(a[key] - b[key]) / fmt:+,.2f} |")
    out.append(f"| HLO instructions | {a['hlo_ops']} | {b['hlo_ops']} | {a['hlo_ops'] - b['hlo_ops']:+} |")
    out.append(f"| all-reduces (one device: nothing to reduce) | {a['all_reduces']} | {b['all_reduces']} | |")
    out.append(f"| outputs aliased to inputs (donation) | {a['aliased']} of {a['outputs']} | "
               f"{b['aliased']} of {b['outputs']} | |")
    out.append(f"| parameters (MB, float32) | {_mb(a['param_bytes'])} | {_mb(b['param_bytes'])} | |")
    extra = a["bytes"] - b["bytes"]
    if math.isnan(extra):
        return "\n".join(out + ["", "(--no-compile: the compiled figures left out)"])
    out += ["", f"{na} accesses {extra / 1e6:+,.2f} MB a step over {nb} (XLA:CPU's count); at the H200's "
                f"4.8 TB/s that would be {extra / H200_BYTES_S * 1e3:+.3f} ms (an estimate from bytes, not a "
                f"measured time)."]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--attention", default="xla", choices=("xla", "cudnn"),
                   help="both programs' kernel (cudnn: on a GPU only)")
    p.add_argument("--dpjax-remat", default="none", choices=("auto", "none", "dots", "full"),
                   help="dpjax's remat (the H200 run's auto chose none; the yardstick keeps dots)")
    p.add_argument("--no-compile", action="store_true",
                   help="the traced figures alone (seconds even at 405M: XLA:CPU's compile is what takes time)")
    p.add_argument("--only-diff", action="store_true", help="leave out op kinds where the programs agree")
    p.add_argument("--json", help="write both programs' figures here too")
    _bench.add_smoke(p, "d_model 32, 2 layers, seq 16")
    a = p.parse_args(argv)
    size = dict(d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads, d_ff=a.d_ff, seq_len=a.seq_len,
                batch=a.batch)
    if a.smoke:
        size = SMOKE
        _bench.smoke_outputs(a, "json")
    mine_fn, mine_args, remat = dpjax_step(size, a.attention, a.dpjax_remat)
    ref_fn, ref_args = yardstick_step(size, a.attention)
    T, compile = size["seq_len"], not a.no_compile
    mine = profile(mine_fn, mine_args, mine_args[0], T, compile)
    ref = profile(ref_fn, ref_args, ref_args[0], T, compile)
    print(f"# {json.dumps(size)}, attention {a.attention}, dpjax remat {remat} (--dpjax-remat {a.dpjax_remat}), "
          f"yardstick remat dots; {_bench.machine()}")
    print(tables(mine, ref, only_diff=a.only_diff))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"size": size, "dpjax": _plain(mine), "yardstick": _plain(ref)}, fh, indent=1)
    return 0


def _plain(figures: dict) -> dict:
    return {k: ({" / ".join(map(str, kk)) if isinstance(kk, tuple) else kk: vv for kk, vv in v.items()}
                if isinstance(v, collections.Counter) else v) for k, v in figures.items()}


if __name__ == "__main__":
    sys.exit(main())
