"""ktx models: the per-task loss contract and the models implementing it."""

from ktx.models.base import BaseModel, segment_sum_by_task
from ktx.models.seq2seq import EncoderDecoderModel
from ktx.models.t5 import T5Config, Transformer

__all__ = ["BaseModel", "segment_sum_by_task", "EncoderDecoderModel", "T5Config", "Transformer"]
