"""Vocabularies: the standard T5 SentencePiece model, found under the data directory."""

from __future__ import annotations

import functools
import os

import seqio

from ktx.data import files

__all__ = ["T5_SPIECE_RELPATH", "T5_EXTRA_IDS", "default_vocabulary", "byte_vocabulary"]

T5_SPIECE_RELPATH = "vocab/t5_spiece.model"
T5_EXTRA_IDS = 100


@functools.lru_cache(maxsize=None)
def _spm(path: str, extra_ids: int) -> seqio.SentencePieceVocabulary:
    return seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)


def default_vocabulary(
    data_dir: str | os.PathLike | None = None, extra_ids: int = T5_EXTRA_IDS
) -> seqio.SentencePieceVocabulary:
    """T5's 32,000-piece SentencePiece vocabulary plus `extra_ids` sentinels (32,100)."""
    path = files.require_file(
        files.resolve_data_dir(data_dir) / T5_SPIECE_RELPATH,
        "copy the standard T5 SentencePiece model (sentencepiece.model of the public T5 "
        f"release) there as {T5_SPIECE_RELPATH}",
    )
    return _spm(str(path), extra_ids)


@functools.lru_cache(maxsize=None)
def byte_vocabulary(extra_ids: int = 0) -> seqio.ByteVocabulary:
    """UTF-8 bytes (259 ids: pad 0, eos 1, unk 2, bytes 3..258) plus sentinels; no files."""
    return seqio.ByteVocabulary(extra_ids=extra_ids)
