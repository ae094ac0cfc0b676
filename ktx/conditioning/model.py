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
| `hyperformer`     | hypernetwork-generated adapters with a generated layer norm, generators per position (Karimi Mahabadi et al., 2021) | `adapt` |
| `hyperformer++`   | one generator for all layers and positions (ditto)        | `adapt` |

Adapter positions (`ConditioningConfig.adapter_positions`, default `("attention", "mlp")`,
the positions of Houlsby et al. and of the HyperFormer code): after the self-attention and
after the feed-forward sub-block of every layer, inside the residual
(`x + dropout(adapter(y))`); `"cross_attention"` adds one after the decoder's
cross-attention. Position `a` of a side is its `a`-th configured position in the order
attention, cross-attention, mlp (the encoder has no cross-attention). Every layer asks the
conditioner for its own slot; the conditioner computes it for all T tasks at once and
gathers per example by `task_id`.

With `T5Config.scan_layers` every method runs inside the scanned stack: the conditioner
computes every layer's per-task quantities once, outside the scan (`Conditioner.layer_inputs`:
hyper-prompts `[M, T, l, H, D]`, adapter weights `[M, A, T, ...]`, the layer index entering
through the layer embeddings of the hypernetworks), and layer `m` gathers its slice per
example; the conditioning parameters are the same in both layouts.

The backbone parameters keep plain T5's names and shapes, so a plain T5 checkpoint loads
into the backbone. Which parameters train is declared as regexes over '/'-joined parameter
paths (`frozen_patterns`, the format of `ktx.training.optimizers.freeze`):
`ConditionedEncoderDecoderModel(train_backbone=False)` freezes every parameter outside
`conditioning`, except T5's own layer norms with `train_layer_norms=True` (HyperFormer's
configuration: T5's layer norms, the hypernetworks and the task embeddings train). The
model stops the frozen parameters' gradients inside the loss; `model.frozen_patterns`
handed to `ktx.training.optimizers.freeze` also gives them no optimizer update at all.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ktx import treepath
from ktx.conditioning.adapters import (
    ADAPTER_ACTIVATIONS,
    TaskAdapters,
    apply_adapter,
)
from ktx.conditioning.hyper_prompt import HYPER_PROMPT_VARIANTS, HyperPrompt
from ktx.conditioning.hyperformer import HyperFormer
from ktx.conditioning.prompt_tuning import PromptTuning
from ktx.conditioning.task_embedding import TaskEmbedding, gather_by_task
from ktx.models import seq2seq, t5
from ktx.analysis.params import CONDITIONING_SCOPE

__all__ = [
    "METHODS",
    "ADAPTER_POSITIONS",
    "T5_LAYER_NORM_PATTERN",
    "ConditioningConfig",
    "Conditioner",
    "ConditionedEncoderLayer",
    "ConditionedDecoderLayer",
    "ConditionedEncoder",
    "ConditionedDecoder",
    "ConditionedTransformer",
    "ConditionedEncoderDecoderModel",
    "conditioned_model",
    "frozen_patterns",
    "trainable_mask",
]

METHODS = ("none", "hyperprompt", "prompt_tuning", "adapters", "hyperformer", "hyperformer++")
ADAPTER_POSITIONS = ("attention", "cross_attention", "mlp")  # in layer order
# T5's own (RMS) layer norms: the pre-norms of every sub-block and the final norms.
T5_LAYER_NORM_PATTERN = (
    r"(?:encoder|decoder)/(?:layers(?:_\d+)?/pre_\w*layer_norm|encoder_norm|decoder_norm)/scale"
)
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
      conditional_layer_norm: HyperFormer(++) generates the scale and bias of a layer norm
        inside every adapter (the paper's conditional layer norm); False: no adapter norm.
      adapter_positions: where adapters (Houlsby and HyperFormer) sit, a subset of
        `ADAPTER_POSITIONS`; default after self-attention and after the feed-forward block.
      adapter_activation: the adapters' nonlinearity, one of `ADAPTER_ACTIVATIONS`
        ("gelu_new", the tanh-approximate GELU of the HyperFormer code, or "relu").
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
    adapter_positions: tuple[str, ...] = ("attention", "mlp")
    adapter_activation: str = "gelu_new"

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
        positions = self.adapter_positions
        if (
            isinstance(positions, str) or not isinstance(positions, (tuple, list))
            or not positions or any(p not in ADAPTER_POSITIONS for p in positions)
            or len(set(positions)) != len(positions)
        ):
            raise ValueError(
                f"ConditioningConfig.adapter_positions={positions!r}; accepted: a non-empty "
                f"sequence of distinct names from {ADAPTER_POSITIONS}"
            )
        object.__setattr__(
            self, "adapter_positions", tuple(p for p in ADAPTER_POSITIONS if p in positions)
        )
        if self.adapter_activation not in ADAPTER_ACTIVATIONS:
            raise ValueError(
                f"ConditioningConfig.adapter_activation={self.adapter_activation!r}; "
                f"accepted: {sorted(ADAPTER_ACTIVATIONS)}"
            )

    def positions(self, side: str) -> dict[str, int]:
        """`{sub-block name: adapter position index}` of one side ("encoder"/"decoder")."""
        names = [p for p in self.adapter_positions
                 if side == "decoder" or p != "cross_attention"]
        return {name: i for i, name in enumerate(names)}

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
    # At most this many distinct tasks among a batch's rows (None: any number): the
    # hyper-prompts are then computed for the batch's tasks only (`batch_tasks`).
    batch_tasks: int | None = None

    def setup(self):
        c, cfg, T = self.conditioning, self.config, self.num_tasks
        dtype = cfg.activation_dtype
        layers = {"encoder": cfg.num_encoder_layers, "decoder": cfg.num_decoder_layers}
        positions = {side: len(c.positions(side)) for side in _SIDES}
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
            # One task embedding per task, shared by the encoder's and decoder's generators.
            self._register("task_embedding", TaskEmbedding(T, c.task_embed_dim))
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

    def _batch_tasks(self, task_id: jax.Array) -> tuple[jax.Array | None, jax.Array]:
        """`(tasks [S], index [B])`: the tasks among the rows `task_id` and each row's
        position in `tasks`, when `batch_tasks` (S) bounds them below T; else
        `(None, task_id)`. An unused slot repeats a present task."""
        n = self.batch_tasks
        if n is None or n >= self.num_tasks:
            return None, task_id
        task_id = jnp.asarray(task_id, jnp.int32)
        present = jnp.bincount(task_id, length=self.num_tasks) > 0
        (tasks,) = jnp.nonzero(present, size=n, fill_value=task_id[0])
        index = jnp.argmax(task_id[:, None] == tasks[None, :], axis=1).astype(jnp.int32)
        return tasks, index

    def attention_prefix(
        self, side: str, layer: int, task_id: jax.Array
    ) -> tuple[jax.Array, jax.Array] | None:
        """Key/value hyper-prompts `[B, l, H, D]` of self-attention `layer`, or None."""
        module = self._module(side, "hyper_prompt")
        if module is None:
            return None
        tasks, index = self._batch_tasks(task_id)
        keys, values = module(layer, tasks=tasks)  # [T | S, l, H, D] each
        return gather_by_task(keys, index), gather_by_task(values, index)

    def input_prompt(self, task_id: jax.Array) -> jax.Array | None:
        """Prompt-Tuning input prompts `[B, l, E]`, or None."""
        return None if self.input_prompts is None else self.input_prompts(task_id)

    def adapter(self, side: str, layer: int, position: int, task_id: jax.Array):
        """`AdapterWeights` with lead `[B]` for one slot, or None."""
        module = self._adapter_module(side)
        if module is None:
            return None
        if isinstance(module, HyperFormer):
            weights = module(self.task_embedding(), layer, position)
        else:
            weights = module(layer, position)
        return weights.gather(task_id, axis=0)

    def layer_inputs(self, side: str, task_id: jax.Array) -> dict[str, Any] | None:
        """Per-task quantities of every layer of `side` (leading axis `[M]`), for a scanned
        stack (`T5Config.scan_layers`): `prefix` (key, value) `[M, T, l, H, D]` (`[M, S,
        ...]` under `batch_tasks`, with `prefix_index` `[M, B]`, each row's position),
        `adapters` (`AdapterWeights`, lead `[M, A, T]`); None when the method adds none.
        Computed outside the scan, as the unrolled layers compute each slice."""
        out: dict[str, Any] = {}
        prompts = self._module(side, "hyper_prompt")
        if prompts is not None:
            tasks, index = self._batch_tasks(task_id)
            out["prefix"] = prompts(tasks=tasks)
            if tasks is not None:
                out["prefix_index"] = jnp.broadcast_to(index, (prompts.num_layers,) + index.shape)
        module = self._adapter_module(side)
        if module is not None:
            out["adapters"] = (
                module(self.task_embedding()) if isinstance(module, HyperFormer) else module()
            )
        return out or None


class _ConditionedHooks:
    """T5 layer hooks that ask the shared `Conditioner` for this layer's slot (unrolled
    stacks), or read it from the layer's slice of `Conditioner.layer_inputs` (scanned
    stacks: the layer holds the `conditioning` config, not the conditioner)."""

    side: str

    def attention_prefix(self, x, task_id, *, name, layer_inputs=None):
        if layer_inputs is not None:
            prefix = layer_inputs.get("prefix")
            if prefix is None:
                return None
            index = layer_inputs.get("prefix_index", task_id)
            return gather_by_task(prefix[0], index), gather_by_task(prefix[1], index)
        if self.conditioner is None:
            return None
        return self.conditioner.attention_prefix(self.side, self.layer_index, task_id)

    def adapt(self, y, task_id, *, name, deterministic, layer_inputs=None):
        conditioning = (
            self.conditioning if self.conditioner is None else self.conditioner.conditioning
        )
        if conditioning is None:
            return y
        position = conditioning.positions(self.side).get(name)
        if position is None:
            return y
        if layer_inputs is not None:
            weights = layer_inputs.get("adapters")
            if weights is None:
                return y
            weights = weights.at(position).gather(task_id, axis=0)
        elif self.conditioner is not None:
            weights = self.conditioner.adapter(self.side, self.layer_index, position, task_id)
        else:
            return y
        if weights is None:
            return y
        return apply_adapter(y, weights, activation=conditioning.adapter_activation)


class ConditionedEncoderLayer(_ConditionedHooks, t5.EncoderLayer):
    conditioner: Any = None
    conditioning: Any = None  # scanned stacks: the ConditioningConfig
    side = "encoder"


class ConditionedDecoderLayer(_ConditionedHooks, t5.DecoderLayer):
    conditioner: Any = None
    conditioning: Any = None
    side = "decoder"


class _ConditionedStack:
    """Hands the conditioner to unrolled layers, its per-layer outputs to a scanned stack."""

    conditioner: Any
    side: str

    def layer_fields(self) -> dict[str, Any]:
        return {"conditioner": self.conditioner}

    def scan_fields(self) -> dict[str, Any]:
        return {"conditioning": getattr(self.conditioner, "conditioning", None)}

    def layer_inputs(self, task_id):
        return (None if self.conditioner is None
                else self.conditioner.layer_inputs(self.side, task_id))


class ConditionedEncoder(_ConditionedStack, t5.Encoder):
    conditioner: Any = None
    side = "encoder"

    def input_prompt(self, x, task_id):
        return None if self.conditioner is None else self.conditioner.input_prompt(task_id)


class ConditionedDecoder(_ConditionedStack, t5.Decoder):
    conditioner: Any = None
    side = "decoder"


class ConditionedTransformer(t5.Transformer):
    """T5.1.1 with task conditioning `conditioning` over `num_tasks` tasks.

    Same call signature and backbone parameters as `t5.Transformer`; the extra
    parameters live under `conditioning/`.
    """

    conditioning_config: ConditioningConfig = ConditioningConfig()
    num_tasks: int = 1
    batch_tasks: int | None = None  # `Conditioner.batch_tasks`

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
        # The attribute name is `ktx.analysis.params.CONDITIONING_SCOPE`: all conditioning params.
        self.conditioning = Conditioner(self.conditioning_config, cfg, self.num_tasks,
                                        batch_tasks=self.batch_tasks)
        self.encoder = ConditionedEncoder(
            config=cfg, shared_embedding=self.token_embedder,
            layer_cls=ConditionedEncoderLayer, conditioner=self.conditioning,
        )
        self.decoder = ConditionedDecoder(
            config=cfg, shared_embedding=self.token_embedder,
            layer_cls=ConditionedDecoderLayer, conditioner=self.conditioning,
        )


def frozen_patterns(
    train_backbone: bool = True, train_layer_norms: bool = False
) -> tuple[str, ...]:
    """Regexes (full match on '/'-joined parameter paths, as `ktx.training.optimizers.freeze`)
    of the parameters that do not train.

    `train_backbone=True`: none. Otherwise every parameter outside `conditioning/`,
    except T5's own layer norms (`T5_LAYER_NORM_PATTERN`) when `train_layer_norms`.
    """
    for name, value in (("train_backbone", train_backbone),
                        ("train_layer_norms", train_layer_norms)):
        if not isinstance(value, bool):
            raise TypeError(f"frozen_patterns: {name}={value!r}; accepted: True or False")
    if train_backbone:
        return ()
    trained = [re.escape(CONDITIONING_SCOPE) + "/"]
    if train_layer_norms:
        trained.append(T5_LAYER_NORM_PATTERN + "$")
    return ("(?!" + "|".join(trained) + ").*",)


def trainable_mask(
    params: Any, train_backbone: bool, train_layer_norms: bool = False
) -> Any:
    """Bool pytree like `params`: True where a parameter trains (no `frozen_patterns`
    regex fully matches its path), for `optax.masked` and the model's stop-gradient."""
    compiled = [re.compile(p) for p in frozen_patterns(train_backbone, train_layer_norms)]

    def keep(path, _):
        name = treepath.name(path)
        return not any(rx.fullmatch(name) for rx in compiled)

    return jax.tree_util.tree_map_with_path(keep, params)


class ConditionedEncoderDecoderModel(seq2seq.EncoderDecoderModel):
    """`EncoderDecoderModel` over a `ConditionedTransformer`.

    `train_backbone=False` stops the gradient of every parameter outside `conditioning`
    (but T5's layer norms when `train_layer_norms`) inside `loss_sums`, so only the
    task-conditioned parameters (and those norms) are trained. `frozen_patterns` holds the
    regexes of the frozen parameters, for `ktx.training.optimizers.freeze`.
    """

    def __init__(
        self, *args, train_backbone: bool = True, train_layer_norms: bool = False, **kwargs
    ):
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
        self.frozen_patterns = frozen_patterns(train_backbone, train_layer_norms)
        self.train_backbone = train_backbone
        self.train_layer_norms = train_layer_norms

    def __repr__(self) -> str:
        return (
            super().__repr__()[:-1]
            + f", conditioning={self.module.conditioning_config}, "
            f"train_backbone={self.train_backbone}, train_layer_norms={self.train_layer_norms})"
        )

    def for_batch_tasks(self, n: int) -> "ConditionedEncoderDecoderModel":
        """This model for batches whose rows hold at most `n` tasks: the hyper-prompts
        are computed for those tasks only (`Conditioner.batch_tasks`), the same numbers
        at `n` tasks' cost. A balanced step's per-device region, where a device holds the
        rows of one or two tasks, uses it."""
        if (self.module.conditioning_config.method != "hyperprompt"
                or n >= self.num_tasks or self.module.batch_tasks == n):
            return self
        out = copy.copy(self)
        out.module = self.module.clone(batch_tasks=n)
        return out

    def loss_sums(self, params, batch, rng, train):
        if self.frozen_patterns:
            mask = trainable_mask(params, self.train_backbone, self.train_layer_norms)
            params = jax.tree.map(
                lambda p, m: p if m else jax.lax.stop_gradient(p), params, mask
            )
        return super().loss_sums(params, batch, rng, train)


def conditioned_model(
    base: seq2seq.EncoderDecoderModel,
    conditioning: ConditioningConfig = ConditioningConfig(),
    *,
    train_backbone: bool = True,
    train_layer_norms: bool = False,
) -> ConditionedEncoderDecoderModel:
    """`base` (a configured plain T5 model) with task conditioning; nothing else changes.

    The T5 shapes, number of tasks and loss options are taken from `base`, so a gin file
    that overrides only `MODEL = @conditioned_model()` switches the method.
    `train_backbone=False` freezes the backbone except, with `train_layer_norms`, T5's
    layer norms (see `frozen_patterns`).
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
        train_layer_norms=train_layer_norms,
    )
