"""The cached multi-task training input: a pure function of (seed, step).

`MultiTaskInput` runs each SeqIO task of a mixture once (`task.get_dataset(lengths,
split, shuffle=False)`), converts its examples with `ktx.data.feature_converter` (packing,
when on, happens per task, so a packed row holds one task only) and keeps the rows in
memory as compact numpy arrays (optionally also on disk under `cache_dir`). The batch of
step `s` is then assembled with numpy gathers:

* layout `"task_partitioned"`: the global batch holds `counts[t]` rows of task `t` in
  contiguous blocks, task 0 first (`task_counts(s)`, from the mixing rates with the
  fractional quotas carried across steps, so every task gets its share over the steps;
  see `ktx.data.mixing`). Task `t` reads its rows in the order of a per-(seed, task,
  epoch) permutation, starting at the cursor `sum of its counts over steps < s`, which
  `RateSchedule.consumed_before` computes in closed form (also for annealed rates).
  Every row is read exactly once per task epoch; nothing is lost or repeated on resume.
  The counts vary from step to step (by a row or two per task): a balanced Trainer
  compiles once per distinct count tuple; `Mixing(carry=False)` keeps them constant.
* layout `"sampled"`: each row's task is drawn with the step's rates and its example
  uniformly (with replacement) from a step-seeded generator; `task_counts` is None.

Task ids are indices in the mixture's registration order (sub-mixtures flattened in
place, first occurrence wins), not the alphabetical order of `seqio.Mixture.tasks`.

Each process gathers only its own rows: unsharded, rows `[i * B / P, (i + 1) * B / P)` of
the global batch for `process_index = i` of `P`; `jax.make_array_from_process_local_data`
(`ktx.partitioning.host_local_to_global`) assembles the global array.

Sharded input (`shard_by_process`, the default with `P > 1`): process `i` reads only shard
`i` of `P` of each task's training split and supplies its share of every task from it;
how the shards are sized, read and paced is in `ktx.data.process_layout` ("Sharded
input").

Evaluation (`eval_batches`, `eval_arrays`) always reads the whole evaluation split in
every process, sharded or not. With `process_count == 1`, or `shard_by_process=False`,
batches are those of the unsharded input (bit-identical), task-grouped.

"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pathlib
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np
import seqio

from ktx.data import encoder_features as ef
from ktx.data import eval_input
from ktx.data import feature_converter as fc
from ktx.data import files
from ktx.data import mixing as mixing_lib
from ktx.data import process_layout
from ktx.data.mixtures import (
    KIND_NAMES,
    TASK_KINDS,
    encoder_num_labels,
    mixture_rates,
    mixture_task_names,
    task_kind,
)
from ktx.data.task_rows import TaskRows

_log = logging.getLogger(__name__)  # ktx.cli prints it as `ktx: ...`

__all__ = ["LAYOUTS", "TASK_KINDS", "MultiTaskInput", "mixture_task_names", "mixture_rates",
           "task_kind", "encoder_num_labels"]

LAYOUTS = ("task_partitioned", "sampled")
_SHARD_SEED = 0x5A4D  # keeps a shard's permutations apart from the whole task's


def _check_batching(layout: str, batch_size: int, process_index: int, process_count: int, seed: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; accepted: {LAYOUTS}")
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}; accepted: an int >= 1")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index={process_index!r}, process_count={process_count!r}; "
            "accepted: 0 <= process_index < process_count"
        )
    if batch_size % process_count:
        raise ValueError(f"batch_size={batch_size} is not divisible by process_count={process_count}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r}; accepted: an int >= 0")


class MultiTaskInput:
    """Deterministic multi-task batches of a SeqIO task or mixture (a `ktx.runs.train.TrainInput`).

    Args:
      mixture_or_task_name: a registered SeqIO task or mixture: encoder-decoder tasks
        (`inputs`, `targets` output features) or encoder tasks (`text_a`, `text_b`,
        `label`; see the module docstring), not both.
      task_feature_lengths: `{"inputs": Le, "targets": Ld}`; longer examples are trimmed
        by the task (`trim_output_features=True`), as in T5X. Encoder tasks:
        `{"inputs": L}`, longer pairs cut longest-first.
      batch_size: the GLOBAL batch size (divisible by `process_count`).
      split: the training split.
      seed: seeds the per-task permutations and the sampled layout.
      layout: "task_partitioned" or "sampled" (see the module docstring).
      mixing: a `ktx.data.mixing.Mixing`, a kind name, or None for the mixture's rates.
      pack: pack several examples of one task per row.
      use_cached: read SeqIO's offline cache of the tasks (`get_dataset(use_cached=...)`),
        built by `ktx cache` (`ktx.data.seqio_cache`); a task that is not cached raises
        ValueError naming it and the `ktx cache` command. The cache holds the examples in
        Beam's shuffled order, so a cached run's batches differ from an uncached run's with
        the same seed (the same examples; cached runs agree with each other).
      cache_dir: when set, converted arrays are saved to / loaded from
        `<cache_dir>/<task>/<split>-<hash>.npz` (hash of lengths, pack and seed; and of the
        shard, `(index, num_shards)`, when sharded).
      process_index, process_count: this process and the number of processes
        (default: `jax.process_index()`, `jax.process_count()`).
      min_rows_per_task: rows per batch guaranteed to each task with a positive rate
        ("task_partitioned" only; see `ktx.data.mixing` on tiny rates).
      shuffle: read each task in a fresh permutation per epoch (else in stored order).
      on_bad_row: "raise" | "skip" for the data files this input reads (training and
        evaluation splits); None: the process default (`ktx.data.files.get_on_bad_row`).
        From gin: `pipeline.MultiTaskInput.on_bad_row = 'skip'`.
      encoder_vocabulary: encoder tasks: the WordPiece vocabulary their text is tokenized
        with (a checkpoint folder holding `tokenizer.json` or `vocab.txt`, or the file;
        `ktx.data.wordpiece.encoder_vocabulary_scope`); None: `$KTX_ENCODER_VOCAB`.
      num_labels: encoder tasks: the model's head sizes (one int for all, or one per task;
        gin binds the model's `NUM_LABELS`); each must match its task's labels (classes,
        or 1 for a regression), else ValueError. None: not checked.
      head_kinds: encoder tasks: the model's head kinds (`ef.HEAD_KINDS`: "sequence",
        "tagging" or "cosine", one for all or one per task; gin binds the model's
        `HEAD_KINDS`; a cosine task's texts are encoded alone, `ef.COSINE_FEATURES`); each
        must match its task's `LabelSpace.kind`, else ValueError. None: not checked.
      seqio_cache_dir: with `use_cached`: the folder `ktx cache --cache_dir` wrote, added
        to SeqIO's global cache directories (`seqio.add_global_cache_dirs`); None: the
        tasks must be cached in those already set.
      shard_by_process: read only shard `process_index` of `process_count` of every task's
        training split (`seqio.ShardInfo`; `ktx.data.process_layout`, "Sharded input"; mixed
        task-partitioned batches become process-grouped, `process_grouped`). None (the
        default): True when `process_count > 1`. False: every process reads every task in
        full and its slice of the task-grouped global batch. Ignored (False) when
        `process_count == 1`. From gin: `pipeline.MultiTaskInput.shard_by_process = False`.
    """

    def __init__(
        self,
        mixture_or_task_name: str,
        task_feature_lengths: Mapping[str, int],
        batch_size: int,
        split: str = "train",
        seed: int = 0,
        layout: str = "task_partitioned",
        mixing: mixing_lib.Mixing | str | None = None,
        pack: bool = False,
        use_cached: bool = False,
        cache_dir: str | os.PathLike | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
        min_rows_per_task: int = 0,
        shuffle: bool = True,
        on_bad_row: str | None = None,
        encoder_vocabulary: str | os.PathLike | None = None,
        num_labels: int | Sequence[int] | None = None,
        seqio_cache_dir: str | os.PathLike | None = None,
        head_kinds: str | Sequence[str] | None = None,
        shard_by_process: bool | None = None,
    ):
        if seqio_cache_dir is not None and not use_cached:
            raise ValueError(f"seqio_cache_dir={seqio_cache_dir!r} is read only with use_cached=True")
        self.seqio_cache_dir = seqio_cache_dir
        if on_bad_row is not None and on_bad_row not in files.BAD_ROW_POLICIES:
            raise ValueError(f"on_bad_row={on_bad_row!r}; accepted: {files.BAD_ROW_POLICIES} or None")
        # Default: this JAX process's share (after `jax.distributed.initialize()`).
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
        _check_batching(layout, batch_size, process_index, process_count, seed)
        task_names = mixture_task_names(mixture_or_task_name)
        kinds = {name: task_kind(name) for name in task_names}
        if len(set(kinds.values())) > 1:
            raise ValueError(
                f"mixture {mixture_or_task_name!r} mixes kinds of tasks {kinds} (encoder, "
                "masked-LM, encoder-decoder); a MultiTaskInput feeds one model: use one kind")
        self.kind = next(iter(kinds.values()))
        lengths = dict(task_feature_lengths)
        keys = {"inputs", "targets"} if self.kind == "enc_dec" else {"inputs"}
        if set(lengths) != keys:
            raise ValueError(
                f"task_feature_lengths={lengths!r}; accepted for "
                + ("encoder-decoder tasks: a dict with keys 'inputs' and 'targets'"
                   if self.kind == "enc_dec" else
                   f"the encoder tasks {list(task_names)}: {{'inputs': L}} (the sequence length)"))
        if self.kind != "enc_dec" and pack:
            raise ValueError(f"pack=True: encoder tasks {list(task_names)} are not packed "
                             "(one example per row); set pack=False")
        for key, value in lengths.items():
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"task_feature_lengths[{key!r}]={value!r}; accepted: an int >= 1")

        self.mixture_or_task_name = mixture_or_task_name
        self.task_feature_lengths = lengths
        self.batch_size = int(batch_size)
        self.split = split
        self.seed = int(seed)
        self.layout = layout
        self.mixing = mixing_lib.parse_mixing(mixing)
        self.pack = bool(pack)
        self.use_cached = bool(use_cached)
        self.cache_dir = pathlib.Path(cache_dir) if cache_dir else None
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.shuffle = bool(shuffle)
        self.on_bad_row = on_bad_row
        self.encoder_vocabulary = encoder_vocabulary
        self.task_names: tuple[str, ...] = task_names
        # The model's head sizes and kinds, checked against each task's labels.
        for name, value, check in (("num_labels", num_labels, ef.check_num_labels),
                                   ("head_kinds", head_kinds, ef.check_head_kinds)):
            if value is None:
                continue
            if self.kind != "encoder":
                raise ValueError(f"{name}={value!r} applies to encoder tasks; "
                                 f"{list(task_names)} are {KIND_NAMES[self.kind]} tasks: "
                                 "leave it None")
            check(task_names, self.label_spaces, value)
        self.num_labels, self.head_kinds = num_labels, head_kinds
        # Every row of a mixture with a tagging task has the tagging features.
        self.tagging = self.kind == "encoder" and any(s.is_tagging for s in self.label_spaces)
        # ... and of a mixture with a cosine head, the second texts alone (ef.COSINE_FEATURES).
        self.cosine = ef.cosine_tasks(head_kinds, len(task_names)) if self.kind == "encoder" else ()

        if shard_by_process is not None and not isinstance(shard_by_process, (bool, np.bool_)):
            raise TypeError(f"shard_by_process={shard_by_process!r}; accepted: True, False or None")
        self.shard_by_process = shard_by_process
        self.sharded = self._resolve_sharding(shard_by_process)
        shard = self.shard_info
        # How each task's split becomes rows (`ktx.data.task_rows`).
        self.rows = TaskRows(
            task_names=task_names, kind=self.kind, task_feature_lengths=lengths, seed=self.seed,
            use_cached=self.use_cached, seqio_cache_dir=seqio_cache_dir, cache_dir=self.cache_dir,
            tagging=self.tagging, cosine=tuple(self.cosine), on_bad_row=on_bad_row,
            encoder_vocabulary=encoder_vocabulary)
        self._train = [self.rows.load(t, split, pack=self.pack, shard=shard)
                       for t in range(self.num_tasks)]
        self._eval: dict[tuple[str, str], dict[str, np.ndarray]] = {}
        local = [int(a["task_id"].shape[0]) for a in self._train]
        # `[P, T]` rows of every process's shard of every task (`[1, T]` unsharded).
        self.shard_sizes: np.ndarray = self._gather_shard_sizes(local) if self.sharded \
            else np.asarray([local], np.int64)
        # GLOBAL rows per task (all shards together): what the mixing schedule is made of.
        self.task_sizes: tuple[int, ...] = tuple(int(n) for n in self.shard_sizes.sum(axis=0))
        self.min_rows_per_task = int(min_rows_per_task)
        self._setup_schedule()
        _log.info(
            "MultiTaskInput %s/%s: %s, global rows per task %s, this process's rows %s, "
            "%.1f MB cached, counts at step 0 %s",
            mixture_or_task_name, split,
            f"process {self.process_index} of {self.process_count} reads shard "
            f"{self.process_index} of {self.process_count} of every task" if self.sharded
            else "every task read in full", dict(zip(self.task_names, self.task_sizes)),
            dict(zip(self.task_names, self.shard_task_sizes)), self.cache_nbytes / 2**20,
            self.schedule.counts_at(0),
        )

    # ------------------------------------------------------------------------ sharding
    @property
    def shard_info(self) -> seqio.ShardInfo | None:
        """This process's shard of every task's training split; None: read in full."""
        return seqio.ShardInfo(self.process_index, self.process_count) if self.sharded else None

    @property
    def shard_task_sizes(self) -> tuple[int, ...]:
        """Rows of each task this process holds: its shard (sharded) or the whole task."""
        return tuple(int(n) for n in self.shard_sizes[self.process_index if self.sharded else 0])

    def _mixes_tasks_in_blocks(self) -> bool:
        """Whether batches are task-partitioned with several tasks sharing a batch."""
        return (self.layout == "task_partitioned" and self.mixing.batches == "mixed"
                and self.num_tasks > 1)

    @property
    def process_grouped(self) -> bool:
        """Whether the global batch is process-grouped, `[p0: t0 t1 ..][p1: t0 t1 ..] ..`
        (sharded, task-partitioned mixed batches of several tasks: each process supplies
        its share of every task, `ktx.data.process_layout`), not grouped by task: the
        Trainer then regroups the rows by task in the step (`StepOptions.regroup_by_task`,
        set from this by `ktx.runs.train`)."""
        return self.sharded and self._mixes_tasks_in_blocks()

    def _resolve_sharding(self, shard_by_process: bool | None) -> bool:
        if self.process_count == 1:
            return False
        return True if shard_by_process is None else bool(shard_by_process)

    def _gather_shard_sizes(self, local: Sequence[int]) -> np.ndarray:
        """`[P, T]` every process's shard sizes: an all-gather across the JAX processes,
        or, for processes simulated in this one (`process_count` given, not
        `jax.process_count()`), the other shards read here (their sizes kept)."""
        if jax.process_count() == self.process_count and jax.process_index() == self.process_index:
            from jax.experimental import multihost_utils

            if max(local, default=0) >= 2**31:
                raise ValueError(f"shard sizes {local} exceed int32; shard_by_process=False")
            sizes = np.asarray(multihost_utils.process_allgather(np.asarray(local, np.int32)), np.int64)
            return sizes.reshape(self.process_count, self.num_tasks)
        sizes = np.zeros((self.process_count, self.num_tasks), np.int64)
        for i in range(self.process_count):
            for t in range(self.num_tasks):
                sizes[i, t] = local[t] if i == self.process_index else self.rows.load(
                    t, self.split, pack=self.pack,
                    shard=seqio.ShardInfo(i, self.process_count))["task_id"].shape[0]
        return sizes

    def _check_shards(self) -> None:
        """Every shard of a task with a positive rate has rows."""
        positive = (self.schedule.rates > 0).any(axis=0)
        for t, name in enumerate(self.task_names):
            empty = np.flatnonzero(self.shard_sizes[:, t] == 0)
            if positive[t] and empty.size:
                raise ValueError(
                    f"task {name!r} has {self.task_sizes[t]} rows in split {self.split!r}: its "
                    f"shards {empty.tolist()} of {self.process_count} are empty but the task has "
                    "a positive mixing rate; use shard_by_process=False")

    def _process_rows(self, steps: np.ndarray, process_index: int) -> np.ndarray:
        """`[N, T]` rows of each task that process `process_index` supplies at each of
        `steps` (task-partitioned layout): its share of every task when process-grouped
        (`ktx.data.process_layout.process_shares`), else its row range's overlap with the
        task blocks (one task per batch: `B / P` rows of the batch's task)."""
        consumed = self.schedule.consumed_before_many(np.concatenate([steps, steps + 1]))
        counts = consumed[steps.size:] - consumed[:steps.size]
        if self.process_grouped:
            return process_layout.process_shares(counts, self.process_count, steps, process_index)
        lo = process_index * self.local_batch_size
        hi = lo + self.local_batch_size
        ends = np.cumsum(counts, axis=1)
        return np.clip(ends, lo, hi) - np.clip(ends - counts, lo, hi)

    def process_task_counts(self, step: int) -> tuple[int, ...] | None:
        """Rows of each task among THIS process's rows of the global batch of `step`
        (task-partitioned layout, grouped by task in task order; they sum to
        `local_batch_size`; summed over the processes, `task_counts(step)`); None for
        "sampled"."""
        if self.layout == "sampled":
            return None
        rows = self._process_rows(np.array([self._step(step)]), self.process_index)[0]
        return tuple(int(n) for n in rows)

    def shard_cursors(self, step: int) -> np.ndarray:
        """`[T]` int64 rows of each task THIS process supplied in the batches before `step`
        (task-partitioned layout): its position in its shard's stream, epochs included.
        Unsharded, or with one process, `RateSchedule.consumed_before` (global). Computed
        from the last step asked for when that is earlier (iterating costs O(1) a step), else
        vectorised over the steps from 0 (~0.5 s per million steps; no batch replayed)."""
        step = self._step(step)
        if self.layout == "sampled":
            raise ValueError("shard_cursors: layout='sampled' reads no stream (each row is drawn)")
        if not self.sharded:
            return self.schedule.consumed_before(step)
        start, cursor = self._cursor_at if self._cursor_at[0] <= step else (0, np.zeros(self.num_tasks, np.int64))
        chunk = 1 << 18
        for a in range(start, step, chunk):
            cursor = cursor + self._process_rows(np.arange(a, min(step, a + chunk)),
                                                 self.process_index).sum(axis=0)
        self._cursor_at = (step, cursor)
        return cursor

    def _setup_schedule(self) -> None:
        if self.layout == "sampled" and self.mixing.batches != "mixed":
            raise ValueError(
                f"layout='sampled' draws each row's task; Mixing(batches={self.mixing.batches!r}) "
                "puts one task in each batch: use layout='task_partitioned'")
        self._permutations: dict[tuple[int, int], np.ndarray] = {}
        self._cursor_at: tuple[int, np.ndarray] = (0, np.zeros(self.num_tasks, np.int64))
        self.steps_per_epoch = max(1, sum(self.task_sizes) // self.batch_size)
        self.schedule = self.mixing.schedule(
            self.task_sizes,
            self.batch_size,
            steps_per_epoch=self.steps_per_epoch,
            mixture_rates=(
                mixture_rates(self.mixture_or_task_name) if self.mixing.kind == "mixture" else None
            ),
            min_count=self.min_rows_per_task if self.layout == "task_partitioned" else 0,
        )
        for t, name in enumerate(self.task_names):
            positive = self.schedule.rates[:, t] > 0
            if self.task_sizes[t] == 0 and positive.any():
                raise ValueError(
                    f"task {name!r} has no examples in split {self.split!r} but a positive mixing rate"
                )
            never = positive & (self.schedule.counts[:, t] == 0) & (self.schedule.shares[:, t] == 0)
            if self.layout == "task_partitioned" and never.any():
                _log.warning(
                    "task %r (rate %.3g) gets 0 of %d rows per batch in the task-partitioned "
                    "layout, so it is not trained on; use Mixing(carry=True), raise "
                    "min_rows_per_task or the batch size, or use layout='sampled'",
                    name, float(self.schedule.rates[0, t]), self.batch_size,
                )
        if self.sharded:
            self._check_shards()

    def replace(
        self,
        *,
        batch_size: int | None = None,
        seed: int | None = None,
        layout: str | None = None,
        mixing: mixing_lib.Mixing | str | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
        min_rows_per_task: int | None = None,
    ) -> "MultiTaskInput":
        """A new input over the same cached rows with some batching options changed
        (no data is re-read; `mixing=None` keeps the current mixing). A sharded input
        keeps its process (it holds that process's shards only)."""
        if self.sharded and ((process_index is not None and process_index != self.process_index)
                             or (process_count is not None and process_count != self.process_count)):
            raise ValueError(
                f"process_index={process_index!r}, process_count={process_count!r}: this input "
                f"holds shard {self.process_index} of {self.process_count} of every task; build a "
                "new MultiTaskInput for another process")
        new = copy.copy(self)
        new.batch_size = self.batch_size if batch_size is None else int(batch_size)
        new.seed = self.seed if seed is None else int(seed)
        new.rows = dataclasses.replace(self.rows, seed=new.seed)  # rows read later (evaluation)
        new.layout = self.layout if layout is None else layout
        new.mixing = self.mixing if mixing is None else mixing_lib.parse_mixing(mixing)
        new.process_index = self.process_index if process_index is None else int(process_index)
        new.process_count = self.process_count if process_count is None else int(process_count)
        new.min_rows_per_task = self.min_rows_per_task if min_rows_per_task is None else int(min_rows_per_task)
        _check_batching(new.layout, new.batch_size, new.process_index, new.process_count, new.seed)
        new._setup_schedule()
        return new

    # ----------------------------------------------------------------------------- info
    @property
    def num_tasks(self) -> int:
        return len(self.task_names)

    @property
    def label_spaces(self) -> tuple[ef.LabelSpace, ...]:
        """Encoder tasks: each task's `LabelSpace` (task-id order)."""
        return tuple(ef.label_space(seqio.get_mixture_or_task(n)) for n in self.task_names)

    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    @property
    def cache_nbytes(self) -> int:
        """Bytes held by the in-memory cache (training and loaded evaluation splits)."""
        arrays = list(self._train) + list(self._eval.values())
        return int(sum(v.nbytes for a in arrays for v in a.values()))

    def task_id(self, task_name: str) -> int:
        """The task id (mixture index) of `task_name`."""
        if task_name not in self.task_names:
            raise ValueError(f"task_name={task_name!r} is not in the mixture; tasks: {self.task_names}")
        return self.task_names.index(task_name)

    def task_counts(self, step: int) -> tuple[int, ...] | None:
        """Rows of each task in the GLOBAL batch of `step` (contiguous blocks in task order,
        or, `process_grouped`, in all the processes' task-ordered rows together); None for
        the sampled layout."""
        if self.layout == "sampled":
            return None
        return self.schedule.counts_at(self._step(step))

    def rates(self, step: int) -> np.ndarray:
        """`[T]` mixing rates in force at `step`."""
        return self.schedule.rates_at(self._step(step))

    def epochs_seen(self, step: int) -> np.ndarray:
        """`[T]` GLOBAL passes over each task's rows (all processes' rows of the batches
        before `step` / the task's rows in all shards; task-partitioned layout; the expected
        number for the sampled one). Sharded, each process's own: `shard_epochs_seen`."""
        step = self._step(step)
        if self.layout == "sampled":
            consumed = self.batch_size * self.schedule.rate_sum_before(step)
        else:
            consumed = self.schedule.consumed_before(step).astype(np.float64)
        return consumed / np.maximum(np.asarray(self.task_sizes, np.float64), 1)

    def shard_epochs_seen(self, step: int) -> np.ndarray:
        """`[T]` passes THIS process made over the rows it holds of each task (its shard
        when sharded, else the whole task) in the batches before `step` (the expected
        number for the sampled layout)."""
        step = self._step(step)
        if self.layout == "sampled":
            consumed = self.local_batch_size * self.schedule.rate_sum_before(step)
        elif self.sharded:
            consumed = self.shard_cursors(step).astype(np.float64)
        else:  # every process reads the global stream
            consumed = self.schedule.consumed_before(step).astype(np.float64)
        return consumed / np.maximum(np.asarray(self.shard_task_sizes, np.float64), 1)

    # ---------------------------------------------------------------------------- batches
    def get_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the global batch of `step`: int32 features
        (`decoder_loss_weights` float32), each `[local_batch_size, ...]`, with `task_id`."""
        step = self._step(step)
        lo = self.process_index * self.local_batch_size
        hi = lo + self.local_batch_size
        if self.layout == "sampled":
            return self._sampled_batch(step, lo, hi)
        if self.sharded:  # this process's own stream of its shard: its rows of each task
            cursors = self.shard_cursors(step)
            rows = self._process_rows(np.array([step]), self.process_index)[0]
            parts = [self._gather(t, self._indices(t, cursors[t] + np.arange(rows[t])))
                     for t in range(self.num_tasks) if rows[t]]
            self._cursor_at = (step + 1, cursors + rows)
            return self._concat(parts)
        counts = np.asarray(self.schedule.counts_at(step), np.int64)
        block_starts = np.concatenate([[0], np.cumsum(counts)])
        cursors = self.schedule.consumed_before(step)
        parts = []
        for t in range(self.num_tasks):
            a, b = max(lo, block_starts[t]), min(hi, block_starts[t + 1])
            if a < b:
                positions = cursors[t] + np.arange(a - block_starts[t], b - block_starts[t])
                parts.append(self._gather(t, self._indices(t, positions)))
        return self._concat(parts)

    def _sampled_batch(self, step: int, lo: int, hi: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 0x5A3D1ED, step])
        tasks = rng.choice(self.num_tasks, size=self.batch_size, p=self.schedule.rates_at(step))
        picks = rng.random(self.batch_size)
        tasks, picks = tasks[lo:hi], picks[lo:hi]
        out = {k: np.empty((hi - lo,) + v.shape[1:], fc.OUTPUT_DTYPES.get(k, np.int32))
               for k, v in self._train[0].items()}
        for t in np.unique(tasks):
            rows = np.nonzero(tasks == t)[0]
            size = self.shard_task_sizes[t]  # this process's shard when sharded
            indices = np.minimum((picks[rows] * size).astype(np.int64), size - 1)
            for k, v in self._gather(int(t), indices).items():
                out[k][rows] = v
        return out

    def eval_batches(
        self, task_name: str, split: str = "validation", batch_size: int | None = None
    ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        """Yields `(batch, num_real)` over all examples of one task's split, in order.

        Every global batch has `batch_size` rows (default: the training batch size),
        the last one padded with zero rows (`decoder_loss_weights` 0, `task_id` of the
        task); `batch` is this process's rows of it and `num_real` the number of real
        (non-padding) rows in the global batch, which come first. Unpacked.
        """
        batch_size = self.batch_size if batch_size is None else batch_size
        return eval_input.padded_batches(self.eval_arrays(task_name, split),
                                         self.task_id(task_name), batch_size,
                                         self.process_index, self.process_count)

    def eval_arrays(self, task_name: str, split: str = "validation") -> dict[str, np.ndarray]:
        """All converted (unpacked, compact) rows of one task's split, with `task_id`."""
        key = (task_name, split)
        # The rows already read for batches (all of them: not when they are a shard).
        if split == self.split and not self.pack and not self.sharded:
            return self._train[self.task_id(task_name)]
        if key not in self._eval:
            self._eval[key] = self.rows.load(self.task_id(task_name), split, pack=False)
        return self._eval[key]

    # --------------------------------------------------------------------------- internals
    def _step(self, step: int) -> int:
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step={step!r}; accepted: an int >= 0")
        return int(step)

    def _permutation(self, task: int, epoch: int) -> np.ndarray:
        key = (task, epoch)
        if key not in self._permutations:
            if len(self._permutations) >= 2 * self.num_tasks + 2:
                self._permutations.pop(next(iter(self._permutations)))  # oldest first
            seed = [self.seed, task, epoch]
            if self.sharded:  # a permutation of this process's shard
                seed += [_SHARD_SEED, self.process_index, self.process_count]
            self._permutations[key] = np.random.default_rng(seed).permutation(
                self.shard_task_sizes[task])
        return self._permutations[key]

    def _indices(self, task: int, positions: np.ndarray) -> np.ndarray:
        size = self.shard_task_sizes[task]  # the task's rows this process holds
        epochs, within = np.divmod(positions, size)
        if not self.shuffle:
            return within
        out = np.empty_like(within)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._permutation(task, int(epoch))[within[sel]]
        return out

    def _gather(self, task: int, indices: np.ndarray) -> dict[str, np.ndarray]:
        return fc.widen({k: v[indices] for k, v in self._train[task].items()})

    def _concat(self, parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

