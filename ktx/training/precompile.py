"""Ahead-of-time compilation of the real train step for a TPU topology, without TPUs.

`precompile(model, optimizer, topology="v4:4x4x4", ...)` builds the (data, model) mesh
over the topology's devices (`jax.experimental.topologies.get_topology_desc`, which needs
`libtpu`: `pip install 'ktx[tpu]'`), the sharded abstract train state and batch, and
lowers and compiles `ktx.training.trainer.train_step` exactly as `ktx train` would run it (same
model, conditioning, balancer, optimizer, partitioning rules, batch and lengths). XLA's
analyses then give, per chip, the memory of the arguments (train state and batch), the
outputs, the temporaries, and the FLOPs of one step; the report compares the total with
the chip's HBM and predicts the step time at the chip's peak.

`topology="cpu"` compiles for this process's devices instead (no libtpu needed): the
same code path, used by the tests.

`precompile_in_child(setup, args, timeout=...)` runs `precompile(**setup(*args))` in a
spawned child process, so that a compiler that crashes (libtpu's has died with SIGSEGV)
or runs over the time limit becomes a `CompileDiedError` naming the topology, the mesh
and the signal or the limit, instead of taking the caller down with it.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from ktx import partitioning
from ktx.models.base import BaseModel
from ktx.training.hlo_cost import step_flops
from ktx.training.trainer import Trainer

__all__ = [
    "CHIPS", "CompileDiedError", "DoesNotFitError", "PrecompileReport", "TEST_CHILD_ENV", "precompile",
    "cost_analysis", "libtpu_init_args", "precompile_in_child", "topology_devices",
]


class DoesNotFitError(RuntimeError):
    """XLA refused the compile: the step needs more device memory than the chip has (the
    message gives XLA's figures: required vs available)."""


class CompileDiedError(RuntimeError):
    """The compile's child process died (killed by a signal: the compiler crashed) or ran
    over its time limit and was stopped; the message names the topology, the mesh and how.
    `signal` is the signal's name (`"SIGSEGV"`) or None for a timeout; `timeout` the limit
    in seconds when it ran over."""

    def __init__(self, message: str, *, signal: str | None = None, timeout: float | None = None):
        super().__init__(message)
        self.signal = signal
        self.timeout = timeout


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip HBM and dense bfloat16 peak (the vendor's published figures)."""

    hbm_gib: float
    peak_tflops: float


# Cloud TPU system architecture pages: v4 32 GiB / 275 TFLOP/s, v5e 16 GiB / 197,
# v5p 95 GiB / 459, v6e (Trillium) 32 GiB / 918 (bf16 dense).
CHIPS = {
    "v4": Chip(32, 275.0),
    "v5e": Chip(16, 197.0),
    "v5p": Chip(95, 459.0),
    "v6e": Chip(32, 918.0),
}


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
    """What one compiled step needs on each chip (bytes) and costs (FLOPs)."""

    topology: str
    num_devices: int
    mesh_shape: dict[str, int]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops_per_step: float | None
    hbm_bytes: int | None
    peak_flops: float | None
    compile_seconds: float
    task_layout: str | None = None  # a balanced step: how it takes per-task gradients
    xla_flops: float | None = None  # XLA's cost analysis: loop bodies once
    matmul_flops: float | None = None  # matmuls, loops by their trip counts
    # XLA's peak of the buffers live at once (its buffer assignment's heap simulation,
    # arguments included); None where the compiler gives none. The total above is what
    # the compiler reserves, and so what must fit.
    live_peak_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        """Peak per-chip footprint: arguments + outputs not aliased to (donated)
        arguments + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.hbm_bytes is None else self.total_bytes <= self.hbm_bytes

    @property
    def predicted_step_seconds(self) -> float | None:
        if self.flops_per_step is None or self.peak_flops is None:
            return None
        return self.flops_per_step / self.peak_flops

    def format(self) -> str:
        gib = 2.0 ** 30

        def g(b):
            return f"{b / gib:8.3f} GiB"

        lines = [
            f"topology {self.topology}: {self.num_devices} devices, mesh "
            + " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
            + f" (compiled in {self.compile_seconds:.1f} s)",
            f"  arguments   {g(self.argument_bytes)}  (train state + batch, per device)",
            f"  outputs     {g(self.output_bytes)}  ({g(self.alias_bytes).strip()} aliased to donated arguments)",
            f"  temporaries {g(self.temp_bytes)}",
            f"  total       {g(self.total_bytes)}"
            + ("" if self.hbm_bytes is None else f"  of {g(self.hbm_bytes).strip()} HBM"),
        ]
        if self.live_peak_bytes:
            lines.append(f"  live peak   {g(self.live_peak_bytes)}  (the most the step's buffers "
                         f"hold at once, by XLA's buffer assignment)")
        if self.flops_per_step is not None:
            line = f"  FLOPs/step  {self.flops_per_step:.4g} per device"
            if self.predicted_step_seconds is not None:
                t = self.predicted_step_seconds
                line += (f"; at peak {t * 1e3:.2f} ms/step" if t >= 1e-4
                         else f"; at peak {t * 1e6:.2f} us/step")
            lines.append(line)
            if self.xla_flops is not None and self.matmul_flops is not None:
                lines.append(f"              (the larger of: matmuls, loops by their trip "
                             f"counts, {self.matmul_flops:.4g}; XLA's cost analysis, loop "
                             f"bodies once, {self.xla_flops:.4g})")
        if self.task_layout:
            lines.append(f"  per-task    {self.task_layout}")
        if self.fits is False:
            lines.append(f"  DOES NOT FIT: {g(self.total_bytes - self.hbm_bytes).strip()} over the HBM")
        elif self.fits:
            lines.append("  fits")
        return "\n".join(lines)


def cost_analysis(compiled: Any) -> dict[str, float] | None:
    """XLA's cost analysis of a compiled computation (`flops`, `bytes accessed`, ...), None
    when XLA gives none; older jax returns one dict per computation, of which the first is
    the entry's."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return cost


def _chip(topology: str) -> Chip | None:
    return CHIPS.get(topology.split(":")[0].lower())


def topology_devices(topology: str) -> list[Any]:
    """The devices of a named TPU topology (`"v4:4x4x4"`, `"v5e:16x16"`, ...) for an
    ahead-of-time compile, or this process's devices for `"cpu"`."""
    if topology == "cpu":
        return list(jax.devices())
    if ":" not in topology:
        raise ValueError(f"topology={topology!r}; accepted: 'cpu' or a TPU topology such as "
                         f"'v4:4x4x4', 'v5e:16x16' (chips: {sorted(CHIPS)})")
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover - present in every supported jax
        raise RuntimeError(f"jax.experimental.topologies is unavailable: {e}") from e
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", _accelerator_type(topology))
    # An ahead-of-time compile opens no chip, so libtpu's one-process-per-host lockfile
    # does not apply: without this, a compile in a child process (`precompile_in_child`)
    # of a process that has loaded libtpu fails ("libtpu multi-process lockfile").
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ["LIBTPU_INIT_ARGS"] = libtpu_init_args(os.environ.get("LIBTPU_INIT_ARGS", ""))
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # noqa: BLE001 - libtpu missing or an unknown topology
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"cannot build TPU topology {topology!r} ({text}); ahead-of-time TPU compiles "
            "need libtpu: pip install 'ktx[tpu]' (or jax[tpu] at the pinned jax version)"
        ) from e
    return list(desc.devices)


# libtpu's TPU compiler runs its work units on fibers, whose stacks are small by default;
# its convolution emitter's cost model recurses (`FusedSpatialMajorConvolution::
# MakeConvWindows` <- `CalculateClassicConvWindowsCost` <- `EstimateFusionCost` <- ..., frames
# of 9-18 KB) deep enough on T5.1.1 XL/XXL steps to overflow one: a SIGSEGV "stack
# overflow" in the compiler (libtpu 0.0.42.1; XL plain on v4-32 8 x 4 crashed 3 of 3 tries
# with the default and compiled with 64 MiB fiber stacks). The stacks are mapped, not
# committed: only the pages a fiber touches cost memory.
FIBER_STACK_FLAG = "--fibers_default_thread_stack_size"
FIBER_STACK_BYTES = 64 << 20


def libtpu_init_args(current: str) -> str:
    """`LIBTPU_INIT_ARGS` for an ahead-of-time compile: `current` with libtpu's fiber
    stacks raised to `FIBER_STACK_BYTES`, unless `current` already sets their size (a
    user's value is kept)."""
    if any(arg.split("=", 1)[0] == FIBER_STACK_FLAG for arg in current.split()):
        return current
    return f"{current} {FIBER_STACK_FLAG}={FIBER_STACK_BYTES}".strip()


def _num_chips(topology: str) -> int | None:
    try:
        return math.prod(int(d) for d in topology.split(":", 1)[1].split("x"))
    except (IndexError, ValueError):
        return None


def _accelerator_type(topology: str) -> str:
    """`"v4:4x4x4"` -> `"v4-128"` (TPU_ACCELERATOR_TYPE; silences libtpu's warnings).
    v4 and v5p count TensorCores (2 per chip), v5e and v6e chips."""
    chip, dims = topology.split(":", 1)
    try:
        chips = math.prod(int(d) for d in dims.split("x"))
    except ValueError:
        return chip
    per_chip = 2 if chip.lower() in ("v4", "v5p") else 1
    return f"{chip.lower().replace('v5e', 'v5litepod')}-{chips * per_chip}"


def abstract_inputs(mesh: Any, spec: Mapping[str, Any]) -> tuple[dict, Any]:
    """A step's abstract batch (`spec`'s shapes and dtypes split over `mesh`'s `data` axis)
    and its replicated rng key, for `Trainer.lower_train_step` without arrays."""
    data = partitioning.data_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=data) for k, v in spec.items()}
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                               sharding=partitioning.replicated_sharding(mesh))
    return batch, rng


def equal_task_counts(num_tasks: int, batch_size: int) -> tuple[int, ...]:
    """`batch_size` rows shared equally by `num_tasks` tasks (the first ones one more)."""
    t = num_tasks
    return tuple(batch_size // t + (1 if i < batch_size % t else 0) for i in range(t))


def check_task_counts(task_counts: Any, num_tasks: int, batch_size: int) -> tuple[int, ...]:
    """The rows per task a balanced step is compiled for: `task_counts` (gin
    `PRECOMPILE_TASK_COUNTS`) checked, or equal counts when None; ValueError naming the
    macro and what it accepts."""
    if task_counts is None:
        return equal_task_counts(num_tasks, batch_size)
    if (not isinstance(task_counts, (list, tuple)) or len(task_counts) != num_tasks
            or not all(isinstance(c, (int, np.integer)) and c >= 0 for c in task_counts)
            or sum(task_counts) != batch_size):
        raise ValueError(
            f"PRECOMPILE_TASK_COUNTS={task_counts!r}; accepted: {num_tasks} row counts (one per "
            f"task, ints >= 0) summing to BATCH_SIZE={batch_size}, e.g. "
            f"{list(equal_task_counts(num_tasks, batch_size))}")
    return tuple(int(c) for c in task_counts)


def precompile(
    model: BaseModel,
    optimizer: optax.GradientTransformation,
    *,
    topology: str,
    batch_size: int,
    task_feature_lengths: Mapping[str, int] | None,
    num_partitions: int = 1,
    balancer: Any = None,
    num_microbatches: int = 1,
    grad_method: str = "auto",
    shared: Sequence[str] | None = None,
    additional_rules: Sequence[tuple[str, str | None]] = (),
    parameter_partitioning_dims: int = 1,
    target_task: int = 0,
    weights_from_losses: bool = True,
    task_grad_dtype: str | None = None,
    task_counts: Sequence[int] | None = None,
    on_compile: Callable[[dict[str, int]], None] | None = None,
) -> PrecompileReport:
    """Lowers and compiles one train step for `topology`; see the module docstring.

    The batch is `model.input_spec(batch_size, task_feature_lengths)`; a balanced step is
    compiled for `task_counts` rows of each task (gin `PRECOMPILE_TASK_COUNTS`; None: equal
    counts, within one row), as `ktx train`'s step takes its per-task gradients for them
    (`Trainer.lower_train_step(task_counts=...)`: device by device, or task blocks rounded
    up to the `data` axis; the report's `task_layout` says which).
    `on_compile(mesh_shape)` is called once the step is lowered, just before XLA compiles it.
    """
    devices = topology_devices(topology)
    mesh = partitioning.create_mesh(num_partitions, devices=devices)
    rules = partitioning.standard_logical_axis_rules(additional_rules, parameter_partitioning_dims)
    trainer = Trainer(model, optimizer, mesh=mesh, rules=rules, balancer=balancer,
                      num_microbatches=num_microbatches, grad_method=grad_method, shared=shared,
                      diagnostics_period=100, target_task=target_task,
                      weights_from_losses=weights_from_losses,
                      task_grad_dtype=task_grad_dtype)
    spec = model.input_spec(batch_size, task_feature_lengths)
    abstract_state, _ = trainer.create_abstract_state(spec)
    batch, rng = abstract_inputs(mesh, spec)
    counts = None
    if balancer is not None and num_microbatches == 1:
        counts = check_task_counts(task_counts, model.num_tasks, batch_size)
    start = time.perf_counter()
    lowered = trainer.lower_train_step(abstract_state, batch, rng, task_counts=counts)
    layout = None
    if counts is not None:
        capacity = trainer._capacity_for(counts)  # what the lowered step was built for
        if capacity is None:
            how = "loss-weighted shortcut (no per-task gradients)"
        elif capacity[0] != "devices":
            how = f"task blocks of {tuple(capacity)} rows"
        elif capacity[1] == 1:
            how = "device by device, one task on each device"
        else:
            how = f"device by device, up to {capacity[1]} tasks on a device"
        layout = f"task counts {counts}: {how}"
    if on_compile is not None:
        on_compile(dict(mesh.shape))
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - XLA reports out-of-memory as a runtime error
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text:
            line = next((ln for ln in text.splitlines() if "memory" in ln), text.splitlines()[0])
            raise DoesNotFitError(
                f"topology {topology} (mesh {dict(mesh.shape)}, batch {batch_size}): does not fit: "
                f"{line.strip()}") from e
        raise
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    flops, xla, matmuls = step_flops(compiled)
    chip = _chip(topology)
    # Per device: a chip's HBM and peak shared by the devices JAX exposes per chip.
    chips = _num_chips(topology)
    share = 1.0 if chips is None else chips / len(devices)
    return PrecompileReport(
        topology=topology,
        num_devices=len(devices),
        mesh_shape=dict(mesh.shape),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        flops_per_step=flops,
        hbm_bytes=None if chip is None else int(chip.hbm_gib * 2 ** 30 * share),
        peak_flops=None if chip is None else chip.peak_tflops * 1e12 * share,
        compile_seconds=seconds,
        task_layout=layout,
        xla_flops=xla,
        matmul_flops=matmuls,
        live_peak_bytes=int(getattr(memory, "peak_memory_in_bytes", 0)) or None,
    )



# Test-only: the tests set this in their own environment (inherited by the child) to make
# the compile's child process die where a crashing compiler would: "SIGSEGV" or "SIGKILL"
# (it sends itself that signal once the step is lowered), "hang" (it sleeps instead of
# compiling, for the time limit). Nothing else reads or sets it.
TEST_CHILD_ENV = "KTX_TEST_PRECOMPILE_CHILD"
_TEST_ACTIONS = ("SIGSEGV", "SIGKILL", "hang")


def _on_compile_in_child(mesh_shape: dict[str, int], conn) -> None:
    """Tells the parent the mesh; then the test-only hook (`TEST_CHILD_ENV`)."""
    conn.send(("compiling", mesh_shape))
    action = os.environ.get(TEST_CHILD_ENV)
    if not action:
        return
    if action not in _TEST_ACTIONS:
        raise ValueError(f"{TEST_CHILD_ENV}={action!r}; accepted: {', '.join(_TEST_ACTIONS)} (tests only)")
    if action == "hang":
        time.sleep(3600)
    else:
        os.kill(os.getpid(), getattr(signal, action))


def _child_main(conn, setup: Callable[..., dict[str, Any]], args: tuple) -> None:
    """The child: `precompile(**setup(*args))`; sends `("compiling", mesh_shape)` once
    lowered, then `("report", report)`, `("does_not_fit", message)` or `("error", exc, tb)`."""
    try:
        kwargs = setup(*args)
        report = precompile(**kwargs, on_compile=lambda mesh: _on_compile_in_child(mesh, conn))
        conn.send(("report", report))
    except DoesNotFitError as e:
        conn.send(("does_not_fit", str(e)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        try:
            conn.send(("error", e, tb))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}"), tb))
    finally:
        conn.close()


def _mesh_text(mesh_shape: dict[str, int] | None, num_partitions: int) -> str:
    if mesh_shape is None:
        return f"mesh data x model={num_partitions}, not built yet"
    return "mesh " + " x ".join(f"{k}={v}" for k, v in mesh_shape.items())


def precompile_in_child(
    setup: Callable[..., dict[str, Any]],
    args: tuple = (),
    *,
    topology: str,
    num_partitions: int = 1,
    timeout: float | None = None,
) -> PrecompileReport:
    """`precompile(**setup(*args))` in a child process (the spawn start method: a fresh
    interpreter, no state shared with this one); returns its report.

    `setup` and `args` must pickle (a module-level function: it parses the configuration
    in the child and returns `precompile`'s keyword arguments, `topology` included);
    `topology` and `num_partitions` only name the run in errors. Raises the child's
    `DoesNotFitError` (same message) or other exception (its traceback added as a note),
    or `CompileDiedError` when the child is killed by a signal or runs over `timeout`
    seconds (counted from its start: tracing, lowering and compiling), after which it is
    killed.
    """
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout={timeout!r}; accepted: seconds > 0, or None for no limit")
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(send, setup, args), name="ktx-precompile")
    child.start()
    send.close()
    deadline = None if timeout is None else time.monotonic() + timeout
    mesh_shape = None
    result = None
    timed_out = False
    try:
        while result is None:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not multiprocessing.connection.wait([receive], left):
                timed_out = True
                break
            try:
                message = receive.recv()
            except EOFError:  # the child died without a word
                break
            if message[0] == "compiling":
                mesh_shape = message[1]
            else:
                result = message
        where = f"topology {topology} ({_mesh_text(mesh_shape, num_partitions)})"
        if timed_out:
            child.kill()
            child.join()
            raise CompileDiedError(
                f"{where}: the compile ran over the time limit of {timeout:g} s and was stopped",
                timeout=timeout)
        if result is None:
            child.join()
            code = child.exitcode
            if code is not None and code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"signal {-code}"
                raise CompileDiedError(
                    f"{where}: the compiler's process was killed by {name} (signal {-code}): "
                    "a compiler crash, no figures", signal=name)
            raise CompileDiedError(f"{where}: the compile's process exited with status {code} "
                                   "without a report")
    finally:
        receive.close()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    kind = result[0]
    if kind == "report":
        return result[1]
    if kind == "does_not_fit":
        raise DoesNotFitError(result[1])
    error, tb = result[1], result[2]
    error.add_note(f"in the compile's child process:\n{tb}")
    raise error
