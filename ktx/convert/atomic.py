"""All-or-nothing output directories for the converters."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

__all__ = ["atomic_directory"]


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[pathlib.Path]:
    """Yields a temporary sibling of `path` to write into; renamed to `path` when the
    block succeeds, removed when it raises, so a failed conversion writes nothing.

    `path` must not exist, or be an empty directory (ValueError otherwise: nothing is
    overwritten).
    """
    path = pathlib.Path(path).expanduser().absolute()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"output {str(path)!r} already exists and is not an empty directory; "
                         "give a new path")
    created = next((p for p in reversed(path.parents) if not p.exists()), None)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
        if path.exists():
            path.rmdir()
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
