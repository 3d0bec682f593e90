"""Rotary position frequencies and the ways a checkpoint stretches them past its context.

Rotary embeddings (Su et al., "RoFormer", 2021) rotate pair i of a K-wide head by
position x inv_freq[i], inv_freq[i] = theta^(-2i/K). A model trained at one context and
used at a longer one rescales the frequencies; each published scheme is one `ROPE_TYPES`
entry (the names HuggingFace's `rope_type` uses, so that a Hub config reads straight in):

    linear   position interpolation: every frequency / factor (Chen et al., "Extending
             context window of large language models via positional interpolation", 2023)
    dynamic  NTK-aware: the base raised so that the longest wavelength spans the sequence,
             theta * (factor * n / n0 - (factor - 1)) ^ (K / (K - 2)) for a sequence of n > n0
             positions, n0 the trained context (bloc97 / emozilla, 2023; "YaRN" section 3.3)
    yarn     by wavelength: pairs that turn more than beta_fast times over the original context
             kept, fewer than beta_slow times interpolated (/ factor), a linear ramp between,
             and sin/cos scaled by 0.1 ln(factor) + 1 (Peng et al., "YaRN", 2023, eq. 17-20)
    llama3   by wavelength: longer than original / low_freq_factor: / factor; shorter than
             original / high_freq_factor: kept; between: a smooth mix (Meta's Llama 3.1
             release, "The Llama 3 herd of models", 2024)

The frequencies are computed in float64 with numpy: a constant of the trace, not a
traced array. `inverse_frequencies` gives them and the factor sin/cos are scaled by.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from dpjax.errors import UserError

# rope type -> the fields it needs (beyond factor) and the ones it may have
ROPE_TYPES = {
    "linear": ((), ()),
    "dynamic": (("max_position_embeddings",), ()),
    "llama3": (("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("original_max_position_embeddings",),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}


@dataclass(frozen=True)
class RopeScaling:
    """One scaling of the rotary frequencies (no scaling is None, not an instance). The
    fields are HuggingFace's names; a field a type does not use stays None."""

    type: str
    factor: float
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn: the context trained at
    max_position_embeddings: int | None = None  # dynamic: the context beyond which it rescales
    attention_factor: float | None = None  # yarn: sin/cos scale (default from factor, mscale)
    beta_fast: float | None = None  # yarn (default 32)
    beta_slow: float | None = None  # yarn (default 1)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool | None = None  # yarn: the ramp's ends rounded outwards (default true)

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise UserError(f"rope scaling type {self.type!r} is not computed by dpjax; it computes "
                            f"{', '.join(ROPE_TYPES)} (and none)")
        need, may = ROPE_TYPES[self.type]
        missing = [k for k in need if getattr(self, k) is None]
        extra = [f.name for f in dataclasses.fields(self) if f.name not in ("type", "factor", *need, *may)
                 and getattr(self, f.name) is not None]
        if missing or extra:
            raise UserError(f"rope scaling {self.type} " + (f"needs {', '.join(missing)}" if missing else "")
                            + ("; " if missing and extra else "") + (f"has no {', '.join(extra)}" if extra else ""))
        if not self.factor > 0:
            raise UserError(f"rope scaling {self.type} factor must be positive, got {self.factor}")

    def fields(self) -> dict:
        """The fields set (HuggingFace's keys, without rope_type)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "type" and getattr(self, f.name) is not None}


def inverse_frequencies(K: int, theta: float, scaling: RopeScaling | None = None,
                        n_positions: int | None = None) -> tuple[np.ndarray, float]:
    """(inv_freq: K/2 float64, the factor sin and cos are multiplied by) for heads of
    width K. n_positions: the sequence length the table serves (only `dynamic` reads it)."""
    exponents = np.arange(0, K, 2, dtype=np.float64) / K
    inv_freq = 1.0 / theta ** exponents
    if scaling is None:
        return inv_freq, 1.0
    s, factor = scaling, scaling.factor
    if s.type == "linear":
        return inv_freq / factor, 1.0
    if s.type == "dynamic":
        # The base grows with the sequence: transformers recomputes it from each forward's
        # length max(positions) + 1 once that passes max_position_embeddings. dpjax makes one
        # table for the run's seq_len (training, evaluation and a forward over a whole
        # sequence run at exactly that length), so it equals transformers' forward over a
        # sequence of seq_len tokens, and is unscaled at or below max_position_embeddings.
        n = max(n_positions or 0, s.max_position_embeddings)
        base = theta * (factor * n / s.max_position_embeddings - (factor - 1)) ** (K / (K - 2))
        return 1.0 / base ** exponents, 1.0
    if s.type == "llama3":
        context = s.original_max_position_embeddings
        wavelength = 2 * math.pi / inv_freq
        smooth = (context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        mixed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        long_, short = wavelength > context / s.low_freq_factor, wavelength < context / s.high_freq_factor
        return np.where(long_, inv_freq / factor, np.where(short, inv_freq, mixed)), 1.0
    return _yarn(K, theta, s, inv_freq)


def _yarn(K: int, theta: float, s: RopeScaling, inv_freq: np.ndarray) -> tuple[np.ndarray, float]:
    """YaRN's frequencies (a ramp over the pairs between the correction dimensions) and
    its attention temperature."""
    factor = s.factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
    else:
        attention = mscale(factor)

    def dimension(turns):  # the pair index whose wavelength turns `turns` times over the original context
        return K * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(s.beta_fast or 32), dimension(s.beta_slow or 1)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, K - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = np.clip((np.arange(K // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each pair's original (extrapolated) frequency
    return inv_freq / factor * (1 - kept) + inv_freq * kept, float(attention)
