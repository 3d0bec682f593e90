"""The sample a training run prints at its end: the start of a validation sequence and
the model's greedy continuation (`dpjax.generate`), as text where the tokens decode
(bytes, a --tokenizer, an --init-from folder's tokenizer.json), else as ids."""

from __future__ import annotations

PROMPT_TOKENS = 16


def sample_line(trainer) -> str | None:
    """'sample: PROMPT|CONTINUATION', or None when this run prints none (--sample-tokens
    0, --progress none, several processes, a sequence too short to continue)."""
    import jax

    from dpjax.generate import Sampling, generate

    cfg, model = trainer.cfg, trainer.model
    prompt_len = min(PROMPT_TOKENS, model.config.seq_len // 2)
    n = min(cfg.sample_tokens, model.config.seq_len - prompt_len)
    if n < 1 or cfg.progress == "none" or jax.process_count() > 1:
        return None
    prompt = trainer.val_stream.batch(0, 1)[:, :prompt_len]
    # the model's own tree: the workers' consensus where a rule keeps a copy per worker (as
    # evaluation reads it), the layer stack as L x ... where an interleaved pipeline keeps V x L/V
    params = trainer.step.consensus(trainer.params) if trainer.step.rule.per_worker else trainer.params
    new = generate(model, trainer.layout.unstore(params), prompt, n, Sampling())[0]
    tok = trainer.tokenizer
    if tok is None:
        return f"sample: {prompt[0].tolist()} -> {new.tolist()}"
    return "sample: " + repr(tok.decode(prompt[0]) + "|" + tok.decode(new))[1:-1]
