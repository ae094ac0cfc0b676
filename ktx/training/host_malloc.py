"""glibc malloc settings for XLA's CPU backend: freed memory is kept for the next step.

XLA:CPU allocates each executable's temporary buffer (activations, gradients, optimizer
temporaries: tens of MiB for a small model) with `malloc` on every call and frees it when
the call ends. Under glibc's defaults that buffer is a fresh `mmap` on many calls: above
the mmap threshold (dynamic, at most 32 MiB), or in a thread's arena whose empty heap glibc
unmapped at the last `free`. Every page of a fresh mapping is a page fault the kernel
zero-fills, on every step. Measured on a 2-core CPU (`docs/balancing.md`, "Page faults"):

* the recommendation model's step (27.5 MB of temporaries) took 0 to 2,900 faults a step,
  by the allocator's history rather than by the step: a GradNorm step 9.7 ms with 2,865
  faults and 5.3 ms of system time, 6.6 ms with none;
* T5.1.1-tiny's step (79 MB of temporaries, more than a thread arena's 64 MiB heap) took
  19,330 faults and 35 ms of system time in a 48 ms step, every step.

`configure(mode)` sets glibc's `mallopt` parameters in this process:

* `"keep"` (the default): no `mmap` for large allocations (`M_MMAP_MAX=0`), never give the top
  of a heap back (`M_TRIM_THRESHOLD` at its largest) and keep 128 MiB of padding, which
  also keeps a thread arena's empty heaps mapped (`M_TOP_PAD`). Freed memory is reused,
  and the process holds its peak. An allocation larger than a thread arena's 64 MiB
  heap is still a fresh mapping when a thread other than the main one makes it (glibc
  falls back to `mmap` there).
* `"single_arena"`: `"keep"` and one arena for every thread (`M_ARENA_MAX=1`), so that
  allocations above 64 MiB come from the main heap too: T5.1.1-tiny's step 48 -> 31 ms,
  no faults; but the recommendation step 6.6-7.4 -> 8.6-9.4 ms, without faults either way.
* `"system"`: glibc's defaults, untouched.

The CLI applies `$KTX_HOST_MALLOC` (default `"keep"`) to `ktx train | eval | infer` when
JAX's default backend is the CPU; the library never calls it on its own (a notebook
calls `configure()` itself). Only glibc has these parameters: elsewhere (macOS, musl)
`configure` does nothing and says so in its result.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MODES", "configure", "configure_on_cpu", "mode_from_env"]

ENV = "KTX_HOST_MALLOC"
MODES = ("keep", "single_arena", "system")

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_INT_MAX = 2**31 - 1  # mallopt takes a C int
_TOP_PAD = 128 << 20  # >= 2 x a thread arena's 64 MiB heap: glibc then never unmaps one

_applied: str | None = None


def mode_from_env() -> str:
    """`$KTX_HOST_MALLOC`, checked; `"keep"` when unset or empty."""
    mode = os.environ.get(ENV, "").strip() or "keep"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}; accepted: {', '.join(MODES)}")
    return mode


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        return libc
    except (AttributeError, OSError):  # not glibc (macOS, musl) or no symbol table
        return None


def configure(mode: str | None = None) -> str:
    """Applies `mode` (`MODES`; None: `$KTX_HOST_MALLOC`, default `"keep"`) to this
    process's glibc malloc and returns what holds now: the mode, or `"system"` where the
    C library is not glibc. Settings stay for the life of the process; a second call
    with another mode than the first raises (glibc cannot return to its dynamic
    defaults)."""
    global _applied
    mode = mode_from_env() if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"host malloc mode {mode!r}; accepted: {', '.join(MODES)}")
    if _applied is not None:
        if mode != _applied:
            raise ValueError(f"host malloc already set to {_applied!r} in this process; "
                             f"{mode!r} cannot replace it")
        return _applied
    if mode == "system":
        _applied = mode
        return mode
    libc = _glibc()
    if libc is None:
        return "system"
    settings = [(_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_TOP_PAD, _TOP_PAD)]
    if mode == "single_arena":
        settings.append((_M_ARENA_MAX, 1))
    for param, value in settings:
        if libc.mallopt(param, value) != 1:
            raise OSError(f"mallopt({param}, {value}) failed: glibc rejected host malloc "
                          f"mode {mode!r}; set {ENV}=system")
    _applied = mode
    return mode


def configure_on_cpu() -> str | None:
    """`configure()` where JAX's default backend is the CPU (what the CLI and the CPU
    benchmarks run); None elsewhere. `$KTX_HOST_MALLOC` is checked on every backend."""
    import jax

    mode = mode_from_env()
    return configure(mode) if jax.default_backend() == "cpu" else None
