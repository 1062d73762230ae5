"""Every file the documentation cites exists, or is cited at a commit that holds it.

The pages read are the Markdown files at the top of the repository, in ``docs/`` and in
``benchmarks/``. A cited path is a relative Markdown link, a path under one of the repository's
top-level folders (in inline code, in a code block or in prose), ``results/NAME`` (short for
``benchmarks/results/NAME``) or a bare result file name (``op_device_YYYY-MM-DD….json``).
A path that is not in the tree passes only when its paragraph names, in inline code, a commit
whose tree holds it (``git cat-file -e COMMIT:PATH``): a record removed from ``results/`` is
cited with the commit that still has it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")])
TOP = ("benchmarks", "docs", "tests", "scripts", "kernels", "workbench", "notebooks", ".ci")

LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
COMMIT = re.compile(r"`([0-9a-f]{7,40})`")
# A path under a top-level folder, or results/NAME; ends at whitespace, a quote or closing punctuation.
TREE_PATH = re.compile(
    r"(?<![\w/.$<>-])((?:\.\./)?(?:" + "|".join(map(re.escape, TOP)) + r"|results)/[\w.{},*…/<>-]*[\w}*…>])"
)
RESULT_NAME = re.compile(r"^(?:[a-z][\w-]*_\d{4}-\d{2}-\d{2}|…)[\w.{},…-]*\.(?:json|log|txt)$")


def _git_has(commit: str, path: str) -> bool:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:{path}"], capture_output=True, check=False
    )
    return done.returncode == 0


def _expand(token: str) -> list[str]:
    """``name_{a,b}.json`` -> both names (one level of braces)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [token[: m.start()] + alt + token[m.end() :] for alt in m.group(1).split(",")]


def _paragraphs(text: str):
    """(first line number, paragraph text, whether it is inside a fenced code block)."""
    start, lines, fenced = 1, [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if lines:
                yield start, "\n".join(lines), fenced
            fenced, lines, start = not fenced, [], number + 1
            continue
        if not line.strip() and not fenced:
            if lines:
                yield start, "\n".join(lines), fenced
            lines, start = [], number + 1
            continue
        lines.append(line)
    if lines:
        yield start, "\n".join(lines), fenced


def _cited(page: Path, text: str) -> list[tuple[int, str, str, list[str]]]:
    """(line, path as written, path from the repository root, commits named in its paragraph)."""
    out = []
    for start, para, fenced in _paragraphs(text):
        commits = COMMIT.findall(para)
        for offset, line in enumerate(para.splitlines()):
            number = start + offset
            for target in LINK.findall(line):
                if re.match(r"^(?:[a-z]+:|#)", target):
                    continue
                path = target.split("#", 1)[0]
                rel = (page.parent / path).resolve().relative_to(ROOT).as_posix()
                out.append((number, target, rel, commits))
            found = set()
            for token in TREE_PATH.findall(line):
                token = token.rstrip(".,;:")
                if "<" in token or token.endswith("/"):
                    continue
                found.add(token)
            spans = [] if fenced else CODE_SPAN.findall(line)
            for span in spans:
                if RESULT_NAME.match(span):
                    found.add("results/" + span)
            for token in sorted(found):
                for name in _expand(token):
                    if name.startswith("results/"):
                        rel = "benchmarks/" + name
                    else:
                        rel = (
                            (page.parent / name).resolve().relative_to(ROOT).as_posix()
                            if name.startswith("../")
                            else name
                        )
                    out.append((number, name, rel, commits))
    return out


def _missing(page: Path, text: str | None = None) -> list[str]:
    """The cited paths of ``page`` (or of ``text`` as if it were that page) that fail the check."""
    bad = []
    text = page.read_text(encoding="utf-8") if text is None else text
    for number, written, rel, commits in _cited(page, text):
        where = f"{page.relative_to(ROOT)}:{number}: {written}"
        if "…" in rel:
            bad.append(f"{where} (write the whole name: an elided one cannot be checked)")
            continue
        if any(ch in rel for ch in "*?["):
            if not list(ROOT.glob(rel)):
                bad.append(f"{where} (no file matches)")
            continue
        if (ROOT / rel).exists():
            continue
        if not any(_git_has(c, rel) for c in commits):
            why = f"not at the commits of its paragraph ({', '.join(commits)})" if commits else "and no commit named"
            bad.append(f"{where} (not in the tree, {why})")
    return bad


def test_the_pages_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "benchmarks/README.md", "docs/performance.md", "docs/kernels.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_path_exists_or_is_cited_at_a_commit_that_has_it(page):
    bad = _missing(page)
    assert not bad, f"{len(bad)} cited path(s) missing:\n" + "\n".join(bad)


def test_the_check_finds_a_missing_path_and_accepts_one_cited_at_its_commit():
    """The checker itself: a page citing a removed record fails without a commit, passes with one."""
    head = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%h", "--", "benchmarks/README.md"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if not head:
        pytest.skip("not a git checkout with history: the commit half of the check cannot run")
    text = (
        "See `results/no_such_record_2020-01-01.json` and [x](no_such_page.md).\n\n"
        f"Removed: `benchmarks/README.md` at `{head}`, `benchmarks/no_such_bench.py` at `{head}`.\n"
    )
    bad = _missing(ROOT / "benchmarks" / "README.md", text)
    assert len(bad) == 3, bad
    assert any("no_such_record_2020-01-01.json" in b and "no commit named" in b for b in bad), bad
    assert any("no_such_page.md" in b for b in bad), bad
    assert any("no_such_bench.py" in b and head in b for b in bad), bad
