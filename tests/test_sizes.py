"""The house's size rules, read from the source (no module is imported, nothing compiles):
one concept per file (a module of dpjax or its models at most MAX_MODULE_LINES lines) and
short functions (at most MAX_FUNCTION_LINES lines, from the `def` line to the last line).

The exceptions are listed by name below and the list can only shrink: an entry that no
longer exceeds its limit fails too, so whoever fixes one also strikes it off.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# (path relative to the repository) -> why it is still long
LONG_MODULES: dict = {}
# (path, qualified name) -> why it is still long
LONG_FUNCTIONS: dict = {}


def sources():
    for base in ("dpjax", "models"):
        for path in sorted((ROOT / base).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines from `def` to the end) of every function, methods and nested
    functions included (`Outer.method`, `outer.inner`)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                yield name, node.end_lineno - node.lineno + 1
            yield from functions(node, name + ".")
        else:
            yield from functions(node, prefix)


def too_long(files) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """({module: lines} over MAX_MODULE_LINES, {(module, function): lines} over MAX_FUNCTION_LINES)."""
    modules, funcs = {}, {}
    for rel, text in files:
        if len(text.splitlines()) > MAX_MODULE_LINES:
            modules[rel] = len(text.splitlines())
        for name, lines in functions(ast.parse(text, rel)):
            if lines > MAX_FUNCTION_LINES:
                funcs[(rel, name)] = lines
    return modules, funcs


def test_modules_and_functions_keep_to_their_size():
    modules, funcs = too_long(sources())
    assert set(modules) <= set(LONG_MODULES), {m: n for m, n in modules.items() if m not in LONG_MODULES}
    assert set(funcs) <= set(LONG_FUNCTIONS), {f: n for f, n in funcs.items() if f not in LONG_FUNCTIONS}


def test_the_exceptions_only_shrink():
    """Every listed exception still exceeds its limit: one that was fixed is struck off."""
    modules, funcs = too_long(sources())
    assert set(LONG_MODULES) <= set(modules), sorted(set(LONG_MODULES) - set(modules))
    assert set(LONG_FUNCTIONS) <= set(funcs), sorted(set(LONG_FUNCTIONS) - set(funcs))


def test_the_walk_counts_methods_and_nested_functions():
    """The check itself: a long method and a long nested function are found, by their
    qualified names, and a module over the limit too."""
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    text = ("class C:\n    def m(self):\n" + body
            + "def f():\n    def g():\n" + body
            + "    return g\n" + "\n" * MAX_MODULE_LINES)
    modules, funcs = too_long([("dpjax/x.py", text)])
    assert modules == {"dpjax/x.py": len(text.splitlines())}
    assert funcs == {("dpjax/x.py", "C.m"): MAX_FUNCTION_LINES + 1, ("dpjax/x.py", "f"): MAX_FUNCTION_LINES + 3,
                     ("dpjax/x.py", "f.g"): MAX_FUNCTION_LINES + 1}


if __name__ == "__main__":
    found_modules, found_functions = too_long(sources())
    for m, n in sorted(found_modules.items()):
        print(f"module {m}: {n} lines")
    for (m, f), n in sorted(found_functions.items()):
        print(f"function {m}:{f}: {n} lines")
