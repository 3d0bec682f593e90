"""A TRL or HuggingFace Trainer user's names (--learning_rate, num_train_epochs: in a YAML file) are answered
with dpjax's flag in the one-line error; every flag the table names is one dpjax.train's parser has."""

from __future__ import annotations

import pytest

from dpjax.errors import UserError
from dpjax.train.cli import build_parser, parse_args
from dpjax.train.record import load_config
from dpjax.train.trl_names import TRL_NAMES


def test_a_trl_flag_names_dpjax_s():
    with pytest.raises(UserError) as e:
        parse_args(["--learning-rate", "2e-5"])
    assert str(e.value) == "unknown flag --learning-rate; TRL's learning_rate is --lr here"
    with pytest.raises(UserError) as e:
        parse_args(["--stpes", "3"])  # a typo still gets the nearest flag
    assert str(e.value) == "unknown flag --stpes; did you mean --steps?"


def test_a_trl_key_in_a_config_file_names_dpjax_s(tmp_path):
    path = tmp_path / "trl.yaml"
    path.write_text("num_train_epochs: 3\n")
    with pytest.raises(UserError) as e:
        load_config(str(path))
    assert str(e.value).startswith(f"--config {path}: unknown setting 'num_train_epochs'; TRL's num_train_epochs "
                                   "is --steps (")


def test_the_table_names_flags_dpjax_has_for_names_it_does_not():
    flags = {o for a in build_parser()._actions for o in a.option_strings}
    for trl, answer in TRL_NAMES.items():
        named = [w for w in answer.split() if w.startswith("--")]
        assert named and all(w in flags for w in named), (trl, answer)
        assert f"--{trl.replace('_', '-')}" not in flags, trl  # a name dpjax has needs no answer
