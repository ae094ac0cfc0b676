"""Row readers of the GLUE, SuperGLUE and CS224N files (`ktx.data.glue_sources` holds the
layouts that name them and the SeqIO source): each turns one official file into rows
shaped like the TFDS features of the same data set, raising `files.DataFileError` naming
file and line for a malformed row (or skipping and counting it, `on_bad_row="skip"`).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ktx.data import files

__all__ = ["GLUE_LABELS", "SUPER_GLUE_LABELS", "Row", "Reader", "fix_wsc_spans"]

Row = dict[str, Any]
Reader = Callable[[pathlib.Path, files.BadRowCounter], list[Row]]

# Label names in TFDS class order (index == TFDS ClassLabel id), as T5 uses them.
GLUE_LABELS: dict[str, tuple[str, ...]] = {
    "cola": ("unacceptable", "acceptable"),
    "sst2": ("negative", "positive"),
    "mrpc": ("not_equivalent", "equivalent"),
    "qqp": ("not_duplicate", "duplicate"),
    "mnli": ("entailment", "neutral", "contradiction"),
    "qnli": ("entailment", "not_entailment"),
    "rte": ("entailment", "not_entailment"),
    "wnli": ("not_entailment", "entailment"),
}
SUPER_GLUE_LABELS: dict[str, tuple[str, ...]] = {
    "boolq": ("False", "True"),
    "cb": ("entailment", "contradiction", "neutral"),
    "copa": ("choice1", "choice2"),
    "multirc": ("False", "True"),
    "rte": ("entailment", "not_entailment"),
    "wic": ("False", "True"),
    "wsc": ("False", "True"),
}


# ----------------------------------------------------------------------------- helpers


def _label(counter, line, value, accepted: Mapping[str, int]) -> int | None:
    key = str(value).strip()
    if key not in accepted:
        counter.bad(line, f"unknown label {value!r}; accepted: {sorted(accepted)}")
        return None
    return accepted[key]


def _float(counter, line, value, name, lo=None, hi=None) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        counter.bad(line, f"{name}={value!r} is not a number")
        return None
    if not np.isfinite(x) or (lo is not None and x < lo) or (hi is not None and x > hi):
        counter.bad(line, f"{name}={value!r} outside [{lo}, {hi}]")
        return None
    return x


def _int(counter, line, value, name) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        counter.bad(line, f"{name}={value!r} is not an integer")
        return None


def _bool_label(counter, line, value) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if value in (0, 1):
        return int(value)
    counter.bad(line, f"unknown label {value!r}; accepted: true, false")
    return None


def _text(counter, line, row, key) -> str | None:
    value = row.get(key)
    if not isinstance(value, str):
        counter.bad(line, f"field {key!r} is {value!r}, expected a string")
        return None
    return value


# -------------------------------------------------------------------------- GLUE readers


def _glue_pair(first: str, second: str, label_key: str, labels: Mapping[str, int],
               header: Sequence[str] | bool = True, out=("sentence1", "sentence2")) -> Reader:
    def read(path, counter):
        rows = []
        for line, r in files.read_tsv(path, header=header, counter=counter):
            label = _label(counter, line, r[label_key], labels)
            if label is not None:
                rows.append({out[0]: r[first], out[1]: r[second], "label": label,
                             "idx": len(rows)})
        return rows
    return read


def _read_cola(path, counter):
    rows = []
    for line, r in files.read_tsv(path, num_fields=4, counter=counter):
        label = _label(counter, line, r[1], {"0": 0, "1": 1})
        if label is not None:
            rows.append({"sentence": r[3], "label": label, "idx": len(rows)})
    return rows


def _read_sst2(path, counter):
    rows = []
    for line, r in files.read_tsv(path, header=("sentence", "label"), counter=counter):
        label = _label(counter, line, r["label"], {"0": 0, "1": 1})
        if label is not None:
            rows.append({"sentence": r["sentence"], "label": label, "idx": len(rows)})
    return rows


def _read_stsb(path, counter):
    rows = []
    for line, r in files.read_tsv(path, header=True, counter=counter):
        if "score" not in r:
            counter.bad(line, f"no 'score' column in the header {list(r)}; a labelled "
                        "STS-B file has 10 columns ending in 'score'")
            continue
        score = _float(counter, line, r["score"], "score", 0.0, 5.0)
        if score is not None:
            rows.append({"sentence1": r["sentence1"], "sentence2": r["sentence2"],
                         "label": np.float32(score), "idx": len(rows)})
    return rows


def _read_stsb_test(path, counter):
    """STS-B's test split: `test_with_labels.tsv` (scored) or GLUE's unlabelled `test.tsv`
    (no `score` column: label -1.0); `idx` is the file's `index` column."""
    rows = []
    for line, r in files.read_tsv(path, header=True, counter=counter):
        if "index" not in r or "sentence1" not in r or "sentence2" not in r:
            raise files.DataFileError(
                f"{path}:1: header {list(r)} lacks 'index', 'sentence1' or 'sentence2'; "
                "expected GLUE's STS-B test layout")
        idx = _int(counter, line, r["index"], "index")
        score = _float(counter, line, r["score"], "score", 0.0, 5.0) if "score" in r else -1.0
        if idx is not None and score is not None:
            rows.append({"sentence1": r["sentence1"], "sentence2": r["sentence2"],
                         "label": np.float32(score), "idx": idx})
    return rows


def _read_mnli(path, counter):
    labels = {n: i for i, n in enumerate(GLUE_LABELS["mnli"])}
    rows = []
    for line, r in files.read_tsv(path, header=True, counter=counter):
        if "gold_label" not in r:
            counter.bad(line, "no 'gold_label' column in the header")
            continue
        label = _label(counter, line, r["gold_label"], labels)
        if label is not None:
            rows.append({"premise": r["sentence1"], "hypothesis": r["sentence2"],
                         "label": label, "idx": len(rows)})
    return rows


def _names(task):
    return {n: i for i, n in enumerate(GLUE_LABELS[task])}


def _glue_test(columns: Mapping[str, str], label: Any = -1) -> Reader:
    """Reader of an unlabelled GLUE test file (`index` or QQP's `id` column, no label):
    rows {out: row[column] for columns} with `label` -1 and `idx` the file's index."""
    def read(path, counter):
        rows = []
        for line, r in files.read_tsv(path, header=True, counter=counter):
            key = "index" if "index" in r else "id"
            missing = [c for c in (key, *columns.values()) if c not in r]
            if missing:
                raise files.DataFileError(
                    f"{path}:1: header {list(r)} lacks columns {missing}; expected an "
                    f"unlabelled GLUE test file with 'index' (QQP: 'id') and {list(columns.values())}")
            idx = _int(counter, line, r[key], key)
            if idx is not None:
                rows.append({**{out: r[c] for out, c in columns.items()}, "label": label,
                             "idx": idx})
        return rows
    return read


_MRPC_HEADER = ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String")

# -------------------------------------------------------------------- SuperGLUE readers


def _jsonl(required: Sequence[str], convert: Callable[[Any, int, Row], Row | None]) -> Reader:
    def read(path, counter):
        rows = []
        for line, r in files.read_jsonl(path, required=required, counter=counter):
            row = convert(counter, line, r)
            if row is not None:
                row["idx"] = _int(counter, line, r.get("idx", len(rows)), "idx")
                if row["idx"] is not None:
                    rows.append(row)
        return rows
    return read


def _sg_classes(task):
    return {n: i for i, n in enumerate(SUPER_GLUE_LABELS[task])}


def _unlabelled(convert: Callable[[Any, int, Row], Row | None], placeholder: Any):
    """`convert` for a test file: a row without "label" is converted with `placeholder` (a
    valid label) and gets label -1; a row with one (the public AX-b/AX-g files) keeps it."""
    def wrapped(counter, line, r):
        if "label" in r:
            return convert(counter, line, r)
        row = convert(counter, line, {**r, "label": placeholder})
        if row is not None:
            row["label"] = -1
        return row
    return wrapped


def _rekey(convert, key_map: Mapping[str, str]):
    """`convert` over a row whose fields `key_map` renames (AX-b's sentence1/2)."""
    def wrapped(counter, line, r):
        return convert(counter, line, {key_map.get(k, k): v for k, v in r.items()})
    return wrapped


def _boolq(counter, line, r):
    label = _bool_label(counter, line, r["label"])
    q, p = _text(counter, line, r, "question"), _text(counter, line, r, "passage")
    if None in (label, q, p):
        return None
    return {"question": q, "passage": p, "label": label}


def _nli(task):
    classes = _sg_classes(task)

    def convert(counter, line, r):
        label = _label(counter, line, r["label"], classes)
        p, h = _text(counter, line, r, "premise"), _text(counter, line, r, "hypothesis")
        if None in (label, p, h):
            return None
        return {"premise": p, "hypothesis": h, "label": label}
    return convert


def _copa(counter, line, r):
    label = r["label"] if r["label"] in (0, 1) and not isinstance(r["label"], bool) else None
    if label is None:
        counter.bad(line, f"unknown label {r['label']!r}; accepted: 0, 1")
        return None
    if r["question"] not in ("cause", "effect"):
        counter.bad(line, f"question={r['question']!r}; accepted: 'cause', 'effect'")
        return None
    texts = [_text(counter, line, r, k) for k in ("premise", "choice1", "choice2")]
    if None in texts:
        return None
    return {"premise": texts[0], "choice1": texts[1], "choice2": texts[2],
            "question": r["question"], "label": label}


def _wic(counter, line, r):
    label = _bool_label(counter, line, r["label"])
    texts = [_text(counter, line, r, k) for k in ("word", "sentence1", "sentence2")]
    if label is None or None in texts:
        return None
    return {"word": texts[0], "sentence1": texts[1], "sentence2": texts[2], "label": label}


def fix_wsc_spans(row: Row) -> Row:
    """TFDS `super_glue/wsc.fixed`'s span corrections (`_fix_wst`), applied to a WSC row.

    For each span whose text is not a substring of `text` (SuperGLUE's WSC.zip writes
    e.g. "The table" for "... through the table because ..."): the case of its first
    letter is made to match the word at its index, trailing "." removed and newlines made
    spaces. "Kamenev and Zinoviev" / "Kamenev, Zinoviev, and Stalin" cannot be fixed (words
    in between) and stay; a span text with "theyscold" gets span2_index 10 (TFDS's text
    replacement there has no effect, so neither has it here). Returns a new row.
    """
    row = dict(row)
    words = row["text"].split()
    for key in ("span1", "span2"):
        span, index = row[f"{key}_text"], row[f"{key}_index"]
        if span in row["text"] or span in ("Kamenev and Zinoviev", "Kamenev, Zinoviev, and Stalin"):
            continue
        if "theyscold" in span:
            row["span2_index"] = 10
        if not 0 <= index < len(words) or not span:
            continue  # TFDS would fail on it; left for the marker to miss
        first = words[index]
        span = (span[0].lower() if first[0].islower() else span[0].upper()) + span[1:]
        row[f"{key}_text"] = span.rstrip(".").replace("\n", " ")
    return row


def _wsc(counter, line, r):
    """A WSC row with TFDS `wsc.fixed`'s span corrections (`fix_wsc_spans`)."""
    label = _bool_label(counter, line, r["label"])
    text = _text(counter, line, r, "text")
    target = r["target"]
    if label is None or text is None:
        return None
    if not isinstance(target, dict) or not all(
        k in target for k in ("span1_index", "span2_index", "span1_text", "span2_text")):
        counter.bad(line, f"target={target!r} lacks span1/2_index and span1/2_text")
        return None
    i1 = _int(counter, line, target["span1_index"], "span1_index")
    i2 = _int(counter, line, target["span2_index"], "span2_index")
    if i1 is None or i2 is None:
        return None
    return {**fix_wsc_spans({"text": text, "span1_index": i1, "span2_index": i2,
                             "span1_text": str(target["span1_text"]),
                             "span2_text": str(target["span2_text"])}),
            "label": label}


def _read_multirc(path, counter, labelled: bool = True):
    """One row per (paragraph, question, answer), as TFDS `super_glue/multirc`; with
    `labelled=False` (test files) an answer without "label" gets -1."""
    rows = []
    for line, r in files.read_jsonl(path, required=("idx", "passage"), counter=counter):
        passage = r["passage"]
        if not isinstance(passage, dict) or not isinstance(passage.get("text"), str) or \
                not isinstance(passage.get("questions"), list):
            counter.bad(line, "passage must be an object with 'text' and a 'questions' list")
            continue
        found = []
        try:
            for q in passage["questions"]:
                for a in q["answers"]:
                    label = a.get("label", None if labelled else -1)
                    if label not in (0, 1, True, False) and (labelled or label != -1):
                        raise ValueError(f"answer {a.get('idx')!r} has label {label!r}; "
                                         "accepted: 0, 1, true, false")
                    found.append({
                        "paragraph": passage["text"], "question": str(q["question"]),
                        "answer": str(a["text"]), "label": int(label),
                        "idx": {"paragraph": int(r["idx"]), "question": int(q["idx"]),
                                "answer": int(a["idx"])},
                    })
        except (KeyError, TypeError, ValueError) as e:
            counter.bad(line, f"malformed MultiRC question/answer: {e!r}")
            continue
        rows.extend(found)
    return rows


def _read_multirc_test(path, counter):
    return _read_multirc(path, counter, labelled=False)


def _read_record(path, counter):
    """One row per query with the passage's entities and the query's answers (TFDS)."""
    rows = []
    for line, r in files.read_jsonl(path, required=("idx", "passage", "qas"), counter=counter):
        try:
            passage = r["passage"]
            text = passage["text"]
            entities = sorted({text[e["start"]:e["end"] + 1] for e in passage["entities"]})
            found = []
            for qa in r["qas"]:
                answers = sorted({a["text"] for a in qa.get("answers", [])})
                found.append({"passage": text, "query": str(qa["query"]),
                              "entities": entities, "answers": answers,
                              "idx": {"passage": int(r["idx"]), "query": int(qa["idx"])}})
        except (KeyError, TypeError, ValueError) as e:
            counter.bad(line, f"malformed ReCoRD passage/query: {e!r}")
            continue
        rows.extend(found)
    return rows


# ----------------------------------------------------------------------- CS224N readers


def _cs224n(columns: Sequence[str], convert: Callable[[Any, int, Row], Row | None]) -> Reader:
    def read(path, counter):
        rows = []
        for line, r in files.read_csv(path, header=True, delimiter="\t", counter=counter):
            missing = [c for c in columns if c not in r]
            if missing:
                raise files.DataFileError(
                    f"{path}:1: header {list(r)} lacks columns {missing}; expected "
                    f"{list(columns)} (the CS224N multitask csv layout)")
            row = convert(counter, line, r)
            if row is not None:
                row["idx"] = len(rows)
                rows.append(row)
        return rows
    return read


def _cs_sst(counter, line, r):
    label = _label(counter, line, r["sentiment"], {str(i): i for i in range(5)})
    if label is None:
        return None
    return {"sentence": r["sentence"].strip(), "label": label}


def _cs_quora(counter, line, r):
    label = _label(counter, line, r["is_duplicate"],
                   {"0": 0, "1": 1, "0.0": 0, "1.0": 1})
    if label is None:
        return None
    return {"question1": r["sentence1"].strip(), "question2": r["sentence2"].strip(),
            "label": label}


def _cs_sts(counter, line, r):
    score = _float(counter, line, r["similarity"], "similarity", 0.0, 5.0)
    if score is None:
        return None
    return {"sentence1": r["sentence1"].strip(), "sentence2": r["sentence2"].strip(),
            "label": np.float32(score)}


# ------------------------------------------------------------------------------ layouts
