"""The Python blocks of README.md and docs/*.md are tests, run as written (Sybil).

Each file's blocks run in order in one namespace, like a notebook's cells: a block runs on its own or
after the blocks above it in the same file. Every file runs in a new empty working folder (the blocks'
files land there), with ``CUDA`` in its namespace for the conditions below. The Markdown itself says
when a block cannot run here, in an HTML comment just above it, so no block is left out silently:

``<!-- skip: next if(not CUDA, reason="needs a CUDA GPU: the GPU tier runs it") -->``
    Sybil's own skip directive: on a machine without CUDA the next block is reported as skipped, with
    the reason; the GPU tier (``scripts/test_gpu.sh``) runs it.
``<!-- torchrun: 2 -->``
    The next block is a whole program for ``torchrun``: it runs alone, in new processes started by
    ``torchrun --standalone --nproc-per-node 2`` (gloo on the CPU; on a GPU machine one rank per GPU,
    at most 2), and must leave every rank with exit status 0.

Blocks of other languages (``bash``, the layout tree) are not run.

"After the blocks above it" holds however pytest is launched: a process that runs a block first runs
every block above it in the same file that it has not run yet (``pytest -n 4``'s default scheduling
hands one file's blocks to several workers; ``-k`` or a node id picks one block). Such a replay runs
each earlier block as its own item would, skips included, except a ``torchrun`` block, a whole
program that leaves nothing in the namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import SkipTest

from sybil import Example, Region, Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.integration.pytest import SybilFile, SybilItem
from sybil.parsers.markdown import SkipParser
from sybil.parsers.markdown.codeblock import CodeBlockParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

ROOT = Path(__file__).resolve().parents[2]
_TORCHRUN = "__docs_torchrun_ranks__"
_DONE = "__docs_done__"  # region starts of the blocks (and directives) this process has evaluated
_REPLAYING = "__docs_replaying__"
_python = PythonEvaluator()


def _evaluate_python(example: Example) -> None:
    ranks = example.namespace.pop(_TORCHRUN, None)
    if ranks is None:
        _python(example)
    elif not example.namespace.get(_REPLAYING):
        _run_under_torchrun(example, ranks)


def _run_under_torchrun(example: Example, ranks: int) -> None:
    import torch

    if torch.cuda.is_available():
        ranks = min(ranks, torch.cuda.device_count())
    script = Path.cwd() / f"torchrun_block_line{example.line}.py"
    script.write_text(str(example.parsed))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise AssertionError(
            f"{example.path}, line {example.line}: torchrun ({ranks} ranks) exited {done.returncode}\n"
            f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
        )


class _TorchrunParser:
    """``<!-- torchrun: N -->``: the next Python block runs under torchrun with N ranks."""

    def __init__(self):
        self.lexer = DirectiveInHTMLCommentLexer(directive="torchrun", arguments=r"\d+")

    def __call__(self, document):
        for lexed in self.lexer(document):
            ranks = int(lexed.lexemes["arguments"])
            yield Region(
                lexed.start, lexed.end, ranks, lambda example: example.namespace.__setitem__(_TORCHRUN, example.parsed)
            )


def _setup(namespace: dict) -> None:
    import torch

    namespace["CUDA"] = torch.cuda.is_available()
    namespace["__docs_cwd__"] = os.getcwd()
    folder = tempfile.mkdtemp(prefix="docs-examples-")
    namespace["__docs_folder__"] = folder
    os.chdir(folder)


def _teardown(namespace: dict) -> None:
    os.chdir(namespace["__docs_cwd__"])
    shutil.rmtree(namespace["__docs_folder__"], ignore_errors=True)


def _evaluate_in_order(example: Example) -> None:
    """Evaluate ``example`` after every region above it in its document not yet evaluated here."""
    namespace = example.namespace
    done = namespace.setdefault(_DONE, set())
    for earlier in example.document.examples():
        if earlier.region.start >= example.region.start:
            break
        if earlier.region.start in done:
            continue
        done.add(earlier.region.start)
        namespace[_REPLAYING] = True
        try:
            earlier.evaluate()
        except SkipTest:
            pass
        except Exception as error:
            raise AssertionError(
                f"{example.path}, line {example.line}: the block at line {earlier.line} above it, run first "
                f"in this process, failed: {type(error).__name__}: {error}"
            ) from error
        finally:
            namespace[_REPLAYING] = False
    done.add(example.region.start)
    example.evaluate()


class _InOrderItem(SybilItem):
    def runtest(self) -> None:
        _evaluate_in_order(self.example)


class _InOrderFile(SybilFile):
    def collect(self):
        for sybil in self.sybils:
            document = sybil.parse(self.path)
            self.documents.append(document)
            for example in document.examples():
                yield _InOrderItem.from_parent(self, sybil=sybil, example=example)


DOCS = Sybil(
    parsers=[CodeBlockParser(language="python", evaluator=_evaluate_python), SkipParser(), _TorchrunParser()],
    patterns=["README.md", "docs/*.md"],
    excludes=["*/README.md"],  # the root's README only: benchmarks/, tests/data/ … hold notes, not examples
    path=str(ROOT),
    setup=_setup,
    teardown=_teardown,
)


def pytest_collect_file(file_path: Path, parent) -> _InOrderFile | None:
    """Collect README.md and docs/*.md (named on pytest's command line: scripts/test.sh does)."""
    if DOCS.should_parse(file_path):
        return _InOrderFile.from_parent(parent, path=file_path, sybils=[DOCS])
    return None
