"""A model's chat template: found beside its tokenizer, rendered with jinja2 the way HuggingFace renders it.

Where the template comes from, first found: a file the user names (`--chat-template FILE`), the
`chat_template.jinja` beside the tokenizer (what transformers 5 saves), or the `chat_template` of its
`tokenizer_config.json` (a string, or a list of named templates whose `default` is taken).

The environment is the one templates on the Hub are written for (transformers' `apply_chat_template`):
jinja2's immutable sandbox (a template is foreign code), `trim_blocks` and `lstrip_blocks`, the loop
controls (`break`, `continue`), `raise_exception(msg)`, a `tojson` that keeps non-ASCII text and does not
HTML-escape, `strftime_now(fmt)`; the variables are `messages`, `add_generation_prompt`, `tools` and
`documents` (None) and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...).

`{% generation %}...{% endgeneration %}` marks the text of an answer (what transformers'
`return_assistant_tokens_mask` counts). Here the block writes a private-use character before and after its
text; `render` removes them and returns where the text between them lies. Unlike a count of the characters
written so far, this also holds for a block inside a macro or a `{% set %}` block, whose output jinja buffers.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime

from dpjax.errors import UserError

OPEN, CLOSE = "\ue000", "\ue001"  # private-use characters: never in a template's text, refused in a row's
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"


class TemplateError(UserError):
    """A chat template that is missing, does not compile, or raises on a row."""


class _Raised(Exception):
    """raise_exception(msg) called by a template: its message is the user's answer."""


def _jinja():
    try:  # an optional dependency (the [hf] extra): each `import jinja2.x` binds jinja2 itself too
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise TemplateError("chat templates need jinja2: pip install 'dpjax[hf]' (or pip install jinja2)") from None
    return jinja2


def _environment():
    jinja2 = _jinja()

    class Generation(jinja2.ext.Extension):
        """{% generation %}body{% endgeneration %} -> OPEN body CLOSE."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return OPEN + caller() + CLOSE

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace(), refusing underscore names: no way to CPython's internals through it."""

        def __init__(*args, **kwargs):  # jinja's own signature trick: namespace(self=...) still works
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    def raise_exception(message):
        raise _Raised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=Namespace, dict=lambda *a, **k: dict(*a, **k))
    return env


def special_tokens(config: dict) -> dict[str, str]:
    """The named special tokens of a tokenizer_config.json (a string, or an added token's {"content": ...})."""
    out = {}
    for key in SPECIAL:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _from_config(config: dict) -> str | None:
    found = config.get("chat_template")
    if isinstance(found, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    return found if isinstance(found, str) else None


def find(folder: str | None, template_file: str | None = None) -> tuple[str, str]:
    """(the template's source, where it was found) for a tokenizer in `folder`."""
    if template_file:
        if not os.path.isfile(template_file):
            raise TemplateError(f"--chat-template {template_file}: no such file")
        with open(template_file, encoding="utf-8") as f:
            return f.read(), template_file
    beside = os.path.join(folder or "", TEMPLATE_FILE)
    if folder and os.path.isfile(beside):
        with open(beside, encoding="utf-8") as f:
            return f.read(), beside
    found = _from_config(read_config(folder)) if folder else None
    if found is None:
        raise TemplateError(f"the tokenizer in {folder!r} has no chat template (no {TEMPLATE_FILE}, no chat_template "
                            "in tokenizer_config.json); give one with --chat-template FILE")
    return found, os.path.join(folder, "tokenizer_config.json")


def read_config(folder: str | None) -> dict:
    """The folder's tokenizer_config.json, {} without one."""
    path = os.path.join(folder or "", "tokenizer_config.json")
    if not folder or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise TemplateError(f"{path}: not a JSON file ({e})") from None


class ChatTemplate:
    """A compiled chat template and the special tokens its variables name."""

    def __init__(self, source: str, special: dict[str, str] | None = None, name: str = "the chat template"):
        jinja2 = _jinja()
        self.source, self.special, self.name = source, dict(special or {}), name
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"{name}: not a jinja template (line {e.lineno}: {e.message})") from None
        self.has_generation = self._has_generation(jinja2)

    def _has_generation(self, jinja2) -> bool:
        """Whether the source holds a {% generation %} block (its tags, not the word in a string)."""
        tree = self.template.environment.parse(self.source)
        return any(isinstance(n.node, jinja2.nodes.ExtensionAttribute) and n.node.name == "_mark"
                   for n in tree.find_all(jinja2.nodes.Call))

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               where: str = "a row") -> tuple[str, list[tuple[int, int]]]:
        """(the rendered text, the [start, end) character spans its generation blocks wrote)."""
        if OPEN in json.dumps(messages, ensure_ascii=False) or CLOSE in json.dumps(messages, ensure_ascii=False):
            raise TemplateError(f"{where}: holds the private-use character U+E000 or U+E001, which dpjax uses to mark "
                                "answers while it renders; remove it")
        # a key whose value is None is dropped: templates test `is defined`, not `is none`, and would print "None"
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            marked = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          tools=None, documents=None, **self.special)
        except _Raised as e:
            raise TemplateError(f"{where}: {self.name} refuses it: {e}") from None
        except Exception as e:  # the template is foreign code: anything it raises is about it or the row
            raise TemplateError(f"{where}: {self.name} fails on it ({type(e).__name__}: {e})") from None
        return _unmark(marked, f"{where}: {self.name}")


def _unmark(marked: str, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without OPEN/CLOSE, and the spans between each outermost pair."""
    out, spans, depth, start, n = [], [], 0, 0, 0
    for piece in _split_marks(marked):
        if piece == OPEN:
            depth += 1
            start = n if depth == 1 else start
        elif piece == CLOSE:
            depth -= 1
            if depth < 0:
                raise TemplateError(f"{where}: an answer's end without its start")
            if depth == 0:
                spans.append((start, n))
        else:
            out.append(piece)
            n += len(piece)
    if depth:
        raise TemplateError(f"{where}: an answer's start without its end")
    return "".join(out), spans


def _split_marks(text: str):
    return (piece for piece in _MARKS.split(text) if piece)


_MARKS = re.compile(f"([{OPEN}{CLOSE}])")
