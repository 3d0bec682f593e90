"""experiments/step_fingerprints.py: what it hashes leaves out only where the code sits, and a
moved program is named (its smoke run, compiling one layout, is in tests/test_experiments.py)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "experiments"))

import step_fingerprints as F  # noqa: E402

HLO = ('  %dot.3 = f32[8,32]{1,0} dot(f32[8,16]{1,0} %p0, f32[16,32]{1,0} %p1), lhs_contracting_dims={1}, '
       'rhs_contracting_dims={0}, metadata={op_name="jit(train)/dot_general" source_file="/a/models/gpt.py" '
       'source_line=LINE}\n')


def test_metadata_is_stripped_and_nothing_else():
    here, moved = F._METADATA.sub("", HLO.replace("LINE", "10")), F._METADATA.sub("", HLO.replace("LINE", "99"))
    assert here == moved and "metadata" not in here
    assert "lhs_contracting_dims={1}, rhs_contracting_dims={0}" in here  # braces of the op itself kept
    other = F._METADATA.sub("", HLO.replace("LINE", "10").replace("f32[16,32]", "bf16[16,32]"))
    assert F.digest(other) != F.digest(here)


def test_the_source_tables_are_dropped_and_the_program_kept():
    text = (HLO.replace("LINE", "10") + "\nFileNames\n1 \"/a/models/gpt.py\"\n\nENTRY %main {\n  ROOT %r = f32[] "
            "constant(0)\n}\n\nStackFrames\n1 {file_location_id=1 parent_frame_id=1}\n")
    kept = F.program(text)
    assert "gpt.py" not in kept and "StackFrames" not in kept and "ROOT %r = f32[] constant(0)" in kept
    assert F.program(text.replace("/a/models", "/b/models")) == kept


def test_compare_names_each_moved_layout_and_text():
    before = {"8x1": {"argv": "--mesh 8x1", "lowered": "a", "compiled": "b"},
              "2x4": {"argv": "--mesh 2x4", "lowered": "c", "compiled": "d"}}
    assert F.compare(before, before) == []
    after = {"8x1": {"argv": "--mesh 8x1", "lowered": "a", "compiled": "B"},
             "fsdp": {"argv": "--fsdp", "lowered": "e", "compiled": "f"}}
    assert F.compare(before, after) == ["2x4: only before", "8x1: compiled b -> B", "fsdp: only after"]
