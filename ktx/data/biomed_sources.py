"""Readers of the biomedical data sets in their official layouts.

- IOB TSV (NCBI-disease, BC5CDR-disease as BioBERT distributes them): one `token<TAB>tag`
  per line, a blank line between sentences.
- MEDIQA-2019 task 3 XML: `<Question QID>` with `<QuestionText>` and `<AnswerList>` of
  `<Answer AID SystemRank ReferenceRank ReferenceScore>` holding `<AnswerText>`.
- TREC LiveQA 2017 medical *train* XML: `<NLM-QUESTION>` / `<SUB-QUESTIONS>` /
  `<SUB-QUESTION>` with `<ANNOTATIONS><FOCUS>..</FOCUS><TYPE>..</TYPE>` and
  `<ANSWERS><ANSWER>..</ANSWER>`: (disease, aspect, passage) triples.
- MedNLI jsonl (credentialed, the user supplies it): `sentence1`, `sentence2`,
  `gold_label` as released, or `premise`, `hypothesis`, `label`.
- Disease-knowledge jsonl the user supplies: `disease`, `aspect`, `passage`.

Every reader names file and line in its errors; a bad row goes to the `BadRowCounter`
policy ("raise", or "skip" and count). Whole-file problems (missing, empty, not XML,
no records) always raise `DataFileError`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Collection, Iterator
from typing import Any
from xml.parsers import expat

from ktx.data import files
from ktx.metrics import biomed as biomed_metrics
from ktx.metrics.tagging import bio_tag_problem

__all__ = [
    "DISEASE_IOB_LABELS",
    "MEDIQA_REFERENCE_SCORES",
    "NLI_LABELS",
    "IobSentence",
    "MediqaAnswer",
    "MediqaQuestion",
    "DiseaseTriple",
    "NliPair",
    "read_iob_sentences",
    "read_mediqa_xml",
    "read_liveqa_triples",
    "read_mednli_jsonl",
    "read_disease_triples_jsonl",
]

DISEASE_IOB_LABELS = ("O", "B-Disease", "I-Disease")
MEDIQA_REFERENCE_SCORES = (1, 2, 3, 4)
NLI_LABELS = biomed_metrics.NLI_LABELS  # the metrics define the label set


@dataclasses.dataclass(frozen=True)
class IobSentence:
    line: int  # line of the sentence's first token
    tokens: tuple[str, ...]
    tags: tuple[str, ...]

    @property
    def mentions(self) -> list[str]:
        return biomed_metrics.iob_mentions(self.tokens, self.tags)


@dataclasses.dataclass(frozen=True)
class MediqaAnswer:
    answer_id: str
    text: str
    reference_score: int
    reference_rank: int
    line: int


@dataclasses.dataclass(frozen=True)
class MediqaQuestion:
    question_id: str
    text: str
    num_candidates: int  # Answer elements of the question in the file (m of the target)
    answers: tuple[MediqaAnswer, ...]
    line: int


@dataclasses.dataclass(frozen=True)
class DiseaseTriple:
    disease: str
    aspect: str
    passage: str
    line: int


@dataclasses.dataclass(frozen=True)
class NliPair:
    premise: str
    hypothesis: str
    label: str
    line: int


def read_iob_sentences(
    path: pathlib.Path,
    *,
    labels: Collection[str] = DISEASE_IOB_LABELS,
    counter: files.BadRowCounter | None = None,
) -> Iterator[IobSentence]:
    """Yields the sentences of an IOB TSV file.

    A line with other than 2 tab-separated fields, an empty token, or a tag outside `labels`
    makes its whole sentence bad (raised, or skipped and counted once); the error names the
    file and that line, and for a tag what is wrong with it (not a BIO tag, an entity type
    the label set lacks: `ktx.metrics.tagging.bio_tag_problem`) and the tags accepted.
    """
    path = pathlib.Path(path)
    counter = counter or files.BadRowCounter(path)
    tokens: list[str] = []
    tags: list[str] = []
    start = None
    bad = False

    def flush():
        if start is not None and not bad:
            return IobSentence(start, tuple(tokens), tuple(tags))
        return None

    for number, text in files.read_lines(path):
        if not text.strip():
            sentence = flush()
            if sentence is not None:
                yield sentence
            tokens, tags, start, bad = [], [], None, False
            continue
        if start is None:
            start = number
        if bad:
            continue
        fields = text.split("\t")
        if len(fields) != 2:
            counter.bad(number, f"expected 2 tab-separated fields (token, tag), found {len(fields)}: {text!r}")
            bad = True
        elif not fields[0].strip():
            counter.bad(number, "empty token")
            bad = True
        elif fields[1].strip() not in labels:
            problem = bio_tag_problem(fields[1].strip(), labels)
            counter.bad(number, f"unknown tag {fields[1]!r}: {problem}")
            bad = True
        else:
            tokens.append(fields[0].strip())
            tags.append(fields[1].strip())
    sentence = flush()
    if sentence is not None:
        yield sentence
    counter.report()


# ----------------------------------------------------------------------------- XML


@dataclasses.dataclass
class _Node:
    tag: str
    attrib: dict[str, str]
    line: int
    children: list[_Node] = dataclasses.field(default_factory=list)
    parts: list[str] = dataclasses.field(default_factory=list)

    @property
    def text(self) -> str:
        """All character data inside the element (descendants included), runs of white
        space (newlines of indented XML included) collapsed to one space."""
        return " ".join("".join(self.parts).split())

    def find_all(self, tag: str) -> list[_Node]:
        return [c for c in self.children if c.tag == tag]

    def find(self, tag: str) -> _Node | None:
        found = self.find_all(tag)
        return found[0] if found else None


def _parse_xml(path: pathlib.Path) -> _Node:
    """Parses `path` into `_Node`s that keep their line numbers (expat; BOM accepted)."""
    parser = expat.ParserCreate()
    root = _Node("#document", {}, 0)
    stack = [root]

    def start(tag, attrib):
        node = _Node(tag, dict(attrib), parser.CurrentLineNumber)
        stack[-1].children.append(node)
        stack.append(node)

    def end(tag):
        node = stack.pop()
        # Character data of descendants belongs to the ancestors' text as well.
        stack[-1].parts.extend(node.parts)

    def data(text):
        stack[-1].parts.append(text)

    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = data
    try:
        with open(path, "rb") as f:
            parser.ParseFile(f)
    except expat.ExpatError as e:
        raise files.DataFileError(
            f"{path}:{e.lineno}: not well-formed XML ({expat.ErrorString(e.code)})"
        ) from e
    if not root.children:
        raise files.DataFileError(f"{path}: no XML root element")
    return root.children[0]


def _int_attr(node: _Node, name: str) -> int | None:
    value = node.attrib.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def read_mediqa_xml(
    path: pathlib.Path, *, counter: files.BadRowCounter | None = None
) -> list[MediqaQuestion]:
    """Reads a labelled MEDIQA-2019 task-3 XML file.

    Bad rows (file line named): an Answer without AID, empty AnswerText, a ReferenceScore
    outside 1-4 or a ReferenceRank outside 1..m (m = the question's Answer elements): the
    answer is bad; a Question without QID or answers, or with repeated reference ranks: the
    question is bad. An unlabelled file (no ReferenceScore anywhere) raises.
    """
    path = pathlib.Path(path)
    counter = counter or files.BadRowCounter(path)
    root = _parse_xml(path)
    question_nodes = root.find_all("Question")
    if not question_nodes:
        raise files.DataFileError(
            f"{path}:{root.line}: no <Question> elements under <{root.tag}>; expected the "
            "MEDIQA-2019 task 3 QA layout"
        )
    if not any("ReferenceScore" in a.attrib for q in question_nodes for a in _answers(q)):
        raise files.DataFileError(
            f"{path}: no ReferenceScore/ReferenceRank labels; use the labelled file "
            "(MEDIQA2019-Task3-QA-TestSet-wLabels.xml for the test set)"
        )
    questions = []
    for q in question_nodes:
        qid = q.attrib.get("QID", "").strip()
        answer_nodes = _answers(q)
        m = len(answer_nodes)
        if not qid:
            counter.bad(q.line, "<Question> without a QID attribute")
            continue
        if m == 0:
            counter.bad(q.line, f"question {qid} has no <Answer> elements")
            continue
        ranks = [_int_attr(a, "ReferenceRank") for a in answer_nodes]
        valid_ranks = [r for r in ranks if r is not None]
        if len(set(valid_ranks)) != len(valid_ranks):
            counter.bad(q.line, f"question {qid}: repeated ReferenceRank values {sorted(valid_ranks)}")
            continue
        answers = []
        for a, rank in zip(answer_nodes, ranks):
            aid = a.attrib.get("AID", "").strip()
            score = _int_attr(a, "ReferenceScore")
            text_node = a.find("AnswerText")
            text = text_node.text if text_node is not None else ""
            if not aid:
                counter.bad(a.line, "<Answer> without an AID attribute")
            elif score not in MEDIQA_REFERENCE_SCORES:
                counter.bad(
                    a.line,
                    f"answer {aid}: ReferenceScore={a.attrib.get('ReferenceScore')!r}; "
                    f"accepted: {list(MEDIQA_REFERENCE_SCORES)}",
                )
            elif rank is None or not 1 <= rank <= m:
                counter.bad(
                    a.line,
                    f"answer {aid}: ReferenceRank={a.attrib.get('ReferenceRank')!r}; accepted: "
                    f"an integer in 1..{m} (the question's number of answers)",
                )
            elif not text:
                counter.bad(a.line, f"answer {aid}: empty <AnswerText>")
            else:
                answers.append(MediqaAnswer(aid, text, score, rank, a.line))
        if answers:
            text_node = q.find("QuestionText")
            questions.append(
                MediqaQuestion(
                    qid, text_node.text if text_node is not None else "", m, tuple(answers), q.line
                )
            )
    counter.report()
    return questions


def _answers(question: _Node) -> list[_Node]:
    answer_list = question.find("AnswerList")
    return answer_list.find_all("Answer") if answer_list is not None else []


def read_liveqa_triples(
    path: pathlib.Path, *, counter: files.BadRowCounter | None = None
) -> list[DiseaseTriple]:
    """(disease, aspect, passage) triples of a TREC LiveQA 2017 medical *train* XML file.

    One triple per FOCUS x ANSWER of each SUB-QUESTION (a sub-question with two foci gives
    each answer once per focus); the aspect is the TYPE. Bad rows (line named): a
    NLM-QUESTION without SUB-QUESTION, a SUB-QUESTION without a non-empty FOCUS, without
    exactly one non-empty TYPE, or without a non-empty ANSWER.
    """
    path = pathlib.Path(path)
    counter = counter or files.BadRowCounter(path)
    root = _parse_xml(path)
    question_nodes = root.find_all("NLM-QUESTION")
    if not question_nodes:
        raise files.DataFileError(
            f"{path}:{root.line}: no <NLM-QUESTION> elements under <{root.tag}>; expected the "
            "TREC LiveQA 2017 medical train layout"
        )
    triples = []
    for q in question_nodes:
        sub_list = q.find("SUB-QUESTIONS")
        subs = sub_list.find_all("SUB-QUESTION") if sub_list is not None else []
        if not subs:
            counter.bad(
                q.line,
                "<NLM-QUESTION> without <SUB-QUESTIONS>/<SUB-QUESTION>: only the LiveQA 2017 "
                "train files annotate sub-questions with FOCUS and TYPE",
            )
            continue
        for sub in subs:
            notes = sub.find("ANNOTATIONS")
            foci = [f.text for f in notes.find_all("FOCUS")] if notes is not None else []
            types = [t.text for t in notes.find_all("TYPE")] if notes is not None else []
            answer_list = sub.find("ANSWERS")
            passages = (
                [a.text for a in answer_list.find_all("ANSWER")] if answer_list is not None else []
            )
            if not foci or not all(foci):
                counter.bad(sub.line, f"sub-question without a non-empty <FOCUS> (found {foci})")
            elif len(types) != 1 or not types[0]:
                counter.bad(sub.line, f"sub-question needs exactly one non-empty <TYPE>, found {types}")
            elif not passages or not all(passages):
                counter.bad(sub.line, "sub-question without a non-empty <ANSWER>")
            else:
                for focus in foci:
                    for passage in passages:
                        triples.append(DiseaseTriple(focus, types[0], passage, sub.line))
    counter.report()
    return triples


# ----------------------------------------------------------------------------- jsonl


def _string_fields(row: dict[str, Any], keys: tuple[str, ...]) -> list[str] | str:
    """The stripped string values of `keys`, or an error message."""
    values = []
    for key in keys:
        value = row.get(key)
        if not isinstance(value, str) or not value.strip():
            return f"{key!r} must be a non-empty string, found {value!r}"
        values.append(value.strip())
    return values


def read_mednli_jsonl(
    path: pathlib.Path, *, counter: files.BadRowCounter | None = None
) -> list[NliPair]:
    """MedNLI pairs from the released jsonl (`sentence1`, `sentence2`, `gold_label`) or
    from `premise`, `hypothesis`, `label` rows; labels must be one of `NLI_LABELS`."""
    path = pathlib.Path(path)
    counter = counter or files.BadRowCounter(path)
    pairs = []
    for number, row in files.read_jsonl(path, counter=counter):
        if "sentence1" in row:
            keys = ("sentence1", "sentence2", "gold_label")
        elif "premise" in row:
            keys = ("premise", "hypothesis", "label")
        else:
            counter.bad(
                number,
                f"keys {sorted(row)}; expected sentence1/sentence2/gold_label (MedNLI release) "
                "or premise/hypothesis/label",
            )
            continue
        values = _string_fields(row, keys)
        if isinstance(values, str):
            counter.bad(number, values)
        elif values[2] not in NLI_LABELS:
            counter.bad(number, f"unknown label {values[2]!r}; accepted: {list(NLI_LABELS)}")
        else:
            pairs.append(NliPair(*values, line=number))
    return pairs


def read_disease_triples_jsonl(
    path: pathlib.Path, *, counter: files.BadRowCounter | None = None
) -> list[DiseaseTriple]:
    """(disease, aspect, passage) triples from jsonl rows with those three string keys."""
    path = pathlib.Path(path)
    counter = counter or files.BadRowCounter(path)
    triples = []
    for number, row in files.read_jsonl(path, counter=counter):
        values = _string_fields(row, ("disease", "aspect", "passage"))
        if isinstance(values, str):
            counter.bad(number, values)
        else:
            triples.append(DiseaseTriple(*values, line=number))
    return triples
