"""ktx input pipeline: data files, vocabularies, mixing rates, feature conversion, batches.

The submodules are imported when first used (PEP 562): `from ktx.data import files` (the
CLI's data folder and bad-row policy) must not import SeqIO and TensorFlow, which
`encoder_features`, `pipeline` and `vocab` bring.
"""

import importlib

__all__ = [
    "encoder_features",
    "feature_converter",
    "files",
    "mixing",
    "pipeline",
    "vocab",
    "wordpiece",
    "Mixing",
    "MultiTaskInput",
    "largest_remainder_counts",
    "mixture_task_names",
]

_SUBMODULES = ("encoder_features", "feature_converter", "files", "mixing", "pipeline", "vocab",
               "wordpiece")
_NAMES = {"Mixing": "mixing", "largest_remainder_counts": "mixing",
          "MultiTaskInput": "pipeline", "mixture_task_names": "pipeline"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
