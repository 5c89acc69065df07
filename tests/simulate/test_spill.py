"""On-chip tensors beyond capacity (simulate._spill): what AWS's legacy kernels rely on.

AWS's attention tutorial kernels (nki-samples 6905a68) declare PSUM tensors with a block per
(query tile, key block) and SBUF tensors beyond trn1's 192 KiB per partition; they compiled and
ran on trn1. The simulator allocates such tensors block by block as they are accessed and
charges spills of what is accessed again after its space was taken. The package's suite runs
with spilling off (tests/conftest.py); these tests turn it on.
"""
import warnings

import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl

BANK_F32 = 512                       # fp32 elements of one 2 KiB PSUM bank per partition


@pytest.fixture
def spilling():
    with nki.spill(True):
        yield


def _blocks_kernel(nblocks, read_back_later):
    """``nblocks`` PSUM blocks of one bank each, written by matmuls; each block is copied out
    either right after it is written (each block dead after one use: never more than one live)
    or in a second loop after all are written (every block live at once)."""
    def kernel(x, w):
        out = nl.ndarray((nblocks, 128, BANK_F32), nl.float32, buffer=nl.shared_hbm)
        xs = nl.load(x)
        ws = nl.load(w)
        ps = nl.ndarray((nblocks, nl.par_dim(128), BANK_F32), nl.float32, buffer=nl.psum)
        for i in nl.affine_range(nblocks):
            ps[i] = nisa.nc_matmul(xs, ws)
            if not read_back_later:
                nl.store(out[i], nisa.tensor_copy(ps[i]))
        if read_back_later:
            for i in nl.affine_range(nblocks):
                nl.store(out[i], nisa.tensor_copy(ps[i]))
        return out
    return kernel


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 128)).astype(np.float32)
    w = rng.standard_normal((128, BANK_F32)).astype(np.float32)
    return x, w


def test_off_refuses_beyond_eight_banks():
    """The project rule (and the suite's setting): more than 8 banks live raises."""
    x, w = _inputs()
    with nki.spill(False), pytest.raises(RuntimeError, match="required psum banks 16 exceeds"):
        nki.simulate_kernel(_blocks_kernel(16, True), x, w)


def test_blocks_live_one_at_a_time_cost_nothing(spilling):
    """A block-dim tensor larger than PSUM whose blocks die after one use runs with no spill:
    the compiler gives the blocks space as they become live (block dimension migration guide)."""
    x, w = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error", nki.SpillWarning)
        with nki.measure(target="trn1") as m:
            out = nki.simulate_kernel(_blocks_kernel(16, False), x, w)
    np.testing.assert_allclose(out, np.broadcast_to(x.T @ w, out.shape), rtol=1e-4, atol=1e-3)
    assert m.spill_refills == 0 and m.spill_hbm_bytes == 0
    assert m.peak_psum_banks <= 8


def test_all_blocks_live_spill_and_refill(spilling):
    """16 one-bank blocks all live: 8 blocks are evicted while the write loop runs (the ones
    whose next use is furthest); each goes to SBUF, which has room, at the cost of one VectorE
    copy, and the read loop reads it there. No HBM traffic."""
    x, w = _inputs()
    with pytest.warns(nki.SpillWarning, match="8 spilled units reloaded, 0 B through HBM"):
        with nki.measure(target="trn1") as m:
            out = nki.simulate_kernel(_blocks_kernel(16, True), x, w)
    np.testing.assert_allclose(out, np.broadcast_to(x.T @ w, out.shape), rtol=1e-4, atol=1e-3)
    assert m.spill_refills == 8
    assert m.spill_hbm_bytes == 0
    with nki.measure(target="trn1") as fit:
        nki.simulate_kernel(_blocks_kernel(8, True), x, w)
    # the 16-block run executes twice the 8-block run's copies plus 8 spill copies
    assert m.instructions["vector"] == 2 * fit.instructions["vector"] + 8
    assert m.engine_cycles["vector"] == 2 * fit.engine_cycles["vector"] + 8 * BANK_F32
    assert m.estimated_seconds > fit.estimated_seconds


def test_psum_spills_to_hbm_when_sbuf_is_full(spilling):
    """With SBUF nearly full, an evicted PSUM block goes through HBM: a copy and a DMA each
    way, 2 x 128 partitions x 2 KiB of spill traffic per refill through HBM."""
    x, w = _inputs()
    cap = 192 * 1024

    def kernel(x, w):
        out = nl.ndarray((9, 128, BANK_F32), nl.float32, buffer=nl.shared_hbm)
        xs = nl.load(x)
        ws = nl.load(w)
        # xs, ws and the filler leave less than one 2 KiB block of SBUF free
        filler = nl.zeros((nl.par_dim(128), (cap - 512 * 4 - 128 * 4 - 1024) // 4), nl.float32)
        ps = nl.ndarray((9, nl.par_dim(128), BANK_F32), nl.float32, buffer=nl.psum)
        for i in nl.affine_range(9):
            ps[i] = nisa.nc_matmul(xs, ws)
        nl.store(out[0], nisa.tensor_copy(ps[0]))   # block 0 was evicted by block 8
        for i in nl.affine_range(8):
            nl.store(out[i + 1], nisa.tensor_copy(ps[i + 1]))
        return out

    with pytest.warns(nki.SpillWarning):
        with nki.measure(target="trn1") as m:
            out = nki.simulate_kernel(kernel, x, w)
    np.testing.assert_allclose(out, np.broadcast_to(x.T @ w, out.shape), rtol=1e-4, atol=1e-3)
    # block 8 evicts the block read last among 0-7 (block 7); SBUF has no room for it, so it
    # goes out through HBM and comes back: 2 x 128 partitions x 2 KiB
    assert m.spill_refills == 1
    assert m.spill_hbm_bytes == 2 * 128 * BANK_F32 * 4


def test_sbuf_tensors_beyond_capacity_spill_to_hbm(spilling):
    """Three 80 KiB-per-partition tiles on trn1 (192 KiB): the third evicts the one used
    furthest ahead (t1); reading it again costs a DMA out and a DMA back (2 x 128 x 80 KiB);
    tiles never used again (t2, t3 after the first add) give their space up at no cost."""
    n = 80 * 1024 // 4
    a = np.arange(128 * n, dtype=np.float32).reshape(128, n)

    def kernel(a):
        out = nl.ndarray((128, n), nl.float32, buffer=nl.shared_hbm)
        t1 = nl.load(a)
        t2 = nl.load(a)
        t3 = nl.zeros((nl.par_dim(128), n), nl.float32)   # t1 is evicted
        s = nl.add(t2, t3)            # t3, t2: resident
        nl.store(out, nl.add(s, t1))  # t1 comes back
        return out

    with pytest.warns(nki.SpillWarning, match="SBUF"):
        with nki.measure(target="trn1") as m:
            out = nki.simulate_kernel(kernel, a)
    np.testing.assert_array_equal(out, 2 * a)
    assert m.spill_refills == 1
    assert m.spill_hbm_bytes == 2 * 128 * n * 4
    assert m.hbm_bytes_read == 2 * a.nbytes           # the kernel's own traffic is unchanged
    with nki.spill(False), pytest.raises(RuntimeError, match="SBUF capacity exceeded"):
        nki.simulate_kernel(kernel, a)


def test_within_capacity_nothing_changes():
    """A kernel that fits measures the same with spilling on or off."""
    x, w = _inputs()
    res = []
    for flag in (False, True):
        with nki.spill(flag), nki.measure(target="trn2") as m:
            nki.simulate_kernel(_blocks_kernel(8, True), x, w)
        res.append((m.estimated_seconds, m.modeled_seconds, dict(m.instructions),
                    m.peak_psum_banks, m.spill_refills))
    assert res[0] == res[1]


def test_psum_spilled_into_sbuf_moves_on_when_sbuf_fills(spilling):
    """PSUM blocks spilled into SBUF give their SBUF space up to a large SBUF tile that needs it
    (they move on to HBM), instead of making the kernel fail."""
    x, w = _inputs()
    cap = 192 * 1024

    def kernel(x, w):
        out = nl.ndarray((16, 128, BANK_F32), nl.float32, buffer=nl.shared_hbm)
        xs = nl.load(x)
        ws = nl.load(w)
        ps = nl.ndarray((16, nl.par_dim(128), BANK_F32), nl.float32, buffer=nl.psum)
        for i in nl.affine_range(16):
            ps[i] = nisa.nc_matmul(xs, ws)      # 8 blocks end up spilled into SBUF (16 KiB)
        big = nl.zeros((nl.par_dim(128), (cap - 8 * 1024) // 4), nl.float32)
        for i in nl.affine_range(16):
            nl.store(out[i], nisa.tensor_copy(ps[i]))
        nl.store(out[0], nl.add(nisa.tensor_copy(ps[0]), big[:, 0:BANK_F32]))
        return out

    with pytest.warns(nki.SpillWarning):
        with nki.measure(target="trn1") as m:
            out = nki.simulate_kernel(kernel, x, w)
    ref = np.broadcast_to(x.T @ w, out.shape)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3)
    assert m.spill_hbm_bytes > 0
