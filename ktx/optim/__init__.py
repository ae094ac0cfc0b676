"""Multi-task gradients and balancing: per-task gradients in one compiled step, and
MetaBalance with its baselines as optax transformations (see docs/balancing.md)::

    task_losses, aux, task_grads = ktx.optim.compute_task_gradients(
        loss_sums_fn, model.normalizer(batch), params, batch,
        num_tasks=T, task_counts=counts)
    tx = optax.chain(ktx.optim.metabalance(relax_factor=0.7, num_tasks=T), optax.adam(1e-3))
    opt_state = tx.init(params)
    updates, opt_state = tx.update(task_grads, opt_state, params, task_losses=task_losses,
                                   task_present=counts > 0)

Balancers take a `TaskGradients` only; wrap a tree of `[T, *param_shape]` arrays with
`TaskGradients.from_stacked(tree)`. Those whose weights depend on the losses only
(`LossWeighting`: Single-Loss, Vanilla-Multi, fixed weights, Uncertainty, DWA) also say
their weights before any gradient (`tx.weights(state, task_losses, task_present)`), and
`loss_weighted_gradient` then builds the combined gradient at a plain step's cost.
"""

from ktx.optim.diagnostics import PackedScalars, diagnostics, find_metabalance_state
from ktx.optim.engine import (
    METHODS,
    compute_task_gradients,
    loss_weighted_gradient,
    split_shared,
)
from ktx.optim.loss_weighting import (
    DWAState,
    GradNormState,
    UncertaintyState,
    dwa,
    gradnorm,
    uncertainty,
)
from ktx.optim.metabalance import STRATEGIES, MetaBalanceState, metabalance
from ktx.optim.mgda import NORMALIZATIONS, mgda, min_norm_weights
from ktx.optim.mtadam import MTAdamState, mtadam
from ktx.optim.num_tasks import resolve_num_tasks
from ktx.optim.olaux import OLAuxState, olaux
from ktx.optim.plots import plot_gradient_magnitudes, read_gradient_magnitudes
from ktx.optim.selection import (
    DEFAULT_UNSHARED_PATTERNS,
    group_names,
    param_names,
    shared_mask,
)
from ktx.optim.surgery import PCGradState, grad_similarity, pcgrad, pcgrad_weights
from ktx.optim.task_gradients import SparseRows, TaskGradients, as_task_gradients
from ktx.optim.weighting import (
    LossWeighting,
    fixed_weights,
    loss_weighting,
    single_loss,
    vanilla_multi,
)

__all__ = [
    "METHODS",
    "STRATEGIES",
    "NORMALIZATIONS",
    "DEFAULT_UNSHARED_PATTERNS",
    "compute_task_gradients",
    "loss_weighted_gradient",
    "LossWeighting",
    "loss_weighting",
    "split_shared",
    "TaskGradients",
    "SparseRows",
    "as_task_gradients",
    "shared_mask",
    "param_names",
    "group_names",
    "resolve_num_tasks",
    "metabalance",
    "MetaBalanceState",
    "single_loss",
    "vanilla_multi",
    "fixed_weights",
    "uncertainty",
    "UncertaintyState",
    "dwa",
    "DWAState",
    "gradnorm",
    "GradNormState",
    "mgda",
    "min_norm_weights",
    "mtadam",
    "MTAdamState",
    "olaux",
    "OLAuxState",
    "pcgrad",
    "pcgrad_weights",
    "PCGradState",
    "grad_similarity",
    "diagnostics",
    "PackedScalars",
    "find_metabalance_state",
    "plot_gradient_magnitudes",
    "read_gradient_magnitudes",
    "BALANCERS",
]

BALANCERS = {
    "metabalance": metabalance,
    "single_loss": single_loss,
    "vanilla_multi": vanilla_multi,
    "fixed_weights": fixed_weights,
    "uncertainty": uncertainty,
    "dwa": dwa,
    "gradnorm": gradnorm,
    "mgda": mgda,
    "mtadam": mtadam,
    "grad_similarity": grad_similarity,
    "pcgrad": pcgrad,
    "olaux": olaux,
}
