"""Tests of ktx.data.pipeline.MultiTaskInput on small SeqIO tasks registered here."""

import logging

import numpy as np
import pytest
import seqio
import tensorflow as tf

from ktx.data import mixing, vocab
from ktx.data.pipeline import MultiTaskInput, mixture_rates, mixture_task_names

SIZES = {"ktx_test_zeta": 12, "ktx_test_alpha": 5}
LENGTHS = {"inputs": 8, "targets": 4}


def _register():
    features = {
        "inputs": seqio.Feature(vocab.byte_vocabulary(), add_eos=True),
        "targets": seqio.Feature(vocab.byte_vocabulary(), add_eos=True),
    }
    for name, size in SIZES.items():
        letter = name.split("_")[-1][0]

        def dataset_fn(split, shuffle_files, seed=None, letter=letter, size=size):
            n = size if split == "train" else 3
            return tf.data.Dataset.from_tensor_slices(
                {"inputs": [f"{letter}{i}" for i in range(n)], "targets": [letter * (1 + i % 2) for i in range(n)]}
            )

        if name in seqio.TaskRegistry.names():
            seqio.TaskRegistry.remove(name)
        seqio.TaskRegistry.add(
            name,
            source=seqio.FunctionDataSource(dataset_fn, splits=("train", "validation")),
            preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
            output_features=features,
        )
    if "ktx_test_mix" in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove("ktx_test_mix")
    # Registration order zeta, alpha (not alphabetical): task ids follow it.
    seqio.MixtureRegistry.add("ktx_test_mix", [("ktx_test_zeta", 3.0), ("ktx_test_alpha", 1.0)])


_register()


@pytest.fixture(scope="module")
def base():
    return MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, seed=7)


def _key(row_tokens):
    return bytes(np.asarray(row_tokens, np.uint8))


def test_task_order_rates_and_counts(base):
    assert mixture_task_names("ktx_test_mix") == ("ktx_test_zeta", "ktx_test_alpha")
    np.testing.assert_allclose(mixture_rates("ktx_test_mix"), [3.0, 1.0])
    assert base.task_names == ("ktx_test_zeta", "ktx_test_alpha") and base.num_tasks == 2
    assert base.task_sizes == (12, 5)
    assert base.steps_per_epoch == 17 // 4
    assert base.task_counts(0) == (3, 1)  # mixture rates 3:1 of 4 rows
    batch = base.get_batch(0)
    assert batch["encoder_input_tokens"].shape == (4, 8) and batch["encoder_input_tokens"].dtype == np.int32
    assert batch["decoder_loss_weights"].dtype == np.float32
    np.testing.assert_array_equal(batch["task_id"], [0, 0, 0, 1])
    # Row contents belong to their task: zeta inputs start with "z" (byte 122 + 3).
    assert set(batch["encoder_input_tokens"][:3, 0]) == {ord("z") + 3}
    assert batch["encoder_input_tokens"][3, 0] == ord("a") + 3


def test_every_example_once_per_epoch_and_resume(base):
    rows = [base.get_batch(s) for s in range(8)]  # zeta: 24 rows = 2 epochs of 12
    zeta = np.concatenate([r["encoder_input_tokens"][:3] for r in rows])
    first, second = {_key(x) for x in zeta[:12]}, {_key(x) for x in zeta[12:]}
    assert len(first) == 12 and first == second
    assert [_key(x) for x in zeta[:12]] != [_key(x) for x in zeta[12:]]  # reshuffled per epoch
    resumed = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, seed=7)
    for s in (5, 3, 7):  # any order: a pure function of the step
        for k, v in resumed.get_batch(s).items():
            np.testing.assert_array_equal(v, rows[s][k])
    other = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, seed=8)
    assert not np.array_equal(other.get_batch(0)["encoder_input_tokens"], rows[0]["encoder_input_tokens"])
    np.testing.assert_allclose(base.epochs_seen(8), [24 / 12, 8 / 5])


def test_process_slices_assemble_the_global_batch(base):
    """Unsharded (`shard_by_process=False`; the default shards), each process's rows are its
    slice of the one-process batch."""
    for step in (0, 5):
        parts = [
            MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, seed=7, process_index=i, process_count=2,
                           shard_by_process=False).get_batch(step)
            for i in range(2)
        ]
        for k, v in base.get_batch(step).items():
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), v)


def test_annealed_counts_change_and_cursor_is_exact():
    inp = MultiTaskInput(
        "ktx_test_mix", LENGTHS, batch_size=8, seed=1, mixing=mixing.Mixing("annealed", num_epochs=3, steps_per_epoch=2)
    )
    # epoch 1: alpha 1 -> 12:5 -> quotas 5.65, 2.35 -> base (5, 2), the 8th row carried:
    # round(0.65) = 1 -> (6, 2), then round(1.3) = 1 -> (5, 3); epoch 3: alpha .2 ->
    # 12^.2 : 5^.2 -> quotas 4.35, 3.65 -> base (4, 3): round(.35) = 0 -> (4, 4), then
    # round(.7) = 1 -> (5, 3).
    assert [inp.task_counts(s) for s in (0, 1, 4, 5)] == [(6, 2), (5, 3), (4, 4), (5, 3)]
    seen = []
    for step in range(9):
        counts = inp.task_counts(step)
        batch = inp.get_batch(step)
        assert batch["task_id"].tolist() == [0] * counts[0] + [1] * counts[1]
        seen.extend(_key(x) for x in batch["encoder_input_tokens"][counts[0]:])
    # alpha rows: every consecutive block of 5 is one whole epoch.
    for start in range(0, len(seen) - 4, 5):
        assert len(set(seen[start:start + 5])) == 5


def test_sampled_layout():
    inp = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=400, layout="sampled", mixing="equal", seed=3)
    assert inp.task_counts(0) is None
    batch = inp.get_batch(2)
    share = batch["task_id"].mean()
    assert 0.4 < share < 0.6
    for k, v in MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=400, layout="sampled", mixing="equal", seed=3).get_batch(2).items():
        np.testing.assert_array_equal(v, batch[k])
    zeta_first = batch["encoder_input_tokens"][batch["task_id"] == 0, 0]
    assert set(zeta_first) == {ord("z") + 3}


def test_packing_keeps_one_task_per_row():
    inp = MultiTaskInput("ktx_test_mix", {"inputs": 12, "targets": 6}, batch_size=4, pack=True, mixing="proportional")
    assert inp.task_sizes[0] < 12  # several examples per row
    batch = inp.get_batch(0)
    assert {"encoder_segment_ids", "decoder_positions"} <= set(batch)
    assert batch["encoder_segment_ids"].max() >= 2
    for row, task in zip(batch["encoder_input_tokens"], batch["task_id"]):
        starts = row[(row != 0) & (row != 1)]  # letters and digits, no EOS/padding
        letters = {t for t in starts if t >= ord("a") + 3}
        assert letters == {ord("zeta"[0] if task == 0 else "a") + 3}


def test_eval_batches_pad_and_cover(base):
    batches = list(base.eval_batches("ktx_test_alpha", "validation", batch_size=2))
    assert [n for _, n in batches] == [2, 1]
    last, _ = batches[-1]
    np.testing.assert_array_equal(last["task_id"], [1, 1])
    assert last["decoder_loss_weights"][1].sum() == 0 and last["encoder_input_tokens"][1].sum() == 0
    assert base.eval_arrays("ktx_test_alpha", "validation")["encoder_input_tokens"].shape == (3, 8)
    assert base.cache_nbytes > 0


def test_disk_cache_round_trip(tmp_path):
    first = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, cache_dir=tmp_path)
    files = sorted(p.relative_to(tmp_path).parts[0] for p in tmp_path.rglob("*.npz"))
    assert files == ["ktx_test_alpha", "ktx_test_zeta"]
    second = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, cache_dir=tmp_path)
    for k, v in first.get_batch(3).items():
        np.testing.assert_array_equal(second.get_batch(3)[k], v)


def test_tiny_rate_warning_and_min_rows(caplog):
    with caplog.at_level(logging.WARNING):
        inp = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=2, mixing=mixing.Mixing(carry=False))
    assert inp.task_counts(0) == (2, 0) == inp.task_counts(9)
    assert "ktx_test_alpha" in caplog.text and "not trained on" in caplog.text
    inp = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=2, min_rows_per_task=1)
    assert inp.task_counts(0) == (1, 1)


def test_tiny_rate_task_gets_its_share_over_steps_and_resumes_exactly(caplog):
    """Rates 3:1 at batch 2: alpha's quota 0.5 rows per step is carried, so it gets a row
    every other step (before: 0 rows in every step, only a warning)."""
    with caplog.at_level(logging.WARNING):
        inp = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=2, seed=3)
    assert "not trained on" not in caplog.text
    counts = [inp.task_counts(s) for s in range(8)]
    assert counts == [(2, 0), (1, 1)] * 4  # quotas 1.5, 0.5: base (1, 0), 1 row carried
    # A fresh input (a resumed run) gives the same batches at any step, read from the
    # cursors alone; every alpha row is read once per epoch of 5.
    resumed = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=2, seed=3)
    alpha = []
    for step in (7, 3, 12, 0):
        for k, v in inp.get_batch(step).items():
            np.testing.assert_array_equal(resumed.get_batch(step)[k], v)
    for step in range(20):
        batch = inp.get_batch(step)
        alpha.extend(_key(x) for x, t in zip(batch["encoder_input_tokens"], batch["task_id"]) if t == 1)
    assert len(alpha) == 10 and len(set(alpha[:5])) == 5 and len(set(alpha[5:])) == 5


def test_errors():
    with pytest.raises(ValueError, match="not registered"):
        MultiTaskInput("ktx_test_nope", LENGTHS, batch_size=4)
    with pytest.raises(ValueError, match="layout="):
        MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, layout="mixed")
    with pytest.raises(ValueError, match="not divisible by process_count=3"):
        MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, process_count=3, process_index=0)
    with pytest.raises(ValueError, match="keys 'inputs' and 'targets'"):
        MultiTaskInput("ktx_test_mix", {"inputs": 8}, batch_size=4)
    with pytest.raises(ValueError, match="no split 'test'"):
        MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, split="test")
    with pytest.raises(ValueError, match="step=-1"):
        MultiTaskInput("ktx_test_zeta", LENGTHS, batch_size=4).get_batch(-1)


def test_replace_shares_the_cache(base):
    bigger = base.replace(batch_size=8, mixing="equal")
    assert bigger.task_counts(0) == (4, 4) and base.task_counts(0) == (3, 1)
    assert bigger._train is base._train  # no data re-read
    halves = [base.replace(process_index=i, process_count=2).get_batch(2) for i in range(2)]
    np.testing.assert_array_equal(
        np.concatenate([h["encoder_input_tokens"] for h in halves]), base.get_batch(2)["encoder_input_tokens"]
    )
    with pytest.raises(ValueError, match="layout="):
        base.replace(layout="bad")


@pytest.mark.parametrize("batches", ["round_robin", "task_per_batch"])
def test_one_task_per_batch_and_resume(batches):
    inp = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, seed=7,
                         mixing=mixing.Mixing("equal", batches=batches))
    tasks = []
    for step in range(6):
        batch = inp.get_batch(step)
        assert len(set(batch["task_id"].tolist())) == 1
        assert inp.task_counts(step)[batch["task_id"][0]] == 4
        tasks.append(int(batch["task_id"][0]))
    assert sorted(tasks) == [0, 0, 0, 1, 1, 1]
    resumed = MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, seed=7,
                             mixing=mixing.Mixing("equal", batches=batches))
    for k, v in resumed.get_batch(5).items():
        np.testing.assert_array_equal(v, inp.get_batch(5)[k])
    with pytest.raises(ValueError, match="layout='sampled' draws each row's task"):
        MultiTaskInput("ktx_test_mix", LENGTHS, batch_size=4, layout="sampled",
                       mixing=mixing.Mixing("equal", batches=batches))
