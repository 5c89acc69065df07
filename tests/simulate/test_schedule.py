"""Measurement.estimated_seconds: the list-scheduled estimate (simulate/_sched.py).

Each test builds a small kernel whose schedule is known by hand and checks the estimate
against it: dependencies serialize, independent work overlaps, disjoint slices of one tile
are independent, DMAs overlap their latency over the queues, rotating buffers limit how far
loads run ahead."""
import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
from simulate import _hw

TRN2 = _hw.get_target("trn2")
NS = 1e-9


def _run(kernel, *args, target="trn2"):
    with nki.measure(target=target) as m:
        nki.simulate_kernel(kernel, *args)
    return m


def _secs(engine, cycles):
    return cycles / TRN2.clock_hz[engine] + _hw.SCHED_ISSUE_NS * NS


@nki.jit
def _chain(a):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.load(a)
    y = nisa.activation(nl.exp, x)                    # ScalarE, waits for the load
    z = nisa.tensor_scalar(y, np.multiply, 2.0)       # VectorE, waits for ScalarE
    nl.store(out, value=z)                            # DMA, waits for VectorE
    return out


@nki.jit
def _independent(a):
    out = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.load(a)
    t = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.sbuf)
    t[:, 0:512] = nisa.activation(nl.exp, x)                       # ScalarE
    t[:, 512:1024] = nisa.tensor_scalar(x, np.multiply, 3.0,       # VectorE, independent
                                        engine=nisa.vector_engine)
    nl.store(out, value=t)
    return out


def test_a_dependency_chain_is_serial_and_beyond_the_overlap_bound():
    a = np.ones((128, 512), np.float32)
    m = _run(_chain, a)
    lo, hi = m.modeled_seconds
    est = m.estimated_seconds
    # load, exp, multiply, store strictly in sequence, plus two DMA latencies and the
    # semaphore waits between engines
    act = _secs("scalar", 512)
    vec = _secs("vector", 512)
    assert est > lo
    assert est >= act + vec + 2 * _hw.DMA_FIXED_LATENCY_NS * NS + 3 * _hw.SCHED_SYNC_NS * NS


@nki.jit
def _dependent(a):
    out = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.load(a)
    t = nl.ndarray((128, 1024), dtype=nl.float32, buffer=nl.sbuf)
    t[:, 0:512] = nisa.activation(nl.exp, x)
    t[:, 512:1024] = nisa.tensor_scalar(t[:, 0:512], np.multiply, 3.0,   # reads ScalarE's
                                        engine=nisa.vector_engine)
    nl.store(out, value=t)
    return out


def test_independent_engines_overlap_on_disjoint_slices():
    """ScalarE and VectorE write disjoint column ranges of one tile: from the same input they
    run side by side; when VectorE reads ScalarE's half they run one after the other."""
    a = np.ones((128, 512), np.float32)
    par = _run(_independent, a).estimated_seconds
    ser = _run(_dependent, a).estimated_seconds
    act, vec = _secs("scalar", 512), _secs("vector", 512)
    assert ser - par >= 0.9 * min(act, vec)


@nki.jit
def _many_loads(a):
    out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    for i in nl.sequential_range(a.shape[0] // 128):
        t = nl.load(a[i * 128:(i + 1) * 128, :])
        acc[...] = nisa.tensor_tensor(acc, t, np.add)
    nl.store(out, value=acc)
    return out


@nki.jit
def _gather_loads(a):
    n = a.shape[0] // 128
    out = nl.ndarray((128, n * 64), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((128, n * 64), dtype=nl.float32, buffer=nl.sbuf)
    for i in nl.affine_range(n):
        t[:, nl.ds(i * 64, 64)] = nl.load(a[i * 128:(i + 1) * 128, :])
    nl.store(out, value=t)
    return out


def test_dma_latency_overlaps_across_queues():
    """32 independent small loads: their fixed latencies overlap over the 16 queues (far below
    32 latencies in a row) but the store after them still pays one more."""
    a = np.ones((32 * 128, 64), np.float32)
    m = _run(_gather_loads, a)
    lat = _hw.DMA_FIXED_LATENCY_NS * NS
    lo, _ = m.modeled_seconds
    assert m.estimated_seconds < 32 * lat / 2          # latencies in a row would be 41.6 us
    assert m.estimated_seconds >= lo + lat


def test_rotating_buffers_hold_loads_back(monkeypatch):
    """With one buffer per allocation site a load cannot start before the previous tile of the
    site was consumed; with two it runs one ahead."""
    a = np.ones((32 * 128, 64), np.float32)
    monkeypatch.setattr(_hw, "SCHED_BUFFERS", 2)
    two = _run(_many_loads, a).estimated_seconds
    monkeypatch.setattr(_hw, "SCHED_BUFFERS", 1)
    one = _run(_many_loads, a).estimated_seconds
    assert one > two


def test_estimate_is_between_the_bound_and_the_run_of_every_instruction_with_latencies():
    a = np.ones((32 * 128, 64), np.float32)
    m = _run(_many_loads, a)
    lo, hi = m.modeled_seconds
    n_dma = m.instructions["dma"]
    assert lo <= m.estimated_seconds <= hi + n_dma * _hw.DMA_FIXED_LATENCY_NS * NS


def test_report_and_run_show_the_estimate():
    m = _run(_chain, np.ones((128, 512), np.float32))
    assert "scheduled estimate" in m.report()
    assert m.kernels[0].estimated_seconds == pytest.approx(m.estimated_seconds)


def test_the_two_cores_of_an_lnc2_launch_run_side_by_side():
    """kv heads spread over two NeuronCores (LNC=2): each core has its own engines, DMA
    queues and rotating buffers, so the estimate drops well below one core's."""
    import ml_dtypes
    import host

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 512, 64)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((1, 2, 512, 64)).astype(ml_dtypes.bfloat16)
    est = {}
    for lnc in (1, 2):
        with nki.measure(target="trn2") as m:
            host.flash_attention(q, k, k, causal=True, lnc=lnc)
        est[lnc] = m.estimated_seconds
    assert est[2] < 0.8 * est[1]


# -- results written straight into a destination ---------------------------------------------


@nki.jit
def _overwrite_while_read(a):
    """VectorE sums ``t``; then ScalarE's exp of ``t`` is written straight back into ``t`` and
    summed again. The exp could start with the first sum (same input), but its write into
    ``t`` must wait for that read (write after read on the destination)."""
    out = nl.ndarray((128, 2), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((128, 4096), dtype=nl.float32, buffer=nl.sbuf)
    t[...] = nisa.memset((128, 4096), 0.5, dtype=nl.float32, engine=nisa.gpsimd_engine)
    u = nisa.tensor_reduce(np.add, t, axis=1)                  # VectorE reads t
    t[...] = nisa.activation(nl.exp, t)                        # ScalarE writes t
    w = nisa.tensor_reduce(np.add, t, axis=1)                  # VectorE reads the new t
    nl.store(out[:, 0:1], value=u)
    nl.store(out[:, 1:2], value=w)
    return out


def test_a_result_written_into_a_destination_waits_for_its_readers():
    m = _run(_overwrite_while_read, np.ones((128, 2), np.float32))
    fill, vec, act = _secs("gpsimd", 4096), _secs("vector", 4096), _secs("scalar", 4096)
    lat = _hw.DMA_FIXED_LATENCY_NS * NS
    # fill, sum, exp, sum and a store in a row (the exp no longer hides under the first sum;
    # overlapped, this launch models at 13.6 us)
    assert m.estimated_seconds >= fill + 2 * vec + act + lat


@nki.jit
def _loads_into_blocks(a):
    """Loads into the blocks of one block-dim tile (blocks before the partition dim) are
    independent writes: they overlap their latencies."""
    n = a.shape[0] // 128
    out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((n, nl.par_dim(128), 64), dtype=nl.float32, buffer=nl.sbuf)
    for i in nl.affine_range(n):
        t[i, :, :] = nl.load(a[i * 128:(i + 1) * 128, :])
    nl.store(out, value=t[n - 1, :, :])
    return out


def test_blocks_of_a_tile_are_independent_destinations():
    a = np.ones((32 * 128, 64), np.float32)
    m = _run(_loads_into_blocks, a)
    assert m.estimated_seconds < 32 * _hw.DMA_FIXED_LATENCY_NS * NS / 2


@nki.jit
def _unrolled_allocations(a):
    """Eight tiles allocated on one source line inside one NKI-loop iteration (an unrolled
    Python loop): distinct buffers, so their loads all go ahead together."""
    out = nl.ndarray((256, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    for i in nl.affine_range(2):
        ts = []
        for j in (0, 1, 2, 3, 4, 5, 6, 7):
            t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
            t[...] = nl.load(a[:, nl.ds(j * 64, 64)])
            ts.append(t)
        for j in (0, 1, 2, 3, 4, 5, 6, 7):
            nl.store(out[nl.ds(i * 128, 128), nl.ds(j * 64, 64)], value=ts[j])
    return out


def test_unrolled_copies_of_an_allocation_do_not_rotate(monkeypatch):
    a = np.ones((128, 512), np.float32)
    monkeypatch.setattr(_hw, "SCHED_BUFFERS", 1)
    m = _run(_unrolled_allocations, a)
    lat = _hw.DMA_FIXED_LATENCY_NS * NS
    # one buffer for the source line would chain the 16 loads (16 latencies in a row); eight
    # buffers, each rotating across the two iterations, let each iteration's loads overlap
    assert m.estimated_seconds < 12 * lat


@nki.jit
def _late_small_dma(a, b):
    """A large load, a dependent chain, then a small independent load issued last: the small
    one uses bandwidth the others leave idle instead of queueing behind them."""
    out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
    big = nl.load(a)
    y = nisa.activation(nl.exp, big)
    nl.store(out[:, 0:64], value=y[:, 0:64])
    s = nl.load(b)
    nl.store(out[:, 64:128], value=s)
    return out


def test_ready_transfers_use_idle_bandwidth():
    a = np.ones((128, 8192), np.float32)
    b = np.ones((128, 64), np.float32)
    m = _run(_late_small_dma, a, b)
    lat = _hw.DMA_FIXED_LATENCY_NS * NS
    move = 128 * 8192 * 4 / TRN2.dma_bytes_per_s
    act = _secs("scalar", 8192)
    # the chain (big load, exp, store) ends the launch; the small load and store fit inside
    assert m.estimated_seconds < move + act + 3 * lat


@nki.jit
def _psum_pipeline(a):
    """16 matmuls, each into a fresh PSUM tile that VectorE copies out."""
    out = nl.ndarray((128, 16 * 512), dtype=nl.float32, buffer=nl.shared_hbm)
    x = nl.load(a[:, 0:128])
    y = nl.load(a)
    res = nl.ndarray((128, 16 * 512), dtype=nl.float32, buffer=nl.sbuf)
    for i in nl.affine_range(16):
        p = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        p[...] = nisa.nc_matmul(x, y)
        res[:, nl.ds(i * 512, 512)] = nisa.tensor_copy(p, engine=nisa.vector_engine)
    nl.store(out, value=res)
    return out


def test_psum_tiles_share_eight_physical_banks(monkeypatch):
    """A PSUM tile takes a physical bank; its first write waits for the bank's previous tile.
    With 8 banks TensorE runs ahead of the copies; with 1 every matmul waits for the copy
    before it."""
    a = np.ones((128, 512), np.float32)
    eight = _run(_psum_pipeline, a).estimated_seconds
    monkeypatch.setattr(_hw, "PSUM_NUM_BANKS", 1)
    one = _run(_psum_pipeline, a).estimated_seconds
    mm = 512 / TRN2.clock_hz["tensor"]
    assert one - eight >= 15 * mm



def _gap_kernel(ordered, loop=False):
    """VectorE: a copy of a just-loaded tile (it waits for the load: an idle gap before it),
    then a copy of a memset tile that needs no load, whose result is stored last. Out of order,
    the second copy fills the gap and its store starts early; in program order it waits for
    the first copy."""
    import contextlib

    import simulate.compiler as ncc

    def kernel(a):
        out = nl.ndarray((128, 2048), dtype=nl.float32, buffer=nl.shared_hbm)
        x = nl.load(a)
        z = nl.zeros((128, 2048), nl.float32)
        if loop:
            for _ in nl.sequential_range(1, directives=ncc.no_reorder() if ordered else ()):
                nisa.tensor_copy(x, engine=nisa.vector_engine)
                w = nisa.tensor_copy(z, engine=nisa.vector_engine)
                nl.store(out, value=w)
        else:
            with ncc.no_reorder() if ordered else contextlib.nullcontext():
                nisa.tensor_copy(x, engine=nisa.vector_engine)
                w = nisa.tensor_copy(z, engine=nisa.vector_engine)
            nl.store(out, value=w)
        return out
    return kernel


def test_no_reorder_keeps_program_order():
    """``no_reorder`` ("operations inside the block execute in program order",
    nki.language.no_reorder docs), as a with-block or a loop directive: the independent copy
    may not move into the idle gap before the copy that waits for the load, so the store of
    its result starts later by at least one copy's time."""
    a = np.ones((128, 2048), np.float32)
    copy = _secs("vector", 2048)
    for loop in (False, True):
        free = _run(_gap_kernel(False, loop), a).estimated_seconds
        kept = _run(_gap_kernel(True, loop), a).estimated_seconds
        assert kept - free > copy


def _gather_after_store(from_scratch):
    @nki.jit
    def k(a, ix):
        ip, jf = nl.arange(128)[:, None], nl.arange(512)[None, :]
        scratch = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(scratch, value=nisa.activation(nl.exp, nl.load(a)))
        it = nl.load(ix)
        g = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        src = scratch if from_scratch else a
        nisa.dma_copy(dst=g, src=src[it[ip, 0], jf])                # indirect rows
        nl.store(out, value=g)
        return scratch, out
    return k


def test_an_indirect_dma_source_waits_for_its_writer():
    """A ``dma_copy`` gathering rows of an HBM tensor by runtime indices reads the whole
    tensor as far as the schedule knows: it waits for the store that wrote it, where the
    same gather from an input runs beside the exponential."""
    a = np.ones((128, 512), np.float32)
    ix = np.arange(128, dtype=np.int32)[::-1].reshape(128, 1).copy()
    after = _run(_gather_after_store(True), a, ix)
    beside = _run(_gather_after_store(False), a, ix)
    assert after.estimated_seconds > beside.estimated_seconds + 0.5 * _hw.DMA_FIXED_LATENCY_NS * NS


def test_an_instruction_takes_the_first_idle_gap_that_fits():
    """The idle-gap search (``_sched.Scheduler._place``) starts at the first gap ending at or
    after the instruction's ready time (a bisection, for speed): the gap it takes must still
    be the first gap in time order where it fits, whatever the ready time -- also one long
    before the latest gaps -- and the gaps stay disjoint and in time order."""
    from simulate import _sched

    s = _sched.Scheduler(TRN2)
    key = (0, "vector")
    rng = np.random.default_rng(0)
    t = 0.0
    longest = 0
    for _ in range(3000):
        gaps = list(s.gaps.get(key, ()))
        # mostly work that waits past the engine's free time (opening a gap), some that is
        # ready early (filling an old gap, or split one)
        t += rng.exponential(1.0)
        ready = t if rng.random() < 0.6 else rng.uniform(0.0, t)
        dur = rng.choice([0.05, 0.3, 1.5])
        fits = [max(g0, ready) for g0, g1 in gaps if max(g0, ready) + dur <= g1]
        free = s.engine_free.get(key, 0.0)
        end = s._place(key, ready, dur)
        assert end == (fits[0] if fits else max(ready, free)) + dur
        now = s.gaps.get(key, [])
        assert all(a1 < b0 for (_, a1), (b0, _) in zip(now, now[1:]))
        assert all(g0 < g1 for g0, g1 in now)
        longest = max(longest, len(now))
    # split gaps accumulate beyond the window: the search is not over a handful of gaps
    assert longest > 4 * _hw.SCHED_REORDER_WINDOW
