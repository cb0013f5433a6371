"""Every Python example in README.md and docs/ runs, so no example rots.

An example is a fenced ``python`` block. The HTML comment on the line before
it (invisible in the rendered page) says how it runs::

    <!-- example: ranks=2 setup=comm env=PYCOMM_LOCAL_SIZE:1 -->

* ``ranks=N``: on N ranks (default 1), each with torchrun's variables.
* ``setup=A,B``: after ``doc_cases.SETUPS[A]`` (and B): the context a
  fragment assumes, e.g. a default group and a communicator.
* ``continues``: the page's previous example and this one run as one
  program (a walk-through in several blocks).
* ``env=K:V,K:V``: environment variables for the example.
* ``cuda``: needs a GPU (skipped without one, like every ``cuda`` test).
* ``requires=M``: needs the module M (skipped without it: a library pycomm
  does not depend on).
* ``own``: runs in processes of its own, through torchrun, not in the
  module's ranks (a library that keeps global state, e.g. DeepSpeed).

A block without a comment runs on one rank as written. Blocks in other
languages (shell commands) are not run here; ``tests/test_bench.py`` runs
``pycomm-bench``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import pytest

from doc_cases import SETUPS, run_example
from harness import RankError, RankPool, free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*example:(.*?)-->\s*$")
MAX_RANKS = 4


@dataclass
class Example:
    where: str                     # page:line of the (last) block
    code: str
    ranks: int = 1
    setup: str = ""
    env: Dict[str, str] = field(default_factory=dict)
    cuda: bool = False
    requires: str = ""
    own: bool = False


def parse_directive(text: str) -> Dict[str, str]:
    out = {}
    for word in text.split():
        key, _, value = word.partition("=")
        out[key] = value
    unknown = set(out) - {"ranks", "setup", "continues", "env", "cuda", "requires", "own"}
    assert not unknown, f"unknown example option(s) {sorted(unknown)} in {text!r}"
    return out


def examples_of(page: Path, root: Path = ROOT) -> List[Example]:
    lines = page.read_text().splitlines()
    rel = page.relative_to(root)
    found: List[Example] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        lang, start = m.group(1), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if lang == "python":
            opts = {}
            if start > 0 and DIRECTIVE.match(lines[start - 1]):
                opts = parse_directive(DIRECTIVE.match(lines[start - 1]).group(1))
            code = "\n".join(lines[start + 1:j]) + "\n"
            where = f"{rel}:{start + 1}"
            if "continues" in opts:
                assert found, f"{where}: 'continues' on the page's first example"
                prev = found[-1]
                prev.code += code
                prev.where = where
            else:
                env = dict(kv.split(":", 1) for kv in opts["env"].split(",")) if opts.get("env") else {}
                found.append(Example(where, code, int(opts.get("ranks") or 1), opts.get("setup", ""), env,
                                     "cuda" in opts, opts.get("requires", ""), "own" in opts))
        i = j + 1
    return found


ALL: List[Example] = [ex for page in PAGES for ex in examples_of(page)]


def test_pages_have_examples():
    """The collector finds the examples (a broken fence or directive would
    silently run nothing)."""
    assert (ROOT / "docs").is_dir()
    counts: Dict[str, int] = {}
    for ex in ALL:
        page = ex.where.split(":")[0]
        counts[page] = counts.get(page, 0) + 1
    assert counts.get("README.md", 0) >= 4, counts
    assert len(counts) >= 8, counts
    for ex in ALL:
        assert 1 <= ex.ranks <= MAX_RANKS, ex.where
        for name in filter(None, ex.setup.split(",")):
            assert name in SETUPS, f"{ex.where}: unknown setup {name!r}"


def test_directive_parsing(tmp_path):
    page = tmp_path / "sample.md"
    page.write_text("<!-- example: ranks=2 setup=comm env=A:1,B:x -->\n```python\nx = 1\n```\n\n"
                    "<!-- example: continues -->\n```python\ny = x\n```\n\n```bash\nls\n```\n\n"
                    "```python\nz = 2\n```\n\n<!-- example: ranks=2 own requires=deepspeed -->\n```python\nw = 3\n```\n")
    exs = examples_of(page, root=tmp_path)
    assert [(e.ranks, e.setup, e.env, e.code, e.requires, e.own) for e in exs] == [
        (2, "comm", {"A": "1", "B": "x"}, "x = 1\ny = x\n", "", False), (1, "", {}, "z = 2\n", "", False),
        (2, "", {}, "w = 3\n", "deepspeed", True)]


class Pool:
    """The module's ranks; started again after an example that left a rank
    busy (a hang), so that one broken example fails alone."""

    def __init__(self) -> None:
        self.pool = RankPool(MAX_RANKS)

    def run(self, example: "Example") -> List[str]:
        """Each rank's result; on a failure, what every rank said."""
        out = self.pool.run_expect(run_example, example.ranks, example.code, example.setup, example.env,
                                   free_port(), example.where, world=example.ranks, timeout=180,
                                   report_hangs=True)
        if any(status in ("hung", "dead") for status, _ in out):
            for p in self.pool.procs:
                p.kill()
            self.pool = RankPool(MAX_RANKS)
        if any(status != "ok" for status, _ in out):
            raise RankError("\n".join(f"--- rank {r}: {status}\n{value or ''}" for r, (status, value) in enumerate(out)))
        return [value for _, value in out]

    def close(self) -> None:
        self.pool.close()


@pytest.fixture(scope="module")
def doc_pool():
    pool = Pool()
    yield pool
    pool.close()


def _params() -> list:
    return [pytest.param(ex, id=ex.where, marks=[pytest.mark.cuda] if ex.cuda else []) for ex in ALL]


@pytest.mark.parametrize("example", _params())
def test_example_runs(doc_pool, example: Example, tmp_path):
    if example.requires:
        pytest.importorskip(example.requires, reason=f"{example.where} needs {example.requires}")
    if example.own:
        assert not example.setup, f"{example.where}: an example in processes of its own takes no setup"
        script = tmp_path / "example.py"
        script.write_text(example.code)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(example.ranks), str(script)], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **example.env})
        assert proc.returncode == 0, f"{example.where}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        return
    assert doc_pool.run(example) == ["ok"] * example.ranks


def test_every_environment_variable_is_documented():
    """Each ``"PYCOMM_*"`` name the code reads appears in docs/environment.md."""
    read = set()
    for path in [ROOT / "setup.py", *(ROOT / "pycomm").rglob("*.py"), *(ROOT / "csrc").rglob("*.[ch]*")]:
        read |= set(re.findall(r'"(PYCOMM_[A-Z0-9_]+)"', path.read_text(errors="ignore")))
    read -= {"PYCOMM_WITH_CUDA", "PYCOMM_RACE_WINDOWS"}  # macros setup.py defines, not variables
    assert {"PYCOMM_ALGO", "PYCOMM_TIMEOUT", "PYCOMM_HEARTBEAT_S"} <= read
    page = (ROOT / "docs" / "environment.md").read_text()
    missing = sorted(v for v in read if f"`{v}`" not in page)
    assert not missing, f"read by the code, missing from docs/environment.md: {missing}"


def test_relative_links_resolve():
    """Links between pages (and to RESULTS sections) point at files and headings that exist."""
    def anchors(page: Path) -> set:
        out = set()
        for line in page.read_text().splitlines():
            if line.startswith("#"):
                title = line.lstrip("#").strip().lower()
                out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
        return out

    broken = []
    for page in PAGES + [ROOT / "benchmarks" / "RESULTS.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
