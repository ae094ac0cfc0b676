"""Token-tagging heads of the ktx encoder models (`head_kinds`): logits and loss against
NumPy, no pooler without a sequence head, per-task blocks / one-hot VJP / microbatches =
the whole batch under dropout for plain BERT, CA-MTL, PALs and TEA, frozen layers, and the
refusals (bad head kinds); SMART's term and MT-uncertainty's entropy on tagging heads
against NumPy."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ktx.data import encoder_features as ef
from ktx.models import bert, camtl, encoder, pals, smart, tea
from ktx.models.base import with_row_ids
from ktx.optim import compute_task_gradients
from ktx.training import trainer as trainer_lib
from tests.models.test_encoder_options import _model as encoder_options_model

B, L = 8, 8
CONFIG = bert.BertConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                         intermediate_size=32, max_position=16, dropout_rate=0.1,
                         attention_dropout_rate=0.1)
KINDS = ("plain", "camtl", "pals", "tea")
COUNTS = (3, 5)  # rows of task 0 (tagging, 3 tags) and task 1 (sequence, 2 classes)
IGN = encoder.IGNORE_LABEL


def _model(kind, config=CONFIG, **kwargs):
    """The four encoder models of `test_encoder_options`, with a tagging and a sequence head."""
    return encoder_options_model(kind, config, **{
        "num_labels": (3, 2), "head_kinds": ("tagging", "sequence"), **kwargs})


def _batch():
    ids = (np.arange(B * L).reshape(B, L) * 7) % 38 + 2
    ids[1, 5:] = 0
    ids[6, 4:] = 0
    labels = np.full((B, L), IGN)
    labels[0, [1, 2, 4]] = [1, 2, 0]      # [CLS] B I (piece) O ...
    labels[1, [1, 3]] = [0, 1]            # row 1: 5 real tokens
    labels[1, 6] = 2                      # on padding: ignored (not attended)
    labels[2, 1:7] = [1, 1, 2, 0, 2, 0]   # every real token labelled
    return {"input_ids": jnp.asarray(ids, jnp.int32),
            "token_type_ids": jnp.zeros((B, L), jnp.int32),
            "label": jnp.asarray([0, 0, 0, 1, 0, 1, 1, 0], jnp.float32),
            "token_labels": jnp.asarray(labels, jnp.int32),
            "task_id": jnp.asarray(np.repeat([0, 1], COUNTS), jnp.int32)}


def _params(model):
    return nn.unbox(model.init_variables(jax.random.key(0), _batch())["params"])


def _flat(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_constants_match_the_data_side():
    assert (encoder.SEQUENCE, encoder.TAGGING, encoder.IGNORE_LABEL) == \
        (ef.SEQUENCE, ef.TAGGING, ef.IGNORE_LABEL)
    assert encoder.HEAD_KINDS == ef.HEAD_KINDS


def test_logits_and_loss_against_numpy():
    model = encoder.EncoderClassifierModel(CONFIG, num_labels=(3, 2),
                                           head_kinds=("tagging", "sequence"))
    batch = _batch()
    params = _params(model)
    hidden, pooled = model.module.apply({"params": params}, batch["input_ids"],
                                        batch["token_type_ids"], method=bert.BertEncoder.encode)
    hidden, pooled = np.asarray(hidden, np.float64), np.asarray(pooled, np.float64)
    heads = params["task_heads"]
    tag = hidden @ np.asarray(heads["task_0"]["kernel"]) + np.asarray(heads["task_0"]["bias"])
    seq = pooled @ np.asarray(heads["task_1"]["kernel"]) + np.asarray(heads["task_1"]["bias"])
    logits = model.logits(params, batch)
    assert logits[0].shape == (B, L, 3) and logits[1].shape == (B, 2)
    np.testing.assert_allclose(logits[0], tag, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(logits[1], seq, rtol=1e-4, atol=1e-5)

    labels = np.asarray(batch["token_labels"])
    attended = np.asarray(batch["input_ids"]) > 0
    want_loss, want_acc, want_correct, want_tokens = np.zeros(2), np.zeros(2), 0.0, 0.0
    logp = tag - np.log(np.exp(tag).sum(-1, keepdims=True))
    for b in range(3):  # tagging rows
        m = (labels[b] >= 0) & attended[b]
        ce = -logp[b, m, labels[b, m]]
        hits = tag[b, m].argmax(-1) == labels[b, m]
        want_loss[0] += ce.mean()
        want_acc[0] += hits.mean()
        want_correct += hits.sum()
        want_tokens += m.sum()
    assert want_tokens == 3 + 2 + 6  # the label on row 1's padding is ignored
    slogp = seq - np.log(np.exp(seq).sum(-1, keepdims=True))
    target = np.asarray(batch["label"]).astype(int)
    for b in range(3, 8):
        want_loss[1] += -slogp[b, target[b]]
        want_acc[1] += seq[b].argmax() == target[b]
    sums, aux = model.loss_sums(params, batch, None, False)
    np.testing.assert_allclose(sums, want_loss, rtol=1e-5)
    np.testing.assert_allclose(aux["accuracy"], want_acc, rtol=1e-6)
    np.testing.assert_allclose(aux["token_correct"], [want_correct, 0])
    np.testing.assert_allclose(aux["tokens"], [want_tokens, 0])
    np.testing.assert_allclose(aux["weight"], [3, 5])
    # global normalisation: the task losses add up to the mean row loss
    np.testing.assert_allclose(model.task_losses(params, batch, None, False)[0].sum(),
                               want_loss.sum() / 8, rtol=1e-5)


def test_a_tagging_row_without_labels_has_no_weight():
    model = encoder.EncoderClassifierModel(CONFIG, num_labels=3, num_tasks=1,
                                           head_kinds="tagging")
    batch = dict(_batch(), task_id=jnp.zeros(B, jnp.int32))
    batch["token_labels"] = batch["token_labels"].at[0].set(IGN)
    weights = model.row_weights(batch)
    assert weights.tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
    sums, aux = model.loss_sums(_params(model), batch, None, False)
    assert float(aux["weight"][0]) == 2 and np.isfinite(sums).all()


@pytest.mark.parametrize("kind", KINDS)
def test_no_pooler_without_a_sequence_head(kind):
    common = dict(num_labels=(3, 3), head_kinds="tagging")
    if kind == "plain":
        model = encoder.EncoderClassifierModel(CONFIG, **common)
    elif kind == "camtl":
        model = camtl.CaMtlClassifierModel(CONFIG, camtl=camtl.CaMtlConfig(max_seq_length=L),
                                           **common)
    elif kind == "pals":
        model = pals.PalsClassifierModel(CONFIG, pals_size=4, pals_heads=2, **common)
    else:
        model = tea.TeaClassifierModel(CONFIG, injection="qkv", **common)
    params = _params(model)
    assert "pooler" not in params and set(params["task_heads"]) == {"task_0", "task_1"}
    assert params["task_heads"]["task_0"]["kernel"].shape == (16, 3)
    logits = model.logits(params, _batch())
    assert [lg.shape for lg in logits] == [(B, L, 3), (B, L, 3)]
    assert "pooler" in _params(_model(kind))  # a sequence head keeps it


def check_task_gradients_sum_to_plain(model, batch, params, counts, methods):
    """Under dropout (checked on), each per-task gradient method of `methods` gives the
    whole batch's per-task losses and per-task gradients summing to the plain gradient of
    `batch` (rows grouped by task, `counts` of each); returns the plain gradient."""
    rng = jax.random.key(7)
    normalizer = model.normalizer(batch)
    plain = jax.jit(jax.grad(
        lambda p: model.task_losses(p, batch, rng, True, normalizer=normalizer)[0].sum()))(params)
    want = jax.jit(lambda p: model.task_losses(p, batch, rng, True, normalizer=normalizer)[0])(
        params)
    assert not np.allclose(jax.jit(lambda p: model.task_losses(p, batch, None, False)[0])(params),
                           want)  # dropout on
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(plain))
    for method in methods:
        losses, _, tg = jax.jit(lambda p: compute_task_gradients(
            lambda q, b: model.loss_sums(q, b, rng, True), normalizer, p, batch,
            num_tasks=len(counts), task_counts=counts if method == "blocks" else None,
            method=method, shared="all"))(params)
        np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-7)
        total = jax.tree.map(lambda g: g.sum(0), tg.stacked)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                     total, plain)
    return plain


@pytest.mark.parametrize("kind", KINDS)
def test_task_blocks_and_vjp_give_the_whole_batch_gradient_under_dropout(kind):
    """Per-row dropout keys: each task's block (and, for plain BERT, the one-hot VJP)
    gives the whole batch's per-task losses, and their gradients sum to the plain
    gradient; frozen layers get none."""
    model = _model(kind, frozen_layers=1)
    plain = check_task_gradients_sum_to_plain(
        model, with_row_ids(_batch()), _params(model), COUNTS,
        ("blocks", "vjp") if kind == "plain" else ("blocks",))
    flat = _flat(plain)
    assert all(not v.any() for p, v in flat.items() if p.startswith(("embeddings/", "layers_0/")))
    assert flat["task_heads/task_0/kernel"].any() and flat["layers_1/output/kernel"].any()


def test_trainer_microbatches_agree_with_plain():
    def three(**kwargs):
        tr = trainer_lib.Trainer(_model("plain"), optax.adam(1e-2), **kwargs)
        state = tr.init_state(jax.random.key(0), _batch())
        out = []
        for _ in range(3):
            state, m = tr.train_step(state, _batch(), jax.random.key(3), task_counts=COUNTS)
            out.append(float(m["loss"]))
        return np.array(out), jax.device_get(state.params)

    plain, p_plain = three()
    assert plain[-1] < plain[0]
    for kwargs in ({"num_microbatches": 2},):
        got, p_got = three(**kwargs)
        np.testing.assert_allclose(got, plain, rtol=1e-5, err_msg=str(kwargs))
        # atol 1e-5: the attention key biases' gradient is zero in exact arithmetic (a bias
        # on every key shifts a query's logits by one constant), so Adam scales rounding
        # noise of either summation order into updates of up to ~1e-6 and either sign.
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                     p_got, p_plain)


def test_refusals_name_the_binding():
    with pytest.raises(ValueError, match=r"EncoderClassifierModel.head_kinds=\('tagging',\)"):
        encoder.EncoderClassifierModel(CONFIG, num_labels=(3, 2), head_kinds=("tagging",))
    with pytest.raises(ValueError, match=r"head_kinds='token'; accepted"):
        encoder.EncoderClassifierModel(CONFIG, num_labels=(3,), head_kinds="token")
    with pytest.raises(ValueError, match="tagging head needs >= 2 tags"):
        encoder.EncoderClassifierModel(CONFIG, num_labels=(1,), head_kinds="tagging")
    model = _model("plain")
    params, batch = _params(model), _batch()
    with pytest.raises(ValueError, match="missing features \\['token_labels'\\]"):
        model.loss_sums(params, {k: v for k, v in batch.items() if k != "token_labels"},
                        None, False)
    assert camtl.ca_mtl_model(model, camtl.CaMtlConfig(max_seq_length=L)).head_kinds == \
        ("tagging", "sequence")
    assert model.input_spec(4, {"inputs": L})["token_labels"].shape == (4, L)


def _np_sym_kl(p_logits, q_logits):
    lp = p_logits - np.log(np.exp(p_logits).sum(-1, keepdims=True))
    lq = q_logits - np.log(np.exp(q_logits).sum(-1, keepdims=True))
    return np.sum((np.exp(lp) - np.exp(lq)) * (lp - lq), axis=-1)


@pytest.mark.parametrize("kind", ["plain", "camtl"])
def test_smart_term_on_a_tagging_head(kind):
    """SMART's ℓ_s of a tagging row is the mean symmetric KL over its labelled tokens (a
    sequence row's is its head's); the term joins each task's loss, and each task's block
    gives the whole batch's sums under dropout."""
    base = _model(kind)
    params, batch, rng = _params(base), with_row_ids(_batch()), jax.random.key(5)
    sm = smart.SmartModel(base, weight=2.0, noise_std=1e-2, step_size=1e-2, epsilon=1e-2)
    # Each call compiled whole (jit): eagerly, every op of every call compiled on its own.
    loss_sums = jax.jit(lambda p, b: sm.loss_sums(p, b, rng, True))
    sums, aux = loss_sums(params, batch)
    clean = jax.jit(lambda p, b: base.logits(p, b, rng, True))(params, batch)
    delta = jax.jit(lambda p, b, c: sm.adversarial_perturbation(p, b, rng, c))(params, batch, clean)
    adversarial = jax.jit(lambda p, b, d: base.logits(p, b, rng, True, embedding_perturbation=d))(
        params, batch, delta)
    c = [np.asarray(x, np.float64) for x in clean]
    a = [np.asarray(x, np.float64) for x in adversarial]
    labels, attended = np.asarray(batch["token_labels"]), np.asarray(batch["input_ids"]) > 0
    want = np.zeros(2)
    for b in range(B):
        if b < COUNTS[0]:
            m = (labels[b] >= 0) & attended[b]
            want[0] += _np_sym_kl(c[0][b], a[0][b])[m].mean()
        else:
            want[1] += _np_sym_kl(c[1][b], a[1][b])
    term = np.asarray(aux["smart_adversarial"])
    assert np.all(term > 0)
    np.testing.assert_allclose(term, want, rtol=2e-3)
    np.testing.assert_allclose(sums, np.asarray(aux["loss"]) + 2.0 * term, rtol=1e-6)
    blocks = [loss_sums(params, {k: v[r] for k, v in batch.items()})[0]
              for r in (slice(0, COUNTS[0]), slice(COUNTS[0], B))]
    np.testing.assert_allclose(blocks[0][0], sums[0], rtol=1e-5)
    np.testing.assert_allclose(blocks[1][1], sums[1], rtol=1e-5)
    with pytest.raises(ValueError, match="need token_mask"):
        smart.row_divergence(base.num_labels, clean, adversarial, batch["task_id"])


def test_mt_uncertainty_entropy_of_a_tagging_row():
    """A tagging row's normalised entropy is the mean over its labelled tokens of its tag
    distribution's entropy / log(n); a sequence row's is its head's."""
    model = _model("plain")
    params, batch = _params(model), _batch()
    got = np.asarray(model.normalised_entropy(params, batch))
    logits = [np.asarray(x, np.float64) for x in model.logits(params, batch)]

    def h(z):
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return -(p * np.log(p)).sum(-1) / (np.log(z.shape[-1]) + 1e-5)

    labels, attended = np.asarray(batch["token_labels"]), np.asarray(batch["input_ids"]) > 0
    want = [h(logits[0][b])[(labels[b] >= 0) & attended[b]].mean() if b < COUNTS[0]
            else h(logits[1][b]) for b in range(B)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(ValueError, match="need token_mask"):
        encoder.row_normalised_entropy(model.logits(params, batch), batch["task_id"])
