"""err_unexpected_output_dependencies: writes to the same location from different affine_range
iterations without a += accumulation (spec §6; issues aws-neuron-sdk #1052/#1055)."""
import numpy as np
import pytest

import simulate as nki
import simulate.language as nl
import simulate.isa as nisa

A = np.ones((4, 128, 64), np.float32)


def _run(body):
    def kernel(a):
        body(a)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, 0.0)
        return out
    return nki.jit(kernel)(A)


def test_loop_invariant_write_in_affine_range_rejected():
    def body(a):
        buf = nl.ndarray((128, 64), nl.float32)
        for i in nl.affine_range(4):
            buf[...] = nl.load(a[i])
    with pytest.raises(SyntaxError, match="Unexpected output dependencies, missing indices in "
                                          "the dst access: i") as e:
        _run(body)
    assert e.value.nki_error == "err_unexpected_output_dependencies"


def test_explicit_accumulate_form_rejected_but_plus_equal_allowed():
    def explicit(a):
        acc = nl.zeros((128, 64), nl.float32)
        for k in nl.affine_range(4):
            acc[...] = nl.add(acc, nl.load(a[k]))
    with pytest.raises(SyntaxError, match="missing indices in the dst access: k"):
        _run(explicit)

    def plus_equal(a):
        acc = nl.zeros((128, 64), nl.float32)
        for k in nl.affine_range(4):
            acc += nl.load(a[k])
            acc[...] += nl.load(a[k])
    _run(plus_equal)


@pytest.mark.parametrize("loop", ["sequential_range", "static_range"])
def test_sequential_loops_may_carry_dependencies(loop):
    def body(a):
        acc = nl.zeros((128, 64), nl.float32)
        for k in getattr(nl, loop)(4):
            acc[...] = nl.add(acc, nl.load(a[k]))
    _run(body)


def test_indexed_or_loop_local_destinations_are_fine():
    def body(a):
        buf = nl.ndarray((4, nl.par_dim(128), 64), nl.float32)
        stats = nl.ndarray((128, 4), nl.float32)
        for i in nl.affine_range(4):
            t = nl.ndarray((128, 64), nl.float32)         # allocated inside: fresh per iteration
            t[...] = nl.load(a[i])
            buf[i] = t
            stats[:, i] = nl.max(t, axis=1)
    _run(body)


def test_nested_loops_report_the_missing_index():
    def body(a):
        buf = nl.ndarray((4, nl.par_dim(128), 64), nl.float32)
        for i in nl.affine_range(2):
            for j in nl.affine_range(4):
                buf[j] = nl.load(a[j])
    with pytest.raises(SyntaxError, match="missing indices in the dst access: i"):
        _run(body)


def test_hbm_store_and_reduce_res_conflicts():
    @nki.jit
    def k(a):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        for i in nl.affine_range(4):
            nl.store(out, nl.load(a[i]))
        return out
    with pytest.raises(SyntaxError, match="tensor 'shared_hbm_0' is written at the same "
                                          "location"):
        k(A)

    def red(a):
        r = nl.ndarray((128, 1), nl.float32)
        for i in nl.affine_range(2):
            nisa.activation_reduce(nl.exp, nl.load(a[i]), reduce_op=np.add, reduce_res=r)
    with pytest.raises(SyntaxError, match="Unexpected output dependencies"):
        _run(red)


def test_dma_rmw_accumulation_exempt_and_masked_disjoint_writes_ok():
    def body(a):
        acc = nl.zeros((128, 64), nl.float32)
        for i in nl.affine_range(4):
            nisa.dma_copy(dst=acc, src=a[i], dst_rmw_op=np.add)
        half = nl.ndarray((128, 64), nl.float32)
        jf = nl.arange(64)[None, :]
        ip = nl.arange(128)[:, None]
        for i in nl.affine_range(2):
            half[ip, jf] = nl.load(a[i], mask=(jf >= 32 * i) & (jf < 32 * i + 32))
    _run(body)


def test_overlapping_but_index_dependent_windows_pass():
    def body(a):
        buf = nl.zeros((128, 96), nl.float32)
        for i in nl.affine_range(2):
            buf[:, nl.ds(32 * i, 64)] = nl.load(a[i])       # depends on i (overlap is allowed)
    _run(body)
