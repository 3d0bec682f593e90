"""--reward's loader (dpjax.train.reward.load) on files: a Python file's function is found, a file
Python cannot import as a module (not .py) is a one-line error saying so (mypy found the
unchecked `spec_from_file_location` None: the run said "AttributeError: 'NoneType' object has
no attribute 'loader'")."""

import pytest

from dpjax.train.reward import RewardError, load


def test_a_python_file_gives_its_function(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text("def exact(prompt, completion):\n    return float(completion == prompt)\n")
    fn, with_row = load(f"{path}:exact")
    assert (fn("a", "a"), fn("a", "b"), with_row) == (1.0, 0.0, False)


def test_a_file_that_is_not_python_is_one_line(tmp_path):
    path = tmp_path / "rewards.txt"
    path.write_text("def exact(prompt, completion):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"rewards\.txt is not a Python file \(path/to/rewards\.py:function\)$"):
        load(f"{path}:exact")
