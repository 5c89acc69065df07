"""DMA cost model: a per-descriptor overhead for every contiguous chunk (hardware-and-limits.md §3
"DMA efficiency rules"): time = (bytes + chunks * 256 B) / DMA bandwidth + 81.25 ns per DMA."""
import ml_dtypes
import numpy as np
import pytest

import simulate as nki
import simulate.language as nl
import simulate.isa as nisa
from simulate import _hw

OVH = _hw.DMA_CHUNK_OVERHEAD_BYTES
FIXED = _hw.DMA_FIXED_NS_PER_INSTRUCTION * 1e-9
BF16 = ml_dtypes.bfloat16


def expected(nbytes, chunks, target="trn2", dmas=1):
    return (nbytes + chunks * OVH) / _hw.get_target(target).dma_bytes_per_s + dmas * FIXED


def test_constant_and_efficiency_points_match_the_guide():
    assert OVH == 256
    eff = {c: c / (c + OVH) for c in (256, 2048, 4096)}
    assert eff[256] == 0.5                                  # "< 256 B: badly overhead-bound"
    assert 0.88 < eff[2048] < 0.89                          # ">= 2 KiB: minimum recommended"
    assert 0.94 < eff[4096] < 0.95                          # ">= 4 KiB: full rate"


def _load_only(src_view):
    """Kernel loading ``src_view(a)`` into a fresh tile and storing it back (two DMAs)."""
    @nki.jit
    def k(a):
        t = nl.load(src_view(a))
        o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
        nl.store(o, t)
        return o
    return k


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_row_per_partition_bf16_tile_is_256_byte_chunks(target):
    a = np.ones((1024, 128), BF16)
    with nki.measure(target=target) as m:
        _load_only(lambda x: x[0:128, :])(a)
    rec = m.kernels[0]
    assert m.dma_bytes_per_partition == [256, 256]
    assert rec.dma_chunks == 2 * 128                       # load + store, one 256 B row each
    assert m.engine_seconds["dma"] == pytest.approx(
        expected(2 * 128 * 256, 2 * 128, target, dmas=2), rel=1e-12)
    assert m.dma_average_chunk_bytes == 256
    assert m.dma_efficiency == pytest.approx(0.5)


def test_three_d_view_gives_t_separate_rows_per_partition():
    T = 4
    a = np.ones((T, 128, 128), BF16)                       # HBM (t, p, d)

    @nki.jit
    def k(x):
        ip, it, idd = nl.mgrid[0:128, 0:T, 0:128]
        t = nl.load(x[it, ip, idd])                          # tile [128, T, 128]
        o = nl.ndarray((128, T * 128), x.dtype, buffer=nl.shared_hbm)
        nl.store(o, t)                                       # contiguous T*256 B rows
        return o
    with nki.measure() as m:
        o = k(a)
    assert o.shape == (128, T * 128)
    assert m.dma_bytes_per_partition == [256, T * 256]
    assert m.kernels[0].dma_chunks == 128 * T + 128
    nbytes = T * 128 * 128 * 2
    assert m.engine_seconds["dma"] == pytest.approx(
        expected(2 * nbytes, 128 * T + 128, dmas=2), rel=1e-12)


def test_fully_contiguous_8k_per_partition_is_one_chunk_per_partition():
    a = np.ones((128, 4096), BF16)
    with nki.measure() as m:
        _load_only(lambda x: x)(a)
    assert m.dma_bytes_per_partition == [8192, 8192]
    assert m.kernels[0].dma_chunks == 2 * 128
    assert m.dma_efficiency == pytest.approx(8192 / (8192 + OVH))


def test_sbuf_side_runs_limit_the_chunks():
    a = np.ones((128, 256), BF16)                          # HBM rows of 512 B

    @nki.jit
    def k(x):
        buf = nl.ndarray((128, 4, 128), x.dtype)
        buf[:, :, 0:64] = nl.load(x)                         # SBUF runs of 64 elements
        buf[:, :, 64:128] = nl.load(x)
        o = nl.ndarray((128, 4, 64), x.dtype, buffer=nl.shared_hbm)
        nl.store(o, buf[:, :, 32:96])                        # SBUF runs of 64 again
        return o
    with nki.measure() as m:
        k(a)
    assert m.dma_bytes_per_partition == [512, 512, 512]    # HBM side unchanged
    assert m.kernels[0].dma_chunks == 3 * 128 * 4
    assert m.dma_average_chunk_bytes == 128
    assert m.engine_seconds["dma"] == pytest.approx(
        expected(3 * 128 * 256 * 2, 3 * 128 * 4, dmas=3), rel=1e-12)


def test_gather_and_scatter_move_one_chunk_per_row():
    data = np.ones((64, 512), np.float32)
    idx = np.arange(16, dtype=np.int32).reshape(16, 1) * 3

    @nki.jit
    def k(d, ix):
        it = nl.load(ix)
        g = nl.load(d[it[nl.arange(16)[:, None], 0], nl.arange(512)[None, :]])
        o = nl.ndarray((64, 512), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o[it[nl.arange(16)[:, None], 0], nl.arange(512)[None, :]], src=g)
        return o
    with nki.measure() as m:
        k(data, idx)
    rec = m.kernels[0]
    assert m.dma_bytes_per_partition == [4, 2048, 2048]
    assert rec.dma_chunks == 16 + 16 + 16                  # index tile, gather, scatter rows
    assert m.engine_seconds["dma"] == pytest.approx(
        expected(16 * 4 + 2 * 16 * 2048, 48, dmas=3), rel=1e-12)


def test_masked_transfer_counts_the_chunks_it_moves():
    @nki.jit
    def k(x):
        ip = nl.arange(128)[:, None]
        jf = nl.arange(512)[None, :]
        t = nl.load(x[ip, jf], mask=(ip < 100) & (jf < 200))
        o = nl.ndarray((100, 200), nl.float32, buffer=nl.shared_hbm)
        nl.store(o[ip, jf], t, mask=(ip < 100) & (jf < 200))
        return o
    with nki.measure() as m:
        k(np.ones((128, 512), np.float32))
    assert m.kernels[0].dma_chunks == 2 * 100
    assert m.engine_seconds["dma"] == pytest.approx(
        expected(2 * 100 * 200 * 4, 200, dmas=2), rel=1e-12)


def test_broadcast_store_source_is_element_granular():
    @nki.jit
    def k(x):
        col = nl.load(x)                                     # [128, 1]
        o = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, col)                                     # stride-0 SBUF source
        return o
    with nki.measure() as m:
        o = k(np.arange(128, dtype=np.float32).reshape(128, 1))
    np.testing.assert_array_equal(o, np.broadcast_to(np.arange(128.0)[:, None], (128, 64)))
    assert m.kernels[0].dma_chunks == 128 + 128 * 64


def test_transposes_keep_their_rate_model():
    @nki.jit
    def k(a):
        t = nl.load_transpose2d(a)
        o = nl.ndarray((128, 512), a.dtype, buffer=nl.shared_hbm)
        nl.store(o, t)
        return o
    a = np.ones((512, 128), BF16)
    with nki.measure(target="trn2") as m:
        k(a)
    nbytes = 512 * 128 * 2
    assert m.kernels[0].dma_chunks == 128                  # the store only
    assert m.engine_seconds["dma"] == pytest.approx(
        nbytes / (368e9 * _hw.TRN2.load_transpose_rate) + (nbytes + 128 * OVH) / 368e9
        + 2 * FIXED, rel=1e-12)


def test_host_array_memory_order_does_not_change_the_model():
    c = np.ones((256, 128), np.float32)
    f = np.asfortranarray(c)
    res = []
    for arr in (c, f):
        with nki.measure() as m:
            _load_only(lambda x: x[0:128, :])(arr)
        res.append((m.dma_bytes_per_partition, m.dma_chunks, m.engine_seconds["dma"]))
    assert res[0] == res[1]
    assert res[0][0] == [512, 512]


def test_report_shows_chunks_and_efficiency():
    a = np.ones((128, 128), BF16)
    with nki.measure() as m:
        _load_only(lambda x: x)(a)
    r = m.report()
    assert "DMA chunks 256, average chunk 256 B" in r
    assert "modeled DMA efficiency 50.0 %" in r
