"""simulate.measure(): exact IO counts, instruction costs, peaks, modeled time."""
import ml_dtypes
import numpy as np
import pytest

import simulate as nki
import simulate.language as nl
import simulate.isa as nisa
from simulate import _hw
from conftest import tiled_add, tiled_matmul


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_tiled_add_exact_io_and_costs(target):
    a = np.ones((512, 2048), np.float32)
    with nki.measure(target=target) as m:
        tiled_add(a, a)
    tgt = _hw.get_target(target)
    assert m.hbm_bytes_read == 8388608 and m.hbm_bytes_written == 4194304
    assert m.per_tensor == {"a": {"read": 4194304, "written": 0},
                            "b": {"read": 4194304, "written": 0},
                            "shared_hbm_0": {"read": 0, "written": 4194304}}
    assert m.dma_transfers == 48 and m.instructions == {"dma": 48, "vector": 16}
    assert m.dma_bytes_per_partition == [2048] * 48            # 512 fp32 contiguous per row
    # tensor_tensor fp32 SBUF+SBUF: 2N cycles, N = 512
    assert m.engine_cycles == {"vector": 16 * 1024}
    # each DMA: 128 partitions x one 2 KiB chunk, 256 B of overhead per chunk
    assert m.kernels[0].dma_chunks == 48 * 128
    dma_s = (12582912 + 48 * 128 * 256) / tgt.dma_bytes_per_s + 48 * 81.25e-9
    assert m.engine_seconds["dma"] == pytest.approx(dma_s, rel=1e-12)
    assert m.engine_seconds["vector"] == pytest.approx(16 * 1024 / tgt.clock_hz["vector"])
    lo, hi = m.modeled_seconds
    assert lo == pytest.approx(max(m.engine_seconds.values()))
    assert hi == pytest.approx(sum(m.engine_seconds.values()))
    assert m.peak_sbuf_bytes_per_partition == 3 * 2048       # x, y and x + y
    assert m.peak_psum_bytes_per_partition == 0
    assert "modeled time" in m.report() and "NOT hardware" in m.report()


def test_measurement_is_deterministic():
    a = np.ones((256, 1024), np.float32)
    res = []
    for _ in range(2):
        with nki.measure() as m:
            tiled_add(a, a)
        res.append((m.hbm_bytes_read, m.engine_cycles, m.modeled_seconds, m.dma_bytes_per_partition))
    assert res[0] == res[1]


@pytest.mark.parametrize("dt,factor", [(ml_dtypes.bfloat16, 1), (np.float32, 4)])
def test_matmul_pe_cycles(dt, factor):
    a = np.ones((512, 256), dt)
    b = np.ones((512, 1024), dt)
    with nki.measure(target="trn2") as m:
        tiled_matmul(a, b)
    n_mm = 4 * 2 * 2
    assert m.instructions["tensor"] == n_mm
    assert m.engine_cycles["tensor"] == n_mm * 512 * factor
    isz = np.dtype(dt).itemsize
    assert m.hbm_bytes_read == (2 * 512 * 256 + 2 * 512 * 1024) * isz
    assert m.per_tensor["lhsT"]["read"] == 2 * 512 * 256 * isz      # re-read per n tile
    assert m.per_tensor["rhs"]["read"] == 2 * 512 * 1024 * isz      # re-read per m tile
    assert m.hbm_bytes_written == 256 * 1024 * 4
    assert m.peak_psum_bytes_per_partition == 2048
    # zeros (memset) + copy per output tile on VectorE: max(64, 512) and fp32 PSUM->SBUF copy
    assert m.instructions["vector"] == 2 * 4


def test_small_free_size_hits_min_ii_and_activation_cost():
    @nki.jit
    def k(a):
        t = nl.load(a)
        e1 = nl.exp(t)                                    # ScalarE max(64, N)
        e2 = nisa.activation(nl.exp, t[:, 0:8])
        r = nisa.reciprocal(t)                            # VectorE 8N
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(out, e1)
        return out
    with nki.measure(target="trn1") as m:
        k(np.ones((128, 512), np.float32))
    assert m.engine_cycles["scalar"] == 512 + 64
    assert m.engine_cycles["vector"] == 8 * 512
    assert m.engine_seconds["scalar"] == pytest.approx(576 / 1.4e9)


def test_trn2_vector_perf_mode_for_bf16_copies():
    @nki.jit
    def k(a):
        t = nl.load(a)
        c = nisa.tensor_copy(t)                           # bf16 SBUF->SBUF
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(out, c)
        return out
    a = np.ones((128, 2048), ml_dtypes.bfloat16)
    with nki.measure(target="trn2") as m2:
        k(a)
    with nki.measure(target="trn1") as m1:
        k(a)
    assert m2.engine_cycles["vector"] == 512 and m1.engine_cycles["vector"] == 2048


def test_masked_elements_not_counted():
    @nki.jit
    def k(a):
        o = nl.ndarray((100, 64), nl.float32, buffer=nl.shared_hbm)
        ip = nl.arange(128)[:, None]
        jf = nl.arange(64)[None, :]
        t = nl.load(a[ip, jf], mask=(ip < 100))
        nl.store(o[ip, jf], t, mask=(ip < 100) & (jf < 32))
        return o
    with nki.measure() as m:
        k(np.ones((100, 64), np.float32))
    assert m.hbm_bytes_read == 100 * 64 * 4
    assert m.hbm_bytes_written == 100 * 32 * 4


def test_transposing_dma_is_slower_on_trn1_and_strided():
    @nki.jit
    def k(a):
        t = nl.load_transpose2d(a)
        out = nl.ndarray((128, 512), a.dtype, buffer=nl.shared_hbm)
        nl.store(out, t)
        return out
    a = np.ones((512, 128), ml_dtypes.bfloat16)
    with nki.measure(target="trn1") as m1:
        k(a)
    with nki.measure(target="trn2") as m2:
        k(a)
    assert m1.dma_bytes_per_partition[0] == 2                # element-granular descriptors
    nbytes = 512 * 128 * 2
    # the transpose is modeled by its rate alone; the store moves 128 chunks of 1 KiB
    t1 = (nbytes / (272e9 * _hw.TRN1.load_transpose_rate) + (nbytes + 128 * 256) / 272e9
          + 2 * 81.25e-9)
    assert m1.engine_seconds["dma"] == pytest.approx(t1)
    assert m2.engine_seconds["dma"] < m1.engine_seconds["dma"]


def test_grid_launch_records_all_instances_and_kernels_list():
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        i = nl.program_id(0)
        nl.store(out[i * 64:(i + 1) * 64, :], nl.load(a[i * 64:(i + 1) * 64, :]))
        return out
    a = np.ones((256, 32), np.float32)
    with nki.measure() as m:
        k[4](a)
        k[2](a[:128])
    assert len(m.kernels) == 2 and m.kernels[0].grid == (4,)
    assert m.kernels[0].hbm_bytes_read == 256 * 32 * 4
    assert m.hbm_bytes_read == (256 + 128) * 32 * 4
    lo = sum(r.modeled_seconds[0] for r in m.kernels)
    assert m.modeled_seconds[0] == pytest.approx(lo)


def test_peak_sbuf_tracks_liveness():
    @nki.jit
    def k(a):
        keep = nl.ndarray((4, nl.par_dim(128), 1000), dtype=a.dtype)   # live throughout
        for i in nl.affine_range(4):
            keep[i] = nl.load(a)
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        for i in nl.affine_range(4):
            t = nl.load(a)                  # a loop body is a block scope: one t at a time
            keep[i] = nl.add(keep[i], t)
        nl.store(out, keep[0])
        return out
    with nki.measure() as m:
        o = k(np.ones((128, 1000), np.float32))
    np.testing.assert_array_equal(o, 2.0)
    assert m.peak_sbuf_bytes_per_partition == 4 * 4000 + 4000


def test_a_loop_body_tile_is_dead_after_its_iteration():
    @nki.jit
    def k(a):
        keep = []
        for i in nl.affine_range(2):
            keep.append(nl.load(a))        # Python keeps it; NKI's block scope does not
        nl.add(keep[0], 1.0)
    with pytest.raises(nki.NKISyntaxError, match="used after that iteration ended"):
        k(np.ones((128, 8), np.float32))


def test_psum_accumulation_of_nl_matmul_is_free_and_sbuf_copy_charged():
    @nki.jit
    def k(a):
        t = nl.load(a)
        ps = nl.zeros((128, 128), nl.float32, buffer=nl.psum)
        ps += nl.matmul(t, t, transpose_x=True)
        sb = nl.ndarray((128, 128), nl.float32)
        sb[...] = nl.matmul(t, t, transpose_x=True)
        out = nl.ndarray((128, 128), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, sb)
        return out
    with nki.measure(target="trn2") as m:
        k(np.ones((128, 128), ml_dtypes.bfloat16))
    assert m.instructions["tensor"] == 2
    # memset of the PSUM tile + one PSUM->SBUF evacuation; no VectorE add for the +=
    assert m.instructions["vector"] == 2


def test_dma_contiguity_of_masked_and_strided_accesses():
    @nki.jit
    def k(a):
        ip = nl.arange(128)[:, None]
        jf = nl.arange(256)[None, :]
        t = nl.load(a[128 + ip, jf], mask=(128 + ip < 200))     # OOB -> advanced view
        u = nl.load(a[ip, 2 * jf])                               # strided columns
        w = nl.load(a[0:128, 0:256])
        out = nl.ndarray((128, 256), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.add(nl.add(t, u), w))
        return out
    with nki.measure() as m:
        k(np.ones((200, 512), np.float32))
    assert m.dma_bytes_per_partition == [1024, 4, 1024, 1024]
    assert m.hbm_bytes_read == (72 + 128 + 128) * 256 * 4


def test_nc_grid_cores_run_in_parallel():
    """An nl.nc(2) grid dimension (trn2 LNC=2) puts its instances on two physical cores that
    run in parallel: the modeled time is that of the busier core, the totals add up."""
    @nki.jit(platform_target="trn2")
    def k(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        i = nl.program_id(0)
        x = nl.load(a[i:i + 1, :])
        y = nisa.activation(nl.exp, x)
        nl.store(out[i:i + 1, :], y)
        return out

    a = np.zeros((4, 512), np.float32)
    runs = {}
    for name, grid in (("serial", 4), ("nc", nl.nc(2) * 2), ("spmd", nl.spmd_dim(2, nl.nc(2)))):
        with nki.measure(target="trn2") as m:
            np.testing.assert_array_equal(k[grid](a), 1.0)
        runs[name] = m
    serial, nc, spmd = runs["serial"], runs["nc"], runs["spmd"]
    assert serial.kernels[0].cores == 1 and nc.kernels[0].cores == 2 == spmd.kernels[0].cores
    assert nc.engine_cycles == serial.engine_cycles == spmd.engine_cycles
    for m in (nc, spmd):
        lo, hi = m.modeled_seconds
        assert lo == pytest.approx(serial.modeled_seconds[0] / 2, rel=1e-9)
        assert hi == pytest.approx(serial.modeled_seconds[1] / 2, rel=1e-9)
