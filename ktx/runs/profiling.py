"""`ProfileWindow`: a `jax.profiler` trace of training steps `[start, stop)` of a run.

`ktx train --gin.PROFILE_STEPS="(100, 110)"` (`train_script.train.profile_steps`) traces
the steps from `start` (the update from batch `start`) up to, not including, `stop`:
the trace begins just before step `start` is dispatched and ends once step `stop - 1`'s
state is ready on the devices. It goes under `<MODEL_DIR>/profile/` (one folder per
process on many: `profile/process_<i>/`) as JAX writes it, readable by TensorBoard's
profile plugin (`tensorboard --logdir MODEL_DIR`, `plugins/profile/<time>/*.xplane.pb`)
and by Perfetto (`perfetto_trace.json.gz` beside it, https://ui.perfetto.dev). The
steps themselves are unchanged; blocks of `steps_per_call` steps end at `start` and
`stop`. A resumed run past `start` traces from its first step up to `stop`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

__all__ = ["ProfileWindow", "check_profile_steps"]


def check_profile_steps(profile_steps: Any, train_steps: int) -> tuple[int, int] | None:
    """`(start, stop)` with `0 <= start < stop <= train_steps`, or None; a ValueError
    naming the binding and what is accepted otherwise."""
    if profile_steps is None:
        return None
    ok = (isinstance(profile_steps, Sequence) and not isinstance(profile_steps, str)
          and len(profile_steps) == 2
          and all(isinstance(s, int) and not isinstance(s, bool) for s in profile_steps))
    if ok:
        start, stop = profile_steps
        if 0 <= start < stop <= train_steps:
            return int(start), int(stop)
    raise ValueError(
        f"profile_steps={profile_steps!r} is not a window of this run's "
        f"steps 0..{train_steps}; accepted: None, or (start, stop) with "
        f"0 <= start < stop <= TRAIN_STEPS={train_steps}")


class ProfileWindow:
    """Starts and stops the trace at the loop's block boundaries.

    Args:
      steps: `(start, stop)` from `check_profile_steps`, or None (no trace).
      directory: the run directory; the trace goes under `profile/`.
      process_index, process_count: on many processes each writes its own folder.
    """

    def __init__(self, steps: tuple[int, int] | None, directory: Any, *,
                 process_index: int = 0, process_count: int = 1):
        self.steps = steps
        folder = pathlib.Path(directory) / "profile"
        self.directory = folder / f"process_{process_index}" if process_count > 1 else folder
        self.active = False

    def boundary(self, done: int) -> bool:
        """A block of steps must end after step `done - 1` (the window's edges)."""
        return self.steps is not None and done in self.steps

    def before(self, step: int) -> None:
        """The loop is about to dispatch step `step`."""
        if self.steps is None or self.active:
            return
        start, stop = self.steps
        if start <= step < stop:
            import jax

            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def after(self, done: int, state: Any) -> None:
        """Steps up to `done - 1` are dispatched; ends the trace once they ran."""
        if self.active and done >= self.steps[1]:
            import jax

            jax.block_until_ready(state)
            self.close()
            if jax.process_index() == 0:
                print(f"Profile of steps {self.steps[0]}..{self.steps[1] - 1}: {self.directory} "
                      "(TensorBoard's profile plugin; perfetto_trace.json.gz for Perfetto)",
                      flush=True)

    def close(self) -> None:
        if self.active:
            import jax

            self.active = False
            jax.profiler.stop_trace()
