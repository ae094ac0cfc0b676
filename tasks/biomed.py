"""Biomedical SeqIO tasks from local files, and the `biomed_all` mixture.

Tasks (files under `<data_dir>/biomed/`, see `BIOMED_FILES`; the data folder and the bad-row
policy come from `ktx.tasks.config` when a dataset is built, never at import):

- `biomed_ncbi_disease`, `biomed_bc5cdr_disease`: disease NER as text-to-text. One example
  per sentence: "ncbi_disease sentence: <tokens>" -> the disease mentions in order, joined
  by " | ", or "none"; scored with entity-level precision / recall / F1.
- `biomed_mednli`: "mednli hypothesis: ... premise: ..." -> entailment | neutral |
  contradiction (T5's MNLI format), accuracy. MedNLI needs credentialed access: the user
  supplies the jsonl files.
- `biomed_mediqa2019_qa`, `biomed_trecqa2017`: answer ranking. One example per (question,
  candidate answer): "<prefix> question: ... answer: ..." -> the score
  ReferenceScore - (ReferenceRank - 1) / m written "%.3f" (m candidates; He et al., 2020),
  scored by accuracy, MRR and precision grouped by question (`answer_ranking_metrics`).
  Splits (He et al., 2020): MEDIQA-2019 train = TrainingSet1-LiveQAMed + TrainingSet2-Alexa,
  validation = ValidationSet, test = TestSet-wLabels; TRECQA-2017 test = TrainingSet1-
  LiveQAMed, validation = ValidationSet, train = the other MEDIQA-2019 files (TrainingSet2-
  Alexa + TestSet-wLabels), the two data sets serving as each other's fine-tuning data.

Example counts: NER = sentences of the file; ranking = candidate answers of the file(s).
The disease-knowledge infusion task lives in `ktx.tasks.biomed_infusion`.

`biomed_all` mixes the public tasks without test-set leakage: the two ranking tasks'
train splits hold each other's test sets (the TREC test set is MEDIQA's TrainingSet1,
MEDIQA's test set is in TRECQA's train), so the mixture is registered over copies
`biomed_all_<task>` (`add_decontaminated_mixture`) whose train split drops every item
that is in a validation or test split of another task of the mixture, matched by
normalised text (`normalize_text`; ranking: question + answer, NER: the sentence). The
counts removed are logged when a train split is read and returned by
`decontamination_report("biomed_all")`; on the public files: MEDIQA train keeps 856 of
1,701 answers (839 TREC test + 6 validation answers removed), TRECQA train 862 of 1,969.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pathlib
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import seqio
import tensorflow as tf

from ktx.data import biomed_sources
from ktx.data import files
from ktx.metrics import biomed as biomed_metrics
from ktx.metrics.biomed import postprocess_mentions, postprocess_nli_label, postprocess_ranking
from ktx.metrics.glue import accuracy
from ktx.tasks import config

_log = logging.getLogger(__name__)  # ktx.cli prints it as `ktx: ...`

__all__ = [
    "BIOMED_FILES",
    "BIOMED_MIXTURE_TASKS",
    "BiomedFilesSource",
    "DecontaminatedSource",
    "Decontamination",
    "normalize_text",
    "add_decontaminated_mixture",
    "decontamination_report",
    "ner_text",
    "nli_text",
    "ranking_text",
    "postprocess_mentions",
    "postprocess_nli_label",
    "postprocess_ranking",
    "ner_rows",
    "mednli_rows",
    "mediqa_rows",
    "add_ner_task",
    "add_mednli_task",
    "add_answer_ranking_task",
]

_MEDIQA = "biomed/mediqa2019_qa/MEDIQA2019-Task3-QA-{}.xml"
BIOMED_FILES: dict[str, dict[str, tuple[str, ...]]] = {
    "ncbi_disease": {
        "train": ("biomed/ncbi_disease/train.tsv",),
        "validation": ("biomed/ncbi_disease/devel.tsv",),
        "test": ("biomed/ncbi_disease/test.tsv",),
    },
    "bc5cdr_disease": {
        "train": ("biomed/bc5cdr_disease/train.tsv",),
        "validation": ("biomed/bc5cdr_disease/devel.tsv",),
        "test": ("biomed/bc5cdr_disease/test.tsv",),
    },
    "mednli": {
        "train": ("biomed/mednli/mli_train_v1.jsonl",),
        "validation": ("biomed/mednli/mli_dev_v1.jsonl",),
        "test": ("biomed/mednli/mli_test_v1.jsonl",),
    },
    "mediqa2019_qa": {
        "train": (_MEDIQA.format("TrainingSet1-LiveQAMed"), _MEDIQA.format("TrainingSet2-Alexa")),
        "validation": (_MEDIQA.format("ValidationSet"),),
        "test": (_MEDIQA.format("TestSet-wLabels"),),
    },
    "trecqa2017": {
        "train": (_MEDIQA.format("TrainingSet2-Alexa"), _MEDIQA.format("TestSet-wLabels")),
        "validation": (_MEDIQA.format("ValidationSet"),),
        "test": (_MEDIQA.format("TrainingSet1-LiveQAMed"),),
    },
}

_HOW_TO_OBTAIN = {
    "ncbi_disease": "get NCBI-disease in BioBERT's NER layout (token<TAB>IOB tag, blank line "
    "between sentences; train.tsv, devel.tsv, test.tsv) from the BioBERT data sets release "
    "(github.com/dmis-lab/biobert) and put them there",
    "bc5cdr_disease": "get BC5CDR-disease in BioBERT's NER layout (token<TAB>IOB tag, blank "
    "line between sentences; train.tsv, devel.tsv, test.tsv) from the BioBERT data sets "
    "release (github.com/dmis-lab/biobert) and put them there",
    "mednli": "MedNLI needs credentialed access: download it from "
    "physionet.org/content/mednli and put mli_{train,dev,test}_v1.jsonl there",
    "mediqa2019_qa": "get the MEDIQA-2019 task 3 QA XML files (MEDIQA_Task3_QA of "
    "github.com/abachaa/MEDIQA2019, TestSet-wLabels for the test set) and put them there",
}
_HOW_TO_OBTAIN["trecqa2017"] = _HOW_TO_OBTAIN["mediqa2019_qa"]

RowsFn = Callable[[pathlib.Path, files.BadRowCounter], list[dict[str, Any]]]


# ----------------------------------------------------------------------------- source


@functools.lru_cache(maxsize=64)
def _read_cached(rows_fn: RowsFn, path: str, mtime_ns: int, size: int, on_bad_row: str):
    del mtime_ns, size  # cache key only: an edited file is read again
    counter = files.BadRowCounter(pathlib.Path(path), on_bad_row)
    rows = rows_fn(pathlib.Path(path), counter)
    if not rows:
        skipped = f" ({counter.skipped} bad rows skipped)" if counter.skipped else ""
        raise files.DataFileError(f"data file {path!r} has no readable examples{skipped}")
    return tuple(rows)


def _columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, tf.Tensor]:
    columns = {}
    for key, first in rows[0].items():
        values = [r[key] for r in rows]
        if isinstance(first, str):
            columns[key] = tf.constant(values, tf.string)
        elif isinstance(first, (float, np.floating)):
            columns[key] = tf.constant(values, tf.float32)
        elif isinstance(first, (bool, int, np.integer)):
            columns[key] = tf.constant(values, tf.int32)
        else:
            raise TypeError(f"row field {key!r} has type {type(first).__name__}; expected str, int, float")
    return columns


def normalize_text(text: str) -> str:
    """Text compared for leakage: NFKC, case-folded, whitespace runs as one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


class BiomedFilesSource(seqio.DataSource):
    """A seqio DataSource whose split is the concatenation of rows read from files.

    Args:
      split_files: split -> file paths, relative to the data folder (or absolute).
      rows_fn: (path, BadRowCounter) -> list of flat row dicts (str / int / float values).
      how_to_obtain: appended to a missing-file error.
      data_dir: the data folder; None: `ktx.tasks.config.get_data_dir()` at read time.
      on_bad_row: "raise" | "skip"; None: `ktx.tasks.config.get_on_bad_row()` at read time.
      key_fields: the row fields that identify an item across data sets (`item_key`);
        None: those of the known `rows_fn` (ranking: question, answer; NER: tokens;
        MedNLI: premise, hypothesis).

    Nothing is read until `get_dataset` / `num_input_examples` / `list_shards`.
    """

    def __init__(
        self,
        split_files: Mapping[str, Sequence[str | os.PathLike]],
        rows_fn: RowsFn,
        how_to_obtain: str,
        *,
        data_dir: str | os.PathLike | None = None,
        on_bad_row: str | None = None,
        key_fields: Sequence[str] | None = None,
    ):
        if not split_files or any(not paths for paths in split_files.values()):
            raise ValueError(f"split_files={split_files!r}: every split needs at least one file")
        if on_bad_row is not None and on_bad_row not in files.BAD_ROW_POLICIES:
            raise ValueError(f"on_bad_row={on_bad_row!r}; accepted: {files.BAD_ROW_POLICIES} or None")
        super().__init__(splits=tuple(split_files))
        self._split_files = {s: tuple(map(str, p)) for s, p in split_files.items()}
        self._rows_fn = rows_fn
        self._how = how_to_obtain
        self._data_dir = data_dir
        self._on_bad_row = on_bad_row
        self.key_fields = tuple(key_fields or _KEY_FIELDS.get(rows_fn, ()))

    @property
    def supports_arbitrary_sharding(self) -> bool:
        return True

    def item_key(self, row: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
        """The row's identity across data sets: `(field, normalize_text(value))` pairs."""
        if not self.key_fields:
            raise ValueError("this source has no key_fields: pass key_fields=(...) to compare items")
        return tuple((f, normalize_text(str(row[f]))) for f in self.key_fields)

    def paths(self, split: str) -> list[pathlib.Path]:
        """The files of `split`, checked to exist and be non-empty."""
        if split not in self._split_files:
            raise ValueError(f"split={split!r}; this source has splits {sorted(self._split_files)}")
        relative = [pathlib.Path(p) for p in self._split_files[split]]
        root = None
        if any(not p.is_absolute() for p in relative):
            root = files.resolve_data_dir(self._data_dir) if self._data_dir else config.get_data_dir()
        return [files.require_file(p if p.is_absolute() else root / p, self._how) for p in relative]

    def rows(self, split: str) -> tuple[dict[str, Any], ...]:
        policy = self._on_bad_row or config.get_on_bad_row()
        out: list[dict[str, Any]] = []
        for path in self.paths(split):
            stat = path.stat()
            out.extend(_read_cached(self._rows_fn, str(path), stat.st_mtime_ns, stat.st_size, policy))
        return tuple(out)

    def list_shards(self, split: str) -> Sequence[str]:
        return [str(p) for p in self.paths(split)]

    def num_input_examples(self, split: str) -> int:
        return len(self.rows(split))

    def get_dataset(
        self,
        split: str = "train",
        shuffle: bool = True,
        seed: int | None = None,
        shard_info: seqio.ShardInfo | None = None,
        *,
        sequence_length=None,
        use_cached=False,
        num_epochs=1,
    ) -> tf.data.Dataset:
        del sequence_length, use_cached, num_epochs
        rows = self.rows(split)
        ds = tf.data.Dataset.from_tensor_slices(_columns(rows))
        if shard_info is not None:
            ds = ds.shard(shard_info.num_shards, shard_info.index)
        if shuffle:
            ds = ds.shuffle(len(rows), seed=seed, reshuffle_each_iteration=True)
        return ds


# ----------------------------------------------------------------------------- rows


def ner_rows(path: pathlib.Path, counter: files.BadRowCounter) -> list[dict[str, Any]]:
    """IOB TSV -> {"line", "tokens" (space-joined), "mentions" (" | "-joined, "" if none)}."""
    rows = []
    for sentence in biomed_sources.read_iob_sentences(path, counter=counter):
        try:
            mentions = biomed_metrics.format_mentions(sentence.mentions)
        except ValueError as e:
            counter.bad(sentence.line, str(e))
            continue
        rows.append({
            "line": sentence.line,
            "tokens": " ".join(sentence.tokens),
            "mentions": "" if mentions == biomed_metrics.NO_MENTION else mentions,
        })
    return rows


def mednli_rows(path: pathlib.Path, counter: files.BadRowCounter) -> list[dict[str, Any]]:
    """MedNLI jsonl -> {"line", "premise", "hypothesis", "label"}."""
    return [
        {"line": p.line, "premise": p.premise, "hypothesis": p.hypothesis, "label": p.label}
        for p in biomed_sources.read_mednli_jsonl(path, counter=counter)
    ]


def mediqa_rows(path: pathlib.Path, counter: files.BadRowCounter) -> list[dict[str, Any]]:
    """MEDIQA XML -> one row per candidate answer with its ids, labels and target score."""
    rows = []
    for q in biomed_sources.read_mediqa_xml(path, counter=counter):
        for a in q.answers:
            rows.append({
                "line": a.line,
                "question_id": f"{path.name}:{q.question_id}",
                "answer_id": a.answer_id,
                "question": q.text,
                "answer": a.text,
                "reference_score": a.reference_score,
                "reference_rank": a.reference_rank,
                "num_candidates": q.num_candidates,
                "score": biomed_metrics.ranking_target_score(
                    a.reference_score, a.reference_rank, q.num_candidates
                ),
            })
    return rows


_KEY_FIELDS: dict[Callable, tuple[str, ...]] = {
    ner_rows: ("tokens",),
    mednli_rows: ("premise", "hypothesis"),
    mediqa_rows: ("question", "answer"),
}


# ----------------------------------------------------------------------------- leakage


@dataclasses.dataclass(frozen=True)
class Decontamination:
    """What `DecontaminatedSource` removed from one split.

    Attributes:
      task: the decontaminated task; split: its split.
      total: rows of the files; removed: rows dropped (kept = total - removed).
      by_source: "<task>/<split>" -> rows of this split whose item is in that split of
        that task (a row in several counts in each).
    """

    task: str
    split: str
    total: int
    removed: int
    by_source: Mapping[str, int]

    @property
    def kept(self) -> int:
        return self.total - self.removed

    def __str__(self) -> str:
        sources = ", ".join(f"{k}: {v}" for k, v in self.by_source.items() if v) or "none"
        return (f"{self.task}/{self.split}: removed {self.removed} of {self.total} rows found in "
                f"other tasks' evaluation splits ({sources}); {self.kept} kept")


class DecontaminatedSource(BiomedFilesSource):
    """`base`'s files, with the rows of `filtered_splits` whose item (`item_key`) is in
    an `eval_splits` split of one of `others` removed (logged, see `decontamination`).

    Args:
      base: the task's own source (files, reader, policy and key fields are taken over).
      name: the task's name (for the log and the report).
      others: (task name, source) of the tasks whose evaluation items must not be trained on.
      eval_splits: their splits that count as evaluation data (those they have).
      filtered_splits: this source's splits to filter (the training data).
    """

    def __init__(
        self,
        base: BiomedFilesSource,
        name: str,
        others: Sequence[tuple[str, BiomedFilesSource]],
        eval_splits: Sequence[str] = ("validation", "test"),
        filtered_splits: Sequence[str] = ("train",),
    ):
        if not isinstance(base, BiomedFilesSource):
            raise TypeError(f"base={base!r}: expected a BiomedFilesSource")
        super().__init__(base._split_files, base._rows_fn, base._how, data_dir=base._data_dir,
                         on_bad_row=base._on_bad_row, key_fields=base.key_fields)
        self.name = name
        self.others = tuple(others)
        self.eval_splits = tuple(eval_splits)
        self.filtered_splits = tuple(s for s in filtered_splits if s in self.splits)
        self._memo: dict[str, tuple[tuple, tuple, Decontamination]] = {}

    def _eval_keys(self) -> tuple[tuple, dict[str, set]]:
        reads, keys = [], {}
        for task, source in self.others:
            for split in self.eval_splits:
                if split in source.splits:
                    rows = source.rows(split)
                    reads.append(rows)
                    keys[f"{task}/{split}"] = {source.item_key(r) for r in rows}
        return tuple(reads), keys

    def _filter(self, split: str) -> tuple[tuple[dict[str, Any], ...], Decontamination]:
        rows = super().rows(split)
        reads, keys = self._eval_keys()
        memo = self._memo.get(split)
        if memo is not None and memo[0][0] is rows and all(a is b for a, b in zip(memo[0][1:], reads)):
            return memo[1], memo[2]
        by_source = dict.fromkeys(keys, 0)
        kept = []
        for row in rows:
            key = self.item_key(row)
            found = [name for name, items in keys.items() if key in items]
            for name in found:
                by_source[name] += 1
            if not found:
                kept.append(row)
        if not kept:
            raise files.DataFileError(f"{self.name}/{split}: every row is in another task's evaluation data")
        report = Decontamination(self.name, split, len(rows), len(rows) - len(kept), by_source)
        self._memo[split] = ((rows, *reads), tuple(kept), report)
        _log.warning("%s", report)
        return tuple(kept), report

    def rows(self, split: str) -> tuple[dict[str, Any], ...]:
        if split not in self.filtered_splits:
            return super().rows(split)
        return self._filter(split)[0]

    def decontamination(self, split: str = "train") -> Decontamination:
        """What was removed from `split` (reads the files if not yet read)."""
        if split not in self.filtered_splits:
            raise ValueError(f"split={split!r} is not filtered; filtered splits: {self.filtered_splits}")
        return self._filter(split)[1]


# ----------------------------------------------------------------------------- preprocessors


@seqio.map_over_dataset
def ner_text(x: Mapping[str, tf.Tensor], prefix: str) -> dict[str, tf.Tensor]:
    """{"tokens", "mentions"} -> inputs "<prefix> sentence: <tokens>", targets mentions|"none"."""
    out = dict(x)
    out["inputs"] = tf.strings.join([prefix, " sentence: ", x["tokens"]])
    out["targets"] = tf.where(
        tf.equal(x["mentions"], ""), tf.constant(biomed_metrics.NO_MENTION), x["mentions"]
    )
    return out


@seqio.map_over_dataset
def nli_text(x: Mapping[str, tf.Tensor], prefix: str = "mednli") -> dict[str, tf.Tensor]:
    """T5's NLI format: "<prefix> hypothesis: <h> premise: <p>" -> the label name."""
    out = dict(x)
    out["inputs"] = tf.strings.join(
        [prefix, " hypothesis: ", x["hypothesis"], " premise: ", x["premise"]]
    )
    out["targets"] = x["label"]
    return out


@seqio.map_over_dataset
def ranking_text(x: Mapping[str, tf.Tensor], prefix: str) -> dict[str, tf.Tensor]:
    """"<prefix> question: <q> answer: <a>" -> the target score written "%.3f"."""
    out = dict(x)
    out["inputs"] = tf.strings.join([prefix, " question: ", x["question"], " answer: ", x["answer"]])
    out["targets"] = tf.strings.as_string(x["score"], precision=3)
    return out


_TOKENIZE = [
    seqio.preprocessors.tokenize,
    seqio.CacheDatasetPlaceholder(),
    seqio.preprocessors.append_eos_after_trim,
]


def _source(key, split_files, rows_fn, data_dir, on_bad_row):
    return BiomedFilesSource(
        split_files if split_files is not None else BIOMED_FILES[key],
        rows_fn,
        _HOW_TO_OBTAIN.get(key, "see the task's documentation for the file layout"),
        data_dir=data_dir,
        on_bad_row=on_bad_row,
    )


def add_ner_task(
    name: str,
    prefix: str,
    split_files: Mapping[str, Sequence[str | os.PathLike]] | None = None,
    *,
    data_dir: str | os.PathLike | None = None,
    on_bad_row: str | None = None,
    output_features: Mapping[str, seqio.Feature] | None = None,
) -> seqio.Task:
    """Registers a disease-NER task over IOB TSV files (default: `BIOMED_FILES[prefix]`)."""
    return seqio.TaskRegistry.add(
        name,
        source=_source(prefix, split_files, ner_rows, data_dir, on_bad_row),
        preprocessors=[functools.partial(ner_text, prefix=prefix), *_TOKENIZE],
        output_features=output_features or config.t5_output_features(),
        postprocess_fn=postprocess_mentions,
        metric_fns=[biomed_metrics.ner_mention_metrics],
    )


def add_mednli_task(
    name: str,
    split_files: Mapping[str, Sequence[str | os.PathLike]] | None = None,
    *,
    data_dir: str | os.PathLike | None = None,
    on_bad_row: str | None = None,
    output_features: Mapping[str, seqio.Feature] | None = None,
) -> seqio.Task:
    """Registers MedNLI over jsonl files (default: `BIOMED_FILES["mednli"]`)."""
    return seqio.TaskRegistry.add(
        name,
        source=_source("mednli", split_files, mednli_rows, data_dir, on_bad_row),
        preprocessors=[functools.partial(nli_text, prefix="mednli"), *_TOKENIZE],
        output_features=output_features or config.t5_output_features(),
        postprocess_fn=postprocess_nli_label,
        metric_fns=[accuracy],
    )


def add_answer_ranking_task(
    name: str,
    prefix: str,
    split_files: Mapping[str, Sequence[str | os.PathLike]] | None = None,
    *,
    data_dir: str | os.PathLike | None = None,
    on_bad_row: str | None = None,
    output_features: Mapping[str, seqio.Feature] | None = None,
    threshold: float = float(biomed_metrics.CORRECT_MIN_REFERENCE_SCORE - 1),
) -> seqio.Task:
    """Registers an answer-ranking task over MEDIQA-2019 XML files
    (default: `BIOMED_FILES[prefix]`); `threshold` as in `answer_ranking_metrics`."""
    metric = functools.partial(biomed_metrics.answer_ranking_metrics, threshold=threshold)
    return seqio.TaskRegistry.add(
        name,
        source=_source(prefix, split_files, mediqa_rows, data_dir, on_bad_row),
        preprocessors=[functools.partial(ranking_text, prefix=prefix), *_TOKENIZE],
        output_features=output_features or config.t5_output_features(),
        postprocess_fn=postprocess_ranking,
        metric_fns=[metric],
    )


add_ner_task("biomed_ncbi_disease", "ncbi_disease")
add_ner_task("biomed_bc5cdr_disease", "bc5cdr_disease")
add_mednli_task("biomed_mednli")
add_answer_ranking_task("biomed_mediqa2019_qa", "mediqa2019_qa")
add_answer_ranking_task("biomed_trecqa2017", "trecqa2017")

# The fine-tuning tasks whose data is public (MedNLI needs credentials, so it is left out;
# users who have it can register their own mixture with "biomed_mednli" added).
BIOMED_MIXTURE_TASKS = (
    "biomed_ncbi_disease",
    "biomed_bc5cdr_disease",
    "biomed_mediqa2019_qa",
    "biomed_trecqa2017",
)


def add_decontaminated_mixture(
    name: str,
    task_names: Sequence[str],
    *,
    default_rate=seqio.mixing_rate_num_examples,
    eval_splits: Sequence[str] = ("validation", "test"),
) -> seqio.Mixture:
    """Registers mixture `name` over copies `<name>_<task without "biomed_">` of the tasks
    whose train split drops every item that is in an `eval_splits` split of ANOTHER task
    of the mixture (`DecontaminatedSource`); evaluation splits are unchanged.
    """
    names = list(task_names)
    tasks = [seqio.get_mixture_or_task(t) for t in names]
    for task in tasks:
        if not isinstance(task.source, BiomedFilesSource):
            raise TypeError(f"task {task.name!r} has a {type(task.source).__name__}; "
                            "add_decontaminated_mixture needs BiomedFilesSource tasks")
    members = []
    for task in tasks:
        member = f"{name}_{task.name.removeprefix('biomed_')}"
        others = [(u.name, u.source) for u in tasks if u.name != task.name]
        source = DecontaminatedSource(task.source, member, others, eval_splits)
        if member in seqio.TaskRegistry.names():
            seqio.TaskRegistry.remove(member)
        seqio.TaskRegistry.add_provider(member, task.replace(name=member, source=source))
        members.append(member)
    if name in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(name)
    return seqio.MixtureRegistry.add(name, members, default_rate=default_rate)


def decontamination_report(mixture_name: str, split: str = "train") -> dict[str, Decontamination]:
    """`{task: Decontamination}` of a mixture's decontaminated tasks (reads their files)."""
    mixture = seqio.get_mixture_or_task(mixture_name)
    tasks = mixture.tasks if isinstance(mixture, seqio.Mixture) else [mixture]
    return {t.name: t.source.decontamination(split) for t in tasks
            if isinstance(t.source, DecontaminatedSource)}


add_decontaminated_mixture("biomed_all", BIOMED_MIXTURE_TASKS)
