"""The number of tasks T of a balancer, and checks shared by the balancers.

optax's `init` only sees the parameters, but a stateful balancer holds one value per task
(moving norms, learnable weights), so its factory takes `num_tasks=` (gin files bind it
from the model's `NUM_TASKS` macro: `optim.metabalance.num_tasks = %NUM_TASKS`).
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "resolve_num_tasks",
    "task_index",
    "check_task_index",
    "check_state_tasks",
    "non_negative",
    "present_tasks",
]

def resolve_num_tasks(num_tasks: int | None, method: str) -> int:
    """`num_tasks` as a positive int; a ValueError naming the fix when it is unset."""
    if num_tasks is None:
        raise ValueError(
            f"{method}.init: the number of tasks is unknown; pass {method}(num_tasks=T) "
            f"(gin: `optim.{method}.num_tasks = %NUM_TASKS`, as gin/optim/{method}.gin does)"
        )
    try:
        t = None if isinstance(num_tasks, bool) else operator.index(num_tasks)
    except TypeError:  # a float, a string, a traced value
        t = None
    if t is None or t < 1:
        raise ValueError(f"{method}: num_tasks={num_tasks!r}; expected a positive int")
    return t


def task_index(value: Any, name: str, method: str, allow_none: bool = False):
    """A task index given as any integer type (`int`, `np.int64`, a 0-d integer array):
    returned as a Python int; a traced 0-d integer (e.g. `optax.inject_hyperparams` feeds
    numeric hyper-parameters as arrays) is returned as is. ValueError/TypeError otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, jax.core.Tracer):
        if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(f"{method}: {name}={value!r}; expected an integer scalar")
        return value
    if isinstance(value, bool):
        raise TypeError(f"{method}: {name}={value!r}; expected an int >= 0, not a bool")
    try:
        index = operator.index(value)
    except TypeError as e:
        raise TypeError(f"{method}: {name}={value!r}; expected an int >= 0") from e
    if index < 0:
        raise ValueError(f"{method}: {name}={value!r}; expected an int >= 0")
    return index


def check_task_index(index: Any, num_tasks: int, name: str, method: str) -> None:
    """ValueError if a concrete `index` is not below `num_tasks` (traced ones pass)."""
    if isinstance(index, int) and index >= num_tasks:
        raise ValueError(f"{method}: {name}={index} but num_tasks={num_tasks}")


def check_state_tasks(method: str, state_tasks: int, grad_tasks: int) -> None:
    """ValueError when the state was built for another number of tasks than the gradients
    carry (init's `num_tasks=` disagrees with the per-task gradients)."""
    if state_tasks != grad_tasks:
        raise ValueError(
            f"{method}: the state was initialised for {state_tasks} tasks but the per-task "
            f"gradients have {grad_tasks}; build it with {method}(num_tasks={grad_tasks}) "
            f"(gin: NUM_TASKS = {grad_tasks})"
        )


def non_negative(value: Any, name: str, method: str):
    """`value` (a number, or a traced array left unchecked) if it is >= 0, else ValueError."""
    if isinstance(value, jax.core.Tracer):
        return value
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{method}: {name}={value!r} is not a number") from e
    if not v >= 0:
        raise ValueError(f"{method}: {name}={value!r}; expected a number >= 0")
    return value


def present_tasks(task_present: Any, num_tasks: int, method: str, default: jax.Array) -> jax.Array:
    """`[T]` bool: which tasks have rows in this batch.

    `task_present` (the trainer's `[T]` "rows of the task > 0") when given, else `default`
    (the method's inference, e.g. "every gradient of the task is exactly zero" -> absent).
    """
    if task_present is None:
        return jnp.asarray(default).astype(bool)
    present = jnp.asarray(task_present)
    if present.shape != (num_tasks,):
        raise ValueError(
            f"{method}: task_present has shape {present.shape}; expected ({num_tasks},)")
    return present.astype(bool)
