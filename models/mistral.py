"""Mistral: a Llama whose attention sees only the last `sliding_window` positions.

Jiang et al., "Mistral 7B" (2023): sliding-window attention (a query at position p attends
to keys p - W + 1 .. p, HuggingFace's `MistralForCausalLM` with `sliding_window` W; null
in config.json is full attention, which Mistral 7B v0.2 and later ship). Everything else is
the Llama's (`dpjax.models.llama`): the same parameter tree, weight names and layers, so
only the attention's mask differs, in every attention path (the local kernels and the
context axis's ring and all-gather: `dpjax.compute.attention`).

Generation: `dpjax.generate` decodes a Mistral with the KV cache, the window in the
cache's mask (the layers' attention core comes from `Decoder.attention`), so a continuation
longer than the window is right (tests/test_mistral.py: transformers' greedy output). The
cache is a ring of W positions a layer (`cache_window`), not the sequence's length.
"""

from __future__ import annotations

from dataclasses import dataclass

from dpjax.errors import UserError
from dpjax.models.llama import Llama, LlamaConfig
from dpjax.models.registry import Entry, register


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    sliding_window: int = 0  # W: each position attends to the last W (itself included); 0: all (HF's null)

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window < 0:
            raise UserError(f"Mistral sliding_window must be 0 (full attention) or positive, got {self.sliding_window}")


# Mistral AI's published shapes (the Hub's config.json); v0.1 had a 4096-token window, v0.3 none.
PRESETS = {
    "mistral-7b": dict(vocab_size=32768, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                       rope_theta=1000000.0, norm_eps=1e-5, sliding_window=0),
    "mistral-7b-v0.1": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                            rope_theta=10000.0, norm_eps=1e-5, sliding_window=4096),
}


class Mistral(Llama):
    """The Llama with a sliding window in every layer's attention mask."""

    name = "mistral"

    @property
    def window(self) -> int | None:
        """The attention window every layer uses (None: full causal attention)."""
        return self.config.sliding_window or None


register(Entry("mistral", Mistral, MistralConfig, presets=PRESETS))
