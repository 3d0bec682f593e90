"""Text from a model: greedy, temperature and nucleus (top-p) sampling, stopping at EOS.

A `Decoder` (the GPT, the Llama and the families built on them) decodes with a KV cache
(`cache.py`: the prompt in one pass, then one token a step, each step attending over the
cache); a model without a stack of layers (the MLP) recomputes the sequence so far for
each new token. The parameters may be sharded on any
mesh: the programs are jitted over the global arrays, so XLA lays the work out as the
parameters lie. `python -m dpjax.generate` is the command line; the train job's sample
at the end of training calls `generate` too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dpjax.errors import UserError
from dpjax.generate import cache as kv


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (the most likely token); else softmax(logits / temperature)
    restricted to the smallest set of tokens whose probability reaches top_p (Holtzman
    et al., "The curious case of neural text degeneration", 2020)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def pick(logits_BxV, key, sampling: Sampling):
    """The next token of each row (int32, B)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    z_BxV = logits_BxV.astype(jnp.float32) / sampling.temperature
    if sampling.top_p < 1:
        order_BxV = jnp.argsort(-z_BxV, axis=-1)
        p_BxV = jax.nn.softmax(jnp.take_along_axis(z_BxV, order_BxV, axis=-1), axis=-1)
        keep_BxV = jnp.cumsum(p_BxV, axis=-1) - p_BxV < sampling.top_p  # the first token past top_p stays in
        kept_BxV = jnp.zeros_like(keep_BxV).at[jnp.arange(z_BxV.shape[0])[:, None], order_BxV].set(keep_BxV)
        z_BxV = jnp.where(kept_BxV, z_BxV, -jnp.inf)
    return jax.random.categorical(key, z_BxV, axis=-1).astype(jnp.int32)


def generate(model, params, prompt_BxT, max_new_tokens: int, sampling: Sampling = Sampling(), eos=(),
             logprobs: bool = False):
    """(B x N new tokens, as a numpy array): up to `max_new_tokens` after each prompt row
    (rows of equal length), each row stopping after any id in `eos` (a row that has stopped
    holds its EOS id in the later places; the others go on). The model's context (its
    config's seq_len) bounds prompt + new tokens. With `logprobs`: (the tokens, B x V
    float32 log-probs of the first new token: log_softmax of the logits at the prompt's
    last position, as the cache's prefill computes them)."""
    prompt_BxT = np.asarray(prompt_BxT, np.int32)
    B, T = prompt_BxT.shape
    check_length(model, T, max_new_tokens)
    # a Decoder (a stack of layers) whose layers take the cache's attention core caches
    make = _cached_step if model.LAYERS is not None and model.CACHED else _window_step
    step = make(model, T + max_new_tokens)
    key = jax.random.key(sampling.seed)
    state = step.start(params, jnp.asarray(prompt_BxT), B)
    eos_ids = np.asarray(list(eos), np.int32)
    done, out, first = np.zeros(B, bool), [], None
    for i in range(max_new_tokens):
        logits_BxV, state = step.next(params, state, T + i)
        if i == 0 and logprobs:
            first = np.asarray(jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1))
        token_B = np.asarray(pick(logits_BxV, jax.random.fold_in(key, i), sampling))
        token_B = np.where(done, out[-1] if out else token_B, token_B)
        out.append(token_B)
        done |= np.isin(token_B, eos_ids)
        if done.all():
            break
        state = step.feed(params, state, jnp.asarray(token_B), T + i)
    new_BxN = np.stack(out, axis=1) if out else np.zeros((B, 0), np.int32)
    return (new_BxN, first) if logprobs else new_BxN


def check_length(model, prompt_len: int, max_new_tokens: int) -> None:
    """One line when a prompt of `prompt_len` tokens plus `max_new_tokens` does not fit the
    model's context (its config's seq_len: the positions it was built for)."""
    context = model.config.seq_len
    if prompt_len < 1 or max_new_tokens < 0:
        raise UserError(f"generation needs a prompt of at least 1 token and max_new_tokens >= 0, got {prompt_len} "
                        f"and {max_new_tokens}")
    if prompt_len + max_new_tokens > context:
        raise UserError(f"a prompt of {prompt_len} tokens + {max_new_tokens} new tokens = {prompt_len + max_new_tokens}"
                        f" positions exceed the model's context of {context}: shorten the prompt or ask fewer "
                        "new tokens")


# jitted once per model object (static) and shapes: a second `generate` with the same model
# and lengths reuses the programs; `start` is traced, so every decoding step shares one
@partial(jax.jit, static_argnums=0)
def _last(model, params, tokens_BxT, start, cache):
    """(the logits of the last of `tokens_BxT`, the cache with their K and V written)."""
    logits_BxTxV, cache = kv.forward(model, params, tokens_BxT, start, cache)
    return logits_BxTxV[:, -1], cache


@partial(jax.jit, static_argnums=0)
def _apply(model, params, tokens_BxT):
    return model.apply(params, tokens_BxT)


@dataclass
class _Step:
    start: object  # (params, prompt, B) -> state
    next: object  # (params, state, length) -> (logits of the next token, state)
    feed: object  # (params, state, token, position) -> state


def _cached_step(model, length: int) -> _Step:
    """A `Decoder` with its KV cache of `length` positions (prompt and new tokens): the
    state is (logits of the last position, cache)."""
    def start(params, prompt_BxT, B):
        return _last(model, params, prompt_BxT, 0, kv.empty(model, B, length))

    def feed(params, state, token_B, position):
        return _last(model, params, token_B[:, None], position, state[1])

    return _Step(start, lambda params, state, length: (state[0], state), feed)


def _window_step(model, length: int) -> _Step:
    """Any model with `apply`: the whole sequence so far, padded to `length` (causal: the
    padding never reaches the logits read), recomputed for each token."""
    def start(params, prompt_BxT, B):
        return jnp.zeros((B, length), jnp.int32).at[:, :prompt_BxT.shape[1]].set(prompt_BxT)

    def next_(params, tokens_BxT, length):
        return _apply(model, params, tokens_BxT)[:, length - 1], tokens_BxT

    def feed(params, tokens_BxT, token_B, position):
        return tokens_BxT.at[:, position].set(token_B)

    return _Step(start, next_, feed)
