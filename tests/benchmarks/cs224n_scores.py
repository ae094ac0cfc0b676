"""The CS224N multitask project's dev scores of an encoder run (as the SlapBERT and
TEA-BERT reports score them): SST-5 accuracy, Quora paraphrase accuracy, STS Pearson r,
and overall = mean(SST acc, Quora acc, (r + 1) / 2). A run trained on some of the three
tasks (single-task fine-tuning: one) is scored on those; overall needs all three.

    KTX_DATA_DIR=... python tests/benchmarks/cs224n_scores.py \
      --gin_file=experiments/cs224n_encoders/minilm_l6.gin --gin.MODEL_DIR="'/tmp/run'" \
      --gin.INITIAL_CHECKPOINT_PATH="'hf:DIR'" --gin.ENCODER_VOCAB="'DIR'" [--step N]

The gin flags are the run's own (they build its model and input); the latest checkpoint
of MODEL_DIR (or `--step`) is scored on each task's `validation` split (Quora: the part of
quora-dev that `cs224n_quora_bert_v001` holds out). Prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import numpy as np
import scipy.stats

from ktx import partitioning
from ktx.cli import gin_config
from ktx.runs.eval import abstract_params_for
from ktx.training.checkpoints import resolve_checkpoint, restore_params
from ktx.training.trainer import Trainer

TASKS = ("cs224n_sst5_bert_v001", "cs224n_quora_bert_v001", "cs224n_sts_bert_v001")


def overall(scores: dict) -> float:
    """The CS224N project's overall dev score: mean(SST acc, Quora acc, (r + 1) / 2)."""
    return float(np.mean([scores["sst_accuracy"], scores["quora_accuracy"],
                          (scores["sts_pearson"] + 1) / 2]))


def main(argv: list[str]) -> dict:
    rest, bindings = gin_config._split_gin_flags(argv)  # noqa: SLF001 - the CLI's flag reader
    parser = argparse.ArgumentParser()
    parser.add_argument("--gin_file", action="append", default=[])
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--batch_size", type=int, default=64)
    args = parser.parse_args(rest)
    gin_config.parse_gin(args.gin_file, bindings)
    import gin

    from ktx.data import files

    files.set_data_dir(gin_config._query_macro("DATA_DIR") or None)  # noqa: SLF001
    files.set_on_bad_row(gin_config._query_macro("ON_BAD_ROW"))  # noqa: SLF001
    model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    train_input = gin.query_parameter("train_script.train.train_input").scoped_configurable_fn()
    model_dir = gin_config._query_macro("MODEL_DIR")  # noqa: SLF001
    names = tuple(train_input.task_names)
    if not names or not set(names) <= set(TASKS) or len(set(names)) != len(names):
        raise ValueError(f"the run's tasks are {names}; this script scores {TASKS} "
                         "(all three, or some of them: single-task runs)")
    trainer = Trainer(model, __import__("optax").sgd(0.0), mesh=partitioning.create_mesh(1))
    lengths = dict(train_input.task_feature_lengths)
    abstract = abstract_params_for(model, trainer, args.batch_size, lengths)
    params, step = restore_params(resolve_checkpoint(model_dir, args.step), abstract)
    logits_fn = jax.jit(lambda p, b: model.logits(p, b))
    scores = {}
    for t, name in enumerate(names):
        preds, labels = [], []
        for batch, num_real in train_input.eval_batches(name, "validation", args.batch_size):
            out = np.asarray(jax.device_get(logits_fn(params, batch)[t]))[:num_real]
            labels.append(np.asarray(batch["label"])[:num_real])
            preds.append(out[:, 0] if out.shape[1] == 1 else out.argmax(-1))
        p, y = np.concatenate(preds), np.concatenate(labels)
        if name == "cs224n_sts_bert_v001":
            scores["sts_pearson"] = float(scipy.stats.pearsonr(p, y)[0])
        else:
            key = "sst_accuracy" if "sst5" in name else "quora_accuracy"
            scores[key] = float(np.mean(p == y.astype(np.int64)))
        scores[f"{name}_examples"] = int(len(y))
    if len(names) == len(TASKS):
        scores["overall"] = overall(scores)
    out = {"benchmark": "cs224n_scores", "model_dir": str(model_dir), "step": int(step), **scores}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
