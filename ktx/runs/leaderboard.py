"""GLUE and SuperGLUE leaderboard submission files from ktx's decoded predictions.

ktx's GLUE/SuperGLUE tasks decode T5 text targets ("entailment", "acceptable", "choice2",
"3.8", "True", an entity); the two submission servers want one file per task with the
benchmark's own label spelling:

* GLUE (gluebenchmark.com): `<Task>.tsv` with a header `index<TAB>prediction`, for CoLA,
  SST-2, MRPC, STS-B, QQP, MNLI-m, MNLI-mm, QNLI, RTE, WNLI and the diagnostic AX; labels
  0/1 (CoLA, SST-2, MRPC, QQP, WNLI), entailment/neutral/contradiction (MNLI, AX),
  entailment/not_entailment (QNLI, RTE), a float in [0, 5] (STS-B).
* SuperGLUE (super.gluebenchmark.com): `<Task>.jsonl` with `{"idx": ..., "label": ...}`
  for BoolQ, CB, COPA, MultiRC, ReCoRD, RTE, WiC, WSC, AX-b, AX-g; labels "true"/"false"
  (BoolQ, WiC), "True"/"False" (WSC), 0/1 (COPA), entailment/contradiction/neutral (CB),
  entailment/not_entailment (RTE, AX-b, AX-g), the answer text (ReCoRD, `idx` the query's),
  and MultiRC grouped per paragraph: `{"idx": p, "passage": {"questions": [{"idx": q,
  "answers": [{"idx": a, "label": 0|1}, ...]}, ...]}}`.

Invalid predictions: a decoded text outside the task's label set (or an STS-B text that
is no finite number, an empty ReCoRD answer) is counted, written as the task's default
label (`SubmissionTask.default`: the most frequent training label, or the first class
where the classes are balanced; STS-B 2.5, the middle of the scale; ReCoRD has no label
set and writes the empty answer, which scores 0) and reported in a `UserWarning` naming
the count. A file is written only when its row count equals the test file's
(`count_test_rows`) and its indices are unique; every file of a call is checked before
any is written.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import pathlib
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = [
    "SubmissionTask",
    "SubmissionFile",
    "Prediction",
    "Decode",
    "GLUE_SUBMISSION",
    "SUPER_GLUE_SUBMISSION",
    "BENCHMARKS",
    "official_label",
    "count_test_rows",
    "plan_decodes",
    "write_glue_submission",
    "write_super_glue_submission",
    "write_submission",
]


@dataclasses.dataclass(frozen=True)
class SubmissionTask:
    """How one task's predictions become one submission file.

    Attributes:
      file_name: the name the server expects ("CoLA.tsv", "MultiRC.jsonl").
      labels: decoded T5 target text -> official label (empty for "score"/"record").
      default: the official label written for an invalid prediction.
      kind: "class" | "score" (STS-B) | "multirc" | "record".
      test_kind: how `count_test_rows` counts the test file: "tsv" (rows after the
        header), "jsonl" (lines), "record" (queries of all lines).
    """

    file_name: str
    labels: Mapping[str, Any]
    default: Any
    kind: str = "class"
    test_kind: str = "tsv"


class Prediction(NamedTuple):
    """One decoded example: `idx` the test file's index (an int; MultiRC a mapping with
    "paragraph", "question", "answer"; ReCoRD an int or a mapping with "query") and `text`
    the decoded target text."""

    idx: Any
    text: str


class SubmissionFile(NamedTuple):
    path: pathlib.Path
    rows: int
    invalid: int


def _binary(negative: str, positive: str) -> dict[str, int]:
    return {negative: 0, positive: 1}


_MNLI = {n: n for n in ("entailment", "neutral", "contradiction")}
_RTE = {n: n for n in ("entailment", "not_entailment")}

GLUE_SUBMISSION: dict[str, SubmissionTask] = {
    "cola": SubmissionTask("CoLA.tsv", _binary("unacceptable", "acceptable"), 1),
    "sst2": SubmissionTask("SST-2.tsv", _binary("negative", "positive"), 1),
    "mrpc": SubmissionTask("MRPC.tsv", _binary("not_equivalent", "equivalent"), 1),
    "stsb": SubmissionTask("STS-B.tsv", {}, 2.5, kind="score"),
    "qqp": SubmissionTask("QQP.tsv", _binary("not_duplicate", "duplicate"), 0),
    "mnli_matched": SubmissionTask("MNLI-m.tsv", _MNLI, "entailment"),
    "mnli_mismatched": SubmissionTask("MNLI-mm.tsv", _MNLI, "entailment"),
    "qnli": SubmissionTask("QNLI.tsv", _RTE, "entailment"),
    "rte": SubmissionTask("RTE.tsv", _RTE, "entailment"),
    "wnli": SubmissionTask("WNLI.tsv", _binary("not_entailment", "entailment"), 0),
    "ax": SubmissionTask("AX.tsv", _MNLI, "entailment"),
}

SUPER_GLUE_SUBMISSION: dict[str, SubmissionTask] = {
    "boolq": SubmissionTask("BoolQ.jsonl", {"False": "false", "True": "true"}, "true",
                            test_kind="jsonl"),
    "cb": SubmissionTask("CB.jsonl", {n: n for n in ("entailment", "contradiction", "neutral")},
                         "contradiction", test_kind="jsonl"),
    "copa": SubmissionTask("COPA.jsonl", {"choice1": 0, "choice2": 1}, 0, test_kind="jsonl"),
    "multirc": SubmissionTask("MultiRC.jsonl", {"False": 0, "True": 1}, 0, kind="multirc",
                              test_kind="jsonl"),
    "record": SubmissionTask("ReCoRD.jsonl", {}, "", kind="record", test_kind="record"),
    "rte": SubmissionTask("RTE.jsonl", _RTE, "entailment", test_kind="jsonl"),
    "wic": SubmissionTask("WiC.jsonl", {"False": "false", "True": "true"}, "false",
                          test_kind="jsonl"),
    "wsc": SubmissionTask("WSC.jsonl", {"False": "False", "True": "True"}, "False",
                          test_kind="jsonl"),
    "axb": SubmissionTask("AX-b.jsonl", _RTE, "not_entailment", test_kind="jsonl"),
    "axg": SubmissionTask("AX-g.jsonl", _RTE, "entailment", test_kind="jsonl"),
}

BENCHMARKS: dict[str, dict[str, SubmissionTask]] = {
    "glue": GLUE_SUBMISSION, "super_glue": SUPER_GLUE_SUBMISSION}


def official_label(spec: SubmissionTask, text: str) -> tuple[Any, bool]:
    """(official label, valid) of one decoded text; invalid -> (spec.default, False)."""
    text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
    text = text.strip()
    if spec.kind == "score":
        try:
            value = float(text)
        except ValueError:
            return spec.default, False
        if not math.isfinite(value):
            return spec.default, False
        return min(max(value, 0.0), 5.0), True
    if spec.kind == "record":
        return (text, True) if text else (spec.default, False)
    if text in spec.labels:
        return spec.labels[text], True
    return spec.default, False


# ------------------------------------------------------------------------- test files


def count_test_rows(path: str | os.PathLike, test_kind: str) -> int:
    """The number of submission rows a test file asks for: "tsv" rows after the header,
    "jsonl" non-blank lines (MultiRC: paragraphs), "record" the queries of all lines."""
    path = pathlib.Path(path)
    if test_kind not in ("tsv", "jsonl", "record"):
        raise ValueError(f"test_kind={test_kind!r}; accepted: 'tsv', 'jsonl', 'record'")
    with open(path, encoding="utf-8", newline="") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    if test_kind == "tsv":
        return max(len(lines) - 1, 0)
    if test_kind == "jsonl":
        return len(lines)
    try:
        return sum(len(json.loads(line)["qas"]) for line in lines)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a ReCoRD jsonl file with 'qas' per line: {e!r}") from e


class Decode(NamedTuple):
    """One test split to decode: the submission task `key`, the ktx task and split to
    read, and the mixture task whose task id the model conditions on."""

    key: str
    task_name: str
    split: str
    model_task: str


_NAME = re.compile(r"^(super_glue|glue)_(\w+?)(_noprefix)?_v(\d+)$")


def plan_decodes(benchmark: str, task_names: Sequence[str]) -> list[Decode]:
    """The test splits to decode for `benchmark`'s submission from a mixture's tasks.

    `glue_mnli_v002` gives MNLI-m, MNLI-mm and AX (`glue_ax_v002` with MNLI's task id);
    `super_glue_rte_v102` gives RTE, AX-b and AX-g (with RTE's task id); other tasks of
    the benchmark give their own `test` split; tasks of other benchmarks are left out.
    Each submission task comes from the first mixture task that provides it.
    """
    if benchmark not in BENCHMARKS:
        raise ValueError(f"leaderboard={benchmark!r}; accepted: {sorted(BENCHMARKS)}")
    plan: dict[str, Decode] = {}
    for name in task_names:
        m = _NAME.match(name)
        if not m or m.group(1) != benchmark:
            continue
        task, noprefix, version = m.group(2), m.group(3) or "", m.group(4)

        def sibling(other):
            return f"{benchmark}_{other}{noprefix}_v{version}"

        if benchmark == "glue" and task == "mnli":
            found = [Decode("mnli_matched", name, "test_matched", name),
                     Decode("mnli_mismatched", name, "test_mismatched", name),
                     Decode("ax", sibling("ax"), "test", name)]
        elif benchmark == "glue" and task in ("mnli_matched", "mnli_mismatched"):
            found = [Decode(task, name, "test", name)]
        elif benchmark == "super_glue" and task == "rte":
            found = [Decode("rte", name, "test", name),
                     Decode("axb", sibling("axb"), "test", name),
                     Decode("axg", sibling("axg"), "test", name)]
        elif task in BENCHMARKS[benchmark] and task not in ("ax", "axb", "axg"):
            found = [Decode(task, name, "test", name)]
        else:
            found = []
        for d in found:
            plan.setdefault(d.key, d)
    return list(plan.values())


# ---------------------------------------------------------------------------- writing


def _as_int(value: Any, what: str, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{key}: {what}={value!r} is not an integer index") from e


def _field(idx: Any, name: str, key: str) -> int:
    if not isinstance(idx, Mapping) or name not in idx:
        raise ValueError(f"{key}: idx={idx!r} lacks {name!r}")
    return _as_int(idx[name], f"idx[{name!r}]", key)


def _records(key: str, spec: SubmissionTask, predictions: Sequence[Any]
             ) -> tuple[list[Any], int]:
    """(rows to write, invalid count); rows are (index, label), MultiRC paragraph dicts."""
    invalid, seen = 0, set()
    if spec.kind == "multirc":
        paragraphs: dict[int, dict[int, list[dict]]] = {}
        for idx, text in predictions:
            p, q, a = (_field(idx, n, key) for n in ("paragraph", "question", "answer"))
            if (p, q, a) in seen:
                raise ValueError(f"{key}: answer idx {(p, q, a)} predicted twice")
            seen.add((p, q, a))
            label, ok = official_label(spec, text)
            invalid += not ok
            paragraphs.setdefault(p, {}).setdefault(q, []).append({"idx": a, "label": label})
        rows = [{"idx": p, "passage": {"questions": [
                    {"idx": q, "answers": sorted(answers, key=lambda x: x["idx"])}
                    for q, answers in sorted(questions.items())]}}
                for p, questions in sorted(paragraphs.items())]
        return rows, invalid
    rows = []
    for idx, text in predictions:
        if spec.kind == "record" and isinstance(idx, Mapping):
            i = _field(idx, "query", key)
        else:
            i = _as_int(idx, "idx", key)
        if i in seen:
            raise ValueError(f"{key}: index {i} predicted twice")
        seen.add(i)
        label, ok = official_label(spec, text)
        invalid += not ok
        rows.append((i, label))
    return sorted(rows, key=lambda r: r[0]), invalid


def write_submission(benchmark: str, predictions_by_task: Mapping[str, Sequence[Any]],
                     out_dir: str | os.PathLike, num_test_rows: Mapping[str, int]
                     ) -> dict[str, SubmissionFile]:
    """Writes `benchmark`'s ("glue" | "super_glue") submission files into `out_dir`.

    Args:
      predictions_by_task: submission task key (a key of `GLUE_SUBMISSION` /
        `SUPER_GLUE_SUBMISSION`) -> `Prediction`s or (idx, text) pairs.
      out_dir: the folder to write (created).
      num_test_rows: key -> the test file's row count (`count_test_rows`); required for
        every key of `predictions_by_task`.

    Returns:
      key -> SubmissionFile(path, rows, invalid).

    Raises:
      ValueError: unknown benchmark or task key, a missing row count, a row count that
        differs from the test file's, a repeated or non-integer index; nothing is written.
    """
    if benchmark not in BENCHMARKS:
        raise ValueError(f"benchmark={benchmark!r}; accepted: {sorted(BENCHMARKS)}")
    specs = BENCHMARKS[benchmark]
    prepared = {}
    for key, predictions in predictions_by_task.items():
        if key not in specs:
            raise ValueError(f"{benchmark} submission task {key!r}; accepted: {sorted(specs)}")
        if key not in num_test_rows:
            raise ValueError(f"num_test_rows lacks {key!r}: the test file's row count is "
                             "needed to check the submission")
        spec = specs[key]
        predictions = list(predictions)
        rows, invalid = _records(key, spec, predictions)
        if len(rows) != num_test_rows[key]:
            raise ValueError(
                f"refusing to write {spec.file_name}: {len(rows)} rows predicted but the test "
                f"file has {num_test_rows[key]} (num_examples set, or rows skipped as bad?)")
        prepared[key] = (spec, rows, invalid, len(predictions))
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for key, (spec, rows, invalid, total) in prepared.items():
        path = out_dir / spec.file_name
        if invalid:
            what = {"score": "are not finite numbers", "record": "are empty"}.get(
                spec.kind, f"are outside the label set {sorted(map(str, spec.labels))}")
            warnings.warn(
                f"{spec.file_name}: {invalid} of {total} predictions {what}; written as the "
                f"default label {spec.default!r}", UserWarning, stacklevel=2)
        with open(path, "w", encoding="utf-8", newline="") as f:
            if path.suffix == ".tsv":
                w = csv.writer(f, delimiter="\t", lineterminator="\n")
                w.writerow(["index", "prediction"])
                w.writerows(rows)
            else:
                for row in rows:
                    f.write(json.dumps(row if spec.kind == "multirc"
                                       else {"idx": row[0], "label": row[1]}) + "\n")
        written[key] = SubmissionFile(path, len(rows), invalid)
    return written


def write_glue_submission(predictions_by_task: Mapping[str, Sequence[Any]],
                          out_dir: str | os.PathLike, num_test_rows: Mapping[str, int]
                          ) -> dict[str, SubmissionFile]:
    """GLUE's `<Task>.tsv` files (`index`, `prediction`); see `write_submission`."""
    return write_submission("glue", predictions_by_task, out_dir, num_test_rows)


def write_super_glue_submission(predictions_by_task: Mapping[str, Sequence[Any]],
                                out_dir: str | os.PathLike, num_test_rows: Mapping[str, int]
                                ) -> dict[str, SubmissionFile]:
    """SuperGLUE's `<Task>.jsonl` files (`idx`, `label`); see `write_submission`."""
    return write_submission("super_glue", predictions_by_task, out_dir, num_test_rows)
