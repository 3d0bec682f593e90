"""The dropless mixture: every token through each of its top-k experts, at any load.

Gale et al., "MegaBlocks: efficient sparse training with mixture-of-experts" (MLSys 2023):
instead of an E x C buffer that drops what does not fit, each device sorts its N k
(token, expert) choices by expert and runs a grouped matmul: one matmul per expert over
its contiguous rows. Two forms of the grouped matmul (`grouped_matmul`):

    ragged     `jax.lax.ragged_dot`, XLA's grouped matmul (the form for GPUs and TPUs)
    segment    the rows cut into tiles of t rows, each expert's run of rows padded to
               whole tiles (at most E (t - 1) rows of padding), a scan over the tiles
               in which a tile of real rows is one t x D by D x F matmul with its
               expert's weights and an empty tile is skipped (`lax.cond`)

On XLA:CPU `ragged_dot` runs as slowly as a dense masked product (every row through
every expert): 4096 rows, D 64, F 128, 8 experts took 131 ms forward and 758 ms with its
gradient, against 110 ms and 165 ms for the segment form, on 2 cores that 8 other
sessions loaded (load 51; experiments/moe_dropless.py, RESULTS.md), so CPU runs the
segment form and other platforms `ragged_dot` (`default_form`; not measured on a GPU).

Over an `expert` axis of n devices (E/n experts on each) the rows travel explicitly
(`dpjax.collectives.all_to_all`, the algorithm the capacity form uses):

    counts     first each device's rows per expert, an n x E/n int32 all-to-all: device
               d learns how many rows each source sends each of its experts
    rows       then the rows, sorted by expert, in n blocks of S rows, block j for
               device j; the receiver places them by expert from the counts alone
               (no second sort), computes, sends them back the same way, and each
               source puts its rows' outputs back in token order

Static shapes need a bound on the rows one device sends another: a token's k experts
are distinct, at most min(k, E/n) of them on one device, so S = N min(k, E/n) rows
(N the device's tokens) can never overflow, whatever the router does, and a device
receives at most n S. That is the price of dropping nothing with static shapes: each
row all-to-all moves (n-1) S D values a device, against the capacity form's
(n-1)/n E C D (C = ceil(F N k / E)): for k = 2, E/n = 2 and factor 1.25, 3.2 times the
bytes (`row_bytes`); the segment form's compute skips the empty tiles.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from dpjax import collectives

FORMS = ("ragged", "segment")


def default_form() -> str:
    """The grouped matmul for this backend: `segment` on CPU (measured faster there, 4.6x
    with the gradient: the module's docstring), `ragged_dot` elsewhere."""
    return "segment" if jax.default_backend() == "cpu" else "ragged"


def tile_rows(expected: int, groups: int) -> int:
    """t: the rows of a tile, the mean rows a group gets (at least 8): padding each group
    to whole tiles adds at most groups x (t - 1) rows."""
    return max(8, math.ceil(expected / groups))


def grouped_matmul(x_NxD, w_XxDxF, sizes_X, form: str, expected: int | None = None):
    """x's rows through their groups' matrices, M x F: rows sizes[0] .. sizes[0]+sizes[1]-1
    use w[1] and so on; rows past sum(sizes) give zeros. `expected`: the rows usually
    used (the segment form's tile size; default M)."""
    M, G = x_NxD.shape[0], w_XxDxF.shape[0]
    if form == "ragged":
        return lax.ragged_dot(x_NxD, w_XxDxF, sizes_X.astype(jnp.int32))
    assert form == "segment", form
    t = tile_rows(expected or M, G)
    tiles = -(-(M + G * (t - 1)) // t)
    ends_X = jnp.cumsum(sizes_X)
    padded_X = (sizes_X + t - 1) // t * t
    pends_X = jnp.cumsum(padded_X)
    row_N = jnp.arange(M)
    group_N = jnp.searchsorted(ends_X, row_N, side="right")  # G for rows past the groups
    gi_N = jnp.minimum(group_N, G - 1)
    at_N = jnp.where(group_N < G, pends_X[gi_N] - padded_X[gi_N] + row_N - (ends_X[gi_N] - sizes_X[gi_N]),
                     tiles * t)  # a row past the groups goes nowhere
    tiled_PxD = jnp.zeros((tiles * t, x_NxD.shape[1]), x_NxD.dtype).at[at_N].set(x_NxD, mode="drop")
    tile_group = jnp.searchsorted(pends_X, jnp.arange(tiles) * t, side="right")
    used = tile_group < G

    def one(_, tile):
        x_tile, g, u = tile
        w_DxF = lax.dynamic_index_in_dim(w_XxDxF, jnp.minimum(g, G - 1), keepdims=False)
        zero = jnp.zeros((t, w_XxDxF.shape[2]), jnp.result_type(x_tile, w_XxDxF))
        return None, lax.cond(u, lambda: x_tile @ w_DxF, lambda: zero)

    _, y_tiles = lax.scan(one, None, (tiled_PxD.reshape(tiles, t, -1), tile_group, used))
    return jnp.take(y_tiles.reshape(tiles * t, -1), at_N, axis=0, mode="fill", fill_value=0)


def group_of_rows(sizes_X, M: int):
    """Each of M sorted rows' group (G for rows past the groups)."""
    return jnp.searchsorted(jnp.cumsum(sizes_X), jnp.arange(M), side="right")


def experts_grouped(x_NxD, p: dict, sizes_X, act: str, form: str, expected: int):
    """Each row through its group's expert: GELU with biases (w1, b1, w2, b2: the GPT's) or
    SwiGLU (wgate, wup, wdown: Mixtral's and Qwen3-MoE's); rows past the groups give zeros."""
    mm = lambda x, w: grouped_matmul(x, w, sizes_X, form, expected)  # noqa: E731
    if act == "swiglu":
        h_NxF = jax.nn.silu(mm(x_NxD, p["wgate_XexDxF"])) * mm(x_NxD, p["wup_XexDxF"])
        return mm(h_NxF, p["wdown_XexFxD"])
    g_N = group_of_rows(sizes_X, x_NxD.shape[0])
    real = (g_N < sizes_X.shape[0])[:, None]
    bias = lambda b: jnp.where(real, jnp.take(b, g_N, axis=0, mode="clip"), 0)  # noqa: E731
    h_NxF = jax.nn.gelu(mm(x_NxD, p["w1_XexDxF"]) + bias(p["b1_XexF"]))
    return mm(h_NxF, p["w2_XexFxD"]) + bias(p["b2_XexD"])


def send_rows(N: int, k: int, El: int) -> int:
    """S: the rows one device can send another (a token's k experts are distinct, at most
    min(k, E/n) on one device): the static bound that drops nothing at any load."""
    return N * min(k, El)


def row_bytes(N: int, k: int, El: int, n: int, D: int, itemsize: int) -> int:
    """Bytes of one device's input to one rows all-to-all (n blocks of S rows of D)."""
    return n * send_rows(N, k, El) * D * itemsize


def dropless(x_NxD, gates, chosen, p: dict, *, act: str, axis=None, n: int = 1,
             algorithm: str = "pairwise", form: str | None = None):
    """y N x D: each token's gate-weighted sum of its k experts' outputs, none dropped.
    `p`: this device's E/n experts (w*_XexDxF ...); axis: the expert axis (None: all here)."""
    form = form or default_form()
    N, D = x_NxD.shape
    k = chosen.shape[1]
    El = p["w1_XexDxF" if act == "gelu" else "wgate_XexDxF"].shape[0]
    E, A = El * n, N * k
    expert_N = chosen.reshape(A)
    order_N = jnp.argsort(expert_N, stable=True)  # choices sorted by expert (and so by device)
    sizes_X = jnp.zeros((E,), jnp.int32).at[expert_N].add(1)
    xs_NxD = x_NxD[order_N // k]
    if n == 1:
        ys_NxD = experts_grouped(xs_NxD, p, sizes_X, act, form, A)
    else:
        ys_NxD = _over_axis(xs_NxD, expert_N[order_N], sizes_X, p, act=act, axis=axis, n=n, El=El,
                            S=send_rows(N, k, El), algorithm=algorithm, form=form)
    y_NxD = jnp.zeros_like(ys_NxD).at[order_N].set(ys_NxD)
    return jnp.einsum("nk,nkd->nd", gates.astype(y_NxD.dtype), y_NxD.reshape(N, k, D))


def _over_axis(xs_NxD, expert_N, sizes_X, p, *, act, axis, n, El, S, algorithm, form):
    """The sorted rows' outputs, computed by the devices holding their experts: counts
    first, then the rows, both by explicit all-to-alls (module docstring). The n x E/n and
    n x S tables (source or destination by local expert or row) carry no shape suffix: the
    letter table has no home in models/ for the axis's ranks."""
    A, D = xs_NxD.shape
    counts = sizes_X.reshape(n, El)  # n x E/n: my rows for each device's experts
    got = collectives.all_to_all(counts, axis, algorithm=algorithm)  # n x E/n: source i's rows per local expert
    per_dev = counts.sum(1)
    dev_N = expert_N // El
    pos_N = jnp.arange(A) - (jnp.cumsum(per_dev) - per_dev)[dev_N]  # < S by send_rows' bound
    send_NxD = jnp.zeros((n, S, D), xs_NxD.dtype).at[dev_N, pos_N].set(xs_NxD).reshape(n * S, D)
    recv_NxD = collectives.all_to_all(send_NxD, axis, algorithm=algorithm)
    # received row (i, s): source i's s-th row, of local expert e by source i's counts
    s_N = jnp.arange(S)
    ends = jnp.cumsum(got, axis=1)
    # n x S: each received row's local expert (E/n: padding past the source's rows)
    e_of = jax.vmap(lambda ends: jnp.searchsorted(ends, s_N, side="right"))(ends)
    real = e_of < El
    ec = jnp.minimum(e_of, El - 1)
    within = s_N[None] - jnp.take_along_axis(ends - got, ec, axis=1)
    total = got.sum(0)
    earlier = jnp.cumsum(got, axis=0) - got  # rows of expert e from sources before i
    at = (jnp.cumsum(total) - total)[ec] + jnp.take_along_axis(earlier, ec, axis=1) + within
    at_N = jnp.where(real, at, n * S).reshape(n * S)  # padding goes nowhere
    grouped_NxD = jnp.zeros((n * S, D), xs_NxD.dtype).at[at_N].set(recv_NxD, mode="drop")
    y_NxD = experts_grouped(grouped_NxD, p, total, act, form, A)
    back_NxD = jnp.take(y_NxD, at_N, axis=0, mode="fill", fill_value=0)
    home = collectives.all_to_all(back_NxD, axis, algorithm=algorithm).reshape(n, S, -1)
    return home[dev_N, pos_N]
