"""`ktx.training.host_malloc`: glibc keeps freed host memory for the next step.

Each case runs in a child process: the settings are process-wide and cannot be undone.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from ktx.training import host_malloc

GLIBC = host_malloc._glibc() is not None
needs_glibc = pytest.mark.skipif(not GLIBC, reason="mallopt parameters exist only in glibc")

# Allocates, fills and frees a 48 MB buffer 20 times (above glibc's largest mmap
# threshold, 32 MiB), on the main thread and on one other thread (a thread arena, as
# XLA's executor thread allocates), and prints the minor page faults of the last 10.
_CHILD = textwrap.dedent("""
    import ctypes, resource, sys, threading
    from ktx.training import host_malloc

    print(host_malloc.configure(sys.argv[1]))
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)

    def churn(out, key):
        for i in range(20):
            if i == 10:
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            p = libc.malloc(48 << 20)  # as XLA's temporary buffer: malloc, write, free
            ctypes.memset(p, 1, 48 << 20)
            libc.free(p)
        out[key] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) // 10

    out = {}
    churn(out, "main")
    t = threading.Thread(target=churn, args=(out, "thread"))
    t.start(); t.join()
    print(out["main"], out["thread"])
""")


def _child(mode):
    env = dict(os.environ, KTX_HOST_MALLOC="")
    r = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    applied, counts = r.stdout.split("\n")[:2]
    main, thread = (int(c) for c in counts.split())
    return applied, main, thread


@needs_glibc
def test_keep_reuses_freed_memory_where_the_defaults_map_it_afresh():
    pages = (48 << 20) // 4096
    applied, main, thread = _child("system")
    assert applied == "system"
    assert main > pages // 2  # glibc's defaults: a fresh mapping, every page faulted
    applied, main, thread = _child("keep")
    assert applied == "keep"
    assert main < pages // 20 and thread < pages // 20


@needs_glibc
def test_single_arena_also_keeps_a_thread_s_memory():
    applied, main, thread = _child("single_arena")
    assert applied == "single_arena"
    assert main < 1000 and thread < 1000


def test_mode_from_env_names_the_variable_and_the_accepted_values(monkeypatch):
    monkeypatch.setenv("KTX_HOST_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match=r"KTX_HOST_MALLOC='jemalloc'; accepted: keep, "
                                         r"single_arena, system"):
        host_malloc.mode_from_env()
    monkeypatch.setenv("KTX_HOST_MALLOC", "")
    assert host_malloc.mode_from_env() == "keep"
    with pytest.raises(ValueError, match="accepted: keep, single_arena, system"):
        host_malloc.configure("fast")


@needs_glibc
@pytest.mark.parametrize("first,second", [("keep", "system"), ("system", "single_arena")])
def test_a_second_mode_in_one_process_is_refused(first, second):
    code = (f"from ktx.training import host_malloc as h; h.configure({first!r}); "
            f"print(h.configure({first!r})); h.configure({second!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == first
    assert (f"host malloc already set to {first!r} in this process; {second!r} cannot "
            "replace it") in r.stderr


def test_ktx_train_reports_a_bad_mode_in_one_line(tmp_path):
    env = dict(os.environ, KTX_HOST_MALLOC="fast", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "ktx", "train", "--gin_file=runs/quickstart.gin",
                        f"--gin.MODEL_DIR='{tmp_path / 'run'}'"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    assert "KTX_HOST_MALLOC='fast'; accepted: keep, single_arena, system" in r.stderr
    assert "Traceback" not in r.stderr
