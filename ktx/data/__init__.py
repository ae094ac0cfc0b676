"""ktx input pipeline: data files, vocabularies, mixing rates, feature conversion, batches."""

from ktx.data import encoder_features, feature_converter, files, mixing, pipeline, vocab, wordpiece
from ktx.data.mixing import Mixing, largest_remainder_counts
from ktx.data.pipeline import MultiTaskInput, mixture_task_names

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
