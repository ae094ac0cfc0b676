"""How a balancer's `init(params)` learns the number of tasks T.

optax's `init` only sees the parameters, but balancer state holds one value per task
(moving norms, learnable weights). A factory takes `num_tasks=` explicitly; when it is
left unset (gin files usually leave it), `init` reads it from `num_tasks_scope`, which
the trainer opens around `tx.init(params)`:

    with ktx.optim.num_tasks_scope(model.num_tasks):
      opt_state = tx.init(params)
"""

from __future__ import annotations

import contextlib
import contextvars

__all__ = ["num_tasks_scope", "resolve_num_tasks"]

_NUM_TASKS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "ktx_optim_num_tasks", default=None
)


@contextlib.contextmanager
def num_tasks_scope(num_tasks: int):
    """Within this block, balancer `init` calls without `num_tasks=` use `num_tasks`."""
    if not isinstance(num_tasks, int) or isinstance(num_tasks, bool) or num_tasks < 1:
        raise ValueError(f"num_tasks_scope(num_tasks={num_tasks!r}): expected a positive int")
    token = _NUM_TASKS.set(num_tasks)
    try:
        yield num_tasks
    finally:
        _NUM_TASKS.reset(token)


def resolve_num_tasks(num_tasks: int | None, method: str) -> int:
    """`num_tasks` if given, else the enclosing `num_tasks_scope`, else a ValueError."""
    if num_tasks is None:
        num_tasks = _NUM_TASKS.get()
    if num_tasks is None:
        raise ValueError(
            f"{method}.init: the number of tasks is unknown; pass {method}(num_tasks=...) "
            "(gin: bind it) or call init inside `with ktx.optim.num_tasks_scope(T):`"
        )
    if not isinstance(num_tasks, int) or isinstance(num_tasks, bool) or num_tasks < 1:
        raise ValueError(f"{method}: num_tasks={num_tasks!r}; expected a positive int")
    return num_tasks
