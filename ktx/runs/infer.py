"""`infer(...)`: decode a split of every task of a mixture and write JSONL predictions.

Each output line is `{"task": name, "index": i, "inputs": text, "targets": text,
"prediction": text, "prediction_tokens": [...]}`, where texts are the examples'
`*_pretokenized` strings when the task has them, else the detokenized ids.

With `leaderboard="glue"` or `"super_glue"` it decodes the benchmark's test splits instead
of `split` (MNLI's matched/mismatched and the diagnostics AX, AX-b, AX-g included, with the
task id of the mixture's MNLI / RTE task; `ktx.runs.leaderboard.plan_decodes`), adds "split"
and the test file's "idx" to each line, and writes the submission files into
`leaderboard_dir` (`ktx.runs.leaderboard.write_submission`: official labels, invalid outputs
counted and replaced by the task's default, row counts checked against the test files).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from ktx.runs import leaderboard as lb
from ktx import partitioning
from ktx.training.checkpoints import resolve_checkpoint, restore_params
from ktx.data import feature_converter as fc
from ktx.runs.eval import _local_rows, _pad, _strip, abstract_params_for, make_predict_fn
from ktx.models.base import BaseModel
from ktx.models.decoding import check_sampling
from ktx.training.trainer import Trainer

__all__ = ["infer", "encode_batch"]


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def encode_batch(examples: list[dict], task_id: int, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
    """Model features for decoding: `encoder_input_tokens [B, Le]` (trimmed/padded with
    0), `decoder_target_tokens [B, Ld]` (only its length is used) and `task_id [B]`."""
    le, ld = lengths["inputs"], lengths["targets"]
    enc = np.zeros((len(examples), le), np.int32)
    dec = np.zeros((len(examples), ld), np.int32)
    for i, ex in enumerate(examples):
        ids = np.asarray(ex["inputs"], np.int32)[:le]
        enc[i, : len(ids)] = ids
        if "targets" in ex:
            t = np.asarray(ex["targets"], np.int32)[:ld]
            dec[i, : len(t)] = t
    return fc.add_task_id({"encoder_input_tokens": enc, "decoder_target_tokens": dec},
                          task_id, np.int32)


def infer(
    *,
    model: BaseModel,
    checkpoint_path: str | os.PathLike,
    mixture_or_task_name: str,
    task_feature_lengths: Mapping[str, int],
    output_file: str | os.PathLike,
    split: str = "validation",
    checkpoint_step: int | None = None,
    batch_size: int = 32,
    num_partitions: int = 1,
    num_examples: int | None = None,
    decode_method: str = "greedy",
    num_beams: int = 4,
    alpha: float = 0.6,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 0,
    leaderboard: str | None = None,
    leaderboard_dir: str | os.PathLike | None = None,
) -> int:
    """Writes predictions of `checkpoint_path` (a run dir, checkpoints dir or step dir;
    latest step unless `checkpoint_step`) for `split` of each task; returns the number
    of lines written. `leaderboard` ("glue" | "super_glue"): decode the benchmark's test
    splits and write its submission files into `leaderboard_dir` (see the module doc).
    `decode_method`: "greedy", "beam" (`num_beams`, `alpha`) or "sample" (`temperature`,
    `top_k`, `top_p`, `seed`: `ktx.models.decoding.temperature_sample`; example `i` of a
    split draws with the key of `(seed, i)`, so its sample does not depend on the batch
    size)."""
    import seqio

    if decode_method == "sample":
        check_sampling(temperature, top_k, top_p)

    from ktx.data.pipeline import mixture_task_names

    task_names = mixture_task_names(mixture_or_task_name)
    if leaderboard is None:
        decodes = [lb.Decode("", name, split, name) for name in task_names]
    else:
        if leaderboard_dir is None:
            raise ValueError(f"leaderboard={leaderboard!r} needs leaderboard_dir (gin macro "
                             "LEADERBOARD_DIR): the folder for the submission files")
        decodes = lb.plan_decodes(leaderboard, task_names)
        if not decodes:
            raise ValueError(f"leaderboard={leaderboard!r}: {mixture_or_task_name!r} has no "
                             f"{leaderboard} task (tasks: {list(task_names)})")
    if model.num_tasks != len(task_names):
        raise ValueError(
            f"{mixture_or_task_name!r} has {len(task_names)} tasks but model.num_tasks="
            f"{model.num_tasks}; set NUM_TASKS to {len(task_names)}"
        )
    trainer = Trainer(model, optax.identity(), mesh=partitioning.create_mesh(num_partitions))
    abstract = abstract_params_for(model, trainer, batch_size, task_feature_lengths)
    params, step = restore_params(resolve_checkpoint(checkpoint_path, checkpoint_step), abstract)
    kwargs = dict(decode_method=decode_method)
    if decode_method == "beam":
        kwargs.update(num_beams=num_beams, alpha=alpha)
    if decode_method == "sample":
        kwargs.update(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    predict = make_predict_fn(model, trainer, **kwargs)
    output_file = pathlib.Path(output_file)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    chief = jax.process_index() == 0
    by_key: dict[str, list[lb.Prediction]] = {}
    num_test_rows: dict[str, int] = {}
    with open(output_file, "w", encoding="utf-8") if chief else open(os.devnull, "w") as f:
        for d in decodes:
            task_id = task_names.index(d.model_task)
            task = seqio.get_mixture_or_task(d.task_name)
            vocab = task.output_features["targets"].vocabulary
            in_vocab = task.output_features["inputs"].vocabulary
            ds = task.get_dataset(task_feature_lengths, split=d.split, shuffle=False)
            if num_examples is not None:
                ds = ds.take(num_examples)
            examples = list(ds.as_numpy_iterator())
            for start in range(0, len(examples), batch_size):
                chunk = examples[start:start + batch_size]
                batch = _pad(encode_batch(chunk, task_id, task_feature_lengths), batch_size)
                if decode_method == "sample":  # the example's index keys its draws
                    batch["decode_row"] = np.arange(start, start + batch_size, dtype=np.int32)
                batch = _local_rows(batch)
                tokens = predict(params, batch)[: len(chunk)]
                for i, (ex, toks) in enumerate(zip(chunk, tokens)):
                    ids = _strip(toks)
                    record = {
                        "task": d.task_name,
                        "index": start + i,
                        "inputs": _text(ex["inputs_pretokenized"]) if "inputs_pretokenized" in ex
                        else in_vocab.decode([int(t) for t in ex["inputs"]]),
                        "targets": _text(ex["targets_pretokenized"]) if "targets_pretokenized" in ex
                        else vocab.decode([int(t) for t in ex.get("targets", [])]),
                        "prediction": vocab.decode(ids),
                        "prediction_tokens": ids,
                    }
                    if leaderboard is not None:
                        record.update(split=d.split, idx=_example_idx(ex))
                        by_key.setdefault(d.key, []).append(
                            lb.Prediction(record["idx"], record["prediction"]))
                    f.write(json.dumps(record) + "\n")
                    written += 1
            if leaderboard is not None:
                spec = lb.BENCHMARKS[leaderboard][d.key]
                num_test_rows[d.key] = _num_test_rows(task, d.split, spec)
    if leaderboard is not None:
        by_key = {k: _first_per_query(v) if lb.BENCHMARKS[leaderboard][k].kind == "record"
                  else v for k, v in by_key.items()}
        missing = [s.file_name for k, s in lb.BENCHMARKS[leaderboard].items() if k not in by_key]
        if chief:
            files = lb.write_submission(leaderboard, by_key, leaderboard_dir, num_test_rows)
            print(f"wrote {len(files)} {leaderboard} submission files to {leaderboard_dir}: "
                  + ", ".join(f"{x.path.name} ({x.rows} rows, {x.invalid} invalid)"
                              for x in files.values()), flush=True)
            if missing:
                print(f"the mixture has no task for {', '.join(missing)}: the submission "
                      "lacks these files", flush=True)
    print(f"wrote {written} predictions of checkpoint step {step} to {output_file}", flush=True)
    return written


def _example_idx(ex: Mapping[str, Any]) -> Any:
    """The test file's index of a decoded example: `idx`, or MultiRC's / ReCoRD's
    `idx/<field>` features as a dict."""
    if "idx" in ex:
        return int(ex["idx"])
    nested = {k.split("/", 1)[1]: int(v) for k, v in ex.items() if k.startswith("idx/")}
    if not nested:
        raise ValueError(f"example has no 'idx' feature (features: {sorted(ex)}); a leaderboard "
                         "needs the test file's indices")
    return nested


def _first_per_query(predictions: list) -> list:
    """ReCoRD: one prediction per query (a query with several answers is decoded once per
    answer, with the same inputs)."""
    seen, out = set(), []
    for p in predictions:
        q = p.idx["query"] if isinstance(p.idx, Mapping) else p.idx
        if q not in seen:
            seen.add(q)
            out.append(p)
    return out


def _num_test_rows(task, split: str, spec) -> int:
    """Rows the submission must have: counted in the test file itself (bad rows a
    `skip` policy dropped included), or from the source for a TFDS copy."""
    shards = task.source.list_shards(split)
    if len(shards) == 1 and pathlib.Path(shards[0]).is_file():
        return lb.count_test_rows(shards[0], spec.test_kind)
    ds = task.source.get_dataset(split, shuffle=False)
    if spec.kind == "multirc":
        return len({int(x["idx"]["paragraph"]) for x in ds.as_numpy_iterator()})
    return task.source.num_input_examples(split)
