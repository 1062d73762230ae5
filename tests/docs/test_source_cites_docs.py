"""Every Markdown page a source file names (in a comment, a docstring or a message) exists.

The sources read are the tracked Python, C++ and shell files, less ``tests/docs/`` (whose tests cite
missing pages on purpose). A name is a path ending in ``.md``:
one with a folder (``docs/kernels.md``) must exist at that path from the repository's root or from
the file's own folder; a bare name (``README.md``) must be the name of a tracked page.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b")


def _tracked() -> list[str]:
    done = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_every_markdown_page_a_source_names_exists():
    tracked = _tracked()
    pages = {Path(p).name for p in tracked if p.endswith(".md")}
    sources = [
        p
        for p in tracked
        if (p.endswith((".py", ".cpp", ".hpp", ".h", ".sh")) or p == "CMakeLists.txt")
        and not p.startswith("tests/docs/")
    ]
    assert any(p.endswith(".cpp") for p in sources) and any(p.endswith(".py") for p in sources)
    missing = []
    for rel in sources:
        for number, line in enumerate((ROOT / rel).read_text(errors="replace").splitlines(), 1):
            for cited in CITED.findall(line):
                if "/" in cited:
                    found = (ROOT / cited).is_file() or (ROOT / rel).parent.joinpath(cited).is_file()
                else:
                    found = cited in pages
                if not found:
                    missing.append(f"{rel}:{number}: {cited}")
    assert not missing, "sources name Markdown pages that do not exist:\n" + "\n".join(missing)
