"""Dropout whose masks are the same on every mesh (LoRA's, `dpjax.models.lora`).

Srivastava et al., "Dropout" (JMLR 2014), inverted as PyTorch's `nn.Dropout` computes it:
each value kept with probability 1 - p and then scaled by 1 / (1 - p), so the expectation
is the input; off (the identity) wherever the step gives no draw (evaluation, generation,
merge, export).

A device draws the bits of its own block only, and each bit is a function of the element's
global coordinates, never of the device that computes it: one Threefry-2x32 hash (Salmon
et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) of

    key:     the run's seed, the step (a counter the step keeps in its state, so a resumed
             run draws on), the layer's index in the whole model and the target (`at`)
    counter: (the row's index in the step's global batch, micro-batches counted,
              its position x the features + the feature's global index)

so that 8x1, 2x4 (features split over `model`), FSDP and any other layout of the same
global batch drop the same values. The counter's second word wraps past 2^32 position x
feature slots (a 128K-token row of 14,336-wide features is 1.9e9).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

SALT = 0xD70   # the step key's distance from the init key (the same seed draws both)
ROWS = "dropout_rows"  # the batch leaf the step builder adds: each row's global index (`dpjax.step.builder`)


def step_key(seed: int, step):
    """The draws of step `step` (a traced uint32: the steps the state has taken), as uint32[2]."""
    return jax.random.key_data(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), SALT), step))


@dataclass(frozen=True)
class Draw:
    """One step's dropout, as the layers see it in `Parallel.dropout`: the rate, the key
    (uint32[2]: the step's, folded with `at`'s ids) and the global index of each of this
    device's rows (uint32, Bd)."""

    rate: float
    key: jax.Array
    rows_Bd: jax.Array

    def at(self, *ids) -> "Draw":
        """The draw of one place (a layer's index, a target's): its ids folded into the key."""
        key = jax.random.wrap_key_data(self.key)
        for i in ids:
            key = jax.random.fold_in(key, i)
        return Draw(self.rate, jax.random.key_data(key), self.rows_Bd)

    def keep(self, positions_T, feature_ids, n_features: int):
        """Bd x T x F bools: which values survive (probability 1 - rate), from the rows'
        global indices, the positions' (`positions_T`: global, as `context.positions` gives
        them) and the features' (`feature_ids`: the global indices, of `n_features` in all,
        of this device's features, flattened)."""
        return keep_bits(self.key, self.rows_Bd, positions_T, feature_ids, n_features) >= threshold(self.rate)

    def drop(self, x, positions_T, feature_ids, n_features: int):
        """x with the dropped values zero and the kept ones scaled by 1 / (1 - rate); x's
        dimensions after Bd x T, flattened, are the features."""
        Bd, T = x.shape[:2]
        flat = x.reshape(Bd, T, -1)
        assert flat.shape[2] == feature_ids.shape[0] and self.rows_Bd.shape == (Bd,), (
            x.shape, feature_ids.shape, self.rows_Bd.shape)
        scale = jnp.asarray(1 / (1 - self.rate), flat.dtype)
        kept = jnp.where(self.keep(positions_T, feature_ids, n_features), flat * scale, jnp.zeros((), flat.dtype))
        return kept.reshape(x.shape)


def threshold(rate: float) -> np.uint32:
    """A 32-bit draw keeps its value when at least this: P(keep) = 1 - rate (to 2^-32)."""
    return np.uint32(min(round(rate * 2 ** 32), 2 ** 32 - 1))


def keep_bits(key, rows_Bd, positions_T, feature_ids, n_features: int):
    """Bd x T x F uint32 draws: Threefry-2x32 of the key and each element's global
    (row, position x n_features + feature); the first of the hash's two output words."""
    rows = rows_Bd.astype(jnp.uint32)[:, None, None]
    slots = (positions_T.astype(jnp.uint32)[None, :, None] * np.uint32(n_features)
             + feature_ids.astype(jnp.uint32)[None, None, :])
    shape = (rows.shape[0], slots.shape[1], slots.shape[2])
    key = key.astype(jnp.uint32)
    return threefry2x32_p.bind(key[0], key[1], jnp.broadcast_to(rows, shape), jnp.broadcast_to(slots, shape))[0]
