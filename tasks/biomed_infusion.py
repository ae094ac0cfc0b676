"""Disease knowledge infusion as a text-to-text task (He et al., 2020, EMNLP: "Infusing
Disease Knowledge into BERT for Health Question Answering, Medical Inference and Disease
Name Recognition").

From a (disease, aspect, passage) triple the paper prepends the auxiliary question "What is
the [aspect] of [disease]?" to the passage, masks the disease and the aspect in the question
and blanks the disease where it occurs in the passage, and trains the model to recover both.
Here, with T5 sentinels:

  inputs : "What is the <extra_id_0> of <extra_id_1>? <passage, each mention of the disease
            (case-insensitive, whole words) replaced by <extra_id_1>>"
  targets: "<extra_id_0> <aspect> <extra_id_1> <disease> <extra_id_2>"

The aspect is lower-cased with "_" read as a space ("SIDE_EFFECT" -> "side effect").
Tasks:
- `biomed_disease_infusion`: triples from the TREC LiveQA 2017 medical train files (one per
  FOCUS x ANSWER of each sub-question; FOCUS = disease, TYPE = aspect); split "train" only.
- `biomed_disease_infusion_jsonl`: triples the user supplies (e.g. Wikipedia disease
  sections) as jsonl rows {"disease", "aspect", "passage"} in
  `<data_dir>/biomed/disease_infusion/{train,validation}.jsonl`.
`add_disease_infusion_task` registers the same over any files. The paper's extra loss term
(beta / sum of the raw logits of the masked tokens) is a model option, not part of the data.
Scored by disease / aspect exact match (case-insensitive).

Encoder (BERT-family) tasks, masked-LM as the paper trains BERT (`ktx.data.mlm_features`:
"What is the [MASK] of [MASK]?" [SEP] passage, the disease's pieces in the passage blanked;
`ktx.models.encoder_mlm.EncoderMlmModel` with `infusion_beta`), over the LiveQA triples:
- `biomed_disease_infusion_bert_v001`: disease and aspect masked (the paper's setting);
- `biomed_disease_infusion_bert_{no_aspect,no_disease,no_auxiliary,random15}_v001`: the
  ablations (aspect visible; disease visible; no auxiliary sentence; BERT's 15% random
  masking). `add_disease_infusion_encoder_task` registers any setting over any files.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import seqio

from ktx.data import biomed_sources
from ktx.data import files
from ktx.data import mlm_features
from ktx.data import wordpiece
from ktx.tasks import biomed
from ktx.tasks import config

__all__ = [
    "INFUSION_FILES",
    "READERS",
    "normalize_aspect",
    "infusion_example",
    "parse_infusion_output",
    "infusion_metrics",
    "add_disease_infusion_task",
    "ENCODER_ABLATIONS",
    "add_disease_infusion_encoder_task",
]

_LIVEQA = "biomed/liveqa2017/TREC-2017-LiveQA-Medical-Train-{}.xml"
INFUSION_FILES = {
    "liveqa": {"train": (_LIVEQA.format(1), _LIVEQA.format(2))},
    "jsonl": {
        "train": ("biomed/disease_infusion/train.jsonl",),
        "validation": ("biomed/disease_infusion/validation.jsonl",),
    },
}
_HOW_TO_OBTAIN = {
    "liveqa": "get TREC-2017-LiveQA-Medical-Train-{1,2}.xml (TrainingDatasets of "
    "github.com/abachaa/LiveQA_MedicalTask_TREC2017) and put them there",
    "jsonl": "write your (disease, aspect, passage) triples there as jsonl rows "
    '{"disease": ..., "aspect": ..., "passage": ...} (e.g. from Wikipedia disease sections)',
}
READERS = {
    "liveqa": biomed_sources.read_liveqa_triples,
    "jsonl": biomed_sources.read_disease_triples_jsonl,
}

_ASPECT, _DISEASE, _END = "<extra_id_0>", "<extra_id_1>", "<extra_id_2>"
_OUTPUT = re.compile(
    re.escape(_ASPECT) + r"(.*?)" + re.escape(_DISEASE) + r"(.*?)(?:" + re.escape(_END) + r"|$)",
    re.DOTALL,
)


def _squash(text: str) -> str:
    return " ".join(text.split())


def normalize_aspect(aspect: str) -> str:
    """"SIDE_EFFECT" / "Side effects " -> "side effect(s)": lower case, "_" as space."""
    return _squash(aspect.replace("_", " ")).lower()


def infusion_example(disease: str, aspect: str, passage: str) -> tuple[str, str]:
    """The (inputs, targets) strings of one triple (see the module docstring).

    Raises:
      ValueError: an empty field, or a field containing a T5 sentinel ("<extra_id_").
    """
    for name, value in (("disease", disease), ("aspect", aspect), ("passage", passage)):
        if not _squash(value):
            raise ValueError(f"{name} is empty")
        if "<extra_id_" in value:
            raise ValueError(f"{name}={value[:80]!r} contains a T5 sentinel '<extra_id_'")
    disease, aspect, passage = _squash(disease), normalize_aspect(aspect), _squash(passage)
    mention = re.compile(r"(?<!\w)" + re.escape(disease) + r"(?!\w)", re.IGNORECASE)
    masked = mention.sub(_DISEASE, passage)
    inputs = f"What is the {_ASPECT} of {_DISEASE}? {masked}"
    targets = f"{_ASPECT} {aspect} {_DISEASE} {disease} {_END}"
    return inputs, targets


def parse_infusion_output(output: str, example=None, is_target: bool = False) -> dict[str, str]:
    """Generated text -> {"aspect", "disease"} (empty strings when the sentinels are missing)."""
    del example, is_target
    match = _OUTPUT.search(output)
    if match is None:
        return {"aspect": "", "disease": ""}
    return {"aspect": _squash(match.group(1)), "disease": _squash(match.group(2))}


def infusion_metrics(
    targets: Sequence[Mapping[str, str]], predictions: Sequence[Mapping[str, str]]
) -> dict[str, float]:
    """Percent of examples whose disease / aspect / both match (case-insensitive)."""
    if len(targets) != len(predictions) or not targets:
        raise ValueError(f"{len(targets)} targets, {len(predictions)} predictions; need equal, > 0")
    same = lambda t, p, k: t[k].lower() == p[k].lower()  # noqa: E731
    disease = [same(t, p, "disease") for t, p in zip(targets, predictions)]
    aspect = [same(t, p, "aspect") for t, p in zip(targets, predictions)]
    return {
        "disease_accuracy": 100 * float(np.mean(disease)),
        "aspect_accuracy": 100 * float(np.mean(aspect)),
        "exact_match": 100 * float(np.mean(np.logical_and(disease, aspect))),
    }


def _rows_fn(reader_name: str, encoder: bool = False):
    """Rows of a reader's triples: T5 `inputs`/`targets`, or (`encoder`) the encoder
    tasks' `question` (the auxiliary sentence, unmasked) and `passage`."""
    reader = READERS[reader_name]

    def rows(path: pathlib.Path, counter: files.BadRowCounter) -> list[dict[str, Any]]:
        out = []
        for triple in reader(path, counter=counter):
            try:
                inputs, targets = infusion_example(triple.disease, triple.aspect, triple.passage)
            except ValueError as e:
                counter.bad(triple.line, str(e))
                continue
            row = {"line": triple.line, "disease": _squash(triple.disease),
                   "aspect": normalize_aspect(triple.aspect)}
            if encoder:
                row["question"] = f"What is the {row['aspect']} of {row['disease']}?"
                row["passage"] = _squash(triple.passage)
            else:
                row.update(inputs=inputs, targets=targets)
            out.append(row)
        return out

    kind = "infusion_encoder" if encoder else "infusion"
    rows.__name__ = rows.__qualname__ = f"{reader_name}_{kind}_rows"
    return rows


_ROWS = {name: _rows_fn(name) for name in READERS}
_ENCODER_ROWS = {name: _rows_fn(name, encoder=True) for name in READERS}


def _source(reader, split_files, rows, data_dir, on_bad_row) -> biomed.BiomedFilesSource:
    """The files of `reader` (`INFUSION_FILES[reader]` unless `split_files`), read into
    rows by `rows[reader]`."""
    if reader not in READERS:
        raise ValueError(f"reader={reader!r}; accepted: {sorted(READERS)}")
    return biomed.BiomedFilesSource(
        split_files if split_files is not None else INFUSION_FILES[reader],
        rows[reader], _HOW_TO_OBTAIN[reader], data_dir=data_dir, on_bad_row=on_bad_row)


def add_disease_infusion_task(
    name: str,
    reader: str = "liveqa",
    split_files: Mapping[str, Sequence[str | os.PathLike]] | None = None,
    *,
    data_dir: str | os.PathLike | None = None,
    on_bad_row: str | None = None,
    output_features: Mapping[str, seqio.Feature] | None = None,
) -> seqio.Task:
    """Registers a disease-infusion task.

    Args:
      name: task name.
      reader: "liveqa" (LiveQA 2017 train XML) or "jsonl" ({"disease","aspect","passage"}).
      split_files: split -> files (relative to the data folder, or absolute); default
        `INFUSION_FILES[reader]`.
      data_dir, on_bad_row: see `ktx.tasks.biomed.BiomedFilesSource`.
      output_features: default the T5 vocabulary features of `ktx.tasks.config`.
    """
    source = _source(reader, split_files, _ROWS, data_dir, on_bad_row)
    return seqio.TaskRegistry.add(
        name,
        source=source,
        preprocessors=[
            seqio.preprocessors.tokenize,
            seqio.CacheDatasetPlaceholder(),
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features=output_features or config.t5_output_features(),
        postprocess_fn=parse_infusion_output,
        metric_fns=[infusion_metrics],
    )


def add_disease_infusion_encoder_task(
    name: str,
    reader: str = "liveqa",
    split_files: Mapping[str, Sequence[str | os.PathLike]] | None = None,
    *,
    mask: str = "disease_and_aspect",
    auxiliary_sentence: bool = True,
    blank_rate: float = 0.25,
    blank_token: str = "[unused0]",
    data_dir: str | os.PathLike | None = None,
    on_bad_row: str | None = None,
) -> seqio.Task:
    """Registers a masked-LM disease-infusion task for encoders
    (`ktx.data.mlm_features.infusion_pieces`: `mask`, `auxiliary_sentence`, `blank_rate`,
    `blank_token`), tokenized with the run's WordPiece vocabulary
    (`wordpiece.ENCODER_VOCABULARY`, the gin `ENCODER_VOCAB`). Trained by
    `ktx.models.encoder_mlm.EncoderMlmModel`; scored by its masked-token accuracy."""
    if mask not in mlm_features.INFUSION_MASKS:
        raise ValueError(f"mask={mask!r}; accepted: {mlm_features.INFUSION_MASKS}")
    if mask == "aspect" and not auxiliary_sentence:
        raise ValueError("mask='aspect' needs auxiliary_sentence=True (the aspect is only in "
                         "the auxiliary sentence)")
    if isinstance(blank_rate, bool) or not isinstance(blank_rate, (int, float)) \
            or not 0.0 <= blank_rate <= 1.0:
        raise ValueError(f"blank_rate={blank_rate!r}; accepted: a probability in [0, 1]")
    source = _source(reader, split_files, _ENCODER_ROWS, data_dir, on_bad_row)
    return seqio.TaskRegistry.add(
        name,
        source=source,
        preprocessors=[functools.partial(
            mlm_features.infusion_preprocessor, mask=mask, auxiliary_sentence=auxiliary_sentence,
            blank_rate=float(blank_rate), blank_token=blank_token)],
        output_features=mlm_features.mlm_output_features(wordpiece.ENCODER_VOCABULARY),
        metric_fns=[],
    )


add_disease_infusion_task("biomed_disease_infusion", "liveqa")
add_disease_infusion_task("biomed_disease_infusion_jsonl", "jsonl")

# The paper's setting and the dissertation's Table 2.6 ablations, for encoders.
ENCODER_ABLATIONS = {
    "biomed_disease_infusion_bert_v001": {},
    "biomed_disease_infusion_bert_no_aspect_v001": {"mask": "disease"},
    "biomed_disease_infusion_bert_no_disease_v001": {"mask": "aspect"},
    "biomed_disease_infusion_bert_no_auxiliary_v001": {"auxiliary_sentence": False},
    "biomed_disease_infusion_bert_random15_v001": {"mask": "random"},
}
for _name, _setting in ENCODER_ABLATIONS.items():
    add_disease_infusion_encoder_task(_name, "liveqa", **_setting)
