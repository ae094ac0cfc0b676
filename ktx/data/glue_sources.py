"""SeqIO data sources for GLUE, SuperGLUE and CS224N in their official file layouts.

Each reader (`ktx.data.glue_readers`) turns one official file into rows shaped like the TFDS features of the same
data set (`glue/*`, `super_glue/*`), so that one set of T5 text preprocessors serves both:

* GLUE: `glue/<Task>/{train,dev}.tsv` as GLUE distributes them (MNLI:
  `dev_matched.tsv`, `dev_mismatched.tsv`); MRPC also from the original MSR paraphrase
  files (`msr_paraphrase_{train,test}.txt`, same columns, UTF-8 BOM allowed); STS-B `test`
  from `test_with_labels.tsv` when present.
* SuperGLUE: `super_glue/<Task>/{train,val}.jsonl` (+ FewGLUE `train_32shot.jsonl`);
  MultiRC yields one row per answer and ReCoRD one per query, as TFDS does; WSC rows get
  the span corrections of TFDS's `wsc.fixed` (`fix_wsc_spans`), the config T5 reads.
* CS224N multitask project: `cs224n/{ids-sst,quora,sts}-{train,dev}.csv` (tab-separated,
  quoted, header with a leading index column).

`OfficialFilesSource` reads a prepared TFDS copy instead when a TFDS folder is given and
the data set is prepared there; it never downloads. A malformed row (wrong field count,
unknown label, bad JSON, missing key) raises `files.DataFileError` naming file and line,
or with `on_bad_row="skip"` is skipped and counted in the log.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import seqio
import tensorflow as tf

from ktx.data import files
from ktx.data.glue_readers import (  # the row readers the layouts below name
    GLUE_LABELS,
    Reader,
    Row,
    SUPER_GLUE_LABELS,
    _MRPC_HEADER,
    _boolq,
    _copa,
    _cs224n,
    _cs_quora,
    _cs_sst,
    _cs_sts,
    _glue_pair,
    _glue_test,
    _jsonl,
    _names,
    _nli,
    _read_cola,
    _read_mnli,
    _read_multirc,
    _read_multirc_test,
    _read_record,
    _read_sst2,
    _read_stsb,
    _read_stsb_test,
    _rekey,
    _unlabelled,
    _wic,
    _wsc,
    fix_wsc_spans,
)

__all__ = [
    "Layout",
    "GLUE_LAYOUTS",
    "SUPER_GLUE_LAYOUTS",
    "GLUE_AX_LAYOUT",
    "SUPER_GLUE_AX_LAYOUTS",
    "CS224N_LAYOUTS",
    "GLUE_LABELS",
    "SUPER_GLUE_LABELS",
    "read_rows",
    "fix_wsc_spans",
    "OfficialFilesSource",
]

@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one data set's files live and how to read them.

    Attributes:
      folder: folder under the data directory, e.g. "glue/CoLA".
      splits: split name -> candidate file names inside `folder` (first present wins).
      reader: (path, BadRowCounter) -> rows shaped like the TFDS features.
      how_to_obtain: appended to a missing-file error.
      tfds_name: the TFDS data set ("glue/cola:2.0.0"), or None.
      tfds_splits: split name -> TFDS split name, for the splits TFDS has with labels.
      split_readers: split name -> reader used instead of `reader` for that split (the
        unlabelled test files, whose columns differ).
    """

    folder: str
    splits: Mapping[str, tuple[str, ...]]
    reader: Reader
    how_to_obtain: str
    tfds_name: str | None = None
    tfds_splits: Mapping[str, str] = dataclasses.field(default_factory=dict)
    split_readers: Mapping[str, Reader] = dataclasses.field(default_factory=dict)

    def reader_for(self, split: str) -> Reader:
        """The reader of `split`'s file."""
        return self.split_readers.get(split, self.reader)


_GLUE_HOW = ("download the GLUE data (https://gluebenchmark.com/tasks, or the "
             "download_glue_data.py script) and unpack <Task>/ under <data_dir>/glue/")
_MRPC_HOW = ("put the original MSR paraphrase files (msr_paraphrase_train.txt, "
             "msr_paraphrase_test.txt from the Microsoft Research Paraphrase Corpus) or GLUE's "
             "MRPC train.tsv/dev.tsv under <data_dir>/glue/MRPC/")
_SG_HOW = ("download SuperGLUE (https://super.gluebenchmark.com/tasks) and unpack <Task>/ under "
           "<data_dir>/super_glue/; FewGLUE train_32shot.jsonl files come from "
           "https://github.com/timoschick/fewglue")
_CS_HOW = ("copy the CS224N default final project data files (ids-sst-*, quora-*, sts-*.csv) "
           "into <data_dir>/cs224n/")


def _glue(folder, reader, tfds, splits=None, tfds_splits=None, how=_GLUE_HOW, test=None):
    """A GLUE layout; `test`: the reader of the unlabelled `test.tsv` (split "test")."""
    splits = dict(splits or {"train": ("train.tsv",), "validation": ("dev.tsv",)})
    split_readers = {}
    if test is not None:
        splits.setdefault("test", ("test.tsv",))
        split_readers["test"] = test
    tfds_splits = tfds_splits or {s: s for s in splits}
    return Layout(f"glue/{folder}", splits, reader, how, f"glue/{tfds}:2.0.0", tfds_splits,
                  split_readers)


_PAIR = {"sentence1": "sentence1", "sentence2": "sentence2"}
_NLI_TEST = _glue_test({"premise": "sentence1", "hypothesis": "sentence2"})

GLUE_LAYOUTS: dict[str, Layout] = {
    "cola": _glue("CoLA", _read_cola, "cola", test=_glue_test({"sentence": "sentence"})),
    "sst2": _glue("SST-2", _read_sst2, "sst2", test=_glue_test({"sentence": "sentence"})),
    "mrpc": _glue(
        "MRPC", _glue_pair("#1 String", "#2 String", "Quality", {"0": 0, "1": 1}, _MRPC_HEADER),
        "mrpc",
        splits={"train": ("train.tsv", "msr_paraphrase_train.txt"),
                "validation": ("dev.tsv", "msr_paraphrase_test.txt")},
        how=_MRPC_HOW,
        test=_glue_test({"sentence1": "#1 String", "sentence2": "#2 String"})),
    "qqp": _glue("QQP", _glue_pair("question1", "question2", "is_duplicate", {"0": 0, "1": 1},
                                   out=("question1", "question2")), "qqp",
                 test=_glue_test({"question1": "question1", "question2": "question2"})),
    # "test": GLUE's test_with_labels.tsv when present (scored), else the unlabelled test.tsv.
    "stsb": _glue("STS-B", _read_stsb, "stsb",
                  splits={"train": ("train.tsv",), "validation": ("dev.tsv",),
                          "test": ("test_with_labels.tsv", "test.tsv")},
                  tfds_splits={"train": "train", "validation": "validation"},
                  test=_read_stsb_test),
    "mnli": dataclasses.replace(
        _glue("MNLI", _read_mnli, "mnli",
              splits={"train": ("train.tsv",),
                      "validation_matched": ("dev_matched.tsv",),
                      "validation_mismatched": ("dev_mismatched.tsv",),
                      "test_matched": ("test_matched.tsv",),
                      "test_mismatched": ("test_mismatched.tsv",)}),
        split_readers={"test_matched": _NLI_TEST, "test_mismatched": _NLI_TEST}),
    "qnli": _glue("QNLI", _glue_pair("question", "sentence", "label", _names("qnli"),
                                     out=("question", "sentence")), "qnli",
                  test=_glue_test({"question": "question", "sentence": "sentence"})),
    "rte": _glue("RTE", _glue_pair("sentence1", "sentence2", "label", _names("rte")), "rte",
                 test=_glue_test(_PAIR)),
    "wnli": _glue("WNLI", _glue_pair("sentence1", "sentence2", "label", {"0": 0, "1": 1}),
                  "wnli", test=_glue_test(_PAIR)),
}

# GLUE's diagnostic (AX), test only, scored by the submission server with MNLI's labels:
# glue/diagnostic/diagnostic.tsv as download_glue_data.py writes it (index, sentence1,
# sentence2), or TFDS glue/ax.
GLUE_AX_LAYOUT = Layout("glue/diagnostic", {"test": ("diagnostic.tsv", "AX.tsv")}, _NLI_TEST,
                        _GLUE_HOW, "glue/ax:2.0.0", {"test": "test"})


def _sg(folder, reader, tfds, test=None, splits=None):
    """A SuperGLUE layout; `test`: the reader of the unlabelled `test.jsonl` (split "test")."""
    splits = dict(splits or {"train": ("train.jsonl",), "validation": ("val.jsonl",),
                             "train_32shot": ("train_32shot.jsonl",), "test": ("test.jsonl",)})
    return Layout(f"super_glue/{folder}", splits, reader, _SG_HOW,
                  f"super_glue/{tfds}:1.0.2",
                  {s: s for s in ("train", "validation", "test") if s in splits},
                  {"test": test} if test is not None else {})


def _sg_task(required, convert, placeholder):
    """(labelled reader, unlabelled test reader) of a one-row-per-line SuperGLUE task."""
    test_required = tuple(k for k in required if k != "label")
    return (_jsonl(required, convert),
            _jsonl(test_required, _unlabelled(convert, placeholder)))


_BOOLQ = _sg_task(("question", "passage", "label"), _boolq, False)
_CB = _sg_task(("premise", "hypothesis", "label"), _nli("cb"), "entailment")
_COPA = _sg_task(("premise", "choice1", "choice2", "question", "label"), _copa, 0)
_RTE = _sg_task(("premise", "hypothesis", "label"), _nli("rte"), "entailment")
_WIC = _sg_task(("word", "sentence1", "sentence2", "label"), _wic, False)
_WSC = _sg_task(("text", "target", "label"), _wsc, False)
_AXB = _jsonl(("sentence1", "sentence2"),
              _rekey(_unlabelled(_nli("rte"), "entailment"),
                     {"sentence1": "premise", "sentence2": "hypothesis"}))

SUPER_GLUE_LAYOUTS: dict[str, Layout] = {
    "boolq": _sg("BoolQ", _BOOLQ[0], "boolq", _BOOLQ[1]),
    "cb": _sg("CB", _CB[0], "cb", _CB[1]),
    "copa": _sg("COPA", _COPA[0], "copa", _COPA[1]),
    "multirc": _sg("MultiRC", _read_multirc, "multirc", _read_multirc_test),
    "record": _sg("ReCoRD", _read_record, "record"),
    "rte": _sg("RTE", _RTE[0], "rte", _RTE[1]),
    "wic": _sg("WiC", _WIC[0], "wic", _WIC[1]),
    "wsc": _sg("WSC", _WSC[0], "wsc.fixed", _WSC[1]),
}

# SuperGLUE's diagnostics, test only, predicted with RTE's model: AX-b (broad coverage,
# sentence1/sentence2) and AX-g (Winogender, premise/hypothesis), as SuperGLUE ships them
# (their public files carry labels, kept when present).
SUPER_GLUE_AX_LAYOUTS: dict[str, Layout] = {
    "axb": _sg("AX-b", _AXB, "axb", splits={"test": ("AX-b.jsonl", "test.jsonl")}),
    "axg": _sg("AX-g", _RTE[1], "axg", splits={"test": ("AX-g.jsonl", "test.jsonl")}),
}

CS224N_LAYOUTS: dict[str, Layout] = {
    "sst": Layout("cs224n", {"train": ("ids-sst-train.csv",), "validation": ("ids-sst-dev.csv",)},
                  _cs224n(("sentence", "sentiment"), _cs_sst), _CS_HOW),
    "quora": Layout("cs224n", {"train": ("quora-train.csv",), "validation": ("quora-dev.csv",)},
                    _cs224n(("sentence1", "sentence2", "is_duplicate"), _cs_quora), _CS_HOW),
    "sts": Layout("cs224n", {"train": ("sts-train.csv",), "validation": ("sts-dev.csv",)},
                  _cs224n(("sentence1", "sentence2", "similarity"), _cs_sts), _CS_HOW),
}


# ------------------------------------------------------------------------------ reading


def _locate(layout: Layout, split: str, data_dir: pathlib.Path) -> pathlib.Path:
    if split not in layout.splits:
        raise ValueError(f"split={split!r} is not one of {sorted(layout.splits)} for "
                         f"{layout.folder}")
    names = layout.splits[split]
    folder = data_dir / layout.folder
    for name in names:
        if (folder / name).exists():
            return files.require_file(folder / name, layout.how_to_obtain)
    expected = " or ".join(repr(str(folder / n)) for n in names)
    raise files.DataFileError(f"missing data file {expected} for split {split!r}; "
                              f"{layout.how_to_obtain}")


@functools.lru_cache(maxsize=64)
def _read_cached(reader: Reader, path: str, mtime_ns: int, size: int, on_bad_row: str):
    del mtime_ns, size  # part of the cache key only: an edited file is read again
    counter = files.BadRowCounter(pathlib.Path(path), on_bad_row)
    rows = reader(pathlib.Path(path), counter)
    if not rows:
        raise files.DataFileError(
            f"data file {path!r} has no readable examples"
            + (f" ({counter.skipped} bad rows skipped)" if counter.skipped else ""))
    return tuple(rows)


def read_rows(layout: Layout, split: str, data_dir: str | os.PathLike,
              on_bad_row: str | None = None) -> tuple[Row, ...]:
    """Rows of `split` from the official file, shaped like the TFDS features
    (`on_bad_row` None: the process's policy, `ktx.data.files.get_on_bad_row`).

    Raises:
      ValueError: unknown split or policy.
      files.DataFileError: missing/empty file (naming the path and how to obtain it) or,
        with on_bad_row="raise", a malformed row (naming file and line).
    """
    if on_bad_row is None:
        on_bad_row = files.get_on_bad_row()
    if on_bad_row not in files.BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row={on_bad_row!r}; accepted: {files.BAD_ROW_POLICIES}")
    path = _locate(layout, split, pathlib.Path(data_dir))
    stat = path.stat()
    return _read_cached(layout.reader_for(split), str(path), stat.st_mtime_ns, stat.st_size,
                        on_bad_row)


def _columns(rows: Sequence[Row]) -> dict[str, Any]:
    """Row dicts -> dict of tensors (nested dicts kept; lists of strings become ragged)."""
    out = {}
    for key, first in rows[0].items():
        values = [r[key] for r in rows]
        if isinstance(first, dict):
            out[key] = _columns(values)
        elif isinstance(first, list):
            out[key] = tf.ragged.constant(values, dtype=tf.string, ragged_rank=1) \
                if any(values) else tf.zeros([len(values), 0], tf.string)
        elif isinstance(first, str):
            out[key] = tf.constant(values, tf.string)
        elif isinstance(first, (float, np.floating)):
            out[key] = tf.constant(values, tf.float32)
        else:
            out[key] = tf.constant(values, tf.int32)
    return out


class OfficialFilesSource(seqio.DataSource):
    """A seqio DataSource over a `Layout`'s files, or a prepared TFDS copy.

    The folders are resolved at `get_dataset` / `num_input_examples` time through the given
    callables, so that registering a task touches no file.

    Args:
      layout: the data set's `Layout`.
      data_dir: () -> data folder (e.g. `ktx.tasks.config.get_data_dir`).
      tfds_data_dir: () -> TFDS folder or None; TFDS is used for a split when the folder
        is set, the split has a TFDS counterpart and the data set is prepared there.
      on_bad_row: () -> "raise" | "skip" (default: the process's policy,
        `ktx.data.files.get_on_bad_row`).
    """

    def __init__(self, layout: Layout, data_dir: Callable[[], os.PathLike | str],
                 tfds_data_dir: Callable[[], str | None] = lambda: None,
                 on_bad_row: Callable[[], str] = files.get_on_bad_row):
        if not isinstance(layout, Layout):
            raise TypeError(f"layout={layout!r}: expected a glue_sources.Layout")
        super().__init__(splits=tuple(layout.splits))
        self._layout = layout
        self._data_dir = data_dir
        self._tfds_data_dir = tfds_data_dir
        self._on_bad_row = on_bad_row

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def supports_arbitrary_sharding(self) -> bool:
        return True

    def _tfds_builder(self, split: str):
        folder = self._tfds_data_dir()
        if not folder or not self._layout.tfds_name or split not in self._layout.tfds_splits:
            return None
        import tensorflow_datasets as tfds  # only when a TFDS folder is configured

        builder = tfds.builder(self._layout.tfds_name, data_dir=folder)
        return builder if builder.is_prepared() else None

    def list_shards(self, split: str) -> Sequence[str]:
        if self._tfds_builder(split) is not None:
            return [f"tfds:{self._layout.tfds_name}[{self._layout.tfds_splits[split]}]"]
        return [str(_locate(self._layout, split, pathlib.Path(self._data_dir())))]

    def num_input_examples(self, split: str) -> int:
        builder = self._tfds_builder(split)
        if builder is not None:
            return builder.info.splits[self._layout.tfds_splits[split]].num_examples
        return len(read_rows(self._layout, split, self._data_dir(), self._on_bad_row()))

    def get_dataset(self, split: str = "train", shuffle: bool = True,
                    seed: int | None = None, shard_info: seqio.ShardInfo | None = None,
                    *, sequence_length=None, use_cached=False, num_epochs=1) -> tf.data.Dataset:
        del sequence_length, use_cached, num_epochs
        builder = self._tfds_builder(split)
        if builder is not None:
            ds = builder.as_dataset(split=self._layout.tfds_splits[split], shuffle_files=False)
            n = None
        else:
            rows = read_rows(self._layout, split, self._data_dir(), self._on_bad_row())
            ds = tf.data.Dataset.from_tensor_slices(_columns(rows))
            n = len(rows)
        if shard_info is not None:
            ds = ds.shard(shard_info.num_shards, shard_info.index)
        if shuffle:
            ds = ds.shuffle(n or 100_000, seed=seed, reshuffle_each_iteration=True)
        return ds
