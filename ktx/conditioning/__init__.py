"""Task-conditioned T5: HyperPrompt, Prompt-Tuning, adapters, HyperFormer(++).

See `docs/methods.md`; `ktx.conditioning.model.conditioned_model` is the gin entry point.
"""

from ktx.conditioning.adapters import AdapterWeights, TaskAdapters, apply_adapter
from ktx.conditioning.hyper_prompt import HYPER_PROMPT_VARIANTS, HyperPrompt, gather_prompts
from ktx.conditioning.hyperformer import HyperFormer
from ktx.conditioning.model import (
    METHODS,
    ConditionedEncoderDecoderModel,
    ConditionedTransformer,
    ConditioningConfig,
    conditioned_model,
    trainable_mask,
)
from ktx.conditioning.prompt_tuning import PromptTuning, prepend_prompts
from ktx.conditioning.task_embedding import (
    LayerEmbedding,
    TaskEmbedding,
    TaskProjector,
    gather_by_task,
)

__all__ = [
    "AdapterWeights",
    "TaskAdapters",
    "apply_adapter",
    "HYPER_PROMPT_VARIANTS",
    "HyperPrompt",
    "gather_prompts",
    "HyperFormer",
    "METHODS",
    "ConditionedEncoderDecoderModel",
    "ConditionedTransformer",
    "ConditioningConfig",
    "conditioned_model",
    "trainable_mask",
    "PromptTuning",
    "prepend_prompts",
    "LayerEmbedding",
    "TaskEmbedding",
    "TaskProjector",
    "gather_by_task",
]
