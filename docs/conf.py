"""Sphinx configuration of ktx's documentation site (`make docs`).

Sphinx with MyST, as flax, optax and JAX build theirs: the guides stay Markdown that reads
on GitHub too, and the API reference comes from the docstrings (autodoc + napoleon). The
build needs no network (no intersphinx) and executes no notebook.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

project = "ktx"
author = "the ktx authors"
copyright = "the ktx authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# docs/notes/ holds the measurement histories: kept in the repository, not in the site.
exclude_patterns = ["_build", "notes", "results/**", "api/_generated"]

myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "sphinx_book_theme"
html_title = "ktx"
html_theme_options = {"show_toc_level": 2, "home_page_in_toc": True}
html_static_path = []


# --- Generated pages: the CLI's commands and flags (from ktx.cli.build_parser, the parser
# `ktx` itself uses) and the gin macros of gin/runs/ (the files' own top-level bindings).
# Written under api/_generated/ (git-ignored, not a page of its own), included by api/cli.md.
def _generate_cli_reference() -> None:
    import pathlib
    import re

    from ktx.cli import build_parser

    out = pathlib.Path(__file__).parent / "api" / "_generated"
    out.mkdir(parents=True, exist_ok=True)
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    lines = []
    for name, p in sub.choices.items():
        lines += [f"### `ktx {name}`", "", (p.description or "").strip(), "",
                  "| flag | default | help |", "|---|---|---|"]
        for a in p._actions:
            if not a.option_strings or "-h" in a.option_strings:
                continue
            default = "" if a.default in (None, False, [], "") else f"`{a.default}`"
            help_text = (a.help or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{a.option_strings[-1]}` | {default} | {help_text} |")
        lines.append("")
    (out / "commands.md").write_text("\n".join(lines) + "\n")

    gin_root = pathlib.Path(__file__).parent.parent / "gin"
    rows = ["| gin file | macro | value |", "|---|---|---|"]
    for path in sorted((gin_root / "runs").glob("*.gin")):
        for line in path.read_text().splitlines():
            m = re.match(r"^([A-Z][A-Z0-9_]*) = (.*?)\s*(#.*)?$", line)
            if m:
                value = m.group(2).replace("|", "\\|")
                rows.append(f"| `runs/{path.name}` | `{m.group(1)}` | `{value}` |")
    (out / "gin_macros.md").write_text("\n".join(rows) + "\n")


_generate_cli_reference()


# ktx's docstrings write code as Markdown does, in single backticks (`x`); in
# reStructuredText that is "interpreted text". Render each one-line span as a literal.
_MARKDOWN_CODE = None


def _markdown_code_to_literal(app, what, name, obj, options, lines):
    import re

    global _MARKDOWN_CODE
    if _MARKDOWN_CODE is None:
        # A span may run over a line break (not over a blank line).
        _MARKDOWN_CODE = re.compile(r"(?<![`:\w])`((?:[^`\n]|\n(?![ \t]*\n))+?)`(?![`_])")
    text = _MARKDOWN_CODE.sub(r"``\1``\\ ", "\n".join(lines))
    lines[:] = text.split("\n")


def setup(app):
    # Before napoleon (priority 500), which splits "type: text" at the first colon.
    app.connect("autodoc-process-docstring", _markdown_code_to_literal, priority=100)
