"""ktx input pipeline: data files, vocabularies, mixing rates, feature conversion, batches."""

from ktx.data import feature_converter, files, mixing, pipeline, vocab
from ktx.data.mixing import Mixing, largest_remainder_counts
from ktx.data.pipeline import MultiTaskInput, mixture_task_names

__all__ = [
    "feature_converter",
    "files",
    "mixing",
    "pipeline",
    "vocab",
    "Mixing",
    "MultiTaskInput",
    "largest_remainder_counts",
    "mixture_task_names",
]
