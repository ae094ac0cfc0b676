"""`RecsysTrainInput`: the training batches of a multi-behaviour recommender.

A `ktx.runs.train.TrainInput` over `MultiBehaviorData.train`. By default batches are
task-partitioned: each step holds a fixed block of rows per behaviour (target first),
positives with label 1 and `num_negatives` uniformly drawn non-interacted items per
positive with label 0. `rows="shared"` is the MetaBalance authors' layout instead: one
row per (user, item) pair carrying every behaviour's label, laid out as one block of the
same pairs per task. Negatives and order are re-drawn every epoch from
`(seed, epoch, task)` only, so a batch is a pure function of `(seed, step)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from ktx.data.recsys_prepare import MultiBehaviorData
from ktx.data.recsys_readers import pair_keys, unique_pairs

__all__ = ["RecsysTrainInput"]


def _largest_remainder(total: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """Splits `total` rows over tasks in proportion to `sizes`, at least one row each."""
    sizes = np.asarray(sizes, np.float64)
    T = len(sizes)
    if total < T:
        raise ValueError(f"batch_size={total} is smaller than the number of tasks ({T})")
    share = 1 + (total - T) * sizes / sizes.sum()
    counts = np.floor(share).astype(np.int64)
    rest = total - counts.sum()
    counts[np.argsort(-(share - counts), kind="stable")[:rest]] += 1
    return tuple(int(c) for c in counts)


class RecsysTrainInput:
    """Task-partitioned training batches over `MultiBehaviorData.train` (a `ktx.runs.train.TrainInput`).

    A task's epoch stream is its positives plus `num_negatives` negatives per positive,
    shuffled; negatives are uniform over items the user has not interacted with in that
    behaviour's training pairs (re-drawn on collision, up to 20 rounds). Every step takes
    `task_counts()[t]` consecutive rows of task t's stream, cycling if the task's stream
    is shorter than the epoch. `steps_per_epoch = max_t ceil(rows_t / count_t)`; with the
    default proportional counts that is one pass over all rows. `max_steps_per_epoch`
    shortens every epoch to its first steps (quick runs): epoch e is still drawn from
    epoch e's streams, so a shortened run sees a prefix of each full epoch.

    `rows="shared"` gives every task the same rows instead, each labelled for every
    behaviour, as the MetaBalance authors' training script feeds its model (every row
    carries all behaviours' labels and every task's loss is taken on it): the epoch
    stream is the union of all behaviours' training pairs (a pair is positive for the
    behaviours it occurs in) plus `num_negatives` negatives per pair, uniform over items
    the user has no training interaction with (labels 0 for every task). A step takes
    `batch_size / T` consecutive pairs and lays them out as T task blocks of the same
    pairs (task t's block labelled for behaviour t), so the per-task gradient engine and
    the losses are those of task-partitioned batches, and `batch_size` still counts the
    rows the model sees (the authors' 256 pairs per step with 3 behaviours: 768).

    Args:
      data: the preprocessed data.
      batch_size: global rows per step (interface: BATCH_SIZE); with `rows="shared"`,
        a multiple of the number of tasks.
      num_negatives: negatives per positive.
      seed: base seed; batch(step) depends only on (seed, step).
      task_batch_sizes: explicit rows per task (sum = batch_size); default proportional
        to each task's rows, at least 1.
      max_steps_per_epoch: cap each epoch at this many steps (None: full epochs;
        gin: STEPS_PER_EPOCH).
      rows: "per_task" (each task's own positives and negatives) or "shared" (the same
        pairs for every task, labelled for each behaviour).
      process_index, process_count: this process's contiguous slice of the global batch.
    """

    def __init__(
        self,
        data: MultiBehaviorData,
        *,
        batch_size: int = 256,
        num_negatives: int = 1,
        seed: int = 0,
        task_batch_sizes: Sequence[int] | None = None,
        max_steps_per_epoch: int | None = None,
        rows: str = "per_task",
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: expected a positive int")
        if rows not in ("per_task", "shared"):
            raise ValueError(f"rows={rows!r}; accepted: 'per_task' or 'shared'")
        if rows == "shared" and task_batch_sizes is not None:
            raise ValueError(
                f"task_batch_sizes={task_batch_sizes!r} with rows='shared': every task gets "
                "the same batch_size / T pairs; leave task_batch_sizes unset")
        self.rows = rows
        if not isinstance(num_negatives, int) or num_negatives < 0:
            raise ValueError(f"num_negatives={num_negatives!r}: expected a non-negative int")
        self.data = data
        self.task_names = tuple(data.behaviours)
        self.num_tasks = len(self.task_names)
        self.batch_size = batch_size
        self.num_negatives = num_negatives
        self.seed = int(seed)
        self._pos = [data.train[b] for b in self.task_names]
        for b, p in zip(self.task_names, self._pos):
            if not len(p):
                raise ValueError(f"behaviour {b!r} has no training pairs")
        if rows == "shared":
            self._union = unique_pairs(np.concatenate(self._pos))
            self.rows_per_task = (len(self._union) * (1 + num_negatives),) * self.num_tasks
            if batch_size % self.num_tasks:
                raise ValueError(
                    f"batch_size={batch_size} with rows='shared': every one of the "
                    f"{self.num_tasks} tasks gets the same pairs, so batch_size (rows per step) "
                    f"must be a multiple of {self.num_tasks}, e.g. "
                    f"{self.num_tasks * max(1, round(batch_size / self.num_tasks))}")
            counts = (batch_size // self.num_tasks,) * self.num_tasks
        else:
            self.rows_per_task = tuple(len(p) * (1 + num_negatives) for p in self._pos)
            if task_batch_sizes is None:
                counts = _largest_remainder(batch_size, self.rows_per_task)
            else:
                counts = tuple(int(c) for c in task_batch_sizes)
                if len(counts) != self.num_tasks or min(counts) < 1 or sum(counts) != batch_size:
                    raise ValueError(
                        f"task_batch_sizes={task_batch_sizes!r}: expected {self.num_tasks} "
                        f"positive ints summing to batch_size={batch_size}"
                    )
        self._counts = counts
        self.full_steps_per_epoch = int(max(-(-r // c) for r, c in zip(self.rows_per_task, counts)))
        if max_steps_per_epoch is not None and (
                isinstance(max_steps_per_epoch, bool) or not isinstance(max_steps_per_epoch, int)
                or max_steps_per_epoch < 1):
            raise ValueError(
                f"max_steps_per_epoch={max_steps_per_epoch!r}; accepted: None (full epochs) or "
                "an integer >= 1")
        self.steps_per_epoch = self.full_steps_per_epoch if max_steps_per_epoch is None else min(
            max_steps_per_epoch, self.full_steps_per_epoch)
        pi = jax.process_index() if process_index is None else process_index
        pc = jax.process_count() if process_count is None else process_count
        if batch_size % pc or not 0 <= pi < pc:
            raise ValueError(
                f"batch_size={batch_size} must divide evenly over process_count={pc} "
                f"(process_index={pi})"
            )
        self.process_index, self.process_count = pi, pc
        self._sorted_keys = [np.sort(pair_keys(p, data.num_items)) for p in self._pos]
        if rows == "shared":
            self._union_keys = np.sort(pair_keys(self._union, data.num_items))
        self._cache: tuple[int, list[dict[str, np.ndarray]]] | None = None

    def task_counts(self, step: int) -> tuple[int, ...]:
        del step  # the layout is the same every step
        return self._counts

    def epoch_of(self, step: int) -> int:
        return int(step) // self.steps_per_epoch

    def _negatives(self, keys: np.ndarray, users: np.ndarray,
                   rng: np.random.Generator) -> np.ndarray:
        """Uniform items whose (user, item) key is not in the sorted `keys`."""
        n_items = self.data.num_items
        items = rng.integers(0, n_items, size=len(users))
        for _ in range(20):
            k = users * n_items + items
            pos = np.searchsorted(keys, k)
            hit = (pos < len(keys)) & (keys[np.minimum(pos, len(keys) - 1)] == k)
            if not hit.any():
                break
            items[hit] = rng.integers(0, n_items, size=int(hit.sum()))
        return items

    def epoch_rows(self, epoch: int) -> list[dict[str, np.ndarray]]:
        """Task t's shuffled stream for `epoch` (positives + fresh negatives)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.rows == "shared":
            streams = [self._shared_stream(epoch)]
            self._cache = (int(epoch), streams)
            return streams
        streams = []
        for t, pos in enumerate(self._pos):
            rng = np.random.default_rng([self.seed, int(epoch), t])
            neg_users = np.repeat(pos[:, 0], self.num_negatives)
            users = np.concatenate([pos[:, 0], neg_users])
            items = np.concatenate([pos[:, 1], self._negatives(self._sorted_keys[t], neg_users, rng)])
            labels = np.concatenate([np.ones(len(pos), np.float32), np.zeros(len(neg_users), np.float32)])
            order = rng.permutation(len(users))
            streams.append({
                "user": users[order].astype(np.int32),
                "item": items[order].astype(np.int32),
                "label": labels[order],
            })
        self._cache = (int(epoch), streams)
        return streams

    def _shared_stream(self, epoch: int) -> dict[str, np.ndarray]:
        """The shuffled pairs of `rows="shared"`: every behaviour's training pairs (labels
        `[n, T]`, 1 where the pair is a training pair of that behaviour) and negatives."""
        rng = np.random.default_rng([self.seed, int(epoch), self.num_tasks, 1])
        pos = self._union
        neg_users = np.repeat(pos[:, 0], self.num_negatives)
        users = np.concatenate([pos[:, 0], neg_users])
        items = np.concatenate([pos[:, 1], self._negatives(self._union_keys, neg_users, rng)])
        keys = pair_keys(pos, self.data.num_items)
        labels = np.zeros((len(users), self.num_tasks), np.float32)
        for t, task_keys in enumerate(self._sorted_keys):
            labels[:len(pos), t] = np.isin(keys, task_keys)
        order = rng.permutation(len(users))
        return {"user": users[order].astype(np.int32), "item": items[order].astype(np.int32),
                "labels": labels[order]}

    def get_global_batch(self, step: int) -> dict[str, np.ndarray]:
        """All rows of `step`, task blocks contiguous in task order."""
        if int(step) < 0:
            raise ValueError(f"step={step!r}: expected >= 0")
        epoch, within = divmod(int(step), self.steps_per_epoch)
        streams = self.epoch_rows(epoch)
        parts: dict[str, list[np.ndarray]] = {"user": [], "item": [], "label": [], "task_id": []}
        if self.rows == "shared":
            stream, b = streams[0], self._counts[0]
            idx = (within * b + np.arange(b)) % len(stream["user"])
            for t in range(self.num_tasks):
                parts["user"].append(stream["user"][idx])
                parts["item"].append(stream["item"][idx])
                parts["label"].append(stream["labels"][idx, t])
                parts["task_id"].append(np.full(b, t, np.int32))
            return {k: np.concatenate(v) for k, v in parts.items()}
        for t, (stream, c) in enumerate(zip(streams, self._counts)):
            idx = (within * c + np.arange(c)) % len(stream["user"])
            for k in ("user", "item", "label"):
                parts[k].append(stream[k][idx])
            parts["task_id"].append(np.full(c, t, np.int32))
        return {k: np.concatenate(v) for k, v in parts.items()}

    def get_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's contiguous rows of the global batch of `step`."""
        batch = self.get_global_batch(step)
        n = self.batch_size // self.process_count
        lo = self.process_index * n
        return {k: v[lo:lo + n] for k, v in batch.items()}
