"""Mixing rates of a multi-task mixture and their per-batch row counts.

Rates (non-negative, normalised to sum 1) come from the tasks' sizes `N_t`:

* `"proportional"`: examples-proportional mixing with an optional cap `K`,
  `r_t ∝ min(N_t, K)` (Raffel et al., 2020, T5, §3.5.2).
* `"temperature"`: `r_t ∝ min(N_t, K) ** (1 / T)`; `T = 10` as in HyperFormer
  (Karimi Mahabadi et al., 2021). `T = 1` is proportional, `T -> inf` equal.
* `"equal"`: `r_t = 1 / T_tasks`.
* `"annealed"`: `r_t ∝ N_t ** alpha` with `alpha = 1 - 0.8 (e - 1) / (E - 1)` in epoch
  `e = 1..E` (Stickland & Murray, 2019, PALs): proportional at the start, nearly equal
  at the end; after epoch `E` the last rates stay.
* `"mixture"`: the rates the SeqIO mixture was registered with.

Rows per batch (task-partitioned layout). With `Mixing.carry` (the default) the
fractional quotas are carried across steps, so that small tasks are trained on too: in a
piece of the schedule with rates `r`, every batch of `B` rows gives task `t` its
`base_t = floor(q_t)` rows (`q_t = r_t * B`, after `min_count`), and the `R = B - sum
base` remaining rows of each batch are shared over the steps in proportion to the
fractional parts `q_t - base_t`: the first `n` steps of the piece hold

    C_t(n) = n * base_t + apportion(n * R, q - base)_t

rows of task `t` (`apportion_rows`: the task range halved recursively, each half
getting its share of the rows rounded half up; monotone in `n`, exact sums). So
`|C_t(n) - n * q_t| <= ceil(log2 T) / 2` rows for every `n` (1.5 rows for 7 tasks, far
within one batch), a task with `q_t = 0.09` gets a row about every 11 steps instead of
never, and the counts of step `s` are `C(s + 1) - C(s)`: a closed form of the step,
so resuming at step `s` gives the counts of an uninterrupted run. The rows of one step
still sum to `B`, each task's between `base_t` and a few more. Each piece starts afresh
(annealed rates change at epoch boundaries), so after `P` pieces the bound is `P` times
that.

`Mixing(carry=False)` gives every batch the same counts, Hamilton's largest-remainder
apportionment of `r * B` (`largest_remainder_counts`, ties to the lower task index): a
task whose quota loses the remainder competition then gets 0 rows in every batch of a
piece and is never trained on, which the pipeline warns about; its advantage is one
count tuple per piece (a balancer that compiles per count tuple compiles once).

Rows in blocks (`Mixing.block_rows = b`, a divisor of `B`): the counts above are taken
for a batch of `B / b` blocks (`min_count` rounded up to whole blocks) and every task's
rows come in whole blocks of `b` rows. With `b` the rows of one `data` device (`B / data`)
every device holds one task's rows, and a balanced step on a mesh takes its per-task
gradients at the plain step's backward pass (`ktx.optim.device_slots`: one slot per
device); the price is a coarser share per step (a task's rows arrive `b` at a time, the
carried quotas' bound is `b` times the one above, in rows).

`min_count` (the pipeline's `min_rows_per_task`) guarantees every task with a positive
rate that many rows in every batch; the sampled layout draws each row's task with
probability `r_t` instead.

One task per batch (`Mixing.batches`; the rates are whichever `kind` gives, annealed
included): every row of step `s`'s batch comes from one task.

* `"round_robin"`: the tasks with a positive rate in turn, `t = s mod T'` (the SlapBERT
  study's round-robin batches).
* `"task_per_batch"`: the tasks' batches interleaved in proportion to the rates: the first
  `n` steps of a piece hold `apportion_rows(n, r)` batches of each task, so a task's
  batches spread evenly over the piece (the order MT-DNN's shuffled per-task mini-batches
  have in expectation, made deterministic: a closed form of the step, as above).

The default, `"mixed"`, gives every step rows of every task: the SlapBERT study's
"interleaved" batches (one batch of each task per step, losses summed), the only one of
the three under which a step has several tasks' gradients to balance (PCGrad, MetaBalance).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = [
    "MIXING_KINDS",
    "BATCH_KINDS",
    "TaskPerBatchSchedule",
    "Mixing",
    "RateSchedule",
    "proportional_rates",
    "temperature_rates",
    "equal_rates",
    "annealed_alpha",
    "annealed_rates",
    "largest_remainder_counts",
    "apportion_rows",
    "apportion_rows_many",
    "parse_mixing",
]

MIXING_KINDS = ("mixture", "proportional", "temperature", "equal", "annealed")
BATCH_KINDS = ("mixed", "round_robin", "task_per_batch")


def _sizes(sizes: Sequence[float], name: str = "sizes") -> np.ndarray:
    array = np.asarray(sizes, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{name} must be finite and >= 0, got {array.tolist()}")
    return array


def _normalise(weights: np.ndarray, what: str) -> np.ndarray:
    total = weights.sum()
    if total <= 0:
        raise ValueError(f"{what}: all rates are zero ({weights.tolist()}); at least one must be > 0")
    return weights / total


def _capped(sizes: np.ndarray, cap: int | None) -> np.ndarray:
    if cap is None:
        return sizes
    if cap <= 0:
        raise ValueError(f"cap={cap!r}; accepted: a positive number of examples or None")
    return np.minimum(sizes, float(cap))


def proportional_rates(sizes: Sequence[float], cap: int | None = None) -> np.ndarray:
    """`[T]` rates `∝ min(N_t, cap)` (examples-proportional mixing, T5)."""
    return _normalise(_capped(_sizes(sizes), cap), "proportional_rates")


def temperature_rates(
    sizes: Sequence[float], temperature: float = 10.0, cap: int | None = None
) -> np.ndarray:
    """`[T]` rates `∝ min(N_t, cap) ** (1 / temperature)` (HyperFormer uses T = 10)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}; accepted: a number > 0")
    return _normalise(_capped(_sizes(sizes), cap) ** (1.0 / temperature), "temperature_rates")


def equal_rates(num_tasks: int) -> np.ndarray:
    """`[T]` rates `1 / num_tasks`."""
    if not isinstance(num_tasks, (int, np.integer)) or num_tasks < 1:
        raise ValueError(f"num_tasks={num_tasks!r}; accepted: an int >= 1")
    return np.full(num_tasks, 1.0 / num_tasks)


def annealed_alpha(epoch: int, num_epochs: int) -> float:
    """`alpha = 1 - 0.8 (e - 1) / (E - 1)` for epoch `e` (1-based) of `E` (PALs, 2019).

    Epochs past `E` keep `alpha(E) = 0.2`; `E = 1` gives `alpha = 1`.
    """
    if num_epochs < 1:
        raise ValueError(f"num_epochs={num_epochs!r}; accepted: an int >= 1")
    if epoch < 1:
        raise ValueError(f"epoch={epoch!r}; epochs are counted from 1")
    if num_epochs == 1:
        return 1.0
    e = min(epoch, num_epochs)
    return 1.0 - 0.8 * (e - 1) / (num_epochs - 1)


def annealed_rates(sizes: Sequence[float], epoch: int, num_epochs: int) -> np.ndarray:
    """`[T]` rates `∝ N_t ** annealed_alpha(epoch, num_epochs)`; empty tasks get 0."""
    array = _sizes(sizes)
    alpha = annealed_alpha(epoch, num_epochs)
    return _normalise(np.where(array > 0, array**alpha, 0.0), "annealed_rates")


def largest_remainder_counts(
    rates: Sequence[float], batch_size: int, min_count: int = 0
) -> tuple[int, ...]:
    """Rows per task in a batch of `batch_size`: largest-remainder rounding of the rates.

    Every task with a positive rate first gets `min_count` rows; the remaining rows are
    apportioned by Hamilton's method: each task gets `floor(q_t)` of its quota
    `q_t = r_t * remaining / sum(r)`, and the rows left over go one each to the largest
    fractional parts (ties: lower task index first). Deterministic; sums to `batch_size`.

    Example: rates (0.5, 0.3, 0.2), batch 4 -> quotas (2.0, 1.2, 0.8) -> (2, 1, 1).
    """
    r = _sizes(rates, "rates")
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}; accepted: an int >= 1")
    if min_count < 0:
        raise ValueError(f"min_count={min_count!r}; accepted: an int >= 0")
    positive = r > 0
    if not positive.any():
        raise ValueError(f"rates={r.tolist()}: at least one rate must be > 0")
    base = np.where(positive, min_count, 0).astype(np.int64)
    remaining = batch_size - int(base.sum())
    if remaining < 0:
        raise ValueError(
            f"min_count={min_count} for {int(positive.sum())} tasks needs {int(base.sum())} "
            f"rows, more than batch_size={batch_size}"
        )
    quota = r / r.sum() * remaining
    floors = np.floor(quota).astype(np.int64)
    # Guard against floating point making floors exceed `remaining`.
    while floors.sum() > remaining:
        floors[np.argmax(floors)] -= 1
    left = remaining - int(floors.sum())
    order = np.lexsort((np.arange(r.size), -(quota - floors)))  # largest remainder first
    floors[order[:left]] += 1
    return tuple(int(c) for c in base + floors)


_SHARE_SCALE = 2**40  # shares become exact integers, so rounding is exact and portable


def _integer_shares(shares: np.ndarray) -> list[int]:
    total = float(shares.sum())
    return [int(v) for v in np.rint(shares / total * _SHARE_SCALE)] if total > 0 else [0] * shares.size


def apportion_rows(num_rows: int, shares: Sequence[float]) -> np.ndarray:
    """`[T]` int64 rows of `num_rows` split in proportion to `shares` (>= 0, one > 0).

    The task range is halved recursively; the left half gets its share of the rows
    rounded half up, the right half the rest. Each count is non-decreasing in
    `num_rows` (so consecutive differences are valid per-step counts), the counts sum
    to `num_rows`, and each is within `ceil(log2 T) / 2` of `num_rows * share`.

    Example: shares (0.25, 0.75): 1 row -> (0, 1), 2 -> (1, 1), 4 -> (1, 3).
    """
    weights = _integer_shares(_sizes(shares, "shares"))
    if num_rows < 0:
        raise ValueError(f"num_rows={num_rows!r}; accepted: an int >= 0")
    if num_rows and not any(weights):
        raise ValueError(f"shares={list(shares)!r}: at least one must be > 0 to apportion rows")
    out = np.zeros(len(weights), np.int64)
    stack = [(0, len(weights), int(num_rows))]
    while stack:
        lo, hi, n = stack.pop()
        if hi - lo == 1 or n == 0:
            out[lo] += n if hi - lo == 1 else 0
            continue
        mid = (lo + hi) // 2
        left_w, total_w = sum(weights[lo:mid]), sum(weights[lo:hi])
        left = (2 * n * left_w + total_w) // (2 * total_w)  # round(n * left_w / total_w)
        stack += [(lo, mid, left), (mid, hi, n - left)]
    return out


def _round_ratio(n: np.ndarray, num: int, den: int) -> np.ndarray:
    """`[N]` int64 `floor((2 n num + den) / (2 den))` (`round(n * num / den)`, halves up)
    for int64 `n >= 0` and Python ints `0 <= num <= den < 2**62`, exactly: a float64
    estimate corrected with the remainder, which is small, computed modulo 2**64."""
    est = np.floor(n.astype(np.float64) * (num / den) + 0.5).astype(np.int64)
    with np.errstate(over="ignore"):
        rem = (n.astype(np.uint64) * np.uint64(2 * num) + np.uint64(den)
               - est.astype(np.uint64) * np.uint64(2 * den)).astype(np.int64)
    while True:  # |estimate error| <= 1 for n < 2**50; a few passes at most
        low, high = rem < 0, rem >= 2 * den
        if not (low.any() or high.any()):
            return est
        est = est - low + high
        rem = rem + 2 * den * low.astype(np.int64) - 2 * den * high.astype(np.int64)


def apportion_rows_many(num_rows: np.ndarray, shares: Sequence[float]) -> np.ndarray:
    """`[N, T]` int64: row `k` is `apportion_rows(num_rows[k], shares)`, vectorised over
    `num_rows` (`[N]` ints >= 0, below 2**50) with the same exact integer rounding."""
    weights = _integer_shares(_sizes(shares, "shares"))
    n = np.asarray(num_rows, np.int64).reshape(-1)
    if np.any(n < 0) or np.any(n >= 2**50):
        raise ValueError(f"num_rows has values outside [0, 2**50): {n.min()}..{n.max()}")
    if n.any() and not any(weights):
        raise ValueError(f"shares={list(shares)!r}: at least one must be > 0 to apportion rows")
    out = np.zeros((n.size, len(weights)), np.int64)
    stack = [(0, len(weights), n)]
    while stack:
        lo, hi, rows = stack.pop()
        if hi - lo == 1:
            out[:, lo] += rows
            continue
        mid = (lo + hi) // 2
        left_w, total_w = sum(weights[lo:mid]), sum(weights[lo:hi])
        if total_w == 0:  # only reached with rows == 0 (as in apportion_rows)
            continue
        left = _round_ratio(rows, left_w, total_w)
        stack += [(lo, mid, left), (mid, hi, rows - left)]
    return out


def _base_and_shares(rates: np.ndarray, batch_size: int, min_count: int) -> tuple[np.ndarray, np.ndarray]:
    """(`[T]` rows every batch, `[T]` shares of the remaining rows) for carried quotas."""
    positive = rates > 0
    minimum = np.where(positive, min_count, 0).astype(np.int64)
    remaining = batch_size - int(minimum.sum())
    # Same validation as the per-batch rounding (batch size, min_count, positive rates).
    largest_remainder_counts(rates, batch_size, min_count)
    quota = rates / rates.sum() * remaining
    floors = np.floor(quota).astype(np.int64)
    while floors.sum() > remaining:  # guard against floating point
        floors[np.argmax(floors)] -= 1
    shares = np.maximum(quota - floors, 0.0)
    if remaining > floors.sum() and not (shares > 0).any():
        shares = rates.astype(np.float64)
    return minimum + floors, shares


@dataclasses.dataclass(frozen=True)
class RateSchedule:
    """Piecewise-constant rates and the per-step counts they give (module docstring).

    Attributes:
      starts: `[P]` first step of each piece (`starts[0] == 0`, increasing); the last
        piece lasts forever.
      rates: `[P, T]` normalised rates in each piece.
      counts: `[P, T]` rows every batch of the piece gives each task (`base`); with
        carried quotas a step adds some of the remaining rows (`counts_at`).
      shares: `[P, T]` how the remaining `B - counts.sum()` rows of each batch are shared
        over the steps of a piece; None: nothing remains, the counts are constant.
      batch_size: `B`; None: `counts` of each piece sum to it (no carried quotas).
      unit: rows per block (`Mixing.block_rows`): `counts`, `shares` and `batch_size` are
        in blocks of `unit` rows, and `counts_at` / `consumed_before` give rows (blocks
        times `unit`). 1: rows.
    """

    starts: np.ndarray
    rates: np.ndarray
    counts: np.ndarray
    shares: np.ndarray | None = None
    batch_size: int | None = None
    unit: int = 1

    def __post_init__(self):
        starts = np.asarray(self.starts, dtype=np.int64)
        if starts.ndim != 1 or starts.size == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0):
            raise ValueError(f"starts must begin at 0 and increase, got {starts.tolist()}")
        if self.rates.shape != self.counts.shape or self.rates.shape[0] != starts.size:
            raise ValueError(
                f"rates {self.rates.shape} and counts {self.counts.shape} must be [P={starts.size}, T]"
            )
        shares = np.zeros(self.rates.shape) if self.shares is None else np.asarray(self.shares, np.float64)
        if shares.shape != self.rates.shape:
            raise ValueError(f"shares {shares.shape} must be [P={starts.size}, T] like rates")
        counts = np.asarray(self.counts, np.int64)
        per_piece = counts.sum(axis=1)
        batch_size = int(per_piece[0]) if self.batch_size is None else int(self.batch_size)
        if np.any(per_piece > batch_size) or (self.shares is None and np.any(per_piece != batch_size)):
            raise ValueError(f"counts sum to {per_piece.tolist()} per piece; batch_size={batch_size}")
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "shares", shares)
        object.__setattr__(self, "batch_size", batch_size)
        object.__setattr__(self, "_remaining", batch_size - per_piece)
        if int(self.unit) < 1:
            raise ValueError(f"unit={self.unit!r}; accepted: an int >= 1")

    @property
    def num_tasks(self) -> int:
        return int(self.counts.shape[1])

    @property
    def carries(self) -> bool:
        """Whether the counts vary over steps (fractional quotas carried)."""
        return bool(np.any(self._remaining > 0))

    def _piece(self, step: int) -> int:
        if step < 0:
            raise ValueError(f"step={step!r}; accepted: an int >= 0")
        return int(np.searchsorted(self.starts, step, side="right") - 1)

    def rates_at(self, step: int) -> np.ndarray:
        """`[T]` rates used at `step`."""
        return self.rates[self._piece(step)]

    def counts_at(self, step: int) -> tuple[int, ...]:
        """Rows of each task in the global batch of `step`."""
        counts = self.consumed_before(step + 1) - self.consumed_before(step)
        return tuple(int(c) for c in counts)

    def _within(self, piece: int, steps: int) -> np.ndarray:
        """`[T]` rows of the first `steps` steps of `piece`."""
        rows = steps * self.counts[piece]
        if self._remaining[piece] and steps:
            rows = rows + apportion_rows(steps * int(self._remaining[piece]), self.shares[piece])
        return rows

    def consumed_before(self, step: int) -> np.ndarray:
        """`[T]` int64 rows of each task in the batches of steps `0 .. step - 1`.

        Closed form over the pieces (no replay of earlier batches).
        """
        piece = self._piece(step)
        total = np.zeros(self.num_tasks, np.int64)
        for k in range(piece):
            total += self._within(k, int(self.starts[k + 1] - self.starts[k]))
        return self.unit * (total + self._within(piece, int(step - self.starts[piece])))

    def _within_many(self, piece: int, steps: np.ndarray) -> np.ndarray:
        """`[N, T]` rows of the first `steps[k]` steps of `piece` (`_within`, vectorised)."""
        rows = steps[:, None] * self.counts[piece][None, :]
        if self._remaining[piece]:
            rows = rows + apportion_rows_many(steps * int(self._remaining[piece]), self.shares[piece])
        return rows

    def consumed_before_many(self, steps: Sequence[int] | np.ndarray) -> np.ndarray:
        """`[N, T]` int64: row `k` is `consumed_before(steps[k])`, vectorised over steps
        (numpy, no Python loop over them)."""
        steps = np.asarray(steps, np.int64).reshape(-1)
        if steps.size and steps.min() < 0:
            raise ValueError(f"steps has a negative value {int(steps.min())}; accepted: ints >= 0")
        pieces = np.searchsorted(self.starts, steps, side="right") - 1
        out = np.zeros((steps.size, self.num_tasks), np.int64)
        before = np.zeros(self.num_tasks, np.int64)  # rows of the full pieces before piece k
        for k in range(self.starts.size):
            sel = pieces == k
            if sel.any():
                out[sel] = before + self._within_many(k, steps[sel] - self.starts[k])
            if k + 1 < self.starts.size:
                before = before + self._within(k, int(self.starts[k + 1] - self.starts[k]))
        return self.unit * out

    def rate_sum_before(self, step: int) -> np.ndarray:
        """`[T]` sum of the rates over steps `0 .. step - 1` (expected rows / batch size)."""
        piece = self._piece(step)
        lengths = np.diff(self.starts[: piece + 1])  # full pieces before `piece`
        full = (lengths[:, None] * self.rates[:piece]).sum(axis=0)
        return full + (step - self.starts[piece]) * self.rates[piece]


@dataclasses.dataclass(frozen=True)
class TaskPerBatchSchedule(RateSchedule):
    """A `RateSchedule` whose every batch holds one task's rows (`Mixing.batches`
    "round_robin" or "task_per_batch"; module docstring). `counts` are 0 and `shares` the
    rates: the whole batch is apportioned step by step."""

    batches: str = "task_per_batch"

    def _within(self, piece: int, steps: int) -> np.ndarray:
        rates = self.rates[piece]
        if self.batches == "task_per_batch":
            return self.batch_size * apportion_rows(steps, rates)
        tasks = np.flatnonzero(rates > 0)
        turns = np.zeros(rates.size, np.int64)
        turns[tasks] = steps // tasks.size + (np.arange(tasks.size) < steps % tasks.size)
        return self.batch_size * turns


    def _within_many(self, piece: int, steps: np.ndarray) -> np.ndarray:
        rates = self.rates[piece]
        if self.batches == "task_per_batch":
            return self.batch_size * apportion_rows_many(steps, rates)
        tasks = np.flatnonzero(rates > 0)
        turns = np.zeros((steps.size, rates.size), np.int64)
        turns[:, tasks] = steps[:, None] // tasks.size + (np.arange(tasks.size)[None, :] < (steps % tasks.size)[:, None])
        return self.batch_size * turns


@dataclasses.dataclass(frozen=True)
class Mixing:
    """How a mixture's tasks share each batch (see the module docstring).

    Attributes:
      kind: one of `MIXING_KINDS`.
      cap: `K` for "proportional" and "temperature" (examples per task counted at most).
      temperature: `T` for "temperature".
      num_epochs: `E` for "annealed" (required for it).
      steps_per_epoch: steps of one annealing epoch; None uses the pipeline's
        `steps_per_epoch` (all tasks' rows / global batch size).
      carry: carry fractional quotas across steps (every task gets its share over the
        steps); False: the same largest-remainder counts in every batch of a piece.
      batches: "mixed" (every batch shares its rows among the tasks, as above),
        "round_robin" or "task_per_batch" (one task per batch; module docstring).
      block_rows: every task's rows in a "mixed" batch come in whole blocks of this many
        rows (a divisor of the batch size); the rows of one `data` device make a balanced
        step on a mesh cost one backward pass (module docstring). 1: single rows.
    """

    kind: str = "mixture"
    cap: int | None = None
    temperature: float = 10.0
    num_epochs: int | None = None
    steps_per_epoch: int | None = None
    carry: bool = True
    batches: str = "mixed"
    block_rows: int = 1

    def __post_init__(self):
        if self.kind not in MIXING_KINDS:
            raise ValueError(f"Mixing.kind={self.kind!r}; accepted: {MIXING_KINDS}")
        if self.batches not in BATCH_KINDS:
            raise ValueError(f"Mixing.batches={self.batches!r}; accepted: {BATCH_KINDS}")
        if self.kind == "annealed" and (self.num_epochs is None or self.num_epochs < 1):
            raise ValueError(
                f"Mixing(kind='annealed') needs num_epochs >= 1 (E in the PALs schedule), "
                f"got {self.num_epochs!r}"
            )
        if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
            raise ValueError(f"Mixing.steps_per_epoch={self.steps_per_epoch!r}; accepted: >= 1 or None")
        if not isinstance(self.block_rows, (int, np.integer)) or self.block_rows < 1:
            raise ValueError(f"Mixing.block_rows={self.block_rows!r}; accepted: an int >= 1 "
                             "(rows per task block, e.g. the batch size / the data axis)")

    def schedule(
        self,
        sizes: Sequence[int],
        batch_size: int,
        *,
        steps_per_epoch: int = 1,
        mixture_rates: Sequence[float] | None = None,
        min_count: int = 0,
    ) -> RateSchedule:
        """The `RateSchedule` of this mixing for tasks of `sizes` rows.

        Args:
          sizes: `[T]` rows (examples, or packed rows) of each task.
          batch_size: global batch size.
          steps_per_epoch: used by "annealed" when `self.steps_per_epoch` is None.
          mixture_rates: `[T]` the registered mixture rates (required by "mixture").
          min_count: rows guaranteed to every task with a positive rate.
        """
        sizes_array = _sizes(sizes)
        pieces: list[np.ndarray]
        starts: list[int] = [0]
        if self.kind == "mixture":
            if mixture_rates is None:
                raise ValueError("Mixing(kind='mixture') needs the mixture's registered rates")
            pieces = [_normalise(_sizes(mixture_rates, "mixture_rates"), "mixture rates")]
        elif self.kind == "proportional":
            pieces = [proportional_rates(sizes_array, self.cap)]
        elif self.kind == "temperature":
            pieces = [temperature_rates(sizes_array, self.temperature, self.cap)]
        elif self.kind == "equal":
            pieces = [equal_rates(sizes_array.size)]
        else:
            epoch_steps = self.steps_per_epoch or steps_per_epoch
            pieces = [annealed_rates(sizes_array, e, self.num_epochs) for e in range(1, self.num_epochs + 1)]
            starts = [e * epoch_steps for e in range(self.num_epochs)]
        rates = np.stack(pieces)
        if self.batches != "mixed":
            if min_count:
                raise ValueError(
                    f"Mixing(batches={self.batches!r}) puts one task in each batch; "
                    f"min_rows_per_task={min_count} asks for every task in every batch: set it to 0")
            return TaskPerBatchSchedule(np.array(starts), rates, np.zeros(rates.shape, np.int64),
                                        rates, batch_size, batches=self.batches)
        unit = int(self.block_rows)
        if batch_size % unit:
            raise ValueError(f"Mixing.block_rows={unit} does not divide the batch size {batch_size}; "
                             "accepted: a divisor of it (e.g. batch size / the mesh's data axis)")
        blocks, min_blocks = batch_size // unit, -(-min_count // unit)
        positive = int((rates > 0).any(axis=0).sum())
        if unit > 1 and min_blocks * unit * positive > batch_size:
            raise ValueError(
                f"min_count={min_count} in blocks of Mixing.block_rows={unit} rows for {positive} "
                f"tasks needs {min_blocks * unit * positive} rows, more than batch_size={batch_size}")
        if not self.carry:
            counts = np.array([largest_remainder_counts(p, blocks, min_blocks) for p in pieces], np.int64)
            return RateSchedule(np.array(starts), rates, counts, unit=unit)
        base, shares = zip(*(_base_and_shares(p, blocks, min_blocks) for p in pieces))
        return RateSchedule(np.array(starts), rates, np.stack(base), np.stack(shares), blocks, unit=unit)


def parse_mixing(mixing: Mixing | str | None) -> Mixing:
    """`None` -> the mixture's rates; a kind name -> `Mixing(kind)`; a `Mixing` as is."""
    if mixing is None:
        return Mixing()
    if isinstance(mixing, Mixing):
        return mixing
    if isinstance(mixing, str):
        return Mixing(kind=mixing)
    raise TypeError(f"mixing={mixing!r}; accepted: None, a Mixing, or one of {MIXING_KINDS}")
