"""The exchange chooses its forms (issue 46, item 4): `Exchange.form` is the one answer to
which form a gradient's exchange takes, set for a layout once by the plan (`placed`), and
nothing outside `dpjax/compression/` asks the compression which form applies.

Read from the source (nothing imported) for the rule: no module outside `dpjax/compression/`
(dpjax and the models it serves) calls the functions that decide a form (`stateful`,
`summable`, `check`, `parse`, `sharded.applies`) or reads a method's `stateful` / `linear`.
`python tests/test_exchange_form.py` prints what the rule finds.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "dpjax.compression"
DECIDERS = {"stateful", "summable", "check", "parse", "applies"}  # the compression's own form questions
METHOD_FACTS = {"stateful", "linear"}  # what a registered method says of itself (`registry.Method`)


def _sources():
    for base in (ROOT / "dpjax", ROOT / "models"):
        for path in sorted(base.rglob("*.py")):
            if not str(path).startswith(str(ROOT / "dpjax" / "compression")):
                yield path


def _dotted(node) -> str | None:
    """`a.b.c` of a Name or an Attribute chain, None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def form_questions(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) for each place `tree` asks the compression which form applies."""
    modules, deciders = {}, {}  # local name -> dpjax.compression module / decider it binds
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == PACKAGE or a.name.startswith(PACKAGE + "."):
                    modules[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full == PACKAGE or (node.module.startswith(PACKAGE) and a.name not in DECIDERS):
                    modules[a.asname or a.name] = full
                elif node.module.startswith(PACKAGE) and a.name in DECIDERS:
                    deciders[a.asname or a.name] = full
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name is None:
                continue
            head, _, rest = name.partition(".")
            if head in deciders and not rest:
                found.append((node.lineno, f"calls {deciders[head]}"))
            elif head in modules and rest and rest.rpartition(".")[2] in DECIDERS:
                found.append((node.lineno, f"calls {modules[head]}.{rest}"))
        elif isinstance(node, ast.Attribute) and node.attr in METHOD_FACTS:
            found.append((node.lineno, f"reads .{node.attr} of {_dotted(node.value) or 'a value'}"))
    return found


def questions() -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} {what}" for path in _sources()
            for line, what in form_questions(ast.parse(path.read_text(), str(path)))]


def test_nothing_outside_compression_asks_which_form():
    """The plan, the step builder, the rules, the memory estimate, the checkpoints and
    Horovod's face read `Exchange.form` (or call the exchange); they never decide it."""
    assert questions() == []


@pytest.mark.parametrize("source, expected", [
    ("from dpjax.compression import stateful\nstateful(s.compression)", ["calls dpjax.compression.stateful"]),
    ("from dpjax import compression\ncompression.parse(x)", ["calls dpjax.compression.parse"]),
    ("from dpjax.compression import sharded\nsharded.applies(l, c)", ["calls dpjax.compression.sharded.applies"]),
    ("import dpjax.compression.grammar as g\ng.summable(c)", ["calls dpjax.compression.grammar.summable"]),
    ("spec.method.stateful", ["reads .stateful of spec.method"]),
    ("from dpjax.plan import check\ncheck(s)\nex.form\nsharded.wire_bytes(a)", []),  # not the compression's
])
def test_the_rule_sees_each_way_of_asking(source, expected):
    """The walk finds a decider however it is imported, and nothing else of that name."""
    assert [what for _, what in form_questions(ast.parse(source))] == expected


def test_the_form_follows_the_method_and_the_layout():
    """PLAIN for none and for the casts (summed on the wire as they are), FEEDBACK for a
    method with state between workers, FSDP's only with FSDP over every data axis; the
    registry's own word for each method is the reference."""
    from dpjax.compression import Exchange, Form, registry

    assert Exchange().form is Form.PLAIN and Exchange(compression="none").form is Form.PLAIN
    for name in registry.names():
        method = registry.get(name)
        spec = name if method.number is None else f"{name}:{'0.1' if method.number_type is float else 2}"
        ex = Exchange(compression=spec)
        assert ex.form is (Form.FEEDBACK if method.stateful else Form.PLAIN), name
        assert ex.placed(True, ()).form is (Form.FSDP if method.stateful else Form.PLAIN), name
        assert ex.placed(True, ("node",)).form is ex.form, name  # workers take the exchange: not FSDP's
        assert ex.placed(False, ()).form is ex.form, name
        assert ex.per_worker(False) is method.stateful and not ex.per_worker(True), name
        assert ex.placed(True, ()).unfit == (method.nonlinear if method.stateful and method.reduce_scatter is None
                                             else None), name
    with pytest.raises(ValueError, match="unknown compression"):
        Exchange(compression="nope")


def test_the_plan_sets_the_form_from_its_layout():
    """`for_layout` places a given exchange on the layout: FSDP with no workers takes the
    FSDP form and wraps the rule (its state gains the reduce-scatter's error buffer)."""
    import jax

    from dpjax.compression import Exchange, Form, sharded
    from dpjax.mesh import make_mesh
    from dpjax.plan import for_layout
    from dpjax.sharding import make_layout
    from models import get_model

    model = get_model("mlp", d_embed=8, d_hidden=16)
    mesh = make_mesh("8x1", jax.devices()[:8])
    for fsdp, workers, form in ((True, (), Form.FSDP), (True, ("data",), Form.FEEDBACK), (False, (), Form.FEEDBACK)):
        layout = make_layout(model, mesh, fsdp=fsdp, workers=workers)
        plan = for_layout(model, layout, global_batch=8, exchange=Exchange(compression="randk:0.1"))
        assert plan.exchange.form is form, (fsdp, workers)
        state = jax.eval_shape(plan.rule.init, jax.eval_shape(model.init, jax.random.key(0)))
        assert isinstance(state, sharded.SharedState) is (form is Form.FSDP), (fsdp, workers)



def test_one_grammar_for_compression_and_update():
    """--compression and --update are cut by one `Spelling` (name, N, key=VALUE options, each
    once), and Horovod's keyword form writes the text the grammar reads back."""
    from dpjax import horovod as hvd
    from dpjax.compression import parse
    from dpjax.errors import UserError
    from dpjax.registry import Spelling
    from dpjax.updates import UpdateSpec, parse_update

    assert Spelling.of(" sparse:8, outer=0.7") == Spelling("sparse", "8", (("outer=0.7", "outer", "0.7"),))
    assert Spelling.of("sync:").number == "" and Spelling.of("sync").number is None
    assert parse_update("sparse:8, outer=0.7") == UpdateSpec("sparse", 8, outer_lr=0.7)
    with pytest.raises(UserError, match="bad --update 'async:2,fetch=1,fetch=2': option 'fetch' given twice"):
        parse_update("async:2,fetch=1,fetch=2")
    with pytest.raises(ValueError, match="option 'start' given twice"):
        parse("powersgd:4,start=1,start=2")
    text = hvd.Compression.powersgd(4, ef=False, start=3)
    assert text == "powersgd:4,ef=0,start=3" and str(parse(text)) == text
    assert (parse(text).number, parse(text).ef, parse(text).start) == (4, False, 3)
    with pytest.raises(ValueError, match="rank R must be"):
        hvd.Compression.powersgd(0)

if __name__ == "__main__":
    print("\n".join(questions()) or "nothing outside dpjax/compression/ asks which form applies")
