"""tests/benchmarks/per_task_grads.py's `--shared_variants`: MetaBalance configurations that
balance only some parameters (what the decomposition of a balanced step's cost uses), and
`--blocks`' configurations with the task blocks."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.append(str(pathlib.Path(__file__).resolve().parent / "benchmarks"))

import per_task_grads  # noqa: E402


def test_variants_parse_to_one_pattern_each():
    got = per_task_grads.parse_shared_variants(
        "mb_logits=logits_dense; mb_norm=encoder_norm/scale$;")
    assert got == {"mb_logits": ["logits_dense"], "mb_norm": ["encoder_norm/scale$"]}
    assert per_task_grads.parse_shared_variants("") == {}


@pytest.mark.parametrize("text, says", [
    ("logits_dense", "NAME=REGEX"),
    ("=x", "NAME=REGEX"),
    ("a=", "NAME=REGEX"),
    ("metabalance=x", "is taken"),
    ("plain=x", "is taken"),
    ("a=x;a=y", "is taken"),
    ("a=(unclosed", "not a regular expression"),
])
def test_bad_variants_are_refused_by_name(text, says):
    with pytest.raises(ValueError, match=says):
        per_task_grads.parse_shared_variants(text)


def test_a_bad_regex_exits_with_usage():
    with pytest.raises(SystemExit) as e:
        per_task_grads.main(["--models", "t5_tiny", "--shared_variants", "a=(unclosed"])
    assert e.value.code == 2


def test_a_variant_trainer_balances_only_its_parameters():
    model, _, sparse = per_task_grads._t5_setup(1)
    tr = per_task_grads.trainer(model, "metabalance", sparse, shared=["logits_dense"])
    assert tr.options.shared == ("logits_dense",)
    assert per_task_grads.trainer(model, "metabalance", sparse).options.shared is None


def test_blocks_configurations_take_the_task_blocks():
    """`--blocks`' `NAME@blocks` Trainers take the task blocks; the others keep "auto"
    (the taps on one device)."""
    model, _, sparse = per_task_grads._t5_setup(1)
    assert per_task_grads.trainer(model, "pcgrad", sparse).options.grad_method == "auto"
    tr = per_task_grads.trainer(model, "pcgrad", sparse, grad_method="blocks")
    assert tr.options.grad_method == "blocks"
