"""Biomedical sentence-pair tasks for BERT-family encoders: answer ranking
(`biomed_mediqa2019_qa_bert_v001`, `biomed_trecqa2017_bert_v001`, mixture
`biomed_ranking_bert_v001`) and medical NLI (`biomed_mednli_bert_v001`).

The same files, splits and rows as the text-to-text tasks of `ktx.tasks.biomed`
(`BIOMED_FILES`; MEDIQA-2019 task 3 XML, MedNLI jsonl, which needs credentialed access and
is not in the shared data), tokenized as pairs with the run's WordPiece vocabulary (gin
macro `ENCODER_VOCAB`):

* answer ranking: `text_a` = the question, `text_b` = one candidate answer, `label` = the
  regression target `ReferenceScore - (ReferenceRank - 1) / m` of He et al. (2020)
  (`ktx.metrics.biomed.ranking_target_score`, in (0, 4]; correct answers above 2): a
  regression head (`NUM_LABELS` 1), scored by `ktx.runs.rank_qa_eval.AnswerRankingEvaluator`
  with the official MEDIQA-2019 accuracy, MRR and precision, grouped by question.
* MedNLI: `text_a` = the premise, `text_b` = the hypothesis, `label` the index of the
  gold label in `NLI_LABELS` (entailment, neutral, contradiction): a 3-class head.

TRECQA-2017's train split holds MEDIQA-2019's test set and the other way round (see
`ktx.tasks.biomed`): train a ranking model on one and report the other's test split only
when neither's train split saw it (`biomed_ranking_bert_v001` mixes both for
validation-split development).
"""

from __future__ import annotations

import seqio
import tensorflow as tf

from ktx.data import biomed_sources, wordpiece
from ktx.data import encoder_features as ef
from ktx.tasks import biomed

__all__ = ["RANKING_BERT_TASKS", "RANKING_BERT_MIXTURE", "MEDNLI_BERT_TASK", "RANKING_SCORES",
           "add_answer_ranking_encoder_task", "add_mednli_encoder_task"]

RANKING_SCORES = ef.LabelSpace.regression(0.0, 4.0)


@seqio.map_over_dataset
def ranking_pair(x):
    """A MEDIQA row -> `{"text_a": question, "text_b": answer, "label": target score}`."""
    return {"text_a": x["question"], "text_b": x["answer"],
            "label": tf.cast(x["score"], tf.float32)}


@seqio.map_over_dataset
def nli_pair(x):
    """A MedNLI row -> `{"text_a": premise, "text_b": hypothesis, "label": class index}`."""
    index = tf.argmax(tf.cast(tf.equal(x["label"], tf.constant(biomed_sources.NLI_LABELS)),
                              tf.int32))
    return {"text_a": x["premise"], "text_b": x["hypothesis"], "label": tf.cast(index, tf.float32)}


def _encoder_task(name, source, pair_fn, labels) -> seqio.Task:
    return seqio.TaskRegistry.add(
        name, source=source, preprocessors=[pair_fn, ef.tokenize_texts],
        output_features=ef.encoder_output_features(wordpiece.ENCODER_VOCABULARY, labels),
        metric_fns=[])


def add_answer_ranking_encoder_task(name: str, key: str, split_files=None, *, data_dir=None,
                                    on_bad_row=None) -> seqio.Task:
    """Registers an answer-ranking encoder task over MEDIQA-2019 XML files (default:
    `biomed.BIOMED_FILES[key]`, key "mediqa2019_qa" or "trecqa2017")."""
    return _encoder_task(name, biomed._source(key, split_files, biomed.mediqa_rows, data_dir,
                                              on_bad_row), ranking_pair, RANKING_SCORES)


def add_mednli_encoder_task(name: str, split_files=None, *, data_dir=None,
                            on_bad_row=None) -> seqio.Task:
    """Registers MedNLI as a 3-class encoder task over its jsonl files (default:
    `biomed.BIOMED_FILES["mednli"]`)."""
    return _encoder_task(name, biomed._source("mednli", split_files, biomed.mednli_rows,
                                              data_dir, on_bad_row),
                         nli_pair, ef.LabelSpace(biomed_sources.NLI_LABELS))


RANKING_BERT_TASKS = (
    add_answer_ranking_encoder_task("biomed_mediqa2019_qa_bert_v001", "mediqa2019_qa").name,
    add_answer_ranking_encoder_task("biomed_trecqa2017_bert_v001", "trecqa2017").name,
)
RANKING_BERT_MIXTURE = "biomed_ranking_bert_v001"
seqio.MixtureRegistry.add(RANKING_BERT_MIXTURE, list(RANKING_BERT_TASKS),
                          default_rate=seqio.mixing_rate_num_examples)
MEDNLI_BERT_TASK = add_mednli_encoder_task("biomed_mednli_bert_v001").name
