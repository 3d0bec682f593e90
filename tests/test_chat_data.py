"""dpjax.data.chat against transformers' own apply_chat_template: the rendered strings, the ids and the
assistant masks that tests/fixtures/make_chat_fixture.py saved (tests/fixtures/chat_tiny/expected.json), the
offset rule's masks against transformers' generation-block masks, truncation and the one-line errors."""

import json
import pathlib
import shutil

import numpy as np
import pytest

from dpjax.data import chat
from dpjax.data.chat_template import ChatTemplate, TemplateError
from dpjax.errors import UserError

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "chat_tiny"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
CASES = [(folder, key) for folder in EXPECTED for key in EXPECTED[folder]
         if "ids" in EXPECTED[folder][key] or "text" in EXPECTED[folder][key]]


@pytest.fixture(scope="module")
def formats():
    return {folder: chat.ChatFormat(str(FIXTURE / folder)) for folder in EXPECTED}


def _row(case):
    return {"messages": case["messages"]} if "messages" in case else {"prompt": case["prompt"],
                                                                       "completion": case["completion"]}


def _unmarked(tmp_path, folder):
    """The folder's template with its {% generation %} tags taken out, as a --chat-template file."""
    source = (FIXTURE / folder / "chat_template.jinja").read_text()
    bare = source.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert bare != source
    (tmp_path / "bare.jinja").write_text(bare)
    return chat.ChatFormat(str(FIXTURE / folder), str(tmp_path / "bare.jinja"))


@pytest.mark.parametrize("folder,key", CASES)
def test_text_and_ids_equal_transformers(formats, folder, key):
    case, fmt = EXPECTED[folder][key], formats[folder]
    if key == "generation_prompt":  # add_generation_prompt: the template's own variable
        assert fmt.template.render(case["messages"], add_generation_prompt=True)[0] == case["text"]
        return
    if key == "string_prompt_completion":  # TRL's standard form: the text as it is, then eos; no template
        text, _ = fmt.render(_row(case))
        assert fmt.encode_text(text)[0].tolist() == case["ids"]
        return
    text, _ = fmt.render(_row(case), loss_on="all")
    assert text == case["text"]
    assert fmt.encode(_row(case)).tokens.tolist() == case["ids"]
    if "prompt_text" in case:
        assert fmt.template.render(case["prompt"], add_generation_prompt=True)[0] == case["prompt_text"]


def test_mask_equals_transformers_assistant_masks(formats, tmp_path):
    """On the template with generation blocks, the mask is transformers' return_assistant_tokens_mask; the offset
    rule (the same template without its blocks) gives it too."""
    bare = _unmarked(tmp_path, "chatml")
    assert formats["chatml"].template.has_generation and not bare.template.has_generation
    checked = 0
    for key, case in EXPECTED["chatml"].items():
        if "assistant_masks" in case:
            want = np.array(case["assistant_masks"], bool)
            np.testing.assert_array_equal(formats["chatml"].encode(_row(case)).loss_mask, want, err_msg=key)
            np.testing.assert_array_equal(bare.encode(_row(case)).loss_mask, want, err_msg=key)
            checked += 1
    assert checked == 6


def test_offset_rule_on_a_template_without_blocks(formats):
    """`plain` trims contents and ends a turn with </s>: the offset rule marks what transformers marks on the same
    template with (trimmed content + eos) in generation blocks; the answer's text inside the question is skipped."""
    for key, case in EXPECTED["plain"].items():
        if "marked_template_masks" in case:
            got = formats["plain"].encode(_row(case)).loss_mask
            np.testing.assert_array_equal(got, np.array(case["marked_template_masks"], bool), err_msg=key)


@pytest.mark.parametrize("folder", list(EXPECTED))
def test_completion_mask_is_trls(formats, folder):
    """loss on completion: the tokens after the prompt rendered for generation (TRL's completion_mask)."""
    for key in ("prompt_completion", "string_prompt_completion"):
        case = EXPECTED[folder][key]
        ex = formats[folder].encode(_row(case), loss_on="completion")
        assert ex.loss_mask.tolist() == [i >= len(case["prompt_ids"]) for i in range(len(case["ids"]))]
    all_ = formats[folder].encode(_row(EXPECTED[folder]["multi_turn"]), loss_on="all")
    assert all_.loss_mask.all() and len(all_.tokens) == len(EXPECTED[folder]["multi_turn"]["ids"])


def test_template_from_tokenizer_config(tmp_path):
    """A template in tokenizer_config.json (the older layout, here as a list of named ones) renders the same."""
    shutil.copy(FIXTURE / "plain" / "tokenizer.json", tmp_path)
    config = json.loads((FIXTURE / "plain" / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"},
                               {"name": "default", "template": (FIXTURE / "plain" / "chat_template.jinja").read_text()}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    case = EXPECTED["plain"]["named_unicode"]
    assert chat.ChatFormat(str(tmp_path)).render(_row(case))[0] == case["text"]


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_load_truncates_drops_and_counts(formats, tmp_path):
    rows = [_row(EXPECTED["chatml"][k]) for k in ("system_user_assistant", "multi_turn", "answer_inside_question")]
    lengths = [len(EXPECTED["chatml"][k]["ids"]) for k in ("system_user_assistant", "multi_turn",
                                                           "answer_inside_question")]
    data = _jsonl(tmp_path / "a.jsonl", rows + [{"messages": [{"role": "user", "content": "hi"}]}, ""])
    seq_len = 30  # rows of 31 tokens: the first two are longer (46, 54), the third fits (20)
    assert lengths == [46, 54, 20]
    right, counts = chat.load(data, formats["chatml"], seq_len, truncate="right")
    # right truncation cuts the first row's only answer away (it starts at token 37): skipped, counted
    assert (counts.rows, counts.truncated, counts.no_answer, counts.examples) == (4, 2, 2, 2)
    full = formats["chatml"].encode(rows[1])
    np.testing.assert_array_equal(right[0].tokens, full.tokens[:31])
    np.testing.assert_array_equal(right[0].loss_mask, full.loss_mask[:31])
    left, counts = chat.load(data, formats["chatml"], seq_len, truncate="left")
    assert (counts.truncated, counts.no_answer, counts.examples) == (2, 1, 3)
    np.testing.assert_array_equal(left[1].tokens, full.tokens[-31:])
    assert counts.tokens == 31 + 31 + 20 and counts.answer_tokens == sum(int(e.loss_mask[1:].sum()) for e in left)
    dropped, counts = chat.load(data, formats["chatml"], seq_len, truncate="drop")
    assert (counts.dropped_long, counts.examples) == (2, 1)
    assert dropped[0].tokens.tolist() == EXPECTED["chatml"]["answer_inside_question"]["ids"]


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_bad_input_is_one_line(formats, tmp_path):
    fmt = formats["chatml"]
    no_answer = _jsonl(tmp_path / "n.jsonl", [_row(EXPECTED["chatml"]["multi_turn"]),
                                               {"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(UserError) as e:
        chat.load(no_answer, fmt, 64, no_answer="refuse")
    _one_line(e, "n.jsonl:2", "no assistant answer")
    assert chat.load(no_answer, fmt, 64)[1].no_answer == 1  # skip (the default): counted
    with pytest.raises(TemplateError) as e:  # the template's raise_exception: transformers' message
        formats["plain"].encode({"messages": EXPECTED["plain"]["bad_role"]["messages"]}, "r.jsonl:7")
    _one_line(e, "r.jsonl:7", EXPECTED["plain"]["bad_role"]["error"])
    shutil.copy(FIXTURE / "chatml" / "tokenizer.json", tmp_path)
    with pytest.raises(TemplateError) as e:
        chat.ChatFormat(str(tmp_path)).encode(_row(EXPECTED["chatml"]["multi_turn"]))
    _one_line(e, "no chat template", "--chat-template")
    bad = _jsonl(tmp_path / "b.jsonl", [_row(EXPECTED["chatml"]["multi_turn"]), "{not json"])
    with pytest.raises(UserError) as e:
        chat.load(bad, fmt, 64)
    _one_line(e, "b.jsonl:2", "not a JSON object")
    with pytest.raises(UserError) as e:
        chat.load(no_answer, fmt, 8, truncate="drop")
    _one_line(e, "every example is longer than --seq-len 8")
    with pytest.raises(UserError) as e:
        fmt.encode(_row(EXPECTED["chatml"]["multi_turn"]), "m.jsonl:1", loss_on="completion")
    _one_line(e, "m.jsonl:1", "prompt/completion")
    (tmp_path / "upper.jinja").write_text("{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}")
    with pytest.raises(UserError) as e:  # no blocks, and the answer is not written as it is: where is it?
        chat.ChatFormat(str(FIXTURE / "chatml"), str(tmp_path / "upper.jinja")).encode(
            _row(EXPECTED["chatml"]["multi_turn"]), "u.jsonl:3")
    _one_line(e, "u.jsonl:3", "assistant turn 1", "generation")
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{% for m in messages %}")
    _one_line(e, "not a jinja template")


def test_sandboxed(formats):
    """A template cannot reach Python's internals (the immutable sandbox) nor change the row it is given."""
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    _one_line(e, "fails on it")
    with pytest.raises(TemplateError):
        ChatTemplate("{% set _ = messages.append(1) %}").render([{"role": "user", "content": "x"}])
    assert ChatTemplate("{{ {'a': 'é'} | tojson }}").render([])[0] == '{"a": "é"}'


def test_cli_reports_counts_and_packing(tmp_path, capsys):
    """python -m dpjax.data.chat's main, in this process (a new process would spend seconds importing JAX)."""
    data = _jsonl(tmp_path / "c.jsonl", [_row(EXPECTED["chatml"][k]) for k in ("multi_turn", "named_unicode")] * 3)
    assert chat.main([data, "--model", str(FIXTURE / "chatml"), "--seq-len", "127"]) == 0
    out = json.loads(capsys.readouterr().out)
    real = 3 * sum(len(EXPECTED["chatml"][k]["ids"]) for k in ("multi_turn", "named_unicode"))  # 3 * (54 + 25)
    assert out["examples"] == 6 and out["rows_packed"] == 3 and out["efficiency"] == round(real / (3 * 128), 4)
    assert chat.main([data, "--model", str(tmp_path), "--seq-len", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer.json" in err


def test_held_out_split():
    examples = [chat.Example(np.full(3, i, np.int32), np.ones(3, bool)) for i in range(40)]
    train, held = chat.split(examples, 0.1, seed=3)
    ids = lambda part: [int(ex.tokens[0]) for ex in part]  # noqa: E731
    assert len(held) == 4 and sorted(ids(train) + ids(held)) == list(range(40))
    assert ids(train) == sorted(ids(train)) and ids(held) == ids(chat.split(examples, 0.1, seed=3)[1])
    assert ids(held) != ids(chat.split(examples, 0.1, seed=4)[1])
    with pytest.raises(UserError):
        chat.split(examples[:1], 0.5)
