"""Disease NER as token tagging for BERT-family encoders: `biomed_ncbi_disease_bert_v001`,
`biomed_bc5cdr_disease_bert_v001` and their mixture `biomed_ner_bert_v001`
(examples-proportional).

The same IOB TSV files as the text-to-text tasks `biomed_ncbi_disease` /
`biomed_bc5cdr_disease` (`ktx.tasks.biomed.BIOMED_FILES`: `train.tsv`, `devel.tsv` as
`validation`, `test.tsv`), read with `ktx.data.biomed_sources.read_iob_sentences`: one
example per sentence, a BIO tag per word out of `DISEASE_IOB_LABELS` = ("O", "B-Disease",
"I-Disease") (label = tag index). A tag outside that set ("X-Disease", "I-Chemical", ...)
is a bad row naming the file, the line, what is wrong and the tags accepted (raised, or
skipped and counted with `ON_BAD_ROW = 'skip'`).

Each word is tokenized on its own with the run's WordPiece vocabulary (gin macro
`ENCODER_VOCAB`, `ktx.data.encoder_features.tokenize_words`); `MultiTaskInput` makes
`[CLS] pieces [SEP]` rows whose first piece of each word carries its tag
(`ktx.data.encoder_features.convert_tagging`). Models need a tagging head per task
(`HEAD_KINDS = 'tagging'`, `NUM_LABELS = 3`); `ktx.runs.tag_eval.TaggingEvaluator`
scores them with entity-level precision / recall / F1 on words.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import seqio

from ktx.data import biomed_sources, files, wordpiece
from ktx.data import encoder_features as ef
from ktx.tasks import biomed

__all__ = ["TaggingRows", "NER_BERT_TASKS", "NER_BERT_MIXTURE", "add_tagging_task"]


@dataclasses.dataclass(frozen=True)
class TaggingRows:
    """IOB TSV -> rows `{"line", "tokens" (words joined by ef.WORD_SEPARATOR), "tags"
    (tag indices into `labels`, space-joined)}` (a `BiomedFilesSource` rows function)."""

    labels: tuple[str, ...] = biomed_sources.DISEASE_IOB_LABELS

    def __call__(self, path: pathlib.Path, counter: files.BadRowCounter) -> list[dict[str, Any]]:
        index = {tag: i for i, tag in enumerate(self.labels)}
        return [{"line": s.line, "tokens": ef.WORD_SEPARATOR.join(s.tokens),
                 "tags": " ".join(str(index[t]) for t in s.tags)}
                for s in biomed_sources.read_iob_sentences(path, labels=self.labels,
                                                           counter=counter)]


def add_tagging_task(name: str, key: str,
                     labels: tuple[str, ...] = biomed_sources.DISEASE_IOB_LABELS) -> seqio.Task:
    """Registers a token-tagging encoder task over `biomed.BIOMED_FILES[key]`."""
    space = ef.LabelSpace.tagging(labels)
    source = biomed.BiomedFilesSource(
        biomed.BIOMED_FILES[key], TaggingRows(tuple(labels)), biomed._HOW_TO_OBTAIN[key],
        key_fields=("tokens",))
    return seqio.TaskRegistry.add(
        name, source=source, preprocessors=[ef.tokenize_words],
        output_features=ef.encoder_output_features(wordpiece.ENCODER_VOCABULARY, space),
        metric_fns=[])


NER_BERT_TASKS = (
    add_tagging_task("biomed_ncbi_disease_bert_v001", "ncbi_disease").name,
    add_tagging_task("biomed_bc5cdr_disease_bert_v001", "bc5cdr_disease").name,
)
NER_BERT_MIXTURE = "biomed_ner_bert_v001"
seqio.MixtureRegistry.add(NER_BERT_MIXTURE, list(NER_BERT_TASKS),
                          default_rate=seqio.mixing_rate_num_examples)
