"""Task-conditioned T5.1.1: one switch (`ConditioningConfig.method`) picks the method.

`ConditionedTransformer` is `ktx.models.t5.Transformer` with a `Conditioner` (scope
`conditioning`, where every task-conditioned parameter lives) handed to the encoder,
the decoder and their layers through T5's extension points:

| method            | what it adds                                              | hook |
|-------------------|-----------------------------------------------------------|------|
| `none`            | nothing: exactly plain T5                                  | |
| `hyperprompt`     | HyperPrompt-{Share,Sep,Global} key/value prompts (He et al., 2022) | `attention_prefix` |
| `prompt_tuning`   | per-task input prompts (Lester et al., 2021)              | `Encoder.input_prompt` |
| `adapters`        | per-task Houlsby adapters (Houlsby et al., 2019)          | `adapt` |
| `hyperformer`     | per-layer hypernetwork adapters + conditional layer norm (Karimi Mahabadi et al., 2021) | `adapt`, `layer_norm` |
| `hyperformer++`   | one hypernetwork for all layers (ditto)                   | `adapt`, `layer_norm` |

Adapter positions: encoder layer 0 = attention, 1 = mlp; decoder layer 0 = self-attention,
1 = cross-attention, 2 = mlp (the layer-norm positions are the pre-norms of the same
sub-blocks). Every layer asks the conditioner for its own slot; the conditioner computes it
for all T tasks at once and gathers per example by `task_id`.

The backbone parameters keep plain T5's names and shapes, so a plain T5 checkpoint loads
into the backbone, and `ConditionedEncoderDecoderModel(train_backbone=False)` trains only
the `conditioning` parameters (the backbone's gradients are stopped inside the loss, so any
optimizer leaves it unchanged).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

from ktx.conditioning.adapters import AdapterWeights, TaskAdapters, apply_adapter
from ktx.conditioning.hyper_prompt import HYPER_PROMPT_VARIANTS, HyperPrompt
from ktx.conditioning.hyperformer import HyperFormer
from ktx.conditioning.prompt_tuning import PromptTuning
from ktx.conditioning.task_embedding import gather_by_task
from ktx.models import seq2seq, t5
from ktx.params import is_conditioning_path

__all__ = [
    "METHODS",
    "ConditioningConfig",
    "Conditioner",
    "ConditionedEncoderLayer",
    "ConditionedDecoderLayer",
    "ConditionedEncoder",
    "ConditionedDecoder",
    "ConditionedTransformer",
    "ConditionedEncoderDecoderModel",
    "conditioned_model",
    "trainable_mask",
]

METHODS = ("none", "hyperprompt", "prompt_tuning", "adapters", "hyperformer", "hyperformer++")
ENCODER_POSITIONS = {"attention": 0, "mlp": 1}
DECODER_POSITIONS = {"attention": 0, "cross_attention": 1, "mlp": 2}
ENCODER_NORMS = {"pre_attention_layer_norm": 0, "pre_mlp_layer_norm": 1}
DECODER_NORMS = {
    "pre_self_attention_layer_norm": 0,
    "pre_cross_attention_layer_norm": 1,
    "pre_mlp_layer_norm": 2,
}
_SIDES = ("encoder", "decoder")


@dataclasses.dataclass(frozen=True)
class ConditioningConfig:
    """Which task conditioning, and its sizes (defaults: He et al., 2022 for T5 Base).

    Attributes:
      method: one of `METHODS`.
      hyperprompt_variant: "share" | "sep" | "global".
      encoder_prompt_length, decoder_prompt_length: hyper-prompt length l per side
        (0 = no prompts on that side; He et al., 2022 use 16 and 6).
      prompt_tuning_length: input prompt length of Prompt-Tuning.
      reduction_factor: bottleneck b = emb_dim // reduction_factor (hypernetworks and
        adapters).
      task_embed_dim: t' (task/layer/position embeddings).
      task_hidden_dim: e, hidden size of the task projector MLP.
      projected_dim: t, size of the (layer-aware) projected task embedding.
      conditional_layer_norm: HyperFormer(++) also generates the pre-norm scales.
    """

    method: str = "none"
    hyperprompt_variant: str = "global"
    encoder_prompt_length: int = 16
    decoder_prompt_length: int = 6
    prompt_tuning_length: int = 16
    reduction_factor: int = 32
    task_embed_dim: int = 64
    task_hidden_dim: int = 128
    projected_dim: int = 64
    conditional_layer_norm: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"ConditioningConfig.method={self.method!r}; accepted: {METHODS}")
        if self.hyperprompt_variant not in HYPER_PROMPT_VARIANTS:
            raise ValueError(
                f"ConditioningConfig.hyperprompt_variant={self.hyperprompt_variant!r}; "
                f"accepted: {HYPER_PROMPT_VARIANTS}"
            )
        for name in ("encoder_prompt_length", "decoder_prompt_length", "prompt_tuning_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ConditioningConfig.{name}={v!r}; accepted: an int >= 0")
        for name in ("reduction_factor", "task_embed_dim", "task_hidden_dim", "projected_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ConditioningConfig.{name}={v!r}; accepted: an int >= 1")

    def bottleneck(self, emb_dim: int) -> int:
        return max(1, emb_dim // self.reduction_factor)


class Conditioner(nn.Module):
    """Holds and computes every task-conditioned quantity of a `ConditionedTransformer`.

    Methods return per-example arrays for one (side, layer[, position]) slot, computed for
    all T tasks and gathered by `task_id` `[B]`; `None` when the method adds nothing there.
    """

    conditioning: ConditioningConfig
    config: t5.T5Config
    num_tasks: int

    def setup(self):
        c, cfg, T = self.conditioning, self.config, self.num_tasks
        dtype = cfg.activation_dtype
        layers = {"encoder": cfg.num_encoder_layers, "decoder": cfg.num_decoder_layers}
        positions = {"encoder": len(ENCODER_POSITIONS), "decoder": len(DECODER_POSITIONS)}
        b = c.bottleneck(cfg.emb_dim)
        self.input_prompts = None
        if c.method == "hyperprompt":
            lengths = {"encoder": c.encoder_prompt_length, "decoder": c.decoder_prompt_length}
            for side in _SIDES:
                if lengths[side] == 0:
                    continue
                self._register(f"{side}_hyper_prompt", HyperPrompt(
                    variant=c.hyperprompt_variant, num_tasks=T, num_layers=layers[side],
                    prompt_length=lengths[side], emb_dim=cfg.emb_dim, num_heads=cfg.num_heads,
                    head_dim=cfg.head_dim, bottleneck_dim=b, task_embed_dim=c.task_embed_dim,
                    task_hidden_dim=c.task_hidden_dim, layer_task_dim=c.projected_dim,
                    dtype=dtype,
                ))
        elif c.method == "prompt_tuning" and c.prompt_tuning_length > 0:
            self.input_prompts = PromptTuning(T, c.prompt_tuning_length, cfg.emb_dim, dtype=dtype)
        elif c.method == "adapters":
            for side in _SIDES:
                self._register(f"{side}_adapters", TaskAdapters(
                    num_tasks=T, num_layers=layers[side], num_positions=positions[side],
                    emb_dim=cfg.emb_dim, bottleneck_dim=b,
                ))
        elif c.method in ("hyperformer", "hyperformer++"):
            for side in _SIDES:
                self._register(f"{side}_hyperformer", HyperFormer(
                    shared=c.method == "hyperformer++", num_tasks=T, num_layers=layers[side],
                    num_positions=positions[side], emb_dim=cfg.emb_dim, bottleneck_dim=b,
                    task_embed_dim=c.task_embed_dim, task_hidden_dim=c.task_hidden_dim,
                    projected_dim=c.projected_dim,
                    conditional_layer_norm=c.conditional_layer_norm, dtype=dtype,
                ))

    def _register(self, attribute: str, module: nn.Module) -> None:
        setattr(self, attribute, module)  # named after the attribute, e.g. encoder_adapters

    def _module(self, side: str, kind: str) -> nn.Module | None:
        return getattr(self, f"{side}_{kind}", None)

    def _adapter_module(self, side: str) -> nn.Module | None:
        return self._module(side, "adapters") or self._module(side, "hyperformer")

    def attention_prefix(
        self, side: str, layer: int, task_id: jax.Array
    ) -> tuple[jax.Array, jax.Array] | None:
        """Key/value hyper-prompts `[B, l, H, D]` of self-attention `layer`, or None."""
        module = self._module(side, "hyper_prompt")
        if module is None:
            return None
        keys, values = module(layer)  # [T, l, H, D] each
        return gather_by_task(keys, task_id), gather_by_task(values, task_id)

    def input_prompt(self, task_id: jax.Array) -> jax.Array | None:
        """Prompt-Tuning input prompts `[B, l, E]`, or None."""
        return None if self.input_prompts is None else self.input_prompts(task_id)

    def adapter(self, side: str, layer: int, position: int, task_id: jax.Array):
        """`AdapterWeights` with lead `[B]` for one slot, or None."""
        module = self._adapter_module(side)
        if module is None:
            return None
        out = module(layer, position)
        weights = out if isinstance(out, AdapterWeights) else out[0]
        return weights.gather(task_id, axis=0)

    def layer_norm_scale(
        self, side: str, layer: int, position: int, task_id: jax.Array
    ) -> jax.Array | None:
        """Task-conditional layer-norm scale `[B, E]` (HyperFormer), or None."""
        module = self._adapter_module(side)
        if not isinstance(module, HyperFormer) or not module.conditional_layer_norm:
            return None
        _, scales = module(layer, position)  # [T, E]
        return gather_by_task(scales, task_id)


class _ConditionedHooks:
    """T5 layer hooks that ask the shared `Conditioner` for this layer's slot."""

    side: str
    norms: dict
    positions: dict

    def layer_norm(self, x, task_id, *, name):
        y = super().layer_norm(x, task_id, name=name)
        if self.conditioner is None:
            return y
        scale = self.conditioner.layer_norm_scale(
            self.side, self.layer_index, self.norms[name], task_id
        )
        if scale is None:
            return y
        # gamma_t multiplies the backbone's own RMS-norm scale (starts near 1).
        return y * scale[:, None, :].astype(y.dtype)

    def attention_prefix(self, x, task_id, *, name):
        if self.conditioner is None:
            return None
        return self.conditioner.attention_prefix(self.side, self.layer_index, task_id)

    def adapt(self, y, task_id, *, name, deterministic):
        if self.conditioner is None:
            return y
        weights = self.conditioner.adapter(
            self.side, self.layer_index, self.positions[name], task_id
        )
        return y if weights is None else apply_adapter(y, weights)


class ConditionedEncoderLayer(_ConditionedHooks, t5.EncoderLayer):
    conditioner: Any = None
    side = "encoder"
    norms = ENCODER_NORMS
    positions = ENCODER_POSITIONS


class ConditionedDecoderLayer(_ConditionedHooks, t5.DecoderLayer):
    conditioner: Any = None
    side = "decoder"
    norms = DECODER_NORMS
    positions = DECODER_POSITIONS


class ConditionedEncoder(t5.Encoder):
    conditioner: Any = None

    def make_layer(self, index: int) -> nn.Module:
        return self.layer_cls(
            config=self.config, layer_index=index, conditioner=self.conditioner,
            name=f"layers_{index}",
        )

    def input_prompt(self, x, task_id):
        return None if self.conditioner is None else self.conditioner.input_prompt(task_id)


class ConditionedDecoder(t5.Decoder):
    conditioner: Any = None

    def make_layer(self, index: int) -> nn.Module:
        return self.layer_cls(
            config=self.config, layer_index=index, conditioner=self.conditioner,
            name=f"layers_{index}",
        )


class ConditionedTransformer(t5.Transformer):
    """T5.1.1 with task conditioning `conditioning` over `num_tasks` tasks.

    Same call signature and backbone parameters as `t5.Transformer`; the extra
    parameters live under `conditioning/`.
    """

    conditioning_config: ConditioningConfig = ConditioningConfig()
    num_tasks: int = 1

    def setup(self):
        cfg = self.config
        if not isinstance(cfg, t5.T5Config):
            raise TypeError(f"ConditionedTransformer.config must be a T5Config, got {type(cfg).__name__}")
        if not isinstance(self.conditioning_config, ConditioningConfig):
            raise TypeError(
                "ConditionedTransformer.conditioning_config must be a ConditioningConfig, "
                f"got {type(self.conditioning_config).__name__}"
            )
        if isinstance(self.num_tasks, bool) or not isinstance(self.num_tasks, int) or self.num_tasks < 1:
            raise ValueError(f"ConditionedTransformer.num_tasks={self.num_tasks!r}; accepted: int >= 1")
        self.token_embedder = t5.Embed(cfg.vocab_size, cfg.emb_dim, dtype=cfg.activation_dtype)
        # The attribute name is `ktx.params.CONDITIONING_SCOPE`: all conditioning params.
        self.conditioning = Conditioner(self.conditioning_config, cfg, self.num_tasks)
        self.encoder = ConditionedEncoder(
            config=cfg, shared_embedding=self.token_embedder,
            layer_cls=ConditionedEncoderLayer, conditioner=self.conditioning,
        )
        self.decoder = ConditionedDecoder(
            config=cfg, shared_embedding=self.token_embedder,
            layer_cls=ConditionedDecoderLayer, conditioner=self.conditioning,
        )


def trainable_mask(params: Any, train_backbone: bool) -> Any:
    """Bool pytree like `params`: True where a parameter is trained (for `optax.masked`)."""

    def keep(path, _):
        names = tuple(str(getattr(k, "key", k)) for k in path)
        return train_backbone or is_conditioning_path(names)

    return jax.tree_util.tree_map_with_path(keep, params)


class ConditionedEncoderDecoderModel(seq2seq.EncoderDecoderModel):
    """`EncoderDecoderModel` over a `ConditionedTransformer`.

    `train_backbone=False` stops the gradient of every parameter outside `conditioning`
    inside `loss_sums`, so only the task-conditioned parameters are trained.
    """

    def __init__(self, *args, train_backbone: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.module, ConditionedTransformer):
            raise TypeError(
                "ConditionedEncoderDecoderModel.module must be a ConditionedTransformer, got "
                f"{type(self.module).__name__}"
            )
        if self.module.num_tasks != self.num_tasks:
            raise ValueError(
                f"ConditionedEncoderDecoderModel: num_tasks={self.num_tasks} but the module "
                f"has num_tasks={self.module.num_tasks}"
            )
        if not isinstance(train_backbone, bool):
            raise TypeError(f"train_backbone={train_backbone!r}; accepted: True or False")
        self.train_backbone = train_backbone

    def __repr__(self) -> str:
        return (
            super().__repr__()[:-1]
            + f", conditioning={self.module.conditioning_config}, train_backbone={self.train_backbone})"
        )

    def loss_sums(self, params, batch, rng, train):
        if not self.train_backbone:
            mask = trainable_mask(params, False)
            params = jax.tree.map(
                lambda p, m: p if m else jax.lax.stop_gradient(p), params, mask
            )
        return super().loss_sums(params, batch, rng, train)


def conditioned_model(
    base: seq2seq.EncoderDecoderModel,
    conditioning: ConditioningConfig = ConditioningConfig(),
    *,
    train_backbone: bool = True,
) -> ConditionedEncoderDecoderModel:
    """`base` (a configured plain T5 model) with task conditioning; nothing else changes.

    The T5 shapes, number of tasks and loss options are taken from `base`, so a gin file
    that overrides only `MODEL = @conditioned_model()` switches the method.
    """
    if not isinstance(base, seq2seq.EncoderDecoderModel):
        raise TypeError(
            f"conditioned_model: base={type(base).__name__}; accepted: a "
            "ktx.models.seq2seq.EncoderDecoderModel"
        )
    module = ConditionedTransformer(
        config=base.config, conditioning_config=conditioning, num_tasks=base.num_tasks
    )
    return ConditionedEncoderDecoderModel(
        module=module,
        num_tasks=base.num_tasks,
        loss_normalization=base.loss_normalization,
        z_loss=base.z_loss,
        label_smoothing=base.label_smoothing,
        infusion_beta=base.infusion_beta,
        eos_id=base.eos_id,
        decoder_start_id=base.decoder_start_id,
        train_backbone=train_backbone,
    )
