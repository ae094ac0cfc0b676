"""What MGDA's min-norm weights do on the recommendation study, step by step.

Trains the study's MGDA configuration (`ktx.studies.recsys.run_config` with
`ktx.optim.mgda()`, 4 negatives per positive as the paper's budget) and records, at every
step, each task's gradient norm over the shared parameters and the min-norm weights MGDA
chose. The recording wraps the two functions of `ktx.optim.mgda` that compute them (the
Gram matrix and the weighted combination) with `jax.debug.callback`, so it sees exactly
what the balancer used; the run takes one step per compiled call (the trajectory does
not depend on it). Given `--model_dir` of an earlier run, the run resumes from that
directory's latest checkpoint (as `ktx train` does) and records the epochs it trains.

It prints one JSON line per trained epoch and a last summary line: per task, the share
of steps whose shared gradient is exactly zero, the mean weight, and the share of steps
where MGDA put a weight above 0.999 on a task with a zero gradient (its min-norm point is
then zero: the shared parameters get no gradient that step).

    KTX_DATA_DIR=../shared/data python tests/benchmarks/mgda_zero_gradients.py \
        [--steps_per_epoch 200] [--max_epochs 1] [--model_dir DIR] [--out steps.json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json

import jax
import numpy as np

from ktx import optim
from ktx.data import recsys as recsys_data
from ktx.studies import recsys as study

_MGDA = importlib.import_module("ktx.optim.mgda")


@contextlib.contextmanager
def recording(steps: list[dict]):
    """Appends `{"norms": [T], "alpha": [T]}` to `steps` for every MGDA update."""
    gram_fn, combine_fn = _MGDA.global_gram, _MGDA.combine_with_weights

    def gram(stacked):
        g = gram_fn(stacked)
        jax.debug.callback(
            lambda x: steps.append({"norms": np.sqrt(np.maximum(np.diag(np.asarray(x)), 0)).tolist()}), g)
        return g

    def combine(updates, alpha):
        jax.debug.callback(lambda a: steps[-1].__setitem__("alpha", np.asarray(a).tolist()), alpha)
        return combine_fn(updates, alpha)

    _MGDA.global_gram, _MGDA.combine_with_weights = gram, combine
    try:
        yield
    finally:
        _MGDA.global_gram, _MGDA.combine_with_weights = gram_fn, combine_fn


def summary(steps: list[dict], names: list[str]) -> dict:
    norms = np.array([s["norms"] for s in steps])
    alpha = np.array([s["alpha"] for s in steps])
    zero = norms == 0.0
    top = alpha.argmax(1)
    stalled = (alpha.max(1) > 0.999) & zero[np.arange(len(top)), top]
    return {
        "steps": len(steps),
        "zero_gradient_share": dict(zip(names, np.round(zero.mean(0), 4).tolist())),
        "mean_weight": dict(zip(names, np.round(alpha.mean(0), 4).tolist())),
        "median_norm": dict(zip(names, np.round(np.median(norms, 0), 6).tolist())),
        "stalled_share": round(float(stalled.mean()), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps_per_epoch", type=int, default=200, help="0: full epochs")
    ap.add_argument("--max_epochs", type=int, default=1)
    ap.add_argument("--model_dir", default=None,
                    help="run directory to resume (and to write); default: a temporary one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write every step's norms and weights here (JSON)")
    args = ap.parse_args()
    data = recsys_data.load_tmall_pairs(None)  # names KTX_DATA_DIR when it is unset
    names = list(data.behaviours)
    steps: list[dict] = []
    with recording(steps):
        result = study.run_config(
            data, balancer=optim.mgda(), seed=args.seed, max_epochs=args.max_epochs,
            patience=20, num_negatives=4, steps_per_epoch=args.steps_per_epoch or None,
            eval_max_users=2000, test_max_users=8000, steps_per_call=1, verbose=False,
            model_dir=args.model_dir)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(steps, f)
    n = result["steps_per_epoch"]
    first = result["resumed_from_epoch"] + 1
    for k in range(0, len(steps), n):
        print(json.dumps({"epoch": first + k // n, **summary(steps[k:k + n], names)}))
    print(json.dumps({"benchmark": "mgda_zero_gradients", "epochs": result["epochs"],
                      "best_epoch": result["best_epoch"],
                      "validation_ndcg@10": [round(v, 5) for v in result["history"]],
                      "train_objective": [round(v, 4) for v in result["train_loss"]],
                      **summary(steps, names)}))


if __name__ == "__main__":
    main()
