"""SeqIO tasks for the Tmall multi-behaviour data and their mixture.

Tasks `recsys_tmall_{buy,collect,cart}_v1` (task ids 0, 1, 2: the target first) and the
mixture `recsys_tmall_v1` (rates proportional to training interactions). Each example is
one observed interaction: `user` int32, `item` int32, `label` float32 (1.0), `task_id`
int32. Splits: `train` for every behaviour (auxiliaries with the target's validation and
test pairs removed, see `ktx.data.recsys`), `validation` and `test` for `buy` only.
Files are read from `<data_dir>/recsys/tmall` (`ktx.tasks.config`) when a dataset is
built, never at import. Training with sampled negatives and full-ranking evaluation use
`ktx.data.recsys.RecsysTrainInput` and `ktx.metrics.ranking` on the same data.
"""

from __future__ import annotations

import functools

import numpy as np
import seqio
import tensorflow as tf

from ktx.data import recsys as recsys_data
from ktx.tasks import config

__all__ = ["TMALL_BEHAVIOURS", "TMALL_MIXTURE", "tmall_task_name", "tmall_dataset"]

TMALL_BEHAVIOURS = ("buy", "collect", "cart")
TMALL_MIXTURE = "recsys_tmall_v1"


def tmall_task_name(behaviour: str) -> str:
    return f"recsys_tmall_{behaviour}_v1"


@functools.lru_cache(maxsize=4)
def _load(data_dir: str, on_bad_row: str) -> recsys_data.MultiBehaviorData:
    import pathlib

    return recsys_data.load_tmall_pairs(
        pathlib.Path(data_dir) / "recsys" / "tmall",
        target=TMALL_BEHAVIOURS[0],
        auxiliaries=TMALL_BEHAVIOURS[1:],
        on_bad_row=on_bad_row,
    )


def tmall_dataset(behaviour: str, split: str, shuffle_files: bool = False, seed: int | None = None) -> tf.data.Dataset:
    """Positive interactions of `behaviour` in `split` as a `tf.data.Dataset`."""
    if behaviour not in TMALL_BEHAVIOURS:
        raise ValueError(f"behaviour={behaviour!r}; accepted: {TMALL_BEHAVIOURS}")
    data = _load(str(config.get_data_dir()), config.get_on_bad_row())
    if split == "train":
        pairs = data.train[behaviour]
    elif split in ("validation", "test") and behaviour == data.target:
        pairs = data.validation if split == "validation" else data.test
    else:
        raise ValueError(
            f"split={split!r} for behaviour {behaviour!r}; accepted: 'train'"
            + (", 'validation', 'test'" if behaviour == data.target else "")
        )
    del shuffle_files, seed  # one file per split; ordering is the file's
    n = len(pairs)
    return tf.data.Dataset.from_tensor_slices({
        "user": pairs[:, 0].astype(np.int32),
        "item": pairs[:, 1].astype(np.int32),
        "label": np.ones(n, np.float32),
        "task_id": np.full(n, TMALL_BEHAVIOURS.index(behaviour), np.int32),
    })


def _register() -> None:
    # Integer ids pass through unchanged: one scalar per example.
    features = {
        name: seqio.Feature(
            seqio.PassThroughVocabulary(size=0), add_eos=False, dtype=dtype, rank=0, required=True
        )
        for name, dtype in (("user", tf.int32), ("item", tf.int32), ("label", tf.float32),
                            ("task_id", tf.int32))
    }
    for behaviour in TMALL_BEHAVIOURS:
        name = tmall_task_name(behaviour)
        splits = ("train", "validation", "test") if behaviour == "buy" else ("train",)
        if name in seqio.TaskRegistry.names():
            seqio.TaskRegistry.remove(name)
        seqio.TaskRegistry.add(
            name,
            source=seqio.FunctionDataSource(
                dataset_fn=functools.partial(_dataset_fn, behaviour), splits=splits
            ),
            preprocessors=[],
            output_features=features,
        )
    if TMALL_MIXTURE in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(TMALL_MIXTURE)
    # Rates: training interactions of the shared Tmall data (buy, collect, cart), so the
    # mixture samples behaviours in proportion to their data, as the epoch of
    # RecsysTrainInput does.
    seqio.MixtureRegistry.add(
        TMALL_MIXTURE,
        [(tmall_task_name("buy"), 181428), (tmall_task_name("collect"), 210852),
         (tmall_task_name("cart"), 1868)],
    )


def _dataset_fn(behaviour: str, split: str, shuffle_files: bool, seed: int | None = None):
    return tmall_dataset(behaviour, split, shuffle_files, seed)


_register()
