"""The data a run trains and evaluates on: the streams of --data and its tokenizer."""

from __future__ import annotations


def streams(cfg, model):
    """The training and validation streams of --data, and what the ids are: the
    --tokenizer given (bpe:N is trained on the corpus here), bytes of text, or for a
    token file perhaps an --init-from folder's tokenizer."""
    from dpjax.data import make_streams
    from dpjax.data.tokenizer import Bytes, for_corpus, for_model

    given, vocab = None, model.config.vocab_size
    if cfg.tokenizer:
        from dpjax.data import text_chunks

        given = for_corpus(cfg.tokenizer, text_chunks(cfg.data))
        if given.vocab_size > vocab:
            from dpjax.plan import UsageError

            raise UsageError(f"--tokenizer {cfg.tokenizer} has {given.vocab_size} ids, the model {vocab}")
    train, val = make_streams(cfg.data, cfg.seq_len, cfg.seed, vocab_size=vocab, token_dtype=cfg.token_dtype,
                              tokenizer=given)
    text = not cfg.data.endswith(".bin") and cfg.data != "synthetic"
    return train, val, given or (Bytes() if text else for_model(cfg.init_from, None, vocab, text=False))
