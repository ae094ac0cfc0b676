"""Task-conditioned T5: HyperPrompt, Prompt-Tuning, adapters, HyperFormer(++).

See `docs/methods.md`; `ktx.conditioning.model.conditioned_model` is the gin entry point.
"""

from ktx.conditioning.adapters import (
    ADAPTER_ACTIVATIONS,
    AdapterWeights,
    TaskAdapters,
    apply_adapter,
    layer_norm,
)
from ktx.conditioning.hyper_prompt import HYPER_PROMPT_VARIANTS, HyperPrompt, gather_prompts
from ktx.conditioning.hyperformer import HyperFormer
from ktx.conditioning.model import (
    ADAPTER_POSITIONS,
    METHODS,
    T5_LAYER_NORM_PATTERN,
    ConditionedEncoderDecoderModel,
    ConditionedTransformer,
    ConditioningConfig,
    conditioned_model,
    frozen_patterns,
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
    "ADAPTER_ACTIVATIONS",
    "AdapterWeights",
    "TaskAdapters",
    "apply_adapter",
    "layer_norm",
    "HYPER_PROMPT_VARIANTS",
    "HyperPrompt",
    "gather_prompts",
    "HyperFormer",
    "ADAPTER_POSITIONS",
    "METHODS",
    "T5_LAYER_NORM_PATTERN",
    "ConditionedEncoderDecoderModel",
    "ConditionedTransformer",
    "ConditioningConfig",
    "conditioned_model",
    "frozen_patterns",
    "trainable_mask",
    "PromptTuning",
    "prepend_prompts",
    "LayerEmbedding",
    "TaskEmbedding",
    "TaskProjector",
    "gather_by_task",
]
