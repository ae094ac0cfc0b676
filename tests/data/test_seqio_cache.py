"""`ktx cache` (SeqIO's Beam transforms on the DirectRunner) and training on cached tasks:
a cached split holds the uncached split's examples (the same multiset: Beam shuffles
their order), on an inline task and on GLUE RTE and the biomedical infusion task."""

from __future__ import annotations

import collections
import pathlib

import gin
import numpy as np
import pytest
import seqio
import tensorflow as tf

from ktx import cli
from ktx.data import vocab
from ktx.data.pipeline import MultiTaskInput
from tests.tiny_t5_gin import tiny_t5_gin

TASK = "cachetest_reverse_v001"  # inline rows, byte vocabulary: no data folder needed
LENGTHS = {"inputs": 32, "targets": 16}
SIZES = {"train": 40, "validation": 12}
_SOURCE_READS = collections.Counter()  # split -> times the task's source was read


def _dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    del shuffle_files, seed
    _SOURCE_READS[split] += 1
    rng = np.random.default_rng(SIZES[split])
    words = ["".join(rng.choice(list("abcdefgh"), size=rng.integers(2, 9))) for _ in range(SIZES[split])]
    return tf.data.Dataset.from_tensor_slices(
        {"inputs": [f"reverse: {w}" for w in words], "targets": [w[::-1] for w in words]})


def _register() -> None:
    if TASK in seqio.TaskRegistry.names():
        seqio.TaskRegistry.remove(TASK)
    byte_vocab = vocab.byte_vocabulary()
    seqio.TaskRegistry.add(
        TASK,
        source=seqio.FunctionDataSource(_dataset_fn, splits=tuple(SIZES)),
        preprocessors=[seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder(),
                       seqio.preprocessors.append_eos_after_trim],
        output_features={k: seqio.Feature(byte_vocab, add_eos=True) for k in ("inputs", "targets")},
    )


_register()


@pytest.fixture(autouse=True)
def _clear_gin():
    gin.clear_config(clear_constants=True)
    yield
    gin.clear_config(clear_constants=True)


def _examples(name: str, split: str, use_cached: bool) -> collections.Counter:
    """The task's examples (untrimmed token ids) as a multiset."""
    ds = seqio.get_mixture_or_task(name).get_dataset(
        sequence_length=None, split=split, use_cached=use_cached, shuffle=False, num_epochs=1,
        trim_output_features=False)
    return collections.Counter((tuple(ex["inputs"].tolist()), tuple(ex["targets"].tolist()))
                               for ex in ds.as_numpy_iterator())


def _sorted_rows(arrays: dict[str, np.ndarray]) -> list[tuple]:
    keys = sorted(arrays)
    return sorted(tuple(tuple(np.asarray(arrays[k][i]).ravel().tolist()) for k in keys)
                  for i in range(arrays["task_id"].shape[0]))


def _train_flags(model_dir, cache_dir, task=TASK) -> list[str]:
    model = pathlib.Path(model_dir).parent / "model.gin"
    model.write_text(tiny_t5_gin())
    return ["train", "--gin_file=runs/train.gin", f"--gin_file={model}",
            f"--gin.MODEL_DIR='{model_dir}'", f"--gin.MIXTURE_OR_TASK_NAME='{task}'",
            f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}", "--gin.TRAIN_STEPS=2", "--gin.BATCH_SIZE=8",
            "--gin.train_script.train.log_period=1",
            "--gin.pipeline.MultiTaskInput.use_cached=True",
            f"--gin.pipeline.MultiTaskInput.seqio_cache_dir='{cache_dir}'"]


# ------------------------------------------------------------------ errors (no Beam run)
def test_not_cached_task_names_the_task_and_the_cache_command(tmp_path, capsys):
    empty = tmp_path / "empty_cache"
    with pytest.raises(ValueError, match=rf"task '{TASK}' is not cached in {empty}: build the cache "
                                         rf"with `ktx cache --tasks={TASK} --splits=train "
                                         rf"--cache_dir={empty}`"):
        MultiTaskInput(TASK, LENGTHS, batch_size=4, use_cached=True, seqio_cache_dir=empty)
    # The same through `ktx train`: one `ktx train: ...` line naming the task and the command.
    assert cli.main(_train_flags(tmp_path / "run", empty)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"ktx train: task '{TASK}' is not cached in {empty}")
    assert f"ktx cache --tasks={TASK} --splits=train --cache_dir={empty}" in err


def test_uncacheable_task_and_seqio_cache_dir_without_use_cached(tmp_path):
    with pytest.raises(ValueError, match="'synthetic_reverse_v001' .* cannot be cached: its "
                                         "preprocessors have no seqio.CacheDatasetPlaceholder"):
        MultiTaskInput("synthetic_reverse_v001", LENGTHS, batch_size=4, use_cached=True,
                       seqio_cache_dir=tmp_path)
    with pytest.raises(ValueError, match="seqio_cache_dir=.* is read only with use_cached=True"):
        MultiTaskInput(TASK, LENGTHS, batch_size=4, seqio_cache_dir=tmp_path)


@pytest.mark.parametrize("flags, message", [
    ([f"--tasks={TASK}"], "ktx cache needs --cache_dir"),
    (["--tasks=cachetest_revers_v001", "--cache_dir=C"],
     f"'cachetest_revers_v001' is not a registered SeqIO task or mixture; close names: {TASK}"),
    (["--tasks=synthetic_quickstart", "--cache_dir=C"],
     "task 'synthetic_count_v001' cannot be cached: its preprocessors have no "
     "seqio.CacheDatasetPlaceholder()"),
    ([f"--tasks={TASK}", "--splits=train,test", "--cache_dir=C"],
     f"task '{TASK}' has no split 'test'; splits: ('train', 'validation')"),
    ([f"--tasks={TASK}", "--cache_dir=INTERRUPTED"], "exists without a COMPLETED file"),
])
def test_cache_command_refuses_before_running(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "INTERRUPTED" / TASK).mkdir(parents=True)  # a cache that never completed
    reads = sum(_SOURCE_READS.values())
    assert cli.main(["cache", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("ktx: ") and message in err, err
    assert sum(_SOURCE_READS.values()) == reads
    assert not (tmp_path / "C").exists()


# ------------------------------------------------------------------ Beam (DirectRunner)
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("apache_beam", reason="ktx cache needs Apache Beam: pip install -e '.[cache]'")
    out = tmp_path_factory.mktemp("seqio_cache")
    gin.clear_config(clear_constants=True)
    assert cli.main(["cache", f"--tasks={TASK}", "--splits=train,validation",
                     f"--cache_dir={out}", "--min_shards=3"]) == 0
    return out


def test_cache_writes_seqio_layout_and_refuses_to_redo_it(cache_dir, capsys):
    folder = cache_dir / TASK
    names = sorted(p.name for p in folder.iterdir())
    assert "COMPLETED" in names and "info.train.json" in names and "stats.validation.json" in names
    assert [n for n in names if n.startswith("train.tfrecord")] == [
        f"train.tfrecord-0000{i}-of-00003" for i in range(3)]
    assert cli.main(["cache", f"--tasks={TASK}", "--splits=train", f"--cache_dir={cache_dir}"]) == 2
    assert (f"ktx: task '{TASK}' is already cached in {folder} (splits ['train', 'validation']); "
            "pass --overwrite") in capsys.readouterr().err


def test_cached_task_has_the_uncached_examples(cache_dir):
    from ktx.data import seqio_cache

    for split, size in SIZES.items():
        assert seqio_cache.require_cached(TASK, split, cache_dir) == str(cache_dir / TASK)
        cached, uncached = _examples(TASK, split, True), _examples(TASK, split, False)
        assert sum(uncached.values()) == size and cached == uncached
    # The same through the training input, once converted (trimmed, EOS, task ids).
    kw = dict(batch_size=4, seed=3)
    a = MultiTaskInput(TASK, LENGTHS, use_cached=True, seqio_cache_dir=cache_dir, **kw)
    b = MultiTaskInput(TASK, LENGTHS, **kw)
    for split in SIZES:
        assert _sorted_rows(a.eval_arrays(TASK, split)) == _sorted_rows(b.eval_arrays(TASK, split))
    # Cached runs agree with each other step by step (the cache's order is fixed on disk).
    c = MultiTaskInput(TASK, LENGTHS, use_cached=True, seqio_cache_dir=cache_dir, **kw)
    for step in range(12):
        for key, value in a.get_batch(step).items():
            np.testing.assert_array_equal(value, c.get_batch(step)[key])


def test_train_two_steps_on_the_cached_task(cache_dir, tmp_path, capsys):
    reads = dict(_SOURCE_READS)
    assert cli.main(_train_flags(tmp_path / "run", cache_dir)) == 0
    assert "step 2/2 | loss" in capsys.readouterr().out
    assert dict(_SOURCE_READS) == reads  # the examples came from the cache, not the source
    config = (tmp_path / "run" / "config.gin").read_text()
    assert "pipeline.MultiTaskInput.use_cached = True" in config
    assert "pipeline.MultiTaskInput.seqio_cache_dir =" in config and f"'{cache_dir}'" in config


def test_overwrite_rebuilds_the_cache(cache_dir, tmp_path, capsys):
    out = tmp_path / "cache"
    assert cli.main(["cache", f"--tasks={TASK}", "--splits=validation", f"--cache_dir={out}",
                     "--min_shards=1"]) == 0
    assert f"cached {TASK} (validation 12 examples) in {out / TASK}" in capsys.readouterr().out
    (out / TASK / "stale.txt").write_text("from an earlier cache")
    assert cli.main(["cache", f"--tasks={TASK}", "--splits=validation", f"--cache_dir={out}",
                     "--min_shards=2", "--overwrite"]) == 0
    names = sorted(p.name for p in (out / TASK).iterdir())
    assert "stale.txt" not in names and "COMPLETED" in names
    assert [n for n in names if n.startswith("validation.tfrecord")] == [
        "validation.tfrecord-00000-of-00002", "validation.tfrecord-00001-of-00002"]


def test_real_tasks_cached_equal_uncached(data_dir, tmp_path):
    """GLUE RTE (train and validation: the data has no test.tsv) and the infusion task
    (train only; two LiveQA files, so two input shards) in one cache folder."""
    pytest.importorskip("apache_beam", reason="ktx cache needs Apache Beam: pip install -e '.[cache]'")
    from ktx.data import seqio_cache

    out = tmp_path / "cache"
    for task, splits in (("glue_rte_v002", "train,validation"), ("biomed_disease_infusion", "train")):
        gin.clear_config(clear_constants=True)
        assert cli.main(["cache", f"--tasks={task}", f"--splits={splits}", f"--cache_dir={out}",
                         "--min_shards=2"]) == 0
    for name, split in (("glue_rte_v002", "train"), ("glue_rte_v002", "validation"),
                        ("biomed_disease_infusion", "train")):
        seqio_cache.require_cached(name, split, out)
        uncached = _examples(name, split, False)
        assert seqio_cache.cache_stats(out, name, split)["examples"] == sum(uncached.values()) > 0
        assert _examples(name, split, True) == uncached, (name, split)


def test_cache_leaves_the_process_data_settings_as_they_were(cache_dir, monkeypatch):
    """DirectRunner runs the workers' setup (data folder, bad-row policy) in this process:
    after `ktx cache` the caller's settings are back (before: the folder leaked, and a later
    loader found data where none was configured)."""
    from ktx.data import files as data_files

    monkeypatch.setenv("KTX_DATA_DIR", str(cache_dir))  # the caller's folder comes from $KTX_DATA_DIR
    data_files.set_data_dir(None)
    data_files.set_on_bad_row(None)
    gin.clear_config(clear_constants=True)
    assert cli.main(["cache", f"--tasks={TASK}", "--splits=train", f"--cache_dir={cache_dir / 'again'}",
                     "--min_shards=1"]) == 0
    monkeypatch.delenv("KTX_DATA_DIR")  # the workers' explicit folder must not outlive the run
    with pytest.raises(data_files.DataFileError, match="No data directory"):
        data_files.resolve_data_dir()
    assert data_files.get_on_bad_row() == "raise"
