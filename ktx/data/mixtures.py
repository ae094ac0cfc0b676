"""What the SeqIO registry says about a task or mixture: its tasks in task-id order, its
registered rates, each task's kind, an encoder mixture's head sizes; and one shard of a
task's split (`get_dataset`).

Task ids are indices in the mixture's registration order (sub-mixtures flattened in
place, first occurrence wins), not the alphabetical order of `seqio.Mixture.tasks`.
"""

from __future__ import annotations

import inspect

import numpy as np
import seqio

from ktx.data import encoder_features as ef
from ktx.data import mlm_features

__all__ = ["TASK_KINDS", "KIND_NAMES", "encoder_num_labels", "get_dataset", "mixture_rates",
           "mixture_task_names", "task_kind"]

TASK_KINDS = ("enc_dec", "encoder", "mlm")
KIND_NAMES = {"enc_dec": "encoder-decoder", "encoder": "encoder", "mlm": "masked-LM"}


def get_dataset(seqio_task: seqio.Task, shard: seqio.ShardInfo | None, **kwargs):
    """`seqio_task.get_dataset(**kwargs)` of one shard (`shard_info`) or of the whole split.

    SeqIO hands `shard_info` to the task's source when the source says it supports
    arbitrary sharding or lists at least `num_shards` shards of the split (ktx's sources
    shard their examples with `tf.data.Dataset.shard`), else it shards the source's
    examples itself (`seqio.FunctionDataSource`). A source that would be handed
    `shard_info` but whose `get_dataset` does not take it raises, naming the task.
    """
    if shard is None:
        return seqio_task.get_dataset(**kwargs)
    source = seqio_task.source
    if not kwargs.get("use_cached") and (
            source.supports_arbitrary_sharding
            or len(source.list_shards(kwargs["split"])) >= shard.num_shards):
        if "shard_info" not in inspect.signature(source.get_dataset).parameters:
            raise ValueError(
                f"task {seqio_task.name!r}: its source {type(source).__name__} is handed "
                f"shard_info (shard {shard.index} of {shard.num_shards}) but its get_dataset "
                "takes no shard_info argument; give it one (read only that shard) or pass "
                "shard_by_process=False")
    return seqio_task.get_dataset(shard_info=shard, **kwargs)


def _get_provider(name: str) -> seqio.Task | seqio.Mixture:
    if not isinstance(name, str) or not name:
        raise ValueError(f"mixture_or_task_name={name!r}; accepted: a registered SeqIO task or mixture name")
    try:
        return seqio.get_mixture_or_task(name)
    except ValueError as e:
        raise ValueError(
            f"mixture_or_task_name={name!r} is not registered ({e}); did you import ktx.tasks?"
        ) from e


def mixture_task_names(mixture_or_task_name: str) -> tuple[str, ...]:
    """Task names in registration order (task id = index); sub-mixtures flattened."""
    provider = _get_provider(mixture_or_task_name)
    if isinstance(provider, seqio.Task):
        return (provider.name,)
    names: list[str] = []
    for name in provider.rate_per_task_name:
        for sub in mixture_task_names(name):
            if sub not in names:
                names.append(sub)
    return tuple(names)


def mixture_rates(mixture_or_task_name: str) -> np.ndarray:
    """`[T]` the rates the mixture was registered with (1 for a single task)."""
    provider = _get_provider(mixture_or_task_name)
    names = mixture_task_names(mixture_or_task_name)
    if isinstance(provider, seqio.Task):
        return np.ones(1)
    rates = []
    for name in names:
        try:
            rates.append(float(provider.get_rate(seqio.get_mixture_or_task(name))))
        except Exception as e:  # rate functions may need task statistics that are absent
            raise ValueError(
                f"mixture {mixture_or_task_name!r}: the registered rate of task {name!r} cannot "
                f"be computed ({type(e).__name__}: {e}); pass mixing='proportional' (or another "
                f"ktx.data.mixing kind) to compute rates from the cached task sizes"
            ) from e
    return np.asarray(rates)


def task_kind(task_name: str) -> str:
    """"encoder" for an encoder task (`ktx.data.encoder_features.is_encoder_task`), "mlm"
    for a masked-LM encoder task (`ktx.data.mlm_features.is_mlm_task`), "enc_dec" for an
    inputs/targets task; anything else raises naming its features."""
    task = seqio.get_mixture_or_task(task_name)
    if ef.is_encoder_task(task):
        return "encoder"
    if mlm_features.is_mlm_task(task):
        return "mlm"
    if {"inputs", "targets"} <= set(task.output_features):
        return "enc_dec"
    raise ValueError(
        f"task {task_name!r} has output features {sorted(task.output_features)}; MultiTaskInput "
        "converts encoder-decoder tasks (inputs, targets), encoder tasks (text_a, text_b, "
        "label: ktx.data.encoder_features) and masked-LM tasks (text_a, text_b, mlm_a, mlm_b: "
        "ktx.data.mlm_features)")


def encoder_num_labels(mixture_or_task_name: str) -> tuple[int, ...]:
    """The head size each encoder task of a mixture needs (task-id order; 1 = regression)."""
    return tuple(ef.label_space(seqio.get_mixture_or_task(n)).num_labels
                 for n in mixture_task_names(mixture_or_task_name))
