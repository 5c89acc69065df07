"""Source rules for every module of ``nki_kernels`` that the simulator cannot see at run time
(a call it never reaches still compiles into the program on a device)."""
import ast
import pathlib

import pytest

import nki_kernels

SOURCES = sorted(pathlib.Path(nki_kernels.__file__).parent.rglob("*.py"))


def _calls(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_python_range(path):
    """neuronx-cc rewrites range() in kernel code into nl.sequential_range; unrolled loops and
    compile-time lists use tiles.unrolled (or nl.static_range)."""
    bad = [n.lineno for n in _calls(path)
           if isinstance(n.func, ast.Name) and n.func.id == "range"]
    assert not bad, f"{path.name}: range() at lines {bad}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_nl_mod(path):
    """Integer remainders go through masks.int_mod (exact, three VectorE instructions)."""
    bad = [n.lineno for n in _calls(path)
           if isinstance(n.func, ast.Attribute) and n.func.attr in ("mod", "fmod")
           and isinstance(n.func.value, ast.Name) and n.func.value.id == "nl"]
    assert not bad, f"{path.name}: nl.mod/nl.fmod at lines {bad}"
