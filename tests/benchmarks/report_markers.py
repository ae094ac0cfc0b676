"""Writing a generated report into a hand-written markdown file, between two markers."""

from __future__ import annotations

import pathlib


def write_between(path: pathlib.Path, begin: str, end: str, lines: list[str]) -> None:
    """Writes `lines` between the `begin` and `end` markers of `path`, keeping the
    hand-written text around them (a new file holds the markers and the lines)."""
    block = "\n".join([begin, *lines, end])
    text = path.read_text() if path.is_file() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif text:
        raise SystemExit(f"{path}: it has no {begin} ... {end} markers; the report "
                         "replaces only the text between them (add them, or give a new file)")
    else:
        text = block + "\n"
    path.write_text(text)
