"""Cosine-similarity heads (`head_kinds` "cosine", the SlapBERT study's STS head): each text
encoded alone, `cosine_scale * cos(u, v)` of the pooled outputs against NumPy, the squared
error loss, per-task blocks / one-hot VJP = the whole batch under dropout, the feature
conversion of a cosine task, and the refusals."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx.data import encoder_features as ef
from ktx.models import bert, encoder
from ktx.models.base import with_row_ids
from tests.models.test_encoder_options import CONFIG, KINDS, B, L
from tests.models.test_encoder_options import _batch as options_batch
from tests.models.test_encoder_options import _model as options_model
from tests.models.test_token_tagging import check_task_gradients_sum_to_plain

COUNTS = (4, 4)  # task 0: 3 classes (sequence head); task 1: a score (cosine head)


def _model(kind, **kwargs):
    return options_model(kind, **{"num_labels": (3, 1), "head_kinds": ("sequence", "cosine"),
                                  "pooling": "mean", **kwargs})


def _batch():
    batch = options_batch()
    ids_b = (np.arange(B * L).reshape(B, L) * 5) % 37 + 2
    ids_b[:, 6:] = 0
    ids_b[5, 3:] = 0
    ids_b[:4] = 0  # task 0's rows: no second text, as the input pipeline gives them
    batch["input_ids_b"] = jnp.asarray(ids_b, jnp.int32)
    batch["attention_mask_b"] = jnp.asarray(ids_b > 0, jnp.int32)
    batch["label"] = jnp.asarray([0, 2, 1, 0, 4.5, 1.0, 0.0, 3.25], jnp.float32)
    return batch


def _params(model):
    return nn.unbox(model.init_variables(jax.random.key(0), _batch())["params"])


def _pooled(kind, model, params, batch):
    """Each model's own deterministic pooled output of `batch`'s `input_ids`."""
    if kind == "plain":
        return model.module.apply({"params": params}, batch["input_ids"],
                                  batch["token_type_ids"], batch.get("attention_mask"),
                                  method=bert.BertEncoder.encode)[1]
    if kind == "camtl":
        return model.encode(params, batch).pooled_output
    return model.encode(params, batch)[1]


@pytest.mark.parametrize("kind", KINDS)
def test_cosine_of_the_separately_encoded_texts(kind):
    model = _model(kind)
    batch = _batch()
    params = _params(model)
    assert set(params["task_heads"]) == {"task_0"}  # a cosine head has no parameters
    u = np.asarray(_pooled(kind, model, params, batch), np.float64)
    second = dict(batch, input_ids=batch["input_ids_b"],
                  token_type_ids=jnp.zeros_like(batch["input_ids_b"]),
                  attention_mask=batch["attention_mask_b"])
    v = np.asarray(_pooled(kind, model, params, second), np.float64)
    u, v = u[4:], v[4:]  # task 1's rows
    cos = (u * v).sum(-1) / np.linalg.norm(u, axis=-1) / np.linalg.norm(v, axis=-1)
    logits = model.logits(params, batch)
    assert logits[1].shape == (B, 1)
    np.testing.assert_allclose(logits[1][4:, 0], 5.0 * cos, rtol=1e-4, atol=1e-5)
    assert not np.asarray(logits[1][:4]).any()  # a mean of nothing is 0: a cosine of 0

    sums, aux = model.loss_sums(params, batch, None, False)
    err = (5.0 * cos - np.asarray(batch["label"][4:])) ** 2
    np.testing.assert_allclose(sums[1], err.sum(), rtol=1e-4)
    np.testing.assert_allclose(aux["squared_error"][1], err.sum(), rtol=1e-4)


def test_cosine_scale_and_the_attention_mask_default():
    model = encoder.EncoderClassifierModel(CONFIG, num_labels=(3, 1), pooling="mean",
                                           head_kinds=("sequence", "cosine"), cosine_scale=1.0)
    batch = _batch()
    params = _params(model)
    without_mask = {k: v for k, v in batch.items() if k != "attention_mask_b"}
    got = model.logits(params, without_mask)[1]  # attention_mask_b defaults to ids > 0
    np.testing.assert_allclose(got, model.logits(params, batch)[1], rtol=1e-6)
    assert np.all(np.abs(np.asarray(got)) <= 1.0 + 1e-6)
    np.testing.assert_allclose(
        np.asarray(_model("plain").logits(params, batch)[1]), 5.0 * np.asarray(got), rtol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "camtl"])
def test_task_blocks_and_vjp_give_the_whole_batch_gradient_under_dropout(kind):
    """Task 0's rows have no second text (a zero vector under mean pooling): the gradient
    stays finite, and the per-task paths sum to it."""
    model = _model(kind)
    check_task_gradients_sum_to_plain(model, with_row_ids(_batch()), _params(model), COUNTS,
                                      ("blocks", "vjp") if kind == "plain" else ("blocks",))


def test_refusals_name_the_binding():
    with pytest.raises(ValueError, match=r"cosine head of num_labels=\[3\].*num_labels=1"):
        encoder.EncoderClassifierModel(CONFIG, num_labels=(3, 1), head_kinds="cosine")
    with pytest.raises(ValueError, match=r"cosine_scale=0.0; accepted: a number > 0"):
        encoder.EncoderClassifierModel(CONFIG, num_labels=(3, 1),
                                       head_kinds=("sequence", "cosine"), cosine_scale=0.0)
    model = _model("plain")
    params = _params(model)
    batch = {k: v for k, v in _batch().items() if k != "input_ids_b"}
    with pytest.raises(ValueError, match=r"missing features \['input_ids_b'\].*cosine heads"):
        model.loss_sums(params, batch, None, False)
    with pytest.raises(ValueError, match="does not support cosine heads"):
        model.logits(params, _batch(), embedding_perturbation=jnp.zeros((B, L, 16)))
    spec = model.input_spec(4, {"inputs": L})
    assert spec["input_ids_b"].shape == spec["attention_mask_b"].shape == (4, L)


def test_separate_conversion_of_a_cosine_task():
    a, b = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14, 15, 16]]
    f = ef.convert_encoder(a, b, [1.5, 4.0], 6, cls_id=101, sep_id=102, separate=True)
    np.testing.assert_array_equal(f["input_ids"], [[101, 5, 6, 7, 102, 0], [101, 8, 102, 0, 0, 0]])
    np.testing.assert_array_equal(f["input_ids_b"], [[101, 9, 10, 102, 0, 0],
                                                     [101, 11, 12, 13, 14, 102]])
    np.testing.assert_array_equal(f["attention_mask_b"], f["input_ids_b"] > 0)
    assert not f["token_type_ids"].any()
    np.testing.assert_array_equal(f["label"], [1.5, 4.0])
    with pytest.raises(ValueError, match="example 1 has no second text"):
        ef.convert_encoder(a, [[9], []], [1.0, 2.0], 6, cls_id=101, sep_id=102, separate=True)

    pair = ef.convert_encoder(a, b, [1.5, 4.0], 6, cls_id=101, sep_id=102)
    padded = ef.with_cosine_features(pair)
    assert not padded["input_ids_b"].any() and padded["input_ids_b"].shape == (2, 6)
    assert ef.with_cosine_features(f)["input_ids_b"] is f["input_ids_b"]
    assert ef.cosine_tasks(("sequence", "cosine"), 2) == (1,)
    assert ef.cosine_tasks("cosine", 3) == (0, 1, 2) and ef.cosine_tasks(None, 2) == ()


def test_head_kinds_check_accepts_cosine_for_regressions_only():
    spaces = (ef.LabelSpace(("neg", "pos")), ef.LabelSpace.regression(0, 5))
    ef.check_head_kinds(("sst", "sts"), spaces, ("sequence", "cosine"))
    with pytest.raises(ValueError, match=r"task 'sst' \(task id 0\) a 'cosine' head.*regression"):
        ef.check_head_kinds(("sst", "sts"), spaces, "cosine")
    assert encoder.COSINE == ef.COSINE and encoder.HEAD_KINDS == ef.HEAD_KINDS


def test_input_rows_of_a_mixture_with_a_cosine_head(tmp_path):
    """MultiTaskInput with HEAD_KINDS ('sequence', 'cosine') over inline SST and STS files:
    the STS rows hold each sentence alone, the SST rows an all-padding second text."""
    import seqio

    import ktx.tasks  # noqa: F401
    from ktx.data.pipeline import MultiTaskInput
    from ktx.tasks import config
    from tests.data.test_wordpiece import ids, write_vocab
    from tests.tasks._fixtures import write

    root = tmp_path / "data"
    write(root, "cs224n/ids-sst-train.csv",
          "\tid\tsentence\tsentiment\n0\tab12\tThe cat sat .\t3\n1\tcd34\tHello !\t0\n")
    write(root, "cs224n/sts-train.csv", "\tid\tsentence1\tsentence2\tsimilarity\n"
          "0\tx1\tThe cat sat .\tHello cat !\t4.5\n1\tx2\tThe mat .\tUnaffable !\t0.5\n")
    name = "test_sst5_and_sts_cosine_bert"
    if name in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(name)
    seqio.MixtureRegistry.add(name, ["cs224n_sst5_bert_v001", "cs224n_sts_bert_v001"],
                              default_rate=1.0)
    config.set_data_dir(root)
    try:
        inp = MultiTaskInput(name, {"inputs": 8}, batch_size=4, shuffle=False,
                             encoder_vocabulary=write_vocab(tmp_path / "vocab"),
                             num_labels=(5, 1), head_kinds=("sequence", "cosine"),
                             cache_dir=tmp_path / "cache")
        batch = inp.get_batch(0)
        with pytest.raises(ValueError, match=r"'cs224n_sst5_bert_v001' \(task id 0\) a "
                                             r"'cosine' head"):
            MultiTaskInput(name, {"inputs": 8}, batch_size=4, num_labels=(5, 1),
                           encoder_vocabulary=tmp_path / "vocab", head_kinds="cosine")
    finally:
        seqio.MixtureRegistry.remove(name)
        config.set_data_dir(None)
    cls, sep = ids("[CLS]")[0], ids("[SEP]")[0]
    sts = np.nonzero(batch["task_id"] == 1)[0]
    sst = np.nonzero(batch["task_id"] == 0)[0]
    assert len(sts) == 2 and len(sst) == 2
    first = {tuple(batch["input_ids"][r].tolist()) for r in sts}
    second = {tuple(batch["input_ids_b"][r].tolist()) for r in sts}
    assert (cls, *ids("the", "cat", "sat", "."), sep, 0, 0) in first
    assert (cls, *ids("hello", "cat", "!"), sep, 0, 0, 0) in second
    assert not batch["token_type_ids"][sts].any()
    np.testing.assert_array_equal(batch["attention_mask_b"][sts], batch["input_ids_b"][sts] > 0)
    assert not batch["input_ids_b"][sst].any() and not batch["attention_mask_b"][sst].any()
    assert sorted(batch["label"][sts].tolist()) == [0.5, 4.5]
