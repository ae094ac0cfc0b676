"""SMART: smoothness-inducing adversarial regularisation for encoder fine-tuning (Jiang et
al., ACL 2020, "SMART: Robust and Efficient Fine-Tuning for Pre-trained Natural Language
Models through Principled Regularized Optimization").

`SmartModel(base)` wraps any ktx encoder classifier (`EncoderClassifierModel`,
`CaMtlClassifierModel`, `PalsClassifierModel`, `TeaClassifierModel`) and adds, per task,
the paper's adversarial term to the base loss sums, so the trainer's plain and per-task
(balanced) gradient paths see it as part of each task's loss. Paper eq. (1):

    min_θ F(θ) = L(θ) + λ_s R_s(θ)
    R_s(θ) = 1/n Σ_i max_{‖x̃_i − x_i‖_∞ ≤ ε} ℓ_s(f(x̃_i; θ), f(x_i; θ))
    ℓ_s(P, Q) = D_KL(P ‖ Q) + D_KL(Q ‖ P) = Σ_k (p_k − q_k)(log p_k − log q_k)   classification
    ℓ_s(p, q) = (p − q)²                                                        regression
    ℓ_s(P, Q) = 1/|M_i| Σ_{j ∈ M_i} ℓ_s(P_j, Q_j)                               token tagging

(a tagging head compares every labelled token's distribution, `M_i` row i's labelled and
attended positions, averaged as its loss is; the paper evaluates on sequence tasks only).

`x_i` is row i's embedding output `[L, E]` (after the embedding LayerNorm and dropout:
the input of the first layer, where the authors' code perturbs), `f` the row's own task
head. The inner max is one step of projected ascent (Algorithm 1, lines 6-7):

    x̃_i ← x_i + ν_i,                 ν_i ~ N(0, σ² I)
    g̃_i ← ∇_x̃ ℓ_s(f(x_i; θ), f(x̃_i; θ)) / (‖∇_x̃ ℓ_s(...)‖_∞ + δ)
    x̃_i ← Π_{‖x̃_i − x_i‖_∞ ≤ ε}(x̃_i + η g̃_i)     (elementwise clip of x̃ − x to [−ε, ε])

repeated `ascent_steps` (T_x̃) times, with θ held fixed (no gradient flows through x̃);
this is `projection="paper"`. `projection="code"` is the authors' code instead (mt-dnn,
`SmartPerturbation` with `norm_p="inf"`): the raw gradient step, then the perturbation
rescaled to unit ∞-norm over the hidden axis of every token, ε only a stabiliser:

    x̃_i − x_i ← (x̃_i − x_i + η g_i) / (max_e |x̃_i − x_i + η g_i|_{[l, e]} + ε)

so its perturbation has size ~1 per token, where the paper's has size ε.
then `λ_s ℓ_s(f(x_i; θ), f(x̃_i; θ))` joins row i's loss, differentiated through both
predictions (Algorithm 1, line 9). `δ` (1e-12) only guards a zero gradient; the norms are
per row. The noise of row i is drawn from `fold_in(fold_in(rng, salt), row_id_i)`, and the
ascent and the adversarial forward reuse the clean forward's dropout keys (the same masks),
so the term of a row does not depend on which rows share its (sub-)batch: task blocks,
the one-hot VJP and microbatches compute the same gradient (`ktx.models.base`).

The Bregman proximal point term (eq. 2-3), with `proximal_weight` μ > 0:

    θ_{t+1} = argmin_θ F(θ) + μ D_Breg(θ, θ̃_t),  D_Breg(θ, θ̃) = 1/n Σ_i ℓ_s(f(x_i; θ), f(x_i; θ̃))
    θ̃_{t+1} = (1 − β) θ_t + β θ̃_t,               θ̃_1 = θ_0 (Algorithm 1, lines 1 and 14)

solved, as the paper does in practice, by one optimizer step on `F + μ D_Breg` per
step. The teacher θ̃ is the model's carried state (`BaseModel.init_model_state`: the
trainer keeps it in `TrainState.model_state`, sharded like the parameters and
checkpointed with them): `init_model_state(params)` copies the step-0 parameters (those of
INITIAL_CHECKPOINT_PATH when a run starts from one), `loss_sums_with_state` adds
`μ ℓ_s(f(x_i; θ), f(x_i; θ̃))` to row i's task (the teacher's prediction under
`stop_gradient`, the student's the clean forward of the adversarial term, reused), and
`update_model_state` applies the momentum (`teacher_update`) to the parameters the
optimizer step produced. The teacher's forward uses the student's dropout keys (the same
masks), so the term measures the parameters' difference only and is exactly 0 at the
first step (θ̃ = θ). Frozen parameters (`frozen_patterns`) never move, so their teacher
equals them for ever: the teacher holds no copy of them (None leaves) and reads them from
θ. `teacher_momentum` β is a number or a schedule `step -> β` (`momentum_schedule`: the
paper's 0.99, then 0.999).

Paper defaults (section 5): σ = 1e-5, ε = 1e-5, η = 1e-3, T_x̃ = 1, λ_s ∈ {1, 3, 5},
μ = 1, β = 0.99 then 0.999. With ε = 1e-5 the paper's term is tiny (ℓ_s ~ 1e-14 on a
BERT, near float32's resolution of probabilities) and far below bfloat16's: use float32
activations (`BertConfig.dtype`), and see `projection="code"`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ktx import treepath
from ktx.models import encoder
from ktx.models.base import BaseModel, Batch, row_keys, segment_sum_by_task

__all__ = [
    "PROJECTIONS",
    "SmartModel",
    "full_teacher",
    "initial_noise",
    "momentum_schedule",
    "proximal_sums",
    "row_divergence",
    "symmetric_kl",
    "teacher_update",
]

Array = jax.Array
_NOISE_SALT = 0x5A4A  # separates the noise stream from the dropout keys of the same rng
_GRAD_EPS = 1e-12
PROJECTIONS = ("paper", "code")


def symmetric_kl(p_logits: Array, q_logits: Array) -> Array:
    """`[..., n]` logits of P and Q -> `[...]` `KL(P‖Q) + KL(Q‖P) = Σ_k (p_k − q_k)(log p_k −
    log q_k)` (float32)."""
    log_p = jax.nn.log_softmax(jnp.asarray(p_logits, jnp.float32), axis=-1)
    log_q = jax.nn.log_softmax(jnp.asarray(q_logits, jnp.float32), axis=-1)
    return jnp.sum((jnp.exp(log_p) - jnp.exp(log_q)) * (log_p - log_q), axis=-1)


def row_divergence(num_labels: Sequence[int], a: Sequence[Array], b: Sequence[Array],
                   task_id: Array, token_mask: Array | None = None) -> Array:
    """`[B]` `ℓ_s` between two predictions of each row's own head: `a`, `b` are `T` logits
    `[B, n_t]`; symmetric KL for `n_t >= 2`, squared difference for a regression head.
    A tagging head's logits `[B, L, n_t]` give the mean symmetric KL over the row's
    positions where `token_mask` `[B, L]` (labelled and attended tokens) is true."""
    task_id = jnp.asarray(task_id, jnp.int32)
    out = jnp.zeros(task_id.shape, jnp.float32)
    for t, (n, x, y) in enumerate(zip(num_labels, a, b)):
        if x.ndim == 3:
            if token_mask is None:
                raise ValueError("row_divergence: a tagging head's [B, L, n] logits need "
                                 "token_mask [B, L] (its labelled tokens)")
            m = jnp.asarray(token_mask, jnp.float32)
            d = jnp.sum(symmetric_kl(x, y) * m, axis=-1) / jnp.maximum(m.sum(axis=-1), 1.0)
        elif n == 1:
            d = jnp.square(jnp.asarray(x[:, 0], jnp.float32) - jnp.asarray(y[:, 0], jnp.float32))
        else:
            d = symmetric_kl(x, y)
        out = jnp.where(task_id == t, d, out)
    return out


def initial_noise(rng: Array, batch: Batch, shape: tuple[int, int], noise_std: float) -> Array:
    """`[B, L, E]` `ν ~ N(0, σ²)`, row i's drawn from `fold_in(fold_in(rng, salt), row_id_i)`."""
    keys = row_keys(jax.random.fold_in(rng, _NOISE_SALT), batch)
    return noise_std * jax.vmap(lambda k: jax.random.normal(k, shape, jnp.float32))(keys)


def teacher_update(teacher: Any, params: Any, beta: float | Array) -> Any:
    """The momentum teacher of the proximal term (eq. 3): `θ̃_t = (1 − β) θ_t + β θ̃_{t−1}`,
    in each leaf's dtype; a None leaf of `teacher` (a frozen parameter) stays None."""
    def update(s, p):
        if s is None:
            return None
        b = jnp.asarray(beta, s.dtype)
        return (1 - b) * p.astype(s.dtype) + b * s

    return jax.tree.map(update, teacher, params, is_leaf=lambda x: x is None)


def full_teacher(teacher: Any, params: Any, frozen: treepath.Selection = ()) -> Any:
    """The teacher's parameters for a forward pass: its leaves, and `params`' where the
    teacher holds None (frozen parameters, equal in θ and θ̃) or where `frozen` (the model's
    `frozen_patterns`) names rows of a scanned stack's leaf (`treepath.Rows`): those rows are
    read from θ, as the unrolled layout reads their frozen layers."""
    rows = treepath.select(params, frozen, strict=False) if frozen else \
        jax.tree.map(lambda _: False, params)

    def pick(s, p, m):
        if s is None:
            return p
        if isinstance(m, np.ndarray):
            return jnp.where(treepath.rows_like(m, p), p, s)
        return s

    return jax.tree.map(pick, teacher, params, rows, is_leaf=lambda x: x is None)


def momentum_schedule(values: Sequence[float] = (0.99, 0.999),
                      boundaries: Sequence[int] = ()) -> Callable[[Array], Array]:
    """`step -> β`: `values[k]` from step `boundaries[k − 1]` on (`values[0]` before
    `boundaries[0]`). The paper's β is 0.99, then 0.999: `momentum_schedule((0.99, 0.999),
    (switch_step,))`."""
    values, boundaries = tuple(values), tuple(boundaries)
    if len(values) != len(boundaries) + 1:
        raise ValueError(f"smart.momentum_schedule(values={values!r}, boundaries={boundaries!r}): "
                         "needs one more value than boundaries")
    for v in values:
        _check_momentum("smart.momentum_schedule.values", v)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in boundaries) or \
            list(boundaries) != sorted(boundaries):
        raise ValueError(f"smart.momentum_schedule.boundaries={boundaries!r}: accepted: increasing "
                         "ints >= 0 (steps)")

    def schedule(step):
        index = jnp.sum(jnp.asarray(step) >= jnp.asarray(boundaries, jnp.int32)) if boundaries \
            else 0
        return jnp.asarray(values, jnp.float32)[index]

    return schedule


def _check_momentum(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name}={value!r}: accepted: a number in [0, 1] (the "
                         "paper: 0.99, then 0.999), or a schedule step -> β (momentum_schedule)")
    return float(value)


def proximal_sums(base: encoder.EncoderClassifierModel, params: Any, teacher: Any,
                  batch: Batch, rng: Array | None = None, train: bool = False) -> Array:
    """`[T]` sums over each task's rows of the Bregman divergence `ℓ_s(f(x; θ), f(x; θ̃))`
    (eq. 2), the teacher's prediction held fixed (its parameters get no gradient); None
    leaves of `teacher` are read from `params` (`full_teacher`). `SmartModel` computes the
    same inside its loss, reusing the student's forward of the adversarial term."""
    student = base.logits(params, batch, rng, train)
    fixed = base.logits(jax.lax.stop_gradient(full_teacher(teacher, params, base.frozen_patterns)),
                        batch, rng, train)
    d = row_divergence(base.num_labels, student, fixed, batch["task_id"], _token_mask(base, batch))
    return segment_sum_by_task(d * base.row_weights(batch), batch["task_id"], base.num_tasks)


def _token_mask(base: encoder.EncoderClassifierModel, batch: Batch) -> Array | None:
    """The labelled tokens `row_divergence` averages a tagging head over (None: no tagging
    head)."""
    return base.labelled_tokens(batch) if base.tagging else None


def _check_number(name: str, value: Any, *, positive: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and (
        value > 0 if positive else value >= 0)
    if not ok:
        raise ValueError(f"SmartModel.{name}={value!r}: must be a number "
                         f"{'> 0' if positive else '>= 0'}")
    return float(value)


class SmartModel(BaseModel):
    """`base`'s loss plus SMART's adversarial term `λ_s ℓ_s(f(x), f(x̃))` per row, summed
    per task (see the module docstring); evaluation (`train=False`) is `base`'s.

    Args:
      base: a ktx encoder classifier (an `encoder.EncoderClassifierModel` or subclass).
      weight: λ_s (0 turns the term off: `base`'s loss exactly).
      noise_std: σ of the initial perturbation ν ~ N(0, σ²).
      step_size: η of the ascent step.
      epsilon: ε, the ℓ∞ radius the perturbation is projected onto.
      ascent_steps: T_x̃, the number of projected ascent steps (the paper: 1).
      projection: "paper" (normalised gradient step, clip to the ε-ball) or "code" (the
        authors' code: raw gradient step, unit ∞-norm per token; see the module docstring).
      proximal_weight: μ of the Bregman proximal point term `μ ℓ_s(f(x; θ), f(x; θ̃))`
        (0: no term and no teacher: the model carries no state).
      teacher_momentum: β of the momentum teacher `θ̃ ← (1 − β) θ + β θ̃`: a number in
        [0, 1] or a schedule `step -> β` (`momentum_schedule`); 1 keeps θ̃ = θ_0.

    Aux adds `smart_adversarial` (`[T]` sums of `ℓ_s(f(x), f(x̃))`, before λ_s) in training,
    and with μ > 0 `smart_proximal` (`[T]` sums of `ℓ_s(f(x; θ), f(x; θ̃))`, before μ).
    Parameters, features, frozen patterns and normalisation are `base`'s.
    """

    def __init__(self, base: encoder.EncoderClassifierModel, *, weight: float = 1.0,
                 noise_std: float = 1e-5, step_size: float = 1e-3, epsilon: float = 1e-5,
                 ascent_steps: int = 1, projection: str = "paper",
                 proximal_weight: float = 0.0,
                 teacher_momentum: float | Callable[[Array], Array] = 0.99):
        if not isinstance(base, encoder.EncoderClassifierModel):
            raise TypeError(f"SmartModel.base={type(base).__name__}; accepted: a ktx encoder "
                            "classifier (ktx.models.encoder.EncoderClassifierModel or subclass)")
        if isinstance(ascent_steps, bool) or not isinstance(ascent_steps, int) or ascent_steps < 1:
            raise ValueError(f"SmartModel.ascent_steps={ascent_steps!r}: must be an int >= 1")
        if projection not in PROJECTIONS:
            raise ValueError(f"SmartModel.projection={projection!r}; accepted: {PROJECTIONS}")
        self.projection = projection
        self.base = base
        self.weight = _check_number("weight", weight)
        self.noise_std = _check_number("noise_std", noise_std)
        self.step_size = _check_number("step_size", step_size)
        self.epsilon = _check_number("epsilon", epsilon, positive=True)
        self.ascent_steps = ascent_steps
        self.proximal_weight = _check_number("proximal_weight", proximal_weight)
        self.teacher_momentum = teacher_momentum if callable(teacher_momentum) else \
            _check_momentum("SmartModel.teacher_momentum", teacher_momentum)
        self.num_tasks = base.num_tasks
        self.num_labels = base.num_labels
        self.loss_normalization = base.loss_normalization
        self.frozen_patterns = base.frozen_patterns

    def __repr__(self) -> str:
        return (f"SmartModel({self.base!r}, weight={self.weight}, noise_std={self.noise_std}, "
                f"step_size={self.step_size}, epsilon={self.epsilon}, "
                f"ascent_steps={self.ascent_steps}, projection={self.projection!r}, "
                f"proximal_weight={self.proximal_weight}, "
                f"teacher_momentum={self.teacher_momentum!r})")

    def init_variables(self, rng: Array, batch: Batch) -> Any:
        return self.base.init_variables(rng, batch)

    def input_spec(self, batch_size: int, feature_lengths: Mapping[str, int]
                   ) -> dict[str, jax.ShapeDtypeStruct]:
        return self.base.input_spec(batch_size, feature_lengths)

    def task_weights(self, batch: Batch) -> Array:
        return self.base.task_weights(batch)

    def logits(self, params: Any, batch: Batch, rng: Array | None = None,
               train: bool = False, **kwargs: Any) -> tuple[Array, ...]:
        """`base.logits`."""
        return self.base.logits(params, batch, rng, train, **kwargs)

    def adversarial_perturbation(self, params: Any, batch: Batch, rng: Array,
                                 clean_logits: Sequence[Array], train: bool = True) -> Array:
        """`[B, L, E]` `x̃ − x` after `ascent_steps` projected ascent steps, with no gradient
        to `params` (the inner max of `R_s`)."""
        base = self.base
        params = jax.lax.stop_gradient(params)
        clean = jax.lax.stop_gradient(tuple(clean_logits))
        task_id, mask = batch["task_id"], _token_mask(base, batch)
        shape = (batch["input_ids"].shape[1], base.config.hidden_size)
        delta = initial_noise(rng, batch, shape, self.noise_std)

        def divergence(d):  # rows are independent: the sum's gradient is per row
            out = base.logits(params, batch, rng, train, embedding_perturbation=d)
            return row_divergence(base.num_labels, clean, out, task_id, mask).sum()

        for _ in range(self.ascent_steps):
            g = jax.grad(divergence)(delta)
            if self.projection == "paper":
                g_inf = jnp.max(jnp.abs(g), axis=(1, 2), keepdims=True)
                delta = jnp.clip(delta + self.step_size * g / (g_inf + _GRAD_EPS),
                                 -self.epsilon, self.epsilon)
            else:
                delta = delta + self.step_size * g
                delta = delta / (jnp.max(jnp.abs(delta), axis=-1, keepdims=True) + self.epsilon)
        return jax.lax.stop_gradient(delta)

    # -- the proximal term's teacher: the model state -----------------------------------

    def init_model_state(self, params: Any) -> Any:
        """`{"teacher": θ̃_1}` = the step-0 parameters (Algorithm 1, line 1), None for a
        frozen parameter (read from θ, which it equals); None with μ = 0. A scanned stack's
        partly frozen leaf is copied whole (its frozen rows equal θ's and stay so)."""
        if self.proximal_weight == 0.0:
            return None
        frozen = treepath.select(params, self.frozen_patterns, strict=False)
        teacher = jax.tree.map(lambda m, p: None if m is True else jnp.array(p, copy=True),
                               frozen, params)
        return {"teacher": teacher}

    def momentum(self, step: Array) -> Array:
        """β at 0-based step `step`."""
        if callable(self.teacher_momentum):
            return jnp.asarray(self.teacher_momentum(step), jnp.float32)
        return jnp.asarray(self.teacher_momentum, jnp.float32)

    def update_model_state(self, model_state: Any, params: Any, step: Array) -> Any:
        """`θ̃ ← (1 − β(step)) θ + β(step) θ̃` with θ the parameters step `step` produced
        (Algorithm 1, line 14)."""
        if model_state is None:
            return None
        return {"teacher": teacher_update(model_state["teacher"], params, self.momentum(step))}

    # -- losses ------------------------------------------------------------------------

    def loss_sums(self, params: Any, batch: Batch, rng: Array | None, train: bool
                  ) -> tuple[Array, dict[str, Array]]:
        """The base loss plus the adversarial term (the proximal term needs the teacher:
        `loss_sums_with_state`)."""
        return self._loss_sums(params, None, batch, rng, train)

    def loss_sums_with_state(self, params: Any, model_state: Any, batch: Batch,
                             rng: Array | None, train: bool) -> tuple[Array, dict[str, Array]]:
        """The base loss plus the adversarial term plus, with μ > 0, the proximal term
        against `model_state["teacher"]` (no gradient to the teacher)."""
        if train and self.proximal_weight > 0.0 and model_state is None:
            raise ValueError(
                f"SmartModel(proximal_weight={self.proximal_weight}) in training needs its "
                "teacher: the train state's model_state (ktx.training.trainer.TrainState, "
                "from SmartModel.init_model_state(params))")
        return self._loss_sums(params, model_state, batch, rng, train)

    def _loss_sums(self, params, model_state, batch, rng, train):
        base = self.base
        proximal = train and self.proximal_weight > 0.0 and model_state is not None
        if not train or (self.weight == 0.0 and not proximal):
            return base.loss_sums(params, batch, rng, train)
        if rng is None:
            raise ValueError("SmartModel.loss_sums(train=True) needs an rng (SMART's noise "
                             "and dropout)")
        teacher = None
        if proximal:  # before the frozen leaves' stop_gradient: the teacher reads θ's
            teacher = jax.lax.stop_gradient(
                full_teacher(model_state["teacher"], params, base.frozen_patterns))
        params = encoder.stop_frozen_gradients(params, base.frozen_patterns)
        clean = base.logits(params, batch, rng, train)
        sums, aux = base.loss_sums_from_logits(clean, batch)
        weights, task_id = base.row_weights(batch), batch["task_id"]
        mask = _token_mask(base, batch)
        if self.weight > 0.0:
            delta = self.adversarial_perturbation(params, batch, rng, clean, train)
            adversarial = base.logits(params, batch, rng, train, embedding_perturbation=delta)
            d = row_divergence(base.num_labels, clean, adversarial, task_id, mask)
            term = segment_sum_by_task(d * weights, task_id, self.num_tasks)
            sums = sums + self.weight * term
            aux = dict(aux, smart_adversarial=term)
        if proximal:
            # The same dropout keys as the student's forward: θ̃ = θ gives exactly 0.
            fixed = jax.lax.stop_gradient(base.logits(teacher, batch, rng, train))
            d = row_divergence(base.num_labels, clean, fixed, task_id, mask)
            term = segment_sum_by_task(d * weights, task_id, self.num_tasks)
            sums = sums + self.proximal_weight * term
            aux = dict(aux, smart_proximal=term)
        return sums, aux
