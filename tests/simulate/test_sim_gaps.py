"""Simulator gaps reported by the kernel authors: skipped indirect rows in the HBM counts,
zero-coefficient aranges in index expressions, broadcast destinations in the engine cost.
(The DMA chunk model is in test_dma_model.py, the block-scope rule in test_scope.py.)"""
import ml_dtypes
import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl


# ---------------------------------------------------------------------------------------------
# 1. indirect DMA rows that are skipped (oob_mode.skip) or masked out are not counted
# ---------------------------------------------------------------------------------------------
def test_dma_copy_scatter_with_skip_counts_only_written_rows():
    data = np.arange(4 * 512, dtype=np.float32).reshape(4, 512)
    idx = np.array([[0], [9], [3], [100]], np.int32)        # rows 1 and 3 are out of range

    @nki.jit
    def k(d, ix):
        it = nl.load(ix)
        src = nl.load(d)
        o = nl.ndarray((8, 512), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, nl.zeros((8, 512), nl.float32))
        nisa.dma_copy(dst=o[it[nl.arange(4)[:, None], 0], nl.arange(512)[None, :]], src=src,
                      oob_mode=nisa.oob_mode.skip)
        return o
    with nki.measure() as m:
        o = k(data, idx)
    np.testing.assert_array_equal(o[0], data[0])
    np.testing.assert_array_equal(o[3], data[2])
    assert not o[[1, 2, 4, 5, 6, 7]].any()
    # zero fill (8 rows) + the two rows actually scattered
    assert m.per_tensor["shared_hbm_0"]["written"] == (8 + 2) * 512 * 4
    assert m.kernels[0].dma_chunks == 4 * 1 + 4 * 1 + 8 + 2    # ix, d, fill, 2 rows


def test_dma_copy_hbm_to_hbm_gather_with_skip_counts_read_and_written_rows():
    idx = np.array([[0], [9], [3], [-1]], np.int32)

    @nki.jit
    def k(d, ix):
        it = nl.load(ix)
        o = nl.ndarray((4, 512), nl.bfloat16, buffer=nl.shared_hbm)
        nl.store(o, nl.zeros((4, 512), nl.bfloat16))
        nisa.dma_copy(dst=o, src=d[it[nl.arange(4)[:, None], 0], nl.arange(512)[None, :]],
                      oob_mode=nisa.oob_mode.skip)
        return o
    d = np.arange(8 * 512, dtype=np.float32).reshape(8, 512)
    with nki.measure() as m:
        o = k(d, idx)
    np.testing.assert_array_equal(o[[0, 2]].astype(np.float32),
                                  d[[0, 3]].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert not o[[1, 3]].astype(np.float32).any()
    assert m.per_tensor["d"]["read"] == 2 * 512 * 4               # fp32 source rows
    # bf16 destination: the written bytes use the destination's element size
    assert m.per_tensor["shared_hbm_0"]["written"] == 4 * 512 * 2 + 2 * 512 * 2


def test_masked_out_of_range_index_rows_in_load_and_store():
    ix = np.array([[0], [1], [3], [100]], np.int32)           # row 3 is masked off

    @nki.jit
    def k(d, ixs):
        it = nl.load(ixs)
        ip = nl.arange(4)[:, None]
        jf = nl.arange(512)[None, :]
        t = nl.load(d[it[ip, 0], jf], mask=ip < 3)
        o = nl.ndarray((8, 512), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, nl.zeros((8, 512), nl.float32))
        nl.store(o[it[ip, 0], jf], t, mask=ip < 3)
        return o
    d = np.arange(8 * 512, dtype=np.float32).reshape(8, 512)
    with nki.measure() as m:
        o = k(d, ix)
    np.testing.assert_array_equal(o[[0, 1, 3]], d[[0, 1, 3]])
    assert not o[[2, 4, 5, 6, 7]].any()
    assert m.per_tensor["d"]["read"] == 3 * 512 * 4
    assert m.per_tensor["shared_hbm_0"]["written"] == (8 + 3) * 512 * 4


def test_masked_dma_copy_from_a_statically_out_of_range_source_view():
    a = np.arange(100 * 64, dtype=np.float32).reshape(100, 64)

    @nki.jit
    def k(x):
        ip = nl.arange(128)[:, None]
        jf = nl.arange(64)[None, :]
        t = nl.zeros((128, 64), nl.float32)
        nisa.dma_copy(dst=t, src=x[64 + ip, jf], mask=(64 + ip < 100))   # rows 100.. masked
        o = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, t)
        return o
    with nki.measure() as m:
        o = k(a)
    np.testing.assert_array_equal(o[:36], a[64:])
    assert not o[36:].any()
    assert m.per_tensor["x"]["read"] == 36 * 64 * 4


def test_unmasked_out_of_range_index_still_raises():
    @nki.jit
    def k(d, ixs):
        it = nl.load(ixs)
        ip = nl.arange(4)[:, None]
        return nl.load(d[it[ip, 0], nl.arange(8)[None, :]], mask=ip < 4)
    with pytest.raises(IndexError, match="is out of bounds for axis 0 with size 64"):
        k(np.ones((8, 8), np.float32), np.array([[0], [1], [3], [100]], np.int32))


# ---------------------------------------------------------------------------------------------
# 2. an arange with coefficient 0 keeps its axis
# ---------------------------------------------------------------------------------------------
def test_iota_of_zero_times_arange_keeps_partition_dim():
    shapes = {}

    @nki.jit
    def k(a):
        ip = nl.arange(128)[:, None]
        jf = nl.arange(64)[None, :]
        z = nisa.iota(0 * ip, dtype=nl.int32)
        w = nisa.iota(0 * ip + jf, dtype=nl.float32)
        u = nisa.iota(ip - ip + 3, dtype=nl.int32)
        v = nisa.iota((0 * nl.arange(128))[:, None], dtype=nl.int32)
        shapes.update(z=z.shape, w=w.shape, u=u.shape, v=v.shape)
        o = nl.ndarray((128, 66), nl.float32, buffer=nl.shared_hbm)
        nl.store(o[:, 0:64], w)
        nl.store(o[:, 64:65], z)
        nl.store(o[:, 65:66], u)
        return o
    o = k(np.zeros((1, 1), np.float32))
    assert shapes == {"z": (128, 1), "w": (128, 64), "u": (128, 1), "v": (128, 1)}
    np.testing.assert_array_equal(o[:, :64], np.broadcast_to(np.arange(64), (128, 64)))
    assert not o[:, 64].any() and (o[:, 65] == 3).all()


def test_zero_coefficient_index_broadcasts_a_row_over_partitions():
    a = np.arange(4 * 32, dtype=np.float32).reshape(4, 32)
    shapes = []

    @nki.jit
    def k(x):
        ip = nl.arange(16)[:, None]
        jf = nl.arange(32)[None, :]
        t = nl.load(x[0 * ip + 2, jf])              # row 2 on every partition
        shapes.append(t.shape)
        o = nl.ndarray((16, 32), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, t)
        return o
    with nki.measure() as m:
        o = k(a)
    np.testing.assert_array_equal(o, np.broadcast_to(a[2], (16, 32)))
    assert shapes == [(16, 32)]
    assert m.per_tensor["x"]["read"] == 16 * 32 * 4


# ---------------------------------------------------------------------------------------------
# 3. a result written straight into a larger (broadcast) destination costs what it writes
# ---------------------------------------------------------------------------------------------
def _cycles(body, target="trn1", src_shape=(128, 1), dst_dtype=nl.float32):
    @nki.jit
    def k(a):
        x = nl.load(a)
        dst = nl.ndarray((128, 512), dst_dtype)
        body(x, dst)
        o = nl.ndarray((128, 512), dst_dtype, buffer=nl.shared_hbm)
        nl.store(o, dst)
        return o
    with nki.measure(target=target) as m:
        k(np.ones(src_shape, np.float32))
    return m.engine_cycles


def test_direct_write_into_broadcast_destination_is_charged_by_destination_size():
    def copy(x, dst):
        dst[...] = nl.copy(x)

    def isa_copy(x, dst):
        dst[...] = nisa.tensor_copy(x)

    def exp(x, dst):
        dst[...] = nl.exp(x)

    def act(x, dst):
        dst[...] = nisa.activation(nl.exp, x, scale=2.0)

    def ts(x, dst):
        dst[...] = nisa.tensor_scalar(x, np.multiply, 2.0)

    def recip(x, dst):
        dst[...] = nisa.reciprocal(x)

    def named(x, dst):
        y = nl.copy(x)
        nl.exp(x)                                    # y is no longer the pending result
        dst[...] = y

    assert _cycles(copy) == {"vector": 512}
    assert _cycles(isa_copy) == {"vector": 512}
    assert _cycles(exp) == {"scalar": 512}
    assert _cycles(act) == {"scalar": 512}
    assert _cycles(ts) == {"vector": 512}
    assert _cycles(recip) == {"vector": 8 * 512}
    assert _cycles(named) == {"vector": 64 + 512, "scalar": 64}
    # no broadcast: unchanged
    assert _cycles(copy, src_shape=(128, 512)) == {"vector": 512}


def test_tensor_copy_dynamic_dst_is_charged_by_destination_size():
    @nki.jit
    def k(a):
        x = nl.load(a)
        dst = nl.ndarray((128, 1024), nl.float32)
        nisa.tensor_copy_dynamic_dst(dst=dst, src=x)
        o = nl.ndarray((128, 1024), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, dst)
        return o
    with nki.measure() as m:
        o = k(np.full((128, 1), 3.0, np.float32))
    assert (o == 3.0).all()
    assert m.engine_cycles == {"vector": 1024}
