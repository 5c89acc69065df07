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
