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


def grouped_matmul(x_MxD, w_GxDxF, sizes_G, form: str, expected: int | None = None):
    """x's rows through their groups' matrices, M x F: rows sizes[0] .. sizes[0]+sizes[1]-1
    use w[1] and so on; rows past sum(sizes) give zeros. `expected`: the rows usually
    used (the segment form's tile size; default M)."""
    M, G = x_MxD.shape[0], w_GxDxF.shape[0]
    if form == "ragged":
        return lax.ragged_dot(x_MxD, w_GxDxF, sizes_G.astype(jnp.int32))
    assert form == "segment", form
    t = tile_rows(expected or M, G)
    tiles = -(-(M + G * (t - 1)) // t)
    ends_G = jnp.cumsum(sizes_G)
    padded_G = (sizes_G + t - 1) // t * t
    pends_G = jnp.cumsum(padded_G)
    row_M = jnp.arange(M)
    group_M = jnp.searchsorted(ends_G, row_M, side="right")  # G for rows past the groups
    gi_M = jnp.minimum(group_M, G - 1)
    at_M = jnp.where(group_M < G, pends_G[gi_M] - padded_G[gi_M] + row_M - (ends_G[gi_M] - sizes_G[gi_M]),
                     tiles * t)  # a row past the groups goes nowhere
    tiled_PxD = jnp.zeros((tiles * t, x_MxD.shape[1]), x_MxD.dtype).at[at_M].set(x_MxD, mode="drop")
    tile_group = jnp.searchsorted(pends_G, jnp.arange(tiles) * t, side="right")
    used = tile_group < G

    def one(_, tile):
        x_txD, g, u = tile
        w_DxF = lax.dynamic_index_in_dim(w_GxDxF, jnp.minimum(g, G - 1), keepdims=False)
        zero = jnp.zeros((t, w_GxDxF.shape[2]), jnp.result_type(x_txD, w_GxDxF))
        return None, lax.cond(u, lambda: x_txD @ w_DxF, lambda: zero)

    _, y_tiles = lax.scan(one, None, (tiled_PxD.reshape(tiles, t, -1), tile_group, used))
    return jnp.take(y_tiles.reshape(tiles * t, -1), at_M, axis=0, mode="fill", fill_value=0)


def group_of_rows(sizes_G, M: int):
    """Each of M sorted rows' group (G for rows past the groups)."""
    return jnp.searchsorted(jnp.cumsum(sizes_G), jnp.arange(M), side="right")


def experts_grouped(x_MxD, p: dict, sizes_G, act: str, form: str, expected: int):
    """Each row through its group's expert: GELU with biases (w1, b1, w2, b2: the GPT's) or
    SwiGLU (wgate, wup, wdown: Mixtral's and Qwen3-MoE's); rows past the groups give zeros."""
    mm = lambda x, w: grouped_matmul(x, w, sizes_G, form, expected)  # noqa: E731
    if act == "swiglu":
        h_MxF = jax.nn.silu(mm(x_MxD, p["wgate_XexDxF"])) * mm(x_MxD, p["wup_XexDxF"])
        return mm(h_MxF, p["wdown_XexFxD"])
    g_M = group_of_rows(sizes_G, x_MxD.shape[0])
    real = (g_M < sizes_G.shape[0])[:, None]
    bias = lambda b: jnp.where(real, jnp.take(b, g_M, axis=0, mode="clip"), 0)  # noqa: E731
    h_MxF = jax.nn.gelu(mm(x_MxD, p["w1_XexDxF"]) + bias(p["b1_XexF"]))
    return mm(h_MxF, p["w2_XexFxD"]) + bias(p["b2_XexD"])


def send_rows(N: int, k: int, El: int) -> int:
    """S: the rows one device can send another (a token's k experts are distinct, at most
    min(k, E/n) on one device): the static bound that drops nothing at any load."""
    return N * min(k, El)


def row_bytes(N: int, k: int, El: int, n: int, D: int, itemsize: int) -> int:
    """Bytes of one device's input to one rows all-to-all (n blocks of S rows of D)."""
    return n * send_rows(N, k, El) * D * itemsize


def dropless(x_NxD, gates_Nxk, chosen_Nxk, p: dict, *, act: str, axis=None, n: int = 1,
             algorithm: str = "pairwise", form: str | None = None):
    """y N x D: each token's gate-weighted sum of its k experts' outputs, none dropped.
    `p`: this device's E/n experts (w*_XexDxF ...); axis: the expert axis (None: all here)."""
    form = form or default_form()
    N, D = x_NxD.shape
    k = chosen_Nxk.shape[1]
    El = p["w1_XexDxF" if act == "gelu" else "wgate_XexDxF"].shape[0]
    E, A = El * n, N * k
    expert_A = chosen_Nxk.reshape(A)
    order_A = jnp.argsort(expert_A, stable=True)  # choices sorted by expert (and so by device)
    sizes_X = jnp.zeros((E,), jnp.int32).at[expert_A].add(1)
    xs_AxD = x_NxD[order_A // k]
    if n == 1:
        ys_AxD = experts_grouped(xs_AxD, p, sizes_X, act, form, A)
    else:
        ys_AxD = _over_axis(xs_AxD, expert_A[order_A], sizes_X, p, act=act, axis=axis, n=n, El=El,
                            S=send_rows(N, k, El), algorithm=algorithm, form=form)
    y_AxD = jnp.zeros_like(ys_AxD).at[order_A].set(ys_AxD)
    return jnp.einsum("nk,nkd->nd", gates_Nxk.astype(y_AxD.dtype), y_AxD.reshape(N, k, D))


def _over_axis(xs_AxD, expert_A, sizes_X, p, *, act, axis, n, El, S, algorithm, form):
    """The sorted rows' outputs, computed by the devices holding their experts: counts
    first, then the rows, both by explicit all-to-alls (module docstring)."""
    A, D = xs_AxD.shape
    counts_nxEl = sizes_X.reshape(n, El)
    got_nxEl = collectives.all_to_all(counts_nxEl, axis, algorithm=algorithm)  # source i's rows per local expert
    per_dev_n = counts_nxEl.sum(1)
    dev_A = expert_A // El
    pos_A = jnp.arange(A) - (jnp.cumsum(per_dev_n) - per_dev_n)[dev_A]  # < S by send_rows' bound
    send_nSxD = jnp.zeros((n, S, D), xs_AxD.dtype).at[dev_A, pos_A].set(xs_AxD).reshape(n * S, D)
    recv_nSxD = collectives.all_to_all(send_nSxD, axis, algorithm=algorithm)
    # received row (i, s): source i's s-th row, of local expert e by source i's counts
    s_S = jnp.arange(S)
    ends_nxEl = jnp.cumsum(got_nxEl, axis=1)
    e_nxS = jax.vmap(lambda ends: jnp.searchsorted(ends, s_S, side="right"))(ends_nxEl)
    real_nxS = e_nxS < El
    ec_nxS = jnp.minimum(e_nxS, El - 1)
    within_nxS = s_S[None] - jnp.take_along_axis(ends_nxEl - got_nxEl, ec_nxS, axis=1)
    total_El = got_nxEl.sum(0)
    earlier_nxEl = jnp.cumsum(got_nxEl, axis=0) - got_nxEl  # rows of expert e from sources before i
    at_nxS = (jnp.cumsum(total_El) - total_El)[ec_nxS] + jnp.take_along_axis(earlier_nxEl, ec_nxS, axis=1) + within_nxS
    at_R = jnp.where(real_nxS, at_nxS, n * S).reshape(n * S)  # padding goes nowhere
    grouped_RxD = jnp.zeros((n * S, D), xs_AxD.dtype).at[at_R].set(recv_nSxD, mode="drop")
    y_RxD = experts_grouped(grouped_RxD, p, total_El, act, form, A)
    back_nSxD = jnp.take(y_RxD, at_R, axis=0, mode="fill", fill_value=0)
    home_nxSxD = collectives.all_to_all(back_nSxD, axis, algorithm=algorithm).reshape(n, S, -1)
    return home_nxSxD[dev_A, pos_A]
