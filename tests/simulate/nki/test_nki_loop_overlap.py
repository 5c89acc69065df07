"""simulate.measure(compiled_loop_overlap=...): whether iterations of an NKI 0.7 compiled loop
(nl.fori_loop / nl.while_loop) overlap in the scheduled estimate. AWS does not document it
(nki-today.md §2), so the estimate can be taken both ways."""
import numpy as np

import simulate
from nki07_fixtures import nk  # noqa: F401 (fixture)


def _kernel(nki, nl, nisa, n):
    """Each iteration loads a tile, computes on VectorE and stores: with overlap the next
    iteration's load runs during this one's compute; with a barrier they serialize."""
    @nki.jit
    def k(a):
        out = nl.ndarray((n, 128, 512), dtype=a.dtype, buffer=nl.shared_hbm)

        def body(i):
            t = nl.ndarray((128, 512), a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a[i])
            u = nl.ndarray((128, 512), a.dtype, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=u, data=t, op0=nl.multiply, operand0=2.0)
            nisa.dma_copy(dst=out[i], src=u)
        nl.fori_loop(0, n, body)
        return out
    return k


def test_overlap_is_the_default_and_a_barrier_serializes(nk):
    nki, nl, nisa = nk
    n = 4
    a = np.random.default_rng(0).standard_normal((n, 128, 512)).astype(np.float32)
    k = _kernel(nki, nl, nisa, n)
    t = {}
    for flag in (None, True, False):
        with simulate.measure(target="trn2", compiled_loop_overlap=flag) as m:
            out = k(a)
        np.testing.assert_array_equal(out, 2 * a)
        t[flag] = m.estimated_seconds
    assert t[None] == t[True]
    assert t[False] > t[True]
    # with barriers each iteration is a chain: its time is at least n times one iteration's
    with simulate.measure(target="trn2", compiled_loop_overlap=False) as one:
        _kernel(nki, nl, nisa, 1)(a[:1])
    assert t[False] >= n * one.estimated_seconds * 0.99


def _bound_kernel(nki, nl, nisa, runtime_bound: bool):
    """A long VectorE chain writes the loop count; the loop body (a load, a ScalarE copy, a
    store) does not depend on it. With a register bound the engines branch on the count, so
    the body waits for it; with the same count as an int it overlaps the chain."""
    @nki.jit
    def k(a, big):
        out = nl.ndarray((128, 512), dtype=a.dtype, buffer=nl.shared_hbm)
        w = nl.ndarray((128, 8192), big.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=w, src=big)
        for _ in range(4):
            nisa.tensor_scalar(dst=w, data=w, op0=nl.multiply, operand0=1.0)
        cnt = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=cnt, data=w[0:1, 0:1], op0=nl.multiply, operand0=0.0,
                           op1=nl.add, operand1=1.0)

        def body(i):
            t = nl.ndarray((128, 512), a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a)
            u = nl.ndarray((128, 512), a.dtype, buffer=nl.sbuf)
            nisa.activation(dst=u, op=nl.copy, data=t)
            nisa.dma_copy(dst=out, src=u)
        if runtime_bound:
            reg = nisa.register_alloc()
            nisa.register_load(reg, cnt)
            nl.fori_loop(0, reg, body)
        else:
            nl.fori_loop(0, 1, body)
        return out
    return k


def test_a_register_bound_waits_for_its_value(nk):
    """nisa.register_load: the sequencers branch on the loaded count, so nothing after it
    starts before the count is written (simulate/_sched.register_wait)."""
    nki, nl, nisa = nk
    rng = np.random.default_rng(0)
    a = rng.standard_normal((128, 512)).astype(np.float32)
    big = rng.standard_normal((128, 8192)).astype(np.float32)
    t = {}
    for flag in (False, True):
        with simulate.measure(target="trn2") as m:
            out = _bound_kernel(nki, nl, nisa, flag)(a, big)
        np.testing.assert_array_equal(out, a)
        t[flag] = m.estimated_seconds
    assert t[True] > t[False]
