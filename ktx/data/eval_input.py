"""A task's evaluation split as global batches of fixed size, in order: this process's rows.

Evaluation reads every example once, in stored order (`MultiTaskInput.eval_batches`):
every global batch has `batch_size` rows, the last one padded with zero rows (loss
weights 0, the task's `task_id`), so one compiled evaluation step serves the whole split;
each process feeds its contiguous `batch_size / P` rows of each global batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from ktx.data import feature_converter as fc

__all__ = ["padded_batches"]


def padded_batches(arrays: Mapping[str, np.ndarray], task_id: int, batch_size: int,
                   process_index: int, process_count: int
                   ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """Yields `(batch, num_real)`: this process's rows of each global batch of `arrays`
    (compact rows with `task_id`), and the number of real rows of the global batch,
    which come first."""
    if batch_size < 1 or batch_size % process_count:
        raise ValueError(
            f"batch_size={batch_size!r}; accepted: an int >= 1 divisible by process_count={process_count}"
        )
    n = arrays["task_id"].shape[0]
    local = batch_size // process_count
    lo = process_index * local
    for start in range(0, n, batch_size):
        chunk = {k: v[start:start + batch_size] for k, v in arrays.items()}
        num_real = chunk["task_id"].shape[0]
        padded = fc.pad_rows(chunk, batch_size)
        padded["task_id"][:] = task_id
        yield fc.widen({k: v[lo:lo + local] for k, v in padded.items()}), num_real
