"""Token tagging: the BIO label scheme and entity-level scores of word tag sequences.

Tags are "O", "B-<type>" and "I-<type>" (IOB2). Entities are decoded as seqeval's default
(non-strict) mode and conlleval do (`ktx.metrics.biomed.iob_to_spans`): an entity starts
at a "B-" tag, or at an "I-<type>" tag that does not continue an entity of the same type
(a stray "I-" after "O", or after an entity of another type, opens a new entity); it
continues over the following "I-<type>" tags of its type and ends before anything else.

Scores are micro-averaged over a corpus (seqeval's `precision_score`, `recall_score`,
`f1_score`): a predicted entity is a true positive when a gold entity of the same
sentence has exactly its span and type. Words whose gold entities could not be predicted
(cut off by truncation) enter as gold entities that no prediction matches
(`EntityCounts.add(..., unmatchable_gold=k)`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence

from ktx.metrics.biomed import iob_to_spans

__all__ = ["OUTSIDE", "bio_types", "check_bio_labels", "bio_tag_problem", "EntityCounts",
           "entity_scores"]

OUTSIDE = "O"
_BIO = re.compile(r"^([BI])-(\S.*)$")


def bio_types(labels: Sequence[str]) -> tuple[str, ...]:
    """The entity types of a BIO label set, in order of first appearance."""
    out: list[str] = []
    for tag in labels:
        match = _BIO.match(tag)
        if match and match.group(2) not in out:
            out.append(match.group(2))
    return tuple(out)


def check_bio_labels(labels: Sequence[str], *, owner: str = "labels") -> tuple[str, ...]:
    """Raises ValueError unless `labels` is a BIO label set: distinct tags, "O" among them,
    every other tag "B-<type>" or "I-<type>", and both tags of each type present."""
    labels = tuple(labels)
    problems = []
    if len(set(labels)) != len(labels):
        problems.append("repeated tags")
    if OUTSIDE not in labels:
        problems.append(f"no {OUTSIDE!r} tag")
    bad = [t for t in labels if t != OUTSIDE and not (isinstance(t, str) and _BIO.match(t))]
    if bad:
        problems.append(f"tags {bad} are neither 'O' nor 'B-<type>' / 'I-<type>'")
    for kind in bio_types(labels):
        missing = [f"{p}-{kind}" for p in "BI" if f"{p}-{kind}" not in labels]
        if missing:
            problems.append(f"type {kind!r} lacks {missing}")
    if problems:
        raise ValueError(f"{owner}={labels!r} is not a BIO label set ({'; '.join(problems)}); "
                         "accepted: 'O' plus 'B-<type>' and 'I-<type>' for each entity type, "
                         "e.g. ('O', 'B-Disease', 'I-Disease')")
    return labels


def bio_tag_problem(tag: str, labels: Collection[str]) -> str | None:
    """Why `tag` is not one of the BIO `labels` (None when it is): not a BIO tag at all
    (e.g. "X-Disease"), an entity type the label set does not have (e.g. "I-Chemical"
    with Disease tags), or otherwise absent from the set."""
    if tag in labels:
        return None
    accepted = f"accepted: {sorted(labels)}"
    if tag == OUTSIDE:
        return f"tag {tag!r} is not in the label set; {accepted}"
    match = _BIO.match(tag)
    if not match:
        return f"tag {tag!r} is not a BIO tag ('O', 'B-<type>', 'I-<type>'); {accepted}"
    types = bio_types(tuple(labels))
    if match.group(2) not in types:
        return (f"tag {tag!r} has entity type {match.group(2)!r}, not one of the label set's "
                f"types {list(types)}; {accepted}")
    return f"tag {tag!r} is not in the label set; {accepted}"


@dataclasses.dataclass
class EntityCounts:
    """Corpus counts of entity matching: true positives, predicted and gold entities."""

    true_positive: int = 0
    predicted: int = 0
    gold: int = 0

    def add(self, gold_tags: Sequence[str], pred_tags: Sequence[str], *,
            unmatchable_gold: int = 0, drop_last_gold: bool = False) -> None:
        """Adds one sentence: `gold_tags` and `pred_tags` over the same words.

        `unmatchable_gold`: gold entities of the sentence outside these words (cut off),
        counted as gold and never matched. `drop_last_gold`: the last gold entity decoded
        from `gold_tags` is only the beginning of a longer entity (it runs past the
        words, and is one of the `unmatchable_gold`), so it is not matched either.
        """
        if len(gold_tags) != len(pred_tags):
            raise ValueError(f"{len(gold_tags)} gold tags but {len(pred_tags)} predicted tags; "
                             "they must cover the same words")
        gold = iob_to_spans(list(gold_tags))
        if drop_last_gold:
            if not gold or gold[-1][1] != len(gold_tags):
                raise ValueError("drop_last_gold=True but no gold entity ends at the last word")
            if unmatchable_gold < 1:
                raise ValueError("drop_last_gold=True needs unmatchable_gold >= 1 (the dropped "
                                 "entity is one of them)")
            gold = gold[:-1]
        pred = iob_to_spans(list(pred_tags))
        self.true_positive += len(set(gold) & set(pred))
        self.predicted += len(pred)
        self.gold += len(gold) + int(unmatchable_gold)

    def __iadd__(self, other: "EntityCounts") -> "EntityCounts":
        self.true_positive += other.true_positive
        self.predicted += other.predicted
        self.gold += other.gold
        return self


def entity_scores(counts: EntityCounts) -> dict[str, float]:
    """`entity_f1`, `entity_precision`, `entity_recall` (percent) of corpus counts; 0 for
    an undefined ratio (seqeval's `zero_division=0`), 100 when there is neither a gold nor
    a predicted entity (as `ktx.metrics.biomed.entity_prf`)."""
    if counts.gold == 0 and counts.predicted == 0:
        return {"entity_f1": 100.0, "entity_precision": 100.0, "entity_recall": 100.0}
    tp = counts.true_positive
    precision = tp / counts.predicted if counts.predicted else 0.0
    recall = tp / counts.gold if counts.gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"entity_f1": 100 * f1, "entity_precision": 100 * precision,
            "entity_recall": 100 * recall}
