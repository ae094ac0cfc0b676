"""The environment of a process a test starts with its own number of CPU devices."""

from __future__ import annotations

import os
import re


def with_devices(devices: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default: this process's) whose XLA_FLAGS give `devices` CPU devices
    and otherwise keep the test session's flags (tests/conftest.py: LLVM at -O0)."""
    env = dict(os.environ if env is None else env)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    return env
