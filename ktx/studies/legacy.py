"""Records written before `ktx study`, read as they are (docs/results/{cs224n,glue,recsys}).

Three layouts, told apart by their keys; each becomes a record's arm, seed, budget
bindings, metrics and wall time under the names the study files in `gin/studies/` give:

- CS224N (`method`, `scores`): arm = method; budget = TRAIN_STEPS, MAX_SEQ_LENGTH and the
  peak learning rate (records without it ran at 5e-5); metrics = the scores
  (`sst_accuracy`, `quora_accuracy`, `sts_pearson`, `overall`); wall time
  `train_seconds` (None for a resumed run).
- GLUE (`method`, `mixing`, `metrics`): arm = method, `_equal` added for equal mixing;
  metrics = `validation_metrics/<task>/<metric>` and `glue_average`.
- MetaBalance on Tmall (`experiment`, `result`): arm = experiment, `_r<relax factor>` added
  when the record has one; budget = its bindings but SEED and RELAX_FACTOR (the runner's
  patience as EARLY_STOPPING_PATIENCE); metrics = `validation_ranking/buy/<metric>` and
  `test_ranking/buy/<metric>` at the best epoch (the ranking evaluators' names); wall
  time `wall_seconds`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["adapt", "CS224N_BUDGET", "TMALL_TARGET"]

TMALL_TARGET = "buy"

# The CS224N and GLUE scripts' budget flags, as gin bindings, and their defaults.
CS224N_BUDGET = {
    "steps": ("TRAIN_STEPS", 600),
    "max_seq_length": ("MAX_SEQ_LENGTH", 64),
    "peak_learning_rate": ("optimizers.linear_decay_schedule.peak_learning_rate", 5e-5),
}


def _encoder_budget(data: Mapping[str, Any]) -> dict[str, Any]:
    return {binding: data.get(key, default) for key, (binding, default) in CS224N_BUDGET.items()}


def adapt(data: Mapping[str, Any]) -> dict[str, Any] | None:
    """`Record` fields of a legacy record (None: not one)."""
    if "method" in data and "scores" in data:  # tests/benchmarks/cs224n_study.py
        metrics = {k: float(v) for k, v in data["scores"].items()
                   if k != "step" and not k.endswith("_examples")}
        return dict(arm=data["method"], seed=int(data["seed"]), budget_bindings=_encoder_budget(data),
                    metrics=metrics, wall_seconds=data.get("train_seconds"))
    if "method" in data and "mixing" in data and "metrics" in data:  # glue_study.py
        metrics = {f"validation_metrics/{task}/{name}": float(value)
                   for task, values in data["metrics"].items() for name, value in values.items()
                   if name != "examples"}
        metrics["glue_average"] = float(data["glue_average"])
        arm = data["method"] + ("" if data["mixing"] == "mixture" else f"_{data['mixing']}")
        return dict(arm=arm, seed=int(data["seed"]), budget_bindings=_encoder_budget(data),
                    metrics=metrics, wall_seconds=data.get("train_seconds"))
    if "experiment" in data and "result" in data:  # metabalance_recsys.py
        bindings = dict(data["bindings"])
        # The study runner's patience is the models' EARLY_STOPPING_PATIENCE under ktx train.
        if "recsys_study.run_config.patience" in bindings:
            bindings["EARLY_STOPPING_PATIENCE"] = bindings.pop("recsys_study.run_config.patience")
        seed = int(bindings.pop("SEED"))
        relax = bindings.pop("RELAX_FACTOR", None)
        result = data["result"]
        # The ranking evaluators' rows under `ktx train` and `ktx eval` (target: buy).
        metrics = {f"{split}_ranking/{TMALL_TARGET}/{k}": float(v)
                   for split in ("validation", "test") for k, v in result[split].items()}
        arm = data["experiment"] + ("" if relax is None else f"_r{relax}")
        return dict(arm=arm, seed=seed, budget_bindings=bindings, metrics=metrics,
                    wall_seconds=data.get("wall_seconds"))
    return None
