"""Strict simulation (simulate.strict): what neuronx-cc's tracer cannot compile or the hardware
leaves undefined is refused, while the patterns AWS kernels use keep running."""
import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
from simulate._strict import (AccumulationGroupError, LoopBoundError, SymbolicIndex,
                              SymbolicIndexError)


def _run(kernel, *args, strict=True):
    with nki.strict(strict):
        return nki.simulate_kernel(kernel, *args)


def _rows_kernel(body):
    """A kernel over 128-row tiles whose per-tile work is ``body(i, a, out)``."""
    @nki.jit
    def kernel(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        for i in nl.affine_range(a.shape[0] // 128):
            body(i, a, out)
        return out
    return kernel


A = np.arange(512 * 64, dtype=np.float32).reshape(512, 64)


# -- the switch ------------------------------------------------------------------------------


def test_switch_and_context_manager():
    default = nki.is_strict()          # on unless NKI_SIM_STRICT=0
    with nki.strict():
        assert nki.is_strict()
        with nki.strict(False):
            assert not nki.is_strict()
        assert nki.is_strict()
    assert nki.is_strict() is default
    old = nki.set_strict(False)
    assert old is default and not nki.is_strict()
    nki.set_strict(default)


def test_default_is_on_and_env_turns_it_off():
    import subprocess
    import sys

    code = "import simulate; print(simulate.is_strict())"
    for env, want in (({}, "True"), ({"NKI_SIM_STRICT": "0"}, "False")):
        import os
        full = {k: v for k, v in os.environ.items() if k != "NKI_SIM_STRICT"}
        full.update(env)
        out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == want


def test_loop_index_as_scalar_operand_is_refused():
    def body(i, a, out):
        t = nl.add(nl.load(a[nl.ds(i * 128, 128), :]), i)
        nl.store(out[nl.ds(i * 128, 128), :], value=t)

    with pytest.raises(SymbolicIndexError, match=r"scalar operand .* nisa.iota"):
        _run(_rows_kernel(body), A)

    def body_iota(i, a, out):               # the documented way
        t = nl.add(nl.load(a[nl.ds(i * 128, 128), :]), nisa.iota(i, dtype=nl.float32))
        nl.store(out[nl.ds(i * 128, 128), :], value=t)

    out = _run(_rows_kernel(body_iota), A)
    np.testing.assert_array_equal(out, A + np.repeat(np.arange(4), 128)[:, None])


# -- what keeps working --------------------------------------------------------------------


def test_affine_patterns_run_in_strict_mode():
    def body(i, a, out):
        assert isinstance(i, SymbolicIndex)
        rows = nl.ds(i * 128, 128)                              # nl.ds of an affine expression
        t = nl.load(a[i * 128:(i + 1) * 128, :])                # slices of affine expressions
        iy = nl.arange(64)[None, :]
        t2 = nl.add(t, 1.0, mask=(i * 128 + iy < 10_000))      # a mask predicate on i
        if i < 2:                                               # a runtime branch on a predicate
            t2 = nl.multiply(t2, 2.0)
        nl.store(out[rows, :], value=t2)

    out = _run(_rows_kernel(body), A)
    want = A + 1.0
    want[:256] *= 2.0
    np.testing.assert_array_equal(out, want)


def test_program_id_is_symbolic_and_usable():
    @nki.jit
    def kernel(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        p = nl.program_id(0)
        assert isinstance(p, SymbolicIndex)
        nl.store(out[nl.ds(p * 128, 128), :], value=nl.load(a[nl.ds(p * 128, 128), :]))
        return out

    np.testing.assert_array_equal(_run(kernel[4], A), A)


def test_static_range_stays_python_int():
    def body(i, a, out):
        for j in nl.static_range(2):
            assert type(j) is int
            cols = list(range(64))[j * 32:(j + 1) * 32]          # Python use of a static index
            t = nl.load(a[nl.ds(i * 128, 128), cols[0]:cols[-1] + 1])
            nl.store(out[nl.ds(i * 128, 128), cols[0]:cols[-1] + 1], value=t)

    np.testing.assert_array_equal(_run(_rows_kernel(body), A), A)


def test_python_range_is_a_sequential_loop():
    """neuronx-cc rewrites range() in kernel code into nl.sequential_range: a traced index and
    one copy of the body in the program."""
    seen = []

    def body(i, a, out):
        for j in range(2):
            seen.append(type(j))
            cols = nl.ds(j * 32, 32)                             # index arithmetic works
            nl.store(out[nl.ds(i * 128, 128), cols], value=nl.load(a[nl.ds(i * 128, 128), cols]))

    k = _rows_kernel(body)
    np.testing.assert_array_equal(_run(k, A), A)
    assert set(seen) == {SymbolicIndex}
    with nki.strict(), nki.measure() as m:
        k(A)
    assert m.program_instructions == 2                           # one load + one store
    with nki.strict(False), nki.measure() as m:
        k(A)
    assert m.program_instructions == 4                           # plain Python: unrolled


def test_python_range_index_as_python_int_is_refused():
    def body(i, a, out):
        for j in range(2):
            cols = [0, 32][j]                                    # a trace-time list lookup
            t = nl.load(a[nl.ds(i * 128, 128), cols:cols + 32])
            nl.store(out[nl.ds(i * 128, 128), cols:cols + 32], value=t)

    with pytest.raises(SymbolicIndexError, match="loop index 'j'"):
        _run(_rows_kernel(body), A)
    _run(_rows_kernel(body), A, strict=False)


def test_python_range_bounds_must_be_constants_and_unrolled_lists_of_tiles_fail():
    def bound(i, a, out):
        for _ in range(i):
            pass

    with pytest.raises(LoopBoundError, match="range: loop bounds must be compile-time"):
        _run(_rows_kernel(bound), A)

    def tiles(i, a, out):                  # the tracer runs the comprehension's body once
        ts = [nl.load(a[nl.ds(i * 128, 128), nl.ds(c * 32, 32)]) for c in range(2)]
        nl.store(out[nl.ds(i * 128, 128), 0:32], value=ts[0])

    with pytest.raises(nki.NKIError, match="used after that iteration ended"):
        _run(_rows_kernel(tiles), A)


def test_range_outside_kernel_code_is_the_builtin():
    host_range = range(3)

    def body(i, a, out):
        assert isinstance(host_range, range)                     # isinstance keeps working
        assert list(np.arange(4)[2:]) == [2, 3]                  # libraries keep the builtin
        nl.store(out[nl.ds(i * 128, 128), :], value=nl.load(a[nl.ds(i * 128, 128), :]))

    _run(_rows_kernel(body), A)
    assert range is type(host_range) and list(range(2)) == [0, 1]   # restored after launch


def test_strict_off_hands_out_ints():
    seen = []

    def body(i, a, out):
        seen.append(type(i))
        nl.store(out[nl.ds(i * 128, 128), :], value=nl.load(a[nl.ds(i * 128, 128), :]))

    _run(_rows_kernel(body), A, strict=False)
    assert set(seen) == {int}


# -- what is refused -------------------------------------------------------------------------


@pytest.mark.parametrize("misuse,fragment", [
    (lambda i: int(i), "int()"),
    (lambda i: float(i), "float()"),
    (lambda i: [0, 1, 2, 3][i], "using it as a Python integer"),
    (lambda i: np.zeros((i + 1, 4)), "using it as a Python integer"),
])
def test_python_decisions_on_loop_indices_are_refused(misuse, fragment):
    def body(i, a, out):
        misuse(i)
        nl.store(out[nl.ds(i * 128, 128), :], value=nl.load(a[nl.ds(i * 128, 128), :]))

    with pytest.raises(SymbolicIndexError, match="traces as a symbolic index value") as exc:
        _run(_rows_kernel(body), A)
    assert fragment in str(exc.value) and "loop index 'i'" in str(exc.value)
    _run(_rows_kernel(body), A, strict=False)           # plain Python ints run it


def test_program_id_as_python_int_is_refused():
    @nki.jit
    def kernel(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        p = nl.program_id(0)
        offsets = [0, 128, 256, 384]
        start = offsets[p]                                 # a Python decision on a program id
        nl.store(out[nl.ds(start, 128), :], value=nl.load(a[nl.ds(start, 128), :]))
        return out

    with pytest.raises(SymbolicIndexError, match=r"nl.program_id\(0\) is a loop index or program"):
        _run(kernel[4], A)


def test_non_integer_arithmetic_is_refused():
    def body(i, a, out):
        i * 0.5
        nl.store(out[nl.ds(i * 128, 128), :], value=nl.load(a[nl.ds(i * 128, 128), :]))

    with pytest.raises(SymbolicIndexError, match="tile_index can only add with integer scalar"):
        _run(_rows_kernel(body), A)


def test_symbolic_loop_bounds_are_refused():
    def body(i, a, out):
        for j in nl.affine_range(i + 1):                   # a triangular loop
            nl.store(out[nl.ds(i * 128, 128), :], value=nl.load(a[nl.ds(i * 128, 128), :]))

    with pytest.raises(LoopBoundError, match="loop bounds must be compile-time constants"):
        _run(_rows_kernel(body), A)


# -- PSUM accumulation groups ------------------------------------------------------------------


def _matmul_kernel(pattern):
    @nki.jit
    def kernel(x):
        out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
        xt = nl.load(x)
        acc = nl.zeros((128, 128), dtype=nl.float32, buffer=nl.psum)
        pattern(acc, xt)
        nl.store(out, value=nl.copy(acc))
        return out
    return kernel


X = (np.random.default_rng(0).standard_normal((128, 128)) / 8).astype(np.float32)


def test_zeros_then_accumulate_is_legal():
    def pattern(acc, xt):
        for _ in nl.affine_range(3):
            acc += nisa.nc_matmul(xt, xt)

    out = _run(_matmul_kernel(pattern), X)
    np.testing.assert_allclose(out, 3 * X.T @ X, rtol=1e-2, atol=1e-2)


def test_overwrite_then_accumulate_is_legal():
    def pattern(acc, xt):
        acc[...] = nisa.nc_matmul(xt, xt)                 # a TensorE overwrite starts a group
        acc += nisa.nc_matmul(xt, xt)

    _run(_matmul_kernel(pattern), X)


@pytest.mark.parametrize("fill, ok", [(0.0, True), (1.0, False)])
def test_a_memset_of_zero_is_a_zero_fill(fill, ok):
    """``memset(0)`` into PSUM then accumulating matmuls (what nki-library's attention_bwd
    does) sums the same whether the zeros are a group's start or not; a nonzero memset is a
    foreign value."""
    def pattern(acc, xt):
        acc[...] = nisa.memset((128, 128), fill, nl.float32)
        acc += nisa.nc_matmul(xt, xt)

    if ok:
        np.testing.assert_allclose(_run(_matmul_kernel(pattern), X), X.T @ X,
                                   rtol=1e-2, atol=1e-2)
    else:
        with pytest.raises(AccumulationGroupError):
            _run(_matmul_kernel(pattern), X)


@pytest.mark.parametrize("foreign", ["scale", "copy", "vector_add"])
def test_accumulating_onto_another_engines_value_is_refused(foreign):
    def pattern(acc, xt):
        acc += nisa.nc_matmul(xt, xt)
        if foreign == "scale":                             # ScalarE rescales in place
            acc[...] = nisa.activation(nl.copy, acc, scale=0.5)
        elif foreign == "copy":
            acc[...] = nl.copy(xt, dtype=nl.float32)
        else:
            acc[...] += 1.0
        acc += nisa.nc_matmul(xt, xt)                      # adds onto a foreign value

    with pytest.raises(AccumulationGroupError, match="TensorE accumulation onto PSUM tile"):
        _run(_matmul_kernel(pattern), X)
    _run(_matmul_kernel(pattern), X, strict=False)        # the permissive default
