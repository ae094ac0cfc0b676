"""Which rows of each task every process supplies to a sharded, mixed, task-partitioned batch.

The global batch of step `s` holds `counts[t]` rows of task `t` (`B` rows in all, `B`
divisible by the number of processes `P`). Sharded (`MultiTaskInput(shard_by_process=...)`),
process `p` supplies its share `n[p][t]` of every task from its own shard, its `B / P`
local rows grouped by task in task order, so the global batch is *process-grouped*:
`[p0: t0 t1 ..][p1: t0 t1 ..] ..`, which the Trainer regroups by task inside the step
(`StepOptions.regroup_by_task`).

`process_shares(counts, P, steps)` `[N, P, T]`: every process gets `counts[t] // P` rows of
task `t`; the remainders `counts[t] % P` are laid out as units, task after task in task
order, one per process cyclically: unit `k` of the step goes to process
`(k + offset(s)) % P`. A task's remainder is below `P`, so its units go to distinct
processes (each share is `floor` or `ceil` of `counts[t] / P`), and the remainders add up
to a multiple of `P` (`B` is), so every process gets the same number of extra rows:
`sum_t n[p][t] = B / P`, `sum_p n[p][t] = counts[t]`.

`offset(s) = floor(frac(s * phi) * P)` (phi = (sqrt(5) - 1) / 2; in integers,
Fibonacci hashing: the top bits of `s * 0x9E3779B97F4A7C15 mod 2**64`): the golden-ratio
Weyl sequence, which takes every offset about equally often over any run of steps (low
discrepancy) and has no period, so counts that vary with a period (carried fractional
quotas) do not keep handing a task's extra row to the same process. A pure function of
the step and the counts: a resumed process recomputes its shares and its position in its
shard. Measured on 80 random mixtures of 2-8 tasks on 2-64 processes over 200,000 steps
(mixture rates and annealed ones): a process's rows of a task so far stay within 4.3 of
`1 / P` of the task's rows with constant counts (`Mixing(carry=False)`) and within 228
with carried quotas, where `offset = s % P` drifted by up to 75,000 rows (a count
pattern in step with the rotation) and a hashed offset by up to 540.

Sharded input (`MultiTaskInput(shard_by_process=...)`, the default with `P > 1`).
Unsharded, every process reads and caches every task in full and gathers its rows of the
one global stream above. Sharded, process `i` reads only shard `i` of `P` of each task's
training split (`task.get_dataset(..., shard_info=seqio.ShardInfo(i, P))`: ktx's sources,
and SeqIO for a `FunctionDataSource`, split the examples round-robin, so shard sizes
differ by at most one row; a file-sharded source (SeqIO's offline cache with at least `P`
files) splits by file). The processes exchange their shard sizes once (an all-gather;
processes simulated in one, with `process_index` / `process_count` given, read the other
shards to count them): `task_sizes` is GLOBAL, the sum over the shards, so the mixing
schedule and the counts of the global batch are those of the unsharded input, while
`shard_task_sizes` is this process's shard. The process supplies
`process_task_counts(s)[t]` rows of task `t` at step `s`, from its own shard, in a
per-(seed, task, shard epoch, process) permutation of the shard, read as a stream from the
position `shard_cursors(s)[t]` = the sum of those rows over the steps before `s`: every
row of a shard is read once per shard epoch (epochs are per shard: `shard_epochs_seen`;
`epochs_seen` stays global). `shard_cursors` is vectorised over the steps with numpy (no
batch replayed: 0.25-0.34 s at step 1e6 for synthetic_quickstart's 4 tasks on 2 processes,
process-grouped, annealed or not, on one CPU core) and advanced by one step's rows while
iterating, so a resumed process recomputes its position from the step alone. Which rows a
process supplies:

* mixed task-partitioned batches of several tasks: every process supplies its share of
  EVERY task, `floor` or `ceil` of `counts[t] / P` with `B / P` rows in all
  (`process_shares` below; the remainder rows go round the processes
  from an offset that moves with the step, so every shard is read at the pace of the
  others), its rows grouped by task in task order. The global batch is then
  process-grouped, `[p0: t0 t1 ..][p1: t0 t1 ..] ..`, with `counts[t]` rows of task `t`
  in all but not grouped by task: `process_grouped` is True, and the Trainer
  (`StepOptions.regroup_by_task`, set by `ktx.runs.train` from it) sorts the rows by task
  inside the step for the balanced path's task blocks;
* one task per batch (`Mixing(batches="task_per_batch" | "round_robin")`) or a single
  task: its row range of the global batch, `B / P` rows of the batch's task;
* layout "sampled": each row's example is drawn from the process's shard.
"""

from __future__ import annotations

import numpy as np

__all__ = ["share_offsets", "process_shares"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # round(2**64 * (sqrt(5) - 1) / 2)


def share_offsets(steps: np.ndarray, process_count: int) -> np.ndarray:
    """`[N]` int64: the process that gets the first remainder unit of each step,
    `floor(frac(step * phi) * P)` computed in integers (exact, the same on every host)."""
    steps = np.asarray(steps, np.int64).reshape(-1)
    p = int(process_count)
    if not 1 <= p < 2**31:
        raise ValueError(f"process_count={process_count!r}; accepted: an int in [1, 2**31)")
    if steps.size and steps.min() < 0:
        raise ValueError(f"steps has a negative value {int(steps.min())}; accepted: ints >= 0")
    top = (steps.astype(np.uint64) * _GOLDEN) >> np.uint64(32)  # frac(step * phi) * 2**32
    return ((top * np.uint64(p)) >> np.uint64(32)).astype(np.int64)


def process_shares(counts: np.ndarray, process_count: int, steps: np.ndarray,
                   process_index: int | None = None) -> np.ndarray:
    """Rows of each task that each process supplies at each step.

    Args:
      counts: `[N, T]` (or `[T]` for one step) rows of each task in the global batch of
        each step; each row of counts sums to a multiple of `process_count`.
      process_count: `P`.
      steps: `[N]` the steps (they choose the offsets, `share_offsets`).
      process_index: None for every process, else only that one's shares.

    Returns:
      int64 `[N, P, T]` (`[N, T]` with `process_index`; the leading `N` axis dropped when
      `counts` is `[T]`).
    """
    counts = np.asarray(counts, np.int64)
    one = counts.ndim == 1
    counts = counts.reshape(1, -1) if one else counts
    steps = np.asarray(steps, np.int64).reshape(-1)
    if counts.ndim != 2 or steps.shape[0] != counts.shape[0]:
        raise ValueError(f"counts of shape {counts.shape} and steps of shape {steps.shape}; "
                         "accepted: counts [N, T] (or [T]) and steps [N]")
    if counts.size and counts.min() < 0:
        raise ValueError(f"counts has a negative value {int(counts.min())}; accepted: ints >= 0")
    p = int(process_count)
    offsets = share_offsets(steps, p)
    totals = counts.sum(axis=1)
    if (totals % p).any():
        bad = int(np.flatnonzero(totals % p)[0])
        raise ValueError(f"counts at step {int(steps[bad])} sum to {int(totals[bad])}, not "
                         f"divisible by process_count={p}")
    if process_index is not None and not 0 <= int(process_index) < p:
        raise ValueError(f"process_index={process_index!r}; accepted: 0 <= process_index < {p}")
    base, rem = np.divmod(counts, p)
    first = np.cumsum(rem, axis=1) - rem  # [N, T] index of each task's first unit
    procs = np.arange(p) if process_index is None else np.array([int(process_index)])
    # Task t's units k in [first, first + rem) go to (k + offset) % P: process q gets one
    # when (q - offset - first) % P < rem (rem < P, so at most one).
    slot = (procs[None, :, None] - offsets[:, None, None] - first[:, None, :]) % p  # [N, Q, T]
    shares = base[:, None, :] + (slot < rem[:, None, :])
    if process_index is not None:
        shares = shares[:, 0]
    return shares[0] if one else shares
