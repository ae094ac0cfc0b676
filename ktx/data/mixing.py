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

A batch of `B` rows holds `largest_remainder_counts(rates, B)` rows of each task
(Hamilton's largest-remainder apportionment, ties to the lower task index). Rates only
change at epoch boundaries, so a `RateSchedule` is piecewise constant and the number of
rows of each task consumed before any step has a closed form: the input pipeline is a
pure function of the step, and resuming at step `s` needs nothing but `s`.

Tiny rates: a task whose quota `r_t * B` loses the remainder competition gets 0 rows in
every batch of a piece of the schedule, i.e. it is never trained on with the
task-partitioned layout. `min_count` (the pipeline's `min_rows_per_task`) guarantees
every task with a positive rate that many rows; the sampled layout draws such a task
with probability `r_t` per row instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = [
    "MIXING_KINDS",
    "Mixing",
    "RateSchedule",
    "proportional_rates",
    "temperature_rates",
    "equal_rates",
    "annealed_alpha",
    "annealed_rates",
    "largest_remainder_counts",
    "parse_mixing",
]

MIXING_KINDS = ("mixture", "proportional", "temperature", "equal", "annealed")


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


@dataclasses.dataclass(frozen=True)
class RateSchedule:
    """Piecewise-constant rates and per-batch counts over training steps.

    Attributes:
      starts: `[P]` first step of each piece (`starts[0] == 0`, increasing); the last
        piece lasts forever.
      rates: `[P, T]` normalised rates in each piece.
      counts: `[P, T]` rows per task per batch in each piece (each row sums to the
        global batch size).
    """

    starts: np.ndarray
    rates: np.ndarray
    counts: np.ndarray

    def __post_init__(self):
        starts = np.asarray(self.starts, dtype=np.int64)
        if starts.ndim != 1 or starts.size == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0):
            raise ValueError(f"starts must begin at 0 and increase, got {starts.tolist()}")
        if self.rates.shape != self.counts.shape or self.rates.shape[0] != starts.size:
            raise ValueError(
                f"rates {self.rates.shape} and counts {self.counts.shape} must be [P={starts.size}, T]"
            )
        object.__setattr__(self, "starts", starts)

    @property
    def num_tasks(self) -> int:
        return int(self.counts.shape[1])

    def _piece(self, step: int) -> int:
        if step < 0:
            raise ValueError(f"step={step!r}; accepted: an int >= 0")
        return int(np.searchsorted(self.starts, step, side="right") - 1)

    def rates_at(self, step: int) -> np.ndarray:
        """`[T]` rates used at `step`."""
        return self.rates[self._piece(step)]

    def counts_at(self, step: int) -> tuple[int, ...]:
        """Rows of each task in the global batch of `step`."""
        return tuple(int(c) for c in self.counts[self._piece(step)])

    def _sum_before(self, step: int, per_step: np.ndarray) -> np.ndarray:
        piece = self._piece(step)
        lengths = np.diff(self.starts[: piece + 1])  # full pieces before `piece`
        full = (lengths[:, None] * per_step[:piece]).sum(axis=0)
        return full + (step - self.starts[piece]) * per_step[piece]

    def consumed_before(self, step: int) -> np.ndarray:
        """`[T]` int64 rows of each task in the batches of steps `0 .. step - 1`.

        Closed form over the pieces (no replay of earlier batches).
        """
        return self._sum_before(step, self.counts).astype(np.int64)

    def rate_sum_before(self, step: int) -> np.ndarray:
        """`[T]` sum of the rates over steps `0 .. step - 1` (expected rows / batch size)."""
        return self._sum_before(step, self.rates)


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
    """

    kind: str = "mixture"
    cap: int | None = None
    temperature: float = 10.0
    num_epochs: int | None = None
    steps_per_epoch: int | None = None

    def __post_init__(self):
        if self.kind not in MIXING_KINDS:
            raise ValueError(f"Mixing.kind={self.kind!r}; accepted: {MIXING_KINDS}")
        if self.kind == "annealed" and (self.num_epochs is None or self.num_epochs < 1):
            raise ValueError(
                f"Mixing(kind='annealed') needs num_epochs >= 1 (E in the PALs schedule), "
                f"got {self.num_epochs!r}"
            )
        if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
            raise ValueError(f"Mixing.steps_per_epoch={self.steps_per_epoch!r}; accepted: >= 1 or None")

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
        counts = np.array([largest_remainder_counts(p, batch_size, min_count) for p in pieces], np.int64)
        return RateSchedule(np.array(starts), rates, counts)


def parse_mixing(mixing: Mixing | str | None) -> Mixing:
    """`None` -> the mixture's rates; a kind name -> `Mixing(kind)`; a `Mixing` as is."""
    if mixing is None:
        return Mixing()
    if isinstance(mixing, Mixing):
        return mixing
    if isinstance(mixing, str):
        return Mixing(kind=mixing)
    raise TypeError(f"mixing={mixing!r}; accepted: None, a Mixing, or one of {MIXING_KINDS}")
