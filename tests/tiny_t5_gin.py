"""The gin text of a very small T5.1.1 model for CLI-level tests (byte vocabulary size)."""

_TEMPLATE = """
from __gin__ import dynamic_registration
import ktx.models.seq2seq as seq2seq
import ktx.models.t5 as t5

MODEL = @seq2seq.EncoderDecoderModel()
seq2seq.EncoderDecoderModel.config = @t5.T5Config()
NUM_TASKS = 1
seq2seq.EncoderDecoderModel.num_tasks = %NUM_TASKS
t5.T5Config:
  vocab_size = 384
  emb_dim = 16
  num_heads = 2
  head_dim = 8
  mlp_dim = 32
  num_encoder_layers = {num_encoder_layers}
  num_decoder_layers = 1
  dropout_rate = 0.0
"""


def tiny_t5_gin(num_encoder_layers: int = 1) -> str:
    """Binds `MODEL` (and a default `NUM_TASKS = 1`) to a 16-wide T5.1.1."""
    return _TEMPLATE.format(num_encoder_layers=num_encoder_layers)
