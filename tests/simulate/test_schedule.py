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
