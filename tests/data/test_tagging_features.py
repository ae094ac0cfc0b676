"""`ktx.data.encoder_features` for token tagging: word pieces and tags aligned on hand-made
sentences (first piece carries the tag, -100 elsewhere), truncation counts, the BIO label
space, head-kind checks, and signed compaction of the ignore value."""

from __future__ import annotations

import numpy as np
import pytest

from ktx.data import encoder_features as ef
from ktx.data import feature_converter as fc

TAGS = ("O", "B-Disease", "I-Disease")
IGN = ef.IGNORE_LABEL
# "The unaffable cats sat" with the tiny vocabulary of tests/data/test_wordpiece.py:
# the (5) | un ##aff ##able (10 11 12) | cat ##s (6 17) | sat (7); tagged O B I O.
PIECES, WORD_LENGTHS, WORD_TAGS = [5, 10, 11, 12, 6, 17, 7], [1, 3, 2, 1], [0, 1, 2, 0]


def _convert(length, pieces=PIECES, lengths=WORD_LENGTHS, tags=WORD_TAGS):
    out = ef.convert_tagging([pieces], [lengths], [tags], length, cls_id=2, sep_id=3,
                             tag_names=TAGS)
    return {k: v[0].tolist() for k, v in out.items()}


def test_first_piece_carries_the_word_tag():
    row = _convert(12)
    assert row["input_ids"] == [2, 5, 10, 11, 12, 6, 17, 7, 3, 0, 0, 0]
    assert row["attention_mask"] == [1] * 9 + [0] * 3
    assert row["token_type_ids"] == [0] * 12
    #                            [CLS] the  un  ##aff ##able cat ##s  sat [SEP] pad
    assert row["token_labels"] == [IGN, 0, 1, IGN, IGN, 2, IGN, 0, IGN, IGN, IGN, IGN]
    assert (row["words_cut"], row["entities_cut"], row["entity_crosses_cut"]) == (0, 0, 0)
    assert row["label"] == 0.0


def test_truncation_counts_what_it_cuts():
    # 4 pieces fit: "the un ##aff ##able"; "cats sat" are cut and the entity
    # "unaffable cats" (words 1-2) runs past the cut.
    row = _convert(6)
    assert row["input_ids"] == [2, 5, 10, 11, 12, 3]
    assert row["token_labels"] == [IGN, 0, 1, IGN, IGN, IGN]
    assert (row["words_cut"], row["entities_cut"], row["entity_crosses_cut"]) == (2, 1, 1)
    # 5 pieces: the first piece of "cats" fits, so the word (and the entity) is kept;
    # only "sat" (O) is cut.
    row = _convert(7)
    assert row["input_ids"] == [2, 5, 10, 11, 12, 6, 3]
    assert row["token_labels"] == [IGN, 0, 1, IGN, IGN, 2, IGN]
    assert (row["words_cut"], row["entities_cut"], row["entity_crosses_cut"]) == (1, 0, 0)
    # An entity wholly beyond the cut: counted, not crossing.
    row = _convert(4, [5, 6, 7], [1, 1, 1], [0, 0, 1])
    assert row["token_labels"] == [IGN, 0, 0, IGN]
    assert (row["words_cut"], row["entities_cut"], row["entity_crosses_cut"]) == (1, 1, 0)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="sentence 0 has 7 pieces, word_lengths"):
        _convert(12, lengths=[1, 3, 2])
    with pytest.raises(ValueError, match=r"tag index 3; accepted: 0..2"):
        _convert(12, tags=[0, 1, 3, 0])
    with pytest.raises(ValueError, match="length=2"):
        _convert(2)
    with pytest.raises(ValueError, match="not a BIO label set"):
        ef.convert_tagging([PIECES], [WORD_LENGTHS], [WORD_TAGS], 12, cls_id=2, sep_id=3,
                           tag_names=("O", "B-Disease"))


def test_tagging_label_space_and_head_kind_checks():
    space = ef.LabelSpace.tagging(TAGS)
    assert space.is_tagging and space.num_labels == 3 and space.kind == "tagging"
    assert space != ef.LabelSpace(TAGS) and repr(space) == f"LabelSpace.tagging({TAGS!r})"
    features = ef.encoder_output_features(None, space)
    assert features["label"].dtype.name == "int32" and features["label"].rank == 1
    assert set(features) == {"text_a", "text_b", "label"}  # as a sequence task: they mix
    with pytest.raises(ValueError, match="not a BIO label set"):
        ef.LabelSpace.tagging(("O", "X-Disease", "I-Disease"))
    sst = ef.LabelSpace(("neg", "pos"))
    ef.check_head_kinds(["a", "b"], [space, sst], ("tagging", "sequence"))
    with pytest.raises(ValueError, match=r"gives task 'b' \(task id 1\) a 'tagging' head.*"
                                         r"HEAD_KINDS = \('tagging', 'sequence'\)"):
        ef.check_head_kinds(["a", "b"], [space, sst], "tagging")
    with pytest.raises(ValueError, match="has 1 entries but the mixture has 2 tasks"):
        ef.check_head_kinds(["a", "b"], [space, sst], ("tagging",))
    with pytest.raises(ValueError, match="accepted: one of"):
        ef.check_head_kinds(["a"], [space], "token")


def test_sequence_rows_in_a_tagging_mixture_and_signed_compaction():
    seq = ef.convert_encoder([[5, 6]], [[]], [1.0], 6, cls_id=2, sep_id=3)
    rows = ef.sequence_rows_for_tagging(seq)
    assert rows["token_labels"].tolist() == [[IGN] * 6]
    assert set(rows) == set(ef.ENCODER_FEATURES) | set(ef.TAGGING_FEATURES)
    small = fc.compact(rows)
    assert small["token_labels"].dtype == np.int8 and small["input_ids"].dtype == np.uint8
    assert fc.widen(small)["token_labels"].tolist() == [[IGN] * 6]
    assert fc.compact({"x": np.array([-200, 40000])})["x"].dtype == np.int32
