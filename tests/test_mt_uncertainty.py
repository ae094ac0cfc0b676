"""MT-uncertainty sampling (`ktx.training.mt_uncertainty`) against a NumPy transcription
of the CA-MTL authors' `MtUcertaintyIterator` (their src/mtl_trainer.py, src/model/
ca_mtl.py and decoder.py: scipy entropy over log(n) + 1e-5, per-task means over the
highest mean, STS-B rows borrowing MRPC's, torch.topk), and in the train step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats

from ktx.models import bert, encoder
from ktx.optim import vanilla_multi
from ktx.training import mt_uncertainty as mtu
from ktx.training.trainer import StepOptions, Trainer

CONFIG = bert.BertConfig(vocab_size=40, hidden_size=16, num_layers=2, num_heads=2,
                         intermediate_size=32, max_position=16, dropout_rate=0.1,
                         attention_dropout_rate=0.1)
LABELS = (3, 2, 1)  # SST-like, MRPC-like, STS-B-like (regression)
PROXIES = ((2, 1),)


def _reference_scores(logits, task_id, labels, proxies):
    """The authors' scoring, step by step, in float64."""
    task_id = np.asarray(task_id)
    entropy = np.zeros(len(task_id))
    mean = np.zeros(len(task_id))
    max_mean = None
    for t in np.unique(task_id):  # CaMtl.forward: per present task
        rows = task_id == t
        if labels[t] == 1:
            h = np.zeros(rows.sum())
        else:
            p = scipy.special.softmax(np.asarray(logits[t], np.float64)[rows], axis=1)
            h = scipy.stats.entropy(p.T) / (scipy.stats.entropy(np.full(labels[t], 1 / labels[t]))
                                             + 1e-5)
        entropy[rows] = h
        mean[rows] = h.mean()
        max_mean = h.mean() if max_mean is None or h.mean() > max_mean else max_mean
    mean = mean / max_mean
    score = entropy * mean
    for target, source in proxies:  # the STS-B <- MRPC copy
        t_rows = np.flatnonzero(task_id == target)
        s_rows = np.flatnonzero(task_id == source)
        n = min(len(t_rows), len(s_rows))
        score[t_rows[:n]] = entropy[s_rows[:n]] * mean[s_rows[:n]]
    return score


def _model(**kwargs):
    return encoder.EncoderClassifierModel(CONFIG, num_labels=LABELS, **kwargs)


def _candidates(rows_per_task=4, seed=0):
    rng = np.random.default_rng(seed)
    n = rows_per_task * len(LABELS)
    ids = rng.integers(1, 40, size=(n, 8))
    ids[::5, 6:] = 0
    task_id = np.repeat(np.arange(len(LABELS)), rows_per_task)
    label = np.where(task_id == 0, rng.integers(0, 3, n),
                     np.where(task_id == 1, rng.integers(0, 2, n), rng.uniform(0, 5, n)))
    return {"input_ids": jnp.asarray(ids, jnp.int32),
            "token_type_ids": jnp.zeros((n, 8), jnp.int32),
            "label": jnp.asarray(label, jnp.float32),
            "task_id": jnp.asarray(task_id, jnp.int32)}


def test_scores_equal_the_authors_iterator():
    rng = np.random.default_rng(1)
    task_id = np.array([0, 0, 0, 1, 1, 2, 2, 2, 0, 1])  # uneven, interleaved, STS has more rows
    logits = [rng.normal(size=(10, n)) * 2 for n in LABELS]
    entropy = encoder.row_normalised_entropy([jnp.asarray(x, jnp.float32) for x in logits],
                                             jnp.asarray(task_id))
    got = mtu.uncertainty_scores(entropy, jnp.asarray(task_id), 3, PROXIES)
    want = _reference_scores(logits, task_id, LABELS, PROXIES)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # one MRPC row for three STS rows: only the first STS row borrows, the others score 0
    short = np.array([0, 0, 1, 2, 2, 2, 0, 0, 0, 0])
    entropy = encoder.row_normalised_entropy([jnp.asarray(x, jnp.float32) for x in logits],
                                             jnp.asarray(short))
    got = mtu.uncertainty_scores(entropy, jnp.asarray(short), 3, PROXIES)
    want = _reference_scores(logits, short, LABELS, PROXIES)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert np.asarray(got)[short == 2].tolist()[1:] == [0.0, 0.0]
    assert np.asarray(got)[3] > 0


def test_selection_is_the_top_rows_of_the_model_scores():
    model, batch = _model(), _candidates()
    params = jax.tree.map(jnp.asarray, __import__("flax").linen.unbox(
        model.init_variables(jax.random.key(0), batch)["params"]))
    logits = [np.asarray(x) for x in model.logits(params, batch)]
    want = _reference_scores(logits, np.asarray(batch["task_id"]), LABELS, PROXIES)
    chosen, scores = mtu.select_uncertain_rows(model, params, batch, 4, PROXIES)
    np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-7)
    order = np.argsort(-want, kind="stable")[:4]
    for k in batch:
        np.testing.assert_array_equal(chosen[k], np.asarray(batch[k])[order])


@pytest.mark.parametrize("balanced", [False, True])
def test_train_step_trains_on_the_selected_rows(balanced):
    """A step with `uncertainty_rows=b` on the candidates == a plain step on the `b` rows
    the initial parameters select (same rng: dropout is keyed by row position)."""
    model, batch = _model(), _candidates(8)  # 24 candidates, 8 kept: the 8 devices' data axis
    kwargs = dict(balancer=vanilla_multi()) if balanced else {}
    sampling = Trainer(model, optax.sgd(0.1), uncertainty_rows=8, uncertainty_proxies=PROXIES,
                       **kwargs)
    plain = Trainer(model, optax.sgd(0.1), **kwargs)
    rng = jax.random.key(3)
    state = sampling.init_state(jax.random.key(0), batch)
    chosen, _ = mtu.select_uncertain_rows(model, state.params, batch, 8, PROXIES)
    chosen = jax.device_get(chosen)
    after, metrics = sampling.train_step(state, batch, rng, (8, 8, 8))
    ref_state = plain.init_state(jax.random.key(0), chosen)
    counts = tuple(int((chosen["task_id"] == t).sum()) for t in range(3))
    ref, ref_metrics = plain.train_step(ref_state, chosen, rng, None if balanced else counts)
    np.testing.assert_array_equal(metrics["examples"], counts)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bad_settings():
    with pytest.raises(ValueError, match=r"regression task\(s\) 2 have no entropy"):
        Trainer(_model(), optax.sgd(0.1), uncertainty_rows=4)
    with pytest.raises(ValueError, match="only regression tasks"):
        Trainer(_model(), optax.sgd(0.1), uncertainty_rows=4, uncertainty_proxies=((0, 1), (2, 1)))
    with pytest.raises(ValueError, match="proxy task 1 is a regression task"):
        mtu.check_proxies(encoder.EncoderClassifierModel(CONFIG, num_labels=(1, 1)), ((0, 1),))
    with pytest.raises(ValueError, match="grad_method='blocks' with MT-uncertainty"):
        StepOptions(uncertainty_rows=4, grad_method="blocks")
    with pytest.raises(ValueError, match="uncertainty_rows=-1"):
        StepOptions(uncertainty_rows=-1)
    with pytest.raises(ValueError, match="has no `normalised_entropy`"):
        mtu.check_proxies(object(), ())
    with pytest.raises(ValueError, match="names task 'nope'; the run's tasks are"):
        mtu.proxy_indices({"nope": "a"}, ["a", "b"])
    assert mtu.proxy_indices({"b": "a"}, ["a", "b"]) == ((1, 0),)
    with pytest.raises(ValueError, match=r"task\(s\) 2 \(sts\) have no entropy"):
        mtu.check_proxies(_model(), (), ["sst", "mrpc", "sts"])
    model, batch = _model(), _candidates()
    with pytest.raises(ValueError, match="keeps num_rows=13 of a candidate batch of 12"):
        mtu.select_uncertain_rows(model, None, batch, 13, PROXIES)
