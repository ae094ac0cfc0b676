"""Reading the results pages' tables in tests: a study's report from its committed records,
the rows between a page's `<!-- NAME:begin -->` and `<!-- NAME:end -->` markers, and whether
a computed value rounds to a shown figure."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]


def study_report(name: str, records: str, bindings: Sequence[tuple[str, str]] = ()):
    """(study, report) of gin/studies/<name>.gin over docs/results/<records>, as `ktx study
    report` builds it."""
    import gin

    from ktx.cli.study import load_study
    from ktx.studies import report as report_lib
    from ktx.studies.records import load_records

    study = load_study(str(REPO / "gin" / "studies" / f"{name}.gin"), bindings=bindings,
                       directory=str(REPO / "docs" / "results" / records))
    gin.clear_config()
    return study, report_lib.build(study, load_records(study.directory))


def between(path: pathlib.Path, name: str) -> list[list[str]]:
    """The table rows (header included, separator left out) between the markers `name`,
    which must each occur once in `path`; a row is its stripped cells."""
    text = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1, (path, name)
    body = text.split(begin, 1)[1].split(end, 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in body.splitlines() if line.startswith("|") and not line.startswith("|---")]


def close(got: float, shown: str) -> bool:
    """`got` rounds to the table's figure (its own number of decimals)."""
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return abs(got - float(shown)) <= 0.5 * 10 ** -decimals + 1e-9
