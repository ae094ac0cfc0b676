"""The code in the documentation is checked: every `ktx` command of README.md and the guides
parses (its command exists, its flags exist, its gin files exist), and the Python snippets
run. A snippet that is a fragment (it needs a model, a batch or a test's tmp_path) is
preceded by the comment `<!-- docs-test: skip -->` and is not run."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
GIN = REPO / "gin"
# README and the site's pages; docs/notes/ (history) and the results records are not guides.
PAGES = [REPO / "README.md"] + sorted(
    p for p in (REPO / "docs").glob("*.md") if p.name not in {"results.md", "results_recsys.md"})
SKIP = "<!-- docs-test: skip -->"
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)


def _blocks(page: pathlib.Path):
    """(language, code, skipped) of each fenced block of a page."""
    text = page.read_text()
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip().splitlines()
        yield m.group(1), m.group(2), bool(before) and before[-1].strip() == SKIP


def _commands(page: pathlib.Path):
    """Every `ktx ...` command line of a page's shell blocks, continuation lines joined."""
    for lang, code, _ in _blocks(page):
        if lang not in ("", "bash", "sh", "console"):
            continue
        joined = re.sub(r"\\\n\s*", " ", code)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            seen = ""
            for part in re.split(r"(&&|;)", line):
                quoted = len(re.findall(r'(?<!\\)"', seen)) % 2 == 1
                seen += part
                # `ktx CMD ...`, after a shell prompt or environment assignments.
                m = re.match(r"(?:\$ )?(?:[A-Za-z_]+=\S+ )*ktx ([a-z]\w*)(.*)$", part.strip())
                if m:
                    args = m.group(2)
                    if quoted:  # inside "...", e.g. ssh's --command: up to the closing quote
                        args = re.split(r'(?<!\\)"', args, 1)[0].replace('\\"', '"')
                    yield m.group(1), args.strip()


def _user_files(page: pathlib.Path) -> set[str]:
    """Files a page writes itself: a block whose first line is `# <name>`."""
    return {code.splitlines()[0][2:].strip() for _, code, _ in _blocks(page)
            if code.startswith("# ") and code.splitlines()[0].endswith((".gin", ".py"))}


COMMANDS = [(p, c, a) for p in PAGES for c, a in _commands(p)]


def test_the_pages_have_commands_and_snippets():
    assert len(COMMANDS) > 30, len(COMMANDS)


@pytest.fixture(scope="module")
def subparsers():
    from ktx.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


@pytest.mark.parametrize("page,command,args", COMMANDS,
                         ids=[f"{p.name}:ktx {c}:{i}" for i, (p, c, _) in enumerate(COMMANDS)])
def test_command_parses(page, command, args, subparsers):
    assert command in subparsers, f"{page.name}: `ktx {command}` is not a command"
    flags = {s for a in subparsers[command]._actions for s in a.option_strings}
    try:
        tokens = shlex.split(args)
    except ValueError as e:
        raise AssertionError(f"{page.name}: `ktx {command} {args}` does not split: {e}") from e
    user_files = _user_files(page)
    for token in tokens:
        if not token.startswith("--") or token.startswith("--gin.") or re.search(r"\.\.\.|<", token):
            continue
        name, _, value = token.partition("=")
        assert name in flags, f"{page.name}: `ktx {command}` has no flag {name}"
        if name == "--gin_file":
            if any(f.endswith(value) for f in user_files) or value.startswith("runs/ckpt_demo/"):
                continue  # written by the page itself, or by `ktx import` on the page
            assert (GIN / value).is_file(), f"{page.name}: no gin file {value} (under gin/)"


SNIPPETS = [(p, i, code) for p in PAGES
            for i, (lang, code, skipped) in enumerate(_blocks(p))
            if lang == "python" and not skipped]


@pytest.mark.parametrize("page,index,code", SNIPPETS,
                         ids=[f"{p.name}:{i}" for p, i, _ in SNIPPETS])
def test_python_snippet_runs(page, index, code):
    import seqio

    # ktx's own tasks first: a snippet importing `ktx.tasks` would otherwise register them
    # here and have them removed below, while the module stays imported (a later test in
    # this process then found `synthetic_quickstart` unregistered).
    import ktx.tasks  # noqa: F401

    tasks, mixtures = set(seqio.TaskRegistry.names()), set(seqio.MixtureRegistry.names())
    try:
        exec(compile(code, f"{page.name}[block {index}]", "exec"), {"__name__": "docs_snippet"})
    finally:  # leave the registries as they were for the tests that share this process
        for name in set(seqio.MixtureRegistry.names()) - mixtures:
            seqio.MixtureRegistry.remove(name)
        for name in set(seqio.TaskRegistry.names()) - tasks:
            seqio.TaskRegistry.remove(name)
