"""Sharded training input (`MultiTaskInput(shard_by_process=...)`): two processes simulated
in one with `process_index` / `process_count`, on small SeqIO tasks registered here."""

import collections
import inspect
import logging
import time

import numpy as np
import pytest
import seqio
import tensorflow as tf

from ktx.data import mixing, process_layout, vocab
from ktx.data.pipeline import MultiTaskInput
from tests.tasks._fixtures import root, write  # noqa: F401  (the `root` fixture)

# Odd sizes: the two shards of each task differ by one row.
SIZES = {"ktx_shard_kappa": 23, "ktx_shard_lambda": 9, "ktx_shard_mu": 14}
LENGTHS = {"inputs": 8, "targets": 4}
MIX = "ktx_shard_mix"


def _register():
    features = {
        "inputs": seqio.Feature(vocab.byte_vocabulary(), add_eos=True),
        "targets": seqio.Feature(vocab.byte_vocabulary(), add_eos=True),
    }
    for name, size in SIZES.items():
        letter = name.split("_")[-1][0]

        def dataset_fn(split, shuffle_files, seed=None, letter=letter, size=size):
            n = size if split == "train" else 5
            return tf.data.Dataset.from_tensor_slices(
                {"inputs": [f"{letter}{i}" for i in range(n)], "targets": [letter] * n})

        if name in seqio.TaskRegistry.names():
            seqio.TaskRegistry.remove(name)
        seqio.TaskRegistry.add(
            name, source=seqio.FunctionDataSource(dataset_fn, splits=("train", "validation")),
            preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
            output_features=features)
    if MIX in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(MIX)
    seqio.MixtureRegistry.add(MIX, [(name, float(n)) for name, n in SIZES.items()])


_register()


# The converted rows of every (task, shard) are kept for the module (`cache_dir`): the tests
# build dozens of inputs over the same shards, and each one converted through tf.data took
# 5-8 s of the suite; what they check is the layout, cursors and shards, which the cache
# does not touch (tests/data/test_pipeline.py tests the cache itself).
_ROWS = {}


@pytest.fixture(autouse=True, scope="module")
def _rows_cache(tmp_path_factory):
    _ROWS["cache_dir"] = tmp_path_factory.mktemp("shard_rows")
    yield
    _ROWS.clear()


def _inputs(mixing_=None, process_index=0, shard=True, **kwargs):
    kwargs.setdefault("batch_size", 6)
    kwargs.setdefault("cache_dir", _ROWS.get("cache_dir"))
    kwargs.setdefault("process_count", 2)
    return MultiTaskInput(MIX, LENGTHS, seed=3, mixing=mixing_, process_index=process_index,
                          shard_by_process=shard, **kwargs)


def _text(row) -> str:
    """The example a row holds ("k12"): its input tokens before EOS, as text."""
    tokens = [int(t) for t in row if t > 1]
    return bytes(t - 3 for t in tokens).decode()


ROUND_ROBIN = mixing.Mixing("proportional", batches="round_robin")
TASK_PER_BATCH = mixing.Mixing("proportional", batches="task_per_batch")
ANNEALED = mixing.Mixing("annealed", num_epochs=3, steps_per_epoch=5)


@pytest.mark.parametrize("mix", [ROUND_ROBIN, TASK_PER_BATCH], ids=["round_robin", "task_per_batch"])
def test_shards_are_disjoint_and_cover_each_task_once_per_shard_epoch(mix):
    """(a) Over a shard epoch each process reads every row of its shard once; the two
    shards are disjoint and together are the task; the next epoch is reshuffled."""
    procs = [_inputs(mix, i) for i in range(2)]
    assert all(p.sharded for p in procs)
    assert procs[0].task_sizes == tuple(SIZES.values())  # global: both shards
    for t, size in enumerate(SIZES.values()):
        assert procs[0].shard_task_sizes[t] + procs[1].shard_task_sizes[t] == size
        assert abs(procs[0].shard_task_sizes[t] - procs[1].shard_task_sizes[t]) <= 1
    read = {i: collections.defaultdict(list) for i in range(2)}
    for step in range(120):
        for i, p in enumerate(procs):
            batch = p.get_batch(step)
            for tid, row in zip(batch["task_id"], batch["encoder_input_tokens"]):
                read[i][int(tid)].append(_text(row))
    for t, (name, size) in enumerate(SIZES.items()):
        epochs = []
        for i, p in enumerate(procs):
            n = p.shard_task_sizes[t]
            rows = read[i][t]
            assert len(rows) >= 2 * n, (name, i, len(rows))
            first, second = rows[:n], rows[n:2 * n]
            assert len(set(first)) == n and set(first) == set(second)  # once per shard epoch
            assert first != second  # a fresh permutation per shard epoch
            epochs.append(set(first))
        assert not epochs[0] & epochs[1]  # disjoint shards
        assert epochs[0] | epochs[1] == {f"{name.split('_')[-1][0]}{k}" for k in range(size)}


def test_mixed_blocks_shard_by_default_without_warnings(caplog):
    """Mixed task-partitioned batches shard by default (process-grouped); False reads every
    task in full and gives the slice of the task-grouped global batch, as before."""
    with caplog.at_level(logging.WARNING):
        default = MultiTaskInput(MIX, LENGTHS, batch_size=6, seed=3, process_index=1,
                                 process_count=2)
    assert default.sharded and default.process_grouped and not caplog.text
    assert default.shard_task_sizes == (11, 4, 7)  # shard 1 of 23, 9, 14 rows
    unsharded = _inputs(None, 1, shard=False)
    assert not unsharded.sharded and not unsharded.process_grouped
    for step in (0, 7):
        np.testing.assert_array_equal(default.get_batch(step)["task_id"],
                                      np.repeat(np.arange(3), default.process_task_counts(step)))
        counts = unsharded.task_counts(step)
        np.testing.assert_array_equal(unsharded.get_batch(step)["task_id"],
                                      np.repeat(np.arange(3), counts)[3:])
    for kwargs in ({"layout": "sampled"}, {"mixing": TASK_PER_BATCH}):
        other = MultiTaskInput(MIX, LENGTHS, batch_size=6, seed=3, process_index=1,
                               process_count=2, **kwargs)
        assert other.sharded and not other.process_grouped
    one = MultiTaskInput(MIX, LENGTHS, batch_size=6, seed=3, process_index=0, process_count=1)
    assert not one.sharded and not one.process_grouped


def test_process_shares_split_every_count_evenly():
    """Row sums B / P, column sums counts[t], each share floor or ceil of counts[t] / P,
    a function of (counts, step) only; with constant counts every process gets counts[t]
    rows of task t per P steps to within a few rows over many steps."""
    rng = np.random.default_rng(0)
    for p in (1, 2, 3, 4, 8):
        for _ in range(100):
            t = int(rng.integers(1, 7))
            counts = rng.multinomial(p * int(rng.integers(1, 6)), np.ones(t) / t)
            steps = rng.integers(0, 10**9, 5)
            shares = process_layout.process_shares(np.tile(counts, (5, 1)), p, steps)
            assert shares.shape == (5, p, t)
            np.testing.assert_array_equal(shares.sum(axis=2), counts.sum() // p)
            np.testing.assert_array_equal(shares.sum(axis=1), np.tile(counts, (5, 1)))
            assert (shares >= counts // p).all() and (shares <= -(-counts // p)).all()
            for k, step in enumerate(steps):  # one step, one process: the same shares
                np.testing.assert_array_equal(process_layout.process_shares(counts, p, [step]),
                                              shares[k])
                np.testing.assert_array_equal(
                    process_layout.process_shares(counts, p, [step], process_index=p - 1),
                    shares[k, p - 1])
    counts = np.array([5, 1, 3, 7])  # 16 rows, remainders 1 1 3 3 on 4 processes
    steps = np.arange(100_000)
    shares = process_layout.process_shares(np.tile(counts, (steps.size, 1)), 4, steps)
    drift = np.cumsum(shares, axis=0) - np.outer(steps + 1, counts)[:, None, :] / 4
    assert np.abs(drift).max() < 5, np.abs(drift).max()
    offsets = process_layout.share_offsets(steps, 4)
    assert np.abs(np.bincount(offsets, minlength=4) - 25_000).max() <= 10  # a quarter each
    with pytest.raises(ValueError, match="sum to 7, not divisible by process_count=2"):
        process_layout.process_shares([3, 4], 2, [0])
    with pytest.raises(ValueError, match="process_index=2"):
        process_layout.process_shares([3, 3], 2, [0], process_index=2)
    with pytest.raises(ValueError, match="process_count=0"):
        process_layout.share_offsets([0], 0)
    with pytest.raises(ValueError, match="steps has a negative value -1"):
        process_layout.share_offsets([-1], 2)


@pytest.mark.parametrize("num_processes,batch_size", [(2, 6), (4, 8)])
@pytest.mark.parametrize("mix", [None, ANNEALED, mixing.Mixing("temperature", carry=False)],
                         ids=["carry", "annealed", "no_carry"])
def test_mixed_batches_read_every_shard_once_per_shard_epoch(num_processes, batch_size, mix):
    """Mixed task-partitioned batches, P processes: each process's rows hold its share of
    every task (grouped by task); the union of a step's rows has counts[t] rows of task t;
    every process reads every row of its shard of every task once per shard epoch, all
    shards at about the same pace; a fresh object at step s gives the same batch."""
    procs = [_inputs(mix, i, batch_size=batch_size, process_count=num_processes)
             for i in range(num_processes)]
    assert all(p.process_grouped for p in procs)
    steps = 150
    read = [collections.defaultdict(list) for _ in procs]
    batches = [[] for _ in procs]
    for step in range(steps):
        counts = procs[0].task_counts(step)
        union = np.zeros(3, np.int64)
        for i, p in enumerate(procs):
            batch = p.get_batch(step)
            batches[i].append(batch)
            local = p.process_task_counts(step)
            assert sum(local) == batch_size // num_processes
            np.testing.assert_array_equal(batch["task_id"], np.repeat(np.arange(3), local))
            union += np.bincount(batch["task_id"], minlength=3)
            for tid, row in zip(batch["task_id"], batch["encoder_input_tokens"]):
                read[i][int(tid)].append(_text(row))
        np.testing.assert_array_equal(union, counts)
    for t, (name, size) in enumerate(SIZES.items()):
        letter = name.split("_")[-1][0]
        shards = []
        for i, p in enumerate(procs):
            n, rows = p.shard_task_sizes[t], read[i][t]
            assert len(rows) == p.shard_cursors(steps)[t] >= 2 * n, (name, i, len(rows), n)
            for start in range(0, len(rows) - n + 1, n):  # every shard epoch: each row once
                assert sorted(rows[start:start + n]) == sorted(rows[:n]), (name, i, start)
            orders = {tuple(rows[start:start + n]) for start in range(0, len(rows) - n + 1, n)}
            assert len(orders) > 1, (name, i)  # a fresh permutation per shard epoch
            shards.append(set(rows[:n]))
        assert sum(len(x) for x in shards) == size  # disjoint shards that make up the task
        assert set().union(*shards) == {f"{letter}{k}" for k in range(size)}
        # Paces: every process has read 1 / P of the task's rows so far, to within 6 rows
        # (of 75 to 150: an unshared block would leave a process 0 rows of a task).
        total = procs[0].schedule.consumed_before(steps)[t]
        assert max(abs(len(read[i][t]) - total / num_processes) for i in range(len(procs))) <= 6
    for i in range(num_processes):  # resume: a fresh object at any step, in any order
        fresh = _inputs(mix, i, batch_size=batch_size, process_count=num_processes)
        for s in (149, 0, 77, 31, 148):
            for k, v in fresh.get_batch(s).items():
                np.testing.assert_array_equal(v, batches[i][s][k], err_msg=f"{i} {s} {k}")


@pytest.mark.parametrize("mix", [None, ANNEALED, mixing.Mixing("temperature", carry=False),
                                 TASK_PER_BATCH], ids=["carry", "annealed", "no_carry", "per_batch"])
def test_resume_at_any_step_gives_the_batch_of_an_uninterrupted_run(mix):
    """(b) A fresh object at step s (resume) gives the batch reached by iterating from 0,
    across shard epochs (carried quotas, annealed rates, constant counts)."""
    for i in range(2):
        run = _inputs(mix, i)
        batches = [run.get_batch(s) for s in range(40)]
        fresh = _inputs(mix, i)
        for s in (39, 0, 13, 21, 5, 38):  # any order: a pure function of the step
            for k, v in fresh.get_batch(s).items():
                np.testing.assert_array_equal(v, batches[s][k], err_msg=f"process {i} step {s} {k}")
        cursors = fresh.shard_cursors(40)
        assert cursors.sum() == 40 * run.local_batch_size
        # Each shard is read as a stream: once per shard epoch, no row skipped or repeated.
        read = collections.defaultdict(list)
        for batch in batches:
            for tid, row in zip(batch["task_id"], batch["encoder_input_tokens"]):
                read[int(tid)].append(_text(row))
        assert sorted(read) == [t for t in range(3) if cursors[t]]
        for t, rows in read.items():
            n = run.shard_task_sizes[t]
            assert len(rows) == cursors[t]
            for start in range(0, len(rows) - n + 1, n):
                assert len(set(rows[start:start + n])) == n, (i, t, start)
        # Past a shard epoch: the cursors wrap around the shards.
        assert (fresh.shard_epochs_seen(40) > 1).any()


def test_one_task_per_batch_rows_are_the_process_slice():
    """(c) One task per batch: each process's rows are its slice of the global batch,
    `B / P` rows of the batch's task."""
    procs = [_inputs(TASK_PER_BATCH, i) for i in range(2)]
    assert not procs[0].process_grouped
    for step in range(0, 30, 3):
        counts = procs[0].task_counts(step)
        assert counts == procs[1].task_counts(step) and sum(counts) == 6
        expected = np.repeat(np.arange(3), counts)
        local = [p.process_task_counts(step) for p in procs]
        assert tuple(a + b for a, b in zip(*local)) == counts
        for i, p in enumerate(procs):
            batch = p.get_batch(step)
            assert batch["task_id"].shape == (p.local_batch_size,) == (3,)
            np.testing.assert_array_equal(batch["task_id"], expected[3 * i:3 * i + 3])


def test_sampled_layout_draws_from_the_process_shard():
    procs = [_inputs(None, i, layout="sampled") for i in range(2)]
    seen = [set(), set()]
    for step in range(60):
        for i, p in enumerate(procs):
            batch = p.get_batch(step)
            seen[i] |= {(int(t), _text(r)) for t, r in zip(batch["task_id"], batch["encoder_input_tokens"])}
    assert not seen[0] & seen[1] and seen[0] and seen[1]
    assert procs[0].shard_epochs_seen(10).shape == (3,)


def test_cache_key_names_the_shard(tmp_path):
    """(d) The on-disk cache of a shard is its own file, and a cached shard reads back the
    same rows."""
    procs = [_inputs(ROUND_ROBIN, i, cache_dir=tmp_path) for i in range(2)]
    full = _inputs(ROUND_ROBIN, 0, cache_dir=tmp_path, shard=False)
    name = "ktx_shard_kappa"
    paths = {procs[0].rows.cache_path(name, "train", False, procs[0].shard_info),
             procs[1].rows.cache_path(name, "train", False, procs[1].shard_info),
             full.rows.cache_path(name, "train", False)}
    assert len(paths) == 3 and all(p.is_file() for p in paths)
    again = _inputs(ROUND_ROBIN, 1, cache_dir=tmp_path)
    for k, v in again.get_batch(9).items():
        np.testing.assert_array_equal(v, procs[1].get_batch(9)[k])


def test_one_process_and_unsharded_batches_are_unchanged():
    """shard_by_process is ignored with one process; with False every process reads the
    global stream as before (the same rows as the one-process batch, sliced)."""
    one = MultiTaskInput(MIX, LENGTHS, batch_size=6, seed=3, process_index=0, process_count=1,
                         shard_by_process=True)
    assert not one.sharded and one.shard_info is None
    halves = [_inputs(None, i, shard=False) for i in range(2)]
    for step in (0, 4, 11):
        whole = one.get_batch(step)
        for k, v in whole.items():
            np.testing.assert_array_equal(v, np.concatenate([h.get_batch(step)[k] for h in halves]))


def test_eval_reads_the_whole_split_and_bad_arguments_raise():
    p = _inputs(ROUND_ROBIN, 1)
    assert p.eval_arrays("ktx_shard_kappa", "train")["task_id"].shape[0] == 23  # not the shard
    assert p.eval_arrays("ktx_shard_kappa", "validation")["task_id"].shape[0] == 5
    with pytest.raises(TypeError, match="shard_by_process='yes'"):
        _inputs(ROUND_ROBIN, 0, shard="yes")
    with pytest.raises(ValueError, match="holds shard 1 of 2"):
        p.replace(process_index=0)


def test_cursor_at_a_million_steps_is_fast():
    p = _inputs(ANNEALED, 1)
    start = time.perf_counter()
    cursors = p.shard_cursors(1_000_000)
    seconds = time.perf_counter() - start
    assert cursors.sum() == 1_000_000 * 3
    np.testing.assert_array_equal(p.shard_cursors(1_000_003) - cursors,
                                  np.sum([p.process_task_counts(s) for s in range(1_000_000, 1_000_003)], 0))
    assert seconds < 10, seconds


def test_every_registered_source_takes_its_shard():
    """Every source ktx registers shards: it takes `shard_info` itself (and says so), or
    is a FunctionDataSource, whose examples SeqIO shards."""
    import ktx.tasks  # noqa: F401  (registers everything)

    kinds = collections.Counter()
    for name in seqio.TaskRegistry.names():
        source = seqio.get_mixture_or_task(name).source
        if isinstance(source, seqio.FunctionDataSource):
            kinds["function"] += 1
            continue
        assert source.supports_arbitrary_sharding, name
        assert "shard_info" in inspect.signature(source.get_dataset).parameters, name
        kinds[type(source).__name__] += 1
    assert kinds["OfficialFilesSource"] and kinds["BiomedFilesSource"]


def test_a_glue_source_reads_disjoint_shards(root):  # noqa: F811
    lines = [f"gj04\t{k % 2}\t\tSentence {k}." for k in range(5)]
    write(root, "glue/CoLA/dev.tsv", "\n".join(lines))
    task = seqio.get_mixture_or_task("glue_cola_v002")
    shards = [[r["sentence"].decode() for r in task.source.get_dataset(
        "validation", shuffle=False, shard_info=seqio.ShardInfo(i, 2)).as_numpy_iterator()]
        for i in range(2)]
    assert sorted(shards[0] + shards[1]) == [f"Sentence {k}." for k in range(5)]
    assert len(shards[0]) == 3 and len(shards[1]) == 2


class _NoShardSource(seqio.DataSource):
    """A source that claims arbitrary sharding but whose get_dataset takes no shard_info."""

    def __init__(self):
        super().__init__(splits=("train",))

    @property
    def supports_arbitrary_sharding(self) -> bool:
        return True

    def list_shards(self, split):
        return [split]

    def get_dataset(self, split="train", shuffle=True, seed=None, **ignored):
        return tf.data.Dataset.from_tensor_slices({"inputs": ["a", "b"], "targets": ["a", "b"]})


def test_a_source_without_shard_info_raises_naming_the_task():
    features = {k: seqio.Feature(vocab.byte_vocabulary(), add_eos=True) for k in ("inputs", "targets")}
    if "ktx_shard_noshard" in seqio.TaskRegistry.names():
        seqio.TaskRegistry.remove("ktx_shard_noshard")
    seqio.TaskRegistry.add("ktx_shard_noshard", source=_NoShardSource(),
                           preprocessors=[seqio.preprocessors.tokenize], output_features=features)
    with pytest.raises(ValueError, match="task 'ktx_shard_noshard'.*takes no shard_info"):
        MultiTaskInput("ktx_shard_noshard", LENGTHS, batch_size=2, process_index=0,
                       process_count=2, shard_by_process=True)
    one = MultiTaskInput("ktx_shard_noshard", LENGTHS, batch_size=2, process_index=0,
                         process_count=2, shard_by_process=False)
    assert one.task_sizes == (2,)


@pytest.mark.parametrize("mix", [None, ANNEALED, TASK_PER_BATCH, ROUND_ROBIN,
                                 mixing.Mixing("temperature", carry=False)])
def test_vectorised_consumed_before_matches_the_scalar_one(mix):
    schedule = mixing.parse_mixing(mix).schedule(
        [1000, 37, 5000, 3, 70], 16, steps_per_epoch=10,
        mixture_rates=[3, 1, 2, 0.5, 1] if mix is None else None)
    steps = np.concatenate([np.arange(120), [10**6, 10**7 + 3]])
    many = schedule.consumed_before_many(steps)
    for k, step in enumerate(steps):
        np.testing.assert_array_equal(many[k], schedule.consumed_before(int(step)))


def test_vectorised_apportion_rows_matches_the_scalar_one():
    rng = np.random.default_rng(0)
    for _ in range(50):
        shares = rng.random(int(rng.integers(1, 9))) * (rng.random() > 0.2)
        shares[0] += 1e-3
        rows = np.concatenate([np.arange(40), rng.integers(0, 2**45, 20)])
        many = mixing.apportion_rows_many(rows, shares)
        for n, row in zip(rows, many):
            np.testing.assert_array_equal(row, mixing.apportion_rows(int(n), shares))
    with pytest.raises(ValueError, match="num_rows"):
        mixing.apportion_rows_many(np.array([-1]), [1.0])
