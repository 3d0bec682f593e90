"""The code blocks and links of README.md and docs/*.md, read as test_docs.py checks them.

A fenced block is one of:
- ```python: run, the page's blocks in order in one namespace (a page is one script);
- ```python after `<!-- docs-test: quote FILE -->`: changed lines quoted from FILE (an
  example the tests run): every line's code (its comment dropped; `...` stands for the
  line's start) occurs in a line of FILE;
- ```python after `<!-- docs-test: signature NAME -->`: NAME's signature, as Python has it;
- ```bash: shell commands; each is checked as what it names (a dpjax command line parsed,
  a training run planned with --dry-run, a file that exists, an extra pyproject declares);
- ``` with no language: output shown as a console prints it, not run; its `$ ` lines are
  commands, checked as a bash block's.
"""

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
_FENCE = re.compile(r"^( *)```(\w*)\s*$")
_MARK = re.compile(r"<!-- docs-test: (\w+) (\S+) -->")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mark: tuple | None  # ("quote", FILE) / ("signature", NAME) / None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = len(m.group(1)), m.group(2), i
        j = i + 1
        while not re.match(r"^ *```\s*$", lines[j]):
            j += 1
        body = "\n".join(line[indent:] for line in lines[i + 1:j])
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        mark = _MARK.search(prev)
        out.append(Block(page, start + 1, lang, body, mark.groups() if mark else None))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def _code(line: str) -> str:
    """A line's code: its trailing comment and surrounding blanks dropped."""
    return re.sub(r"\s+#.*$", "", line).strip()


def unquoted(block: Block) -> list[str]:
    """The lines of a quote block that its file does not hold (each `;`-separated statement
    looked for on its own)."""
    have = [_code(line) for line in (ROOT / block.mark[1]).read_text().split("\n")]
    have += [s.strip() for h in have for s in h.split(";")]
    missing = []
    for line in block.code.split("\n"):
        for stmt in _code(line).split(";"):
            stmt = stmt.strip().removeprefix("...").strip()
            if stmt and not any(stmt in h for h in have):
                missing.append(stmt)
    return missing


@dataclass
class Command:
    block: Block
    words: list[str]
    error: str | None = None  # the `error: ...` line an output block shows after it

    @property
    def id(self) -> str:
        return f"{self.block.id}:{' '.join(self.words)[:60]}"


def commands(block: Block) -> list[Command]:
    """The commands of a bash block (or the `$ ` lines of an output block): continuation
    lines joined, comments dropped, `a && b` two commands, `| cat` and a trailing `&` left
    out, `[--opt v]` (optional arguments) kept as given."""
    text = re.sub(r"\\\n\s*", " ", block.code)
    out = []
    for line in text.split("\n"):
        if block.lang != "bash":
            if line.startswith("error: ") and out:
                out[-1].error = line
            if not line.startswith("$ "):
                continue
            line = line[2:]
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for part in line.split(" && "):
            part = re.sub(r"\s*\|\s*cat$", "", part.strip()).removesuffix("&").strip()
            if part:
                words = [w.strip("[]") for w in shlex.split(part)]
                out.append(Command(block, [w for w in words if w not in ("", "...")]))
    return out


def links(page: Path) -> list[tuple[str, str]]:
    """(text, target) of every markdown link of a page, code blocks and spans left out."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\[([^\]]+)\]\(([^)\s]+)\)", text)


def slug(heading: str) -> str:
    """The anchor mkdocs (and GitHub) gives a heading: lower case, punctuation gone, blanks
    to hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return re.sub(r"\s+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}
