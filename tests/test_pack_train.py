"""`--pack` in training (`dpjax.data.sft.PackedStream`, `dpjax.tasks.sft`): packed and
unpacked runs give the same losses (the unpacked run on the same mesh is the reference) on
8x1, 2x4 and with FSDP; the packed batches hold exactly the window's examples, in a fixed
number of rows that the data axes divide; the refusals are one line."""

import jax
import numpy as np
import pytest

from dpjax import step as S
from dpjax.data import packing
from dpjax.data.sft import ExampleStream, PackedStream
from dpjax.mesh import dp_size, mesh_size
from dpjax.errors import UserError
from dpjax.plan import resolve
from dpjax.train import parse_args

SEQ, B, V, STEPS = 32, 16, 64, 10
MODEL = ["--model", "llama", "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2",
         "--d-ff", "64", "--vocab-size", str(V), "--seq-len", str(SEQ), "--data", "synthetic", "--optimizer",
         "sgd", "--lr", "0.5", "--clip-norm", "0", "--task", "sft", "--batch-size", str(B)]


def examples(n=90, seed=1):
    """Prompt-then-answer examples of 3 to 20 tokens: several fit in a row of 33."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 21))
        prompt = int(rng.integers(1, length - 1))
        out.append((rng.integers(1, V, length), np.arange(length) >= prompt))
    return out


def losses(mesh, packed: bool, *extra, deal=1):
    settings = parse_args([*MODEL, "--mesh", mesh, *extra])
    plan = resolve(settings, jax.devices()[:mesh_size(mesh)])
    step, passes = S.for_plan(plan), settings.backward_passes
    if packed:
        stream = PackedStream(examples(), SEQ, 0, window=B * passes, deal_steps=deal, batch_size=B, steps=STEPS,
                              multiple=dp_size(plan.mesh))
    else:
        stream = ExampleStream(examples(), SEQ, 0, window=B * passes, deal_steps=deal)
    params, opt = step.init(S.init_params(plan.model, plan.layout, jax.random.key(0), plan.policy))
    out = []
    for i in range(STEPS):
        batch = S.put_batch(stream, i * B * passes, B, plan.mesh, passes=passes, rows=stream.rows if packed else None)
        params, opt, loss = step.train(params, opt, batch)
        out.append(float(loss))
    return out, (stream.rows if packed else B)


@pytest.mark.parametrize("mesh,extra,deal", [("2x4", (), 1),
                                              pytest.param("8x1", (), None, marks=pytest.mark.slow),
                                              pytest.param("data=4,model=2", ("--fsdp",), None, marks=pytest.mark.slow),
                                              pytest.param("4x2", ("--backward-passes", "2"), 3,
                                                           marks=pytest.mark.slow),
                                              pytest.param("data=2,context=2", (), 1, marks=pytest.mark.slow)])
def test_packed_and_unpacked_runs_give_the_same_losses(mesh, extra, deal):
    """Ten SGD steps: the same answer-token mean of the same examples each step, so the same
    losses to float32 round-off, while the packed batch has fewer rows (its 16 examples of
    3-20 tokens fill about 6 rows of 33); read in the seeded order (deal 1) or with each group
    of steps' examples dealt among them (--pack-window: 3 steps, or None: the epoch's 5), the
    unpacked run dealt alike."""
    unpacked, _ = losses(mesh, False, *extra, deal=deal)
    packed, rows = losses(mesh, True, *extra, deal=deal)
    assert rows < B
    np.testing.assert_allclose(packed, unpacked, rtol=1e-5)
    assert unpacked[-1] < unpacked[0]  # it trains: the equality is not of two runs that do nothing


@pytest.mark.parametrize("deal", [1, 3])
def test_the_packed_rows_hold_the_window_and_are_fixed(deal):
    """Each window's examples (its micro-batches together; dealt among 3 windows or not) in R rows a micro-batch, R the
    most any window of the run needs (packed again here, window by window) over the passes,
    rounded up to the data axes; the weights sum to the window's slots (N / n each of n
    answer targets), and the efficiency is real tokens over slots."""
    exs, passes, steps = examples(), 2, 7
    stream = PackedStream(exs, SEQ, 0, window=B * passes, deal_steps=deal, batch_size=B, steps=steps, multiple=4)
    plain = ExampleStream(exs, SEQ, 0, window=B * passes, deal_steps=deal)
    lengths = np.array([len(ids) for ids, _ in exs])
    most, real = 0, 0
    for w in range(steps):
        ids = plain._example_ids(np.arange(w * B * passes, (w + 1) * B * passes))
        most = max(most, len(packing.first_fit(lengths[ids].tolist(), SEQ + 1)))
        real += lengths[ids].sum()
        got = [stream.batch(w * B * passes + k * B, B) for k in range(passes)]
        seen = []  # each segment's tokens (the inputs' ids; the row's last token too when an example ends there)
        for g in got:
            for tokens, seg, pos in zip(g["tokens"], g["segment_ids"], g["positions"]):
                for s in range(1, seg.max() + 1):
                    at = np.flatnonzero(seg == s)
                    np.testing.assert_array_equal(pos[at], np.arange(len(at)))  # restarting at 0
                    end = at[-1] + 1 + (at[-1] == SEQ - 1 and tokens[SEQ] != 0)  # ids are >= 1, padding 0
                    seen.append(tuple(tokens[at[0]:end]))
        assert sorted(seen) == sorted(tuple(exs[i][0]) for i in ids)  # the window's examples, each once
        weights = np.concatenate([g["weights"] for g in got])
        assert weights.sum() == pytest.approx(stream.window_rows * SEQ, rel=1e-5)
        ref = np.concatenate([plain.batch(w * B * passes + k * B, B)["weights"] for k in range(passes)])
        assert (weights > 0).sum() == (ref > 0).sum()  # the same answer targets, packed or not
    assert stream.rows % 4 == 0 and stream.rows == -(-(-(-most // passes)) // 4) * 4
    assert stream.efficiency == pytest.approx(real / (steps * passes * stream.rows * (SEQ + 1)))
    assert stream.unpacked_efficiency == pytest.approx(real / (steps * passes * B * (SEQ + 1)))
    # part of a micro-batch's rows, as a device reads them: the same rows as the whole
    part = stream.batch(B, B, rows=slice(2, 4))
    whole = stream.batch(B, B)
    for k in part:
        np.testing.assert_array_equal(part[k], whole[k][2:4])


def test_pack_refusals_are_one_line(tmp_path):
    from dpjax.plan import check

    with pytest.raises(UserError) as e:
        check(parse_args(["--data", "stdlib", "--pack", "first_fit"]))
    assert "--pack first_fit applies to chat data" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError) as e:
        check(parse_args(["--data", "stdlib", "--pack-window", "4"]))
    assert "--pack-window applies to chat data" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError) as e:
        check(parse_args(["--data", "stdlib", "--pack-window", "0"]))
    assert "--pack-window must be at least 1, got 0" in str(e.value)
    from dpjax.compute.policy import resolve as policy

    with pytest.raises(ValueError) as e:
        policy("bfloat16", attention="cudnn", platform="gpu", head_dim=64, packed=True)
    assert "packed rows (--pack)" in str(e.value) and "\n" not in str(e.value)
    chosen, notes = policy("bfloat16", attention="auto", platform="gpu", head_dim=64, packed=True)
    assert chosen.attention == "xla" and "packed rows" in notes[0]


def test_pack_when_no_two_conversations_fit_a_row_is_one_line_and_writes_nothing(tmp_path, capsys):
    """A --seq-len shorter than every conversation (each cut to a whole row): nothing to pack."""
    import json
    import os

    from dpjax.train import main

    chatml = os.path.join(os.path.dirname(__file__), "fixtures", "chat_tiny", "chatml")
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} and {i}?"},
                                                     {"role": "assistant", "content": f"It is {2 * i}."}]}) + "\n"
                            for i in range(12)))
    out = tmp_path / "out"
    out.mkdir()
    args = ["--model", "llama", "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2",
            "--d-ff", "64", "--tokenizer", chatml, "--data", f"chat:{data}", "--seq-len", "12", "--truncate", "left",
            "--batch-size", "8", "--pack", "best_fit", "--metrics", str(out / "m.jsonl"), "--ckpt-dir",
            str(out / "ckpt")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --pack best_fit: no two conversations fit in a row of --seq-len 12") and (
        len(err.splitlines()) == 1), err
    assert os.listdir(out) == []


@pytest.mark.slow
def test_a_packed_run_resumes_bit_for_bit_records_its_packing_and_equals_unpacked_dealt_alike(tmp_path, capsys):
    """As a user runs it (`dpjax.train.main`, 4x2, 2 micro-batches, answers of 2 to 12 words): a
    packed run with the default --pack-window (an epoch's steps) stopped at step 3 and resumed to 6 gives the
    straight run's losses exactly (the dealt order is a function of the seed and the position); its chat line
    and run record give the packing; and an unpacked run given the same --pack-window reads the same
    conversations each step: the same losses within 1e-5."""
    import json
    import os

    from conftest import assert_resumes_bit_for_bit, read_losses

    from dpjax.train import main

    chatml = os.path.join(os.path.dirname(__file__), "fixtures", "chat_tiny", "chatml")
    rng = np.random.default_rng(0)
    words = "the a of to and in is it you that was for on are with as be this have from".split()
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(rng.choice(words, 3))},
        {"role": "assistant", "content": " ".join(rng.choice(words, int(rng.integers(2, 13))))}]}) + "\n"
        for _ in range(120)))
    args = ["--model", "llama", "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2",
            "--d-ff", "64", "--tokenizer", chatml, "--data", f"chat:{data}", "--seq-len", "96", "--batch-size", "8",
            "--mesh", "4x2", "--backward-passes", "2", "--optimizer", "sgd", "--lr", "0.5", "--clip-norm", "0",
            "--eval-every", "0", "--sample-tokens", "0"]
    packed = [*args, "--pack", "best_fit"]
    assert_resumes_bit_for_bit(packed, tmp_path)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("chat data: "))
    with open(tmp_path / "m.jsonl") as f:
        record = json.loads(f.readline())["record"]["data"]["chat"]
    p = record["packing"]
    epoch = record["examples"] // 16  # an epoch's steps: the conversations trained on over a window of 2 x 8
    assert p["method"] == "best_fit" and p["window_steps"] == epoch and p["conversations_per_batch"] == 8
    assert p["rows_per_batch"] % 4 == 0 and p["rows_per_batch"] < 8  # the 4 data devices divide them; fewer than 8
    # real tokens / slots: a step's tokens in rows over its rows (the record rounds them to 2 and 4 places)
    assert p["efficiency"] > 0.8 and p["efficiency"] == pytest.approx(p["rows_of_tokens"] / p["rows_per_batch"],
                                                                      abs=0.005 / p["rows_per_batch"] + 1e-4)
    assert f"the conversations of {epoch} steps dealt" in line and f"{p['efficiency']:.1%} of the slots" in line
    unpacked = tmp_path / "u.jsonl"
    assert main([*args, "--pack-window", str(epoch), "--steps", "6", "--metrics", str(unpacked)]) == 0
    np.testing.assert_allclose(read_losses(unpacked), read_losses(tmp_path / "s.jsonl"), rtol=1e-5)
    plain = tmp_path / "p.jsonl"  # the seeded order (no --pack-window): other conversations a step
    assert main([*args, "--steps", "6", "--metrics", str(plain)]) == 0
    assert read_losses(plain) != read_losses(unpacked)
