"""The C++ layers point one way (csrc/<layer>/README.md says what each may
include), only csrc/torch includes torch, and the torch-free layers compile
on their own, warning-free, without torch on the include path.

No processes and no build needed: the includes are read as text, and the
compile check runs the system compiler on the sources.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Set

import pytest

from harness import compile_all

CSRC = Path(__file__).resolve().parent.parent / "csrc"
LAYERS = ["core", "kernels", "algorithms", "transport", "compression", "torch"]
TORCH_PREFIXES = ("torch/", "ATen/", "c10/", "pybind11/", "Python.h")
SOURCE_SUFFIXES = (".h", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def allowed() -> Dict[str, Set[str]]:
    """Each layer's "May include:" line from its README."""
    table = {}
    for layer in LAYERS:
        text = (CSRC / layer / "README.md").read_text()
        m = re.search(r"^May include: (.*)$", text, re.M)
        assert m, f"csrc/{layer}/README.md has no 'May include:' line"
        names = {w.strip(" .") for w in m.group(1).split(",")}
        table[layer] = {n for n in names if n in LAYERS}
    return table


def sources() -> List[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in SOURCE_SUFFIXES)


def layer_of(path: Path) -> str:
    return path.resolve().relative_to(CSRC).parts[0]


def test_every_source_lives_in_a_layer():
    loose = [str(p.relative_to(CSRC)) for p in sources() if layer_of(p) not in LAYERS]
    assert not loose, f"sources outside the layer folders: {loose}"


def test_includes_point_down():
    table = allowed()
    wrong = []
    for path in sources():
        mine = layer_of(path)
        for kind, target in INCLUDE.findall(path.read_text()):
            if kind == "<":
                if target.startswith(TORCH_PREFIXES) and mine != "torch":
                    wrong.append(f"{path.relative_to(CSRC)} includes <{target}>: torch belongs in csrc/torch")
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.exists(), f"{path.relative_to(CSRC)}: #include \"{target}\" does not exist"
            theirs = layer_of(resolved)
            if theirs != mine and theirs not in table[mine]:
                wrong.append(f"{path.relative_to(CSRC)} ({mine}) includes {target} ({theirs}); "
                             f"{mine} may include {sorted(table[mine]) or 'nothing'}")
    assert not wrong, "\n".join(wrong)


def test_layer_table_is_acyclic():
    table = allowed()
    order = {layer: i for i, layer in enumerate(LAYERS)}
    for layer, below in table.items():
        for other in below:
            assert order[other] < order[layer], f"{layer} may include {other}, which sits above it"


def torch_free_units() -> List[Path]:
    """Every C++ file below csrc/torch that needs no CUDA headers either."""
    units = []
    for path in sources():
        if layer_of(path) == "torch" or path.suffix in (".cu", ".cuh"):
            continue
        if any(t.startswith(("cuda", "cub/", "thrust/")) for k, t in INCLUDE.findall(path.read_text()) if k == "<"):
            continue
        units.append(path)
    return units


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_torch_free_layers_compile_alone_without_warnings(torch_free_objects):
    """No torch include path: a torch include anywhere below csrc/torch fails
    here. -Wall -Wextra -Werror: the build's warnings (unused functions
    included) cannot hide in these layers. The .cpp files are compiled once
    for this and the link check (conftest's torch_free_objects, same flags)."""
    flags = ["-std=c++17", "-c", "-o", os.devnull, "-Wall", "-Wextra", "-Werror", "-x", "c++", "-"]
    units = torch_free_units()
    assert {p for p in units if p.suffix == ".cpp"} == set(torch_free_objects)
    # A header compiles through a unit that includes it, as users do.
    headers = [p for p in units if p.suffix != ".cpp"]
    results = dict(zip(headers, compile_all([["g++", *flags]] * len(headers),
                                            inputs=[f'#include "{h}"\n' for h in headers], cwd=str(CSRC))))
    results.update({p: (rc, err) for p, (rc, err, _) in torch_free_objects.items()})
    failures = [f"{p.relative_to(CSRC)}:\n{results[p][1]}" for p in units if results[p][0] != 0]
    assert not failures, "\n".join(failures)
