"""Multi-behaviour interaction data for the MetaBalance recommendation study.

The public names of four modules, each one step of the data's way to a model:

* `ktx.data.recsys_readers`: reading the raw files (UserBehavior, IJCAI-15, per-behaviour
  pair and list files, MovieLens, a given held-out test file) into `Interactions`,
  each bad row raised or counted naming its file and line.
* `ktx.data.recsys_prepare`: filters, contiguous ids, the per-user 70/10/20 split and
  leakage removal (He et al., 2022) into `MultiBehaviorData`; the shared Tmall folder
  (`load_tmall_pairs`).
* `ktx.data.recsys_input`: `RecsysTrainInput`, the training batches (task-partitioned
  rows, or the authors' shared rows carrying every behaviour's label) with fresh
  negatives every epoch.
* `ktx.data.recsys_eval_pairs`: what full-ranking evaluation reads (the ranked users,
  the excluded training pairs, per-user item lists).

Gin files and callers import them from here (`import ktx.data.recsys as recsys_data`).
"""

from __future__ import annotations

from ktx.data.recsys_eval_pairs import subsample_users, training_exclusions, user_item_lists
from ktx.data.recsys_input import RecsysTrainInput
from ktx.data.recsys_prepare import (
    MultiBehaviorData,
    data_size,
    load_tmall_pairs,
    prepare_multibehavior,
)
from ktx.data.recsys_readers import (
    HELDOUT_LAYOUTS,
    IJCAI15_ACTIONS,
    IJCAI15_HEADER,
    MOVIELENS_RATING_THRESHOLDS,
    USER_BEHAVIOR_ACTIONS,
    Interactions,
    read_behaviour_lists,
    read_behaviour_pairs,
    read_heldout,
    read_ijcai15_log,
    read_list_file,
    read_movielens,
    read_pair_file,
    read_user_behavior,
)

__all__ = [
    "USER_BEHAVIOR_ACTIONS",
    "IJCAI15_ACTIONS",
    "IJCAI15_HEADER",
    "HELDOUT_LAYOUTS",
    "Interactions",
    "MultiBehaviorData",
    "read_user_behavior",
    "read_ijcai15_log",
    "read_pair_file",
    "read_list_file",
    "read_behaviour_pairs",
    "read_behaviour_lists",
    "read_movielens",
    "read_heldout",
    "MOVIELENS_RATING_THRESHOLDS",
    "prepare_multibehavior",
    "load_tmall_pairs",
    "data_size",
    "subsample_users",
    "training_exclusions",
    "RecsysTrainInput",
    "user_item_lists",
]
