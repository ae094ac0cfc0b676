"""One task's split as compact numpy rows, converted once and optionally kept on disk.

`TaskRows.load` runs a SeqIO task's split once (`task.get_dataset(lengths, split,
shuffle=False)`, one process's shard of it when given `seqio.ShardInfo`), converts its
examples with `ktx.data.feature_converter` (packing, when on, happens per task, so a
packed row holds one task only) and returns them as compact arrays with `task_id`; with a
`cache_dir` the arrays are saved to and loaded from `<cache_dir>/<task>/<split>-<hash>.npz`
(the hash of everything that changes them). `ktx.data.pipeline.MultiTaskInput` holds one
and assembles batches from its rows.

Encoder tasks (`ktx.data.encoder_features`: output features `text_a`, `text_b`, `label`;
the `*_bert_v001` tasks of `ktx.tasks`) give `EncoderClassifierModel` rows instead:
`input_ids`, `token_type_ids`, `attention_mask` `[L]` and `label` float32, with
`task_feature_lengths = {"inputs": L}` (the model's key) and the same layouts, mixing,
carry and resume semantics; they are never packed. Their WordPiece vocabulary is
`encoder_vocabulary` (the gin macro `ENCODER_VOCAB`), and `num_labels` (the model's
`NUM_LABELS`) and `head_kinds` (`HEAD_KINDS`) are checked against each task's labels. A
mixture with a token-tagging task (`LabelSpace.tagging`) gives every row
`ef.TAGGING_FEATURES` too (`token_labels` `[L]`, -100 where ignored; the truncation
counts), sequence tasks' rows with nothing labelled there
(`ef.convert_tagging`, `ef.sequence_rows_for_tagging`); what truncation cuts from a
tagging task is logged. With a cosine head (`head_kinds`, a regression task of pairs)
that task's texts are encoded alone (`ef.convert_encoder(separate=True)`) and every row
of the mixture gets `ef.COSINE_FEATURES` (all padding for the other tasks). A mixture
holds one kind of task (encoder or encoder-decoder).

Memory: the cache holds every converted row of every task (of this process's shards,
sharded: about `1 / P` of it) in compact dtypes (tokens
uint16 for vocabularies under 65,536 ids, loss weights uint8): at most `2 Le + 5 Ld + 2` bytes
per unpacked row (1,186 at 512/32; ~0.1 GB per 100k examples), packing adding segment
ids and positions. `cache_nbytes` reports it. The cache is unsuitable for corpora that
do not fit in host memory (C4-sized pre-training data): stream those with seqio's own
`get_dataset` instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np
import seqio

from ktx.data import encoder_features as ef
from ktx.data import feature_converter as fc
from ktx.data import files
from ktx.data import mixtures
from ktx.data import mlm_features
from ktx.data import seqio_cache
from ktx.data import wordpiece

__all__ = ["CACHE_FORMAT", "TaskRows"]

CACHE_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class TaskRows:
    """How the tasks of one input become rows (`MultiTaskInput`'s arguments of the same names).

    Attributes:
      task_names: the tasks, in task-id order (`mixtures.mixture_task_names`).
      kind: their kind, one of `mixtures.TASK_KINDS`.
      task_feature_lengths: `{"inputs": Le, "targets": Ld}`, or `{"inputs": L}` for
        encoder and masked-LM tasks.
      seed: handed to `get_dataset` (random preprocessors).
      use_cached: read SeqIO's offline cache (`ktx cache`), from `seqio_cache_dir`.
      cache_dir: where converted arrays are kept; None: converted every time.
      tagging: every row gets the tagging features (a mixture with a tagging task).
      cosine: task ids whose texts are encoded alone (a cosine head); every row then gets
        `ef.COSINE_FEATURES`.
      on_bad_row, encoder_vocabulary: the data files' bad-row policy and the encoder
        tasks' WordPiece vocabulary while reading.
    """

    task_names: tuple[str, ...]
    kind: str
    task_feature_lengths: Mapping[str, int]
    seed: int = 0
    use_cached: bool = False
    seqio_cache_dir: str | os.PathLike | None = None
    cache_dir: pathlib.Path | None = None
    tagging: bool = False
    cosine: tuple[int, ...] = ()
    on_bad_row: str | None = None
    encoder_vocabulary: str | os.PathLike | None = None

    @property
    def cosine_names(self) -> set[str]:
        return {self.task_names[t] for t in self.cosine}

    def cache_path(self, task_name: str, split: str, pack: bool,
                   shard: seqio.ShardInfo | None = None) -> pathlib.Path | None:
        """Where the converted rows are kept (None without a `cache_dir`)."""
        if self.cache_dir is None:
            return None
        fields = [CACHE_FORMAT, self.task_feature_lengths, pack, self.seed, self.use_cached]
        if shard is not None:  # one process's shard of the split
            fields.append(["shard", shard.index, shard.num_shards])
        if self.tagging:  # sequence rows get the tagging features too
            fields.append("tagging")
        if self.cosine:  # the cosine tasks' texts are encoded alone
            fields.append(["cosine", list(self.cosine), task_name in self.cosine_names])
        if self.kind != "enc_dec":  # the ids depend on the vocabulary
            vocabulary = seqio.get_mixture_or_task(task_name).output_features["text_a"].vocabulary
            fields.append(getattr(vocabulary, "cache_key", repr(vocabulary)))
        key = json.dumps(fields, sort_keys=True)
        digest = hashlib.sha1(key.encode()).hexdigest()[:12]
        return self.cache_dir / task_name / f"{split}-{digest}.npz"

    def load(self, task: int, split: str, *, pack: bool,
             shard: seqio.ShardInfo | None = None) -> dict[str, np.ndarray]:
        """Task `task`'s rows of `split` (of one shard when given), with `task_id`."""
        with files.on_bad_row_policy(self.on_bad_row), \
                wordpiece.encoder_vocabulary_scope(self.encoder_vocabulary):
            return self._load_with_policy(task, split, pack=pack, shard=shard)

    def _load_with_policy(self, task: int, split: str, *, pack: bool,
                          shard: seqio.ShardInfo | None) -> dict[str, np.ndarray]:
        name = self.task_names[task]
        path = self.cache_path(name, split, pack, shard)
        if path is not None and path.is_file():
            with np.load(path) as data:
                arrays = {k: data[k] for k in data.files}
            return fc.add_task_id(arrays, task, np.uint16)
        if self.use_cached:
            seqio_cache.require_cached(name, split, self.seqio_cache_dir)
        seqio_task = seqio.get_mixture_or_task(name)
        if split not in seqio_task.splits:
            raise ValueError(f"task {name!r} has no split {split!r}; splits: {tuple(seqio_task.splits)}")
        if self.kind == "encoder":
            arrays = fc.compact(self._convert_encoder(seqio_task, split, shard))
        elif self.kind == "mlm":
            arrays = fc.compact(self._convert_mlm(seqio_task, split, shard))
        else:
            arrays = fc.compact(self._convert_enc_dec(seqio_task, split, pack, shard))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
            np.savez(tmp, **arrays)
            os.replace(tmp, path)
        return fc.add_task_id(arrays, task, np.uint16)

    def _convert_enc_dec(self, seqio_task: seqio.Task, split: str, pack: bool,
                         shard: seqio.ShardInfo | None) -> dict[str, np.ndarray]:
        ds = mixtures.get_dataset(seqio_task, shard,
            sequence_length=self.task_feature_lengths,
            split=split,
            use_cached=self.use_cached,
            shuffle=False,
            seed=self.seed,
            num_epochs=1,
            trim_output_features=True,
        )
        keys = tuple(self.task_feature_lengths)
        ds = ds.map(lambda ex: {k: ex[k] for k in keys}).padded_batch(
            1024, padded_shapes={k: [self.task_feature_lengths[k]] for k in keys}
        )
        tokens = fc.tokens_from_batches(
            ds.as_numpy_iterator(), self.task_feature_lengths, source=f"{seqio_task.name}/{split}"
        )
        return fc.convert_enc_dec(
            tokens, self.task_feature_lengths["inputs"], self.task_feature_lengths["targets"], pack=pack
        )

    def _convert_mlm(self, seqio_task: seqio.Task, split: str,
                     shard: seqio.ShardInfo | None) -> dict[str, np.ndarray]:
        vocabulary = seqio_task.output_features["text_a"].vocabulary
        cls_id, sep_id = vocabulary.cls_id, vocabulary.sep_id  # a bad file raises here
        ds = mixtures.get_dataset(
            seqio_task, shard, sequence_length=None, split=split, use_cached=self.use_cached, shuffle=False,
            seed=self.seed, num_epochs=1, trim_output_features=False,
        )
        columns = _columns(ds, mlm_features.MLM_TEXT_FEATURES)
        return mlm_features.convert_mlm(*(columns[k] for k in mlm_features.MLM_TEXT_FEATURES),
                                        self.task_feature_lengths["inputs"], cls_id=cls_id,
                                        sep_id=sep_id)

    def _convert_encoder(self, seqio_task: seqio.Task, split: str,
                         shard: seqio.ShardInfo | None) -> dict[str, np.ndarray]:
        # Read the vocabulary here, so that a bad file raises its own error, not a
        # tf.data one from inside the tokenizer op.
        vocabulary = seqio_task.output_features["text_a"].vocabulary
        cls_id, sep_id = vocabulary.cls_id, vocabulary.sep_id
        ds = mixtures.get_dataset(
            seqio_task, shard, sequence_length=None, split=split, use_cached=self.use_cached, shuffle=False,
            seed=self.seed, num_epochs=1, trim_output_features=False,
        )
        space = ef.label_space(seqio_task)
        source = f"task {seqio_task.name!r} split {split!r}"
        if space.is_tagging:
            columns = _columns(ds, ("text_a", "word_lengths", "label"))
            features = ef.convert_tagging(
                columns["text_a"], columns["word_lengths"], columns["label"],
                self.task_feature_lengths["inputs"], cls_id=cls_id, sep_id=sep_id,
                tag_names=space.names)
            ef.log_truncation(features, source=source, length=self.task_feature_lengths["inputs"])
            return ef.with_cosine_features(features) if self.cosine else features
        columns = _columns(ds, ("text_a", "text_b", "label"))
        ef.check_labels(np.asarray(columns["label"], np.float64), space, source=source)
        features = ef.convert_encoder(
            columns["text_a"], columns["text_b"], columns["label"],
            self.task_feature_lengths["inputs"], cls_id=cls_id, sep_id=sep_id,
            separate=seqio_task.name in self.cosine_names)
        if self.cosine:
            features = ef.with_cosine_features(features)
        return ef.sequence_rows_for_tagging(features) if self.tagging else features


def _columns(ds, keys: Sequence[str], batch_size: int = 4096) -> dict[str, list]:
    """The examples of a tf.data dataset as one list per key of each example's value (a
    1-D array of token ids, or a scalar), in order. Read in ragged batches: example by
    example, tf.data's per-element overhead (about 1-3 ms, mostly rebuilding ragged
    tensors) made reading a split of 30,000 pairs take over a minute."""
    ds = ds.map(lambda ex: {k: ex[k] for k in keys}).ragged_batch(batch_size)
    columns: dict[str, list] = {k: [] for k in keys}
    for batch in ds.as_numpy_iterator():
        for key, column in columns.items():
            # a ragged column comes as rows (an object array, or 2-D when they are all of
            # one length), a scalar one as a 1-D array: either way one item per example
            column.extend(batch[key])
    return columns
