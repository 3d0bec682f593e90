"""The sample a training run prints at its end: the start of a validation sequence and
the model's greedy continuation (`dpjax.generate`), as text where the tokens decode
(bytes, a --tokenizer, an --init-from folder's tokenizer.json), else as ids. With chat
data: a held-out conversation's prompt rendered by the chat template for generation
(add_generation_prompt) and the model's answer, up to its end-of-turn token."""

from __future__ import annotations

import jax
import numpy as np

from dpjax.data.chat import row_at
from dpjax.generate import Sampling, generate

PROMPT_TOKENS = 16


def sample_line(trainer) -> str | None:
    """'sample: PROMPT|CONTINUATION', or None when this run prints none (--sample-tokens
    0, --progress none, several processes, a sequence too short to continue)."""
    cfg, model = trainer.cfg, trainer.model
    if cfg.sample_tokens < 1 or cfg.progress == "none" or jax.process_count() > 1:
        return None
    if trainer.chat is not None:
        prompt, eos = _chat_prompt(trainer.chat)
        keep = model.config.seq_len - min(cfg.sample_tokens, model.config.seq_len // 2)
        prompt = prompt[:, -keep:]  # a long prompt's end (as --truncate left keeps it): room for the answer
    else:
        prompt_len = min(PROMPT_TOKENS, model.config.seq_len // 2)
        prompt, eos = trainer.val_stream.batch(0, 1)[:, :prompt_len], ()
    n = min(cfg.sample_tokens, model.config.seq_len - prompt.shape[1])
    if n < 1:
        return None
    # the model's own tree: the workers' consensus where a rule keeps a copy per worker (as
    # evaluation reads it), the layer stack as L x ... where an interleaved pipeline keeps V x L/V
    params = trainer.step.consensus(trainer.params) if trainer.step.rule.per_worker else trainer.params
    new = generate(model, trainer.layout.unstore(params), prompt, n, Sampling(), eos=eos)[0]
    tok = trainer.tokenizer
    if tok is None:
        return f"sample: {prompt[0].tolist()} -> {new.tolist()}"
    if len(eos) and new.size and new[-1] in eos:  # generate repeats the end-of-turn token once a row stops
        new = new[:list(new).index(new[-1]) + 1]
    return "sample: " + repr(tok.decode(prompt[0]) + "|" + tok.decode(new))[1:-1]


def _chat_prompt(chat):
    """(1 x P ids of the first held-out conversation's prompt as the template renders it for
    generation, the ids of the tokens that end an answer)."""
    where = chat.held_out[0].where
    ids, _ = chat.format.encode_text(chat.format.prompt(row_at(where), where))
    eos = [i for i in (chat.format.tok.token_to_id(t) for t in chat.format.stops) if i is not None]
    return np.asarray(ids, np.int32)[None], eos
