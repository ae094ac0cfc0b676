"""Which captured stderr lines are native log lines a quiet `ktx` start holds back, and a
filter process that writes the others back (`python stderr_filter.py LEVEL`).

Standalone (the standard library only), so that `ktx.cli.quiet.native_stderr` can run it
with `python -S -E` as the reader of the pipe it puts on file descriptor 2: a line written
just before the process dies inside the capture (libtpu exits on a flag it does not know,
from inside JAX's backend initialisation) still reaches the terminal, since the filter
outlives the process and writes back what it read when the pipe closes.
"""

from __future__ import annotations

import re
import sys

# absl / TensorFlow native log lines: `I0000 00:00:1796189708.809523    6032 port.cc:153] ...`.
ABSL_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+(?:\.\d+)?\s+\d+ [\w./+-]+:\d+\]")
# Lines printed around them, without a severity of their own (held back as info).
PREAMBLES = (
    "WARNING: All log messages before absl::InitializeLog() is called",
    "WARNING: Logging before InitGoogle() is written to STDERR",
    "Failed to find host bounds for accelerator type",
    "=== Source Location Trace: ===",
    "To enable the following instructions:",
)
SOURCE_LOCATION = re.compile(r"^[\w./+-]+\.(cc|h|cpp):\d+$")
SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}


def held_back(line: str, level: int) -> bool:
    """Whether `line` is a native log line below `level` (0: none is)."""
    m = ABSL_LINE.match(line)
    if m:
        return SEVERITY[m.group(1)] < level
    if line.startswith(PREAMBLES) or SOURCE_LOCATION.match(line.strip()):
        return level > 0
    return False


def main(level: int) -> None:
    out = sys.stdout.buffer
    for raw in sys.stdin.buffer:
        if not held_back(raw.decode("utf-8", "replace").rstrip("\n"), level):
            out.write(raw)
            out.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]))
