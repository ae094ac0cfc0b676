"""How much of a move in the study's NDCG@10 is sampling noise of the ranked users.

The recommendation study early-stops on the mean NDCG@10 of a fixed random subset of the
validation users (`--eval_max_users`) and reports test metrics on another subset
(`--test_max_users`). This measures the standard error of such a mean on the shared
Tmall data: the popularity ranking (no training, deterministic; its NDCG@10 is of the
trained models' order) of each subset, the subset's users cut into `--groups` random
groups of equal size, standard error = sd(group means) / sqrt(groups). The output is
one JSON line on stdout, last.

    KTX_DATA_DIR=../shared/data python tests/benchmarks/ranking_noise.py \
        [--validation_users 2000] [--test_users 8000] [--groups 20]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from ktx.data import recsys as recsys_data
from ktx.metrics.ranking import full_ranking
from ktx.models.recsys import PopularityScorer


def subset_noise(data, split: str, max_users: int | None, groups: int, seed: int = 0) -> dict:
    """Mean NDCG@10 of the popularity ranking over `split`'s subset and its standard error."""
    held = recsys_data.subsample_users(getattr(data, split), max_users)
    users = np.unique(held[:, 0])
    if groups < 2 or groups > len(users):
        raise SystemExit(f"--groups {groups}: expected 2 to {len(users)} (the {split} users)")
    pop = PopularityScorer()
    params = pop.params(data.train[data.target], data.num_items)
    exclude = recsys_data.training_exclusions(data, "all")

    def ndcg(pairs):
        return full_ranking(pop, params, num_users=data.num_users, num_items=data.num_items,
                            heldout=pairs, exclude=exclude)["ndcg@10"]

    parts = np.array_split(np.random.default_rng(seed).permutation(users), groups)
    means = np.array([ndcg(held[np.isin(held[:, 0], part)]) for part in parts])
    return {"users": int(len(users)), "ndcg@10": round(ndcg(held), 5),
            "standard_error": round(float(means.std(ddof=1) / np.sqrt(groups)), 5)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--validation_users", type=int, default=2000, help="0: all")
    ap.add_argument("--test_users", type=int, default=8000, help="0: all")
    ap.add_argument("--groups", type=int, default=20)
    args = ap.parse_args()
    data = recsys_data.load_tmall_pairs(None)
    out = {"benchmark": "ranking_noise", "groups": args.groups}
    for split, n in (("validation", args.validation_users), ("test", args.test_users)):
        out[split] = subset_noise(data, split, n or None, args.groups)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
