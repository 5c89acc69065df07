"""Indexing (spec §4), masks (spec §5), data movement (spec §7)."""
import ml_dtypes
import numpy as np
import pytest

import simulate as nki
import simulate.language as nl
import simulate.isa as nisa


def _copy_kernel(index_fn, out_shape, mask_fn=None, dtype=np.float32):
    @nki.jit
    def k(a):
        out = nl.ndarray(out_shape, dtype=dtype, buffer=nl.shared_hbm)
        idx = index_fn()
        m = mask_fn() if mask_fn else None
        t = nl.load(a[idx], mask=m)
        nl.store(out, t, mask=m)
        return out
    return k


def test_basic_indexing_forms(rng):
    a = rng.standard_normal((4, 128, 64)).astype(np.float32)

    @nki.jit
    def k(x):
        out = nl.ndarray((5, 128, 32), nl.float32, buffer=nl.shared_hbm)
        nl.store(out[0], nl.load(x[1, :, 0:32]))
        nl.store(out[1], nl.load(x[2, :, nl.ds(32, 32)]))
        nl.store(out[2, :, :], nl.load(x[3][:, 32:]))
        nl.store(out[3], nl.load(x[-1, :, ::2]))
        nl.store(out[4, ...], nl.load(x[0, ..., 1:64:2]))
        return out
    o = k(a)
    np.testing.assert_array_equal(o[0], a[1, :, 0:32])
    np.testing.assert_array_equal(o[1], a[2, :, 32:64])
    np.testing.assert_array_equal(o[2], a[3, :, 32:])
    np.testing.assert_array_equal(o[3], a[-1, :, ::2])
    np.testing.assert_array_equal(o[4], a[0, :, 1::2])


def test_advanced_indexing_arange_mgrid_affine(rng):
    a = rng.standard_normal((256, 512)).astype(np.float32)

    @nki.jit
    def k(x):
        out = nl.ndarray((4, 128, 256), nl.float32, buffer=nl.shared_hbm)
        ip = nl.arange(128)[:, None]
        jf = nl.arange(256)[None, :]
        nl.store(out[0], nl.load(x[ip + 128, jf * 2]))            # strided, via views
        i, j = nl.mgrid[0:128, 0:256]
        nl.store(out[1], nl.load(x[i, j + 256]))
        g = nl.mgrid[0:128, 0:256]
        nl.store(out[2][g.p, g.x], nl.load(x[g]))
        nl.store(out[3], nl.load(x[ip, 2 * (255 - jf)]))         # negative stride
        return out
    o = k(a)
    np.testing.assert_array_equal(o[0], a[128:, 0:512:2])
    np.testing.assert_array_equal(o[1], a[:128, 256:])
    np.testing.assert_array_equal(o[2], a[:128, :256])
    np.testing.assert_array_equal(o[3], a[:128, 510::-2])


def test_advanced_index_fast_path_is_a_view():
    seen = {}

    @nki.jit
    def k(x):
        ip = nl.arange(128)[:, None]
        jf = nl.arange(64)[None, :]
        v1 = x[ip, 2 * jf + 1]
        v2 = x[jf, ip]                                   # transposed access
        v3 = x[ip + jf, 0]                               # overlapping windows: fancy
        seen.update(v1=v1._v is not None, v2=v2._v is not None, v3=v3._v is None,
                    s2=v2.shape, s3=v3.shape)
        o = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, nl.load(v2))
        return o
    a = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    o = k(a)
    assert seen == dict(v1=True, v2=True, v3=True, s2=(128, 64), s3=(128, 64))
    np.testing.assert_array_equal(o, a[:64, :128].T)


def test_diagonal_window_gather(rng):
    a = rng.standard_normal((256, 4)).astype(np.float32)

    @nki.jit
    def k(x):
        ip = nl.arange(128)[:, None]
        jf = nl.arange(64)[None, :]
        o = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, nl.load(x[ip + jf, 1]))
        return o
    o = k(a)
    np.testing.assert_array_equal(o, a[np.arange(128)[:, None] + np.arange(64)[None, :], 1])


def test_index_on_mixed_int_and_arange():
    a = np.arange(8 * 512, dtype=np.float32).reshape(8, 512)

    @nki.jit
    def k(x):
        o = nl.ndarray((1, 512), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x[3, nl.arange(512)[None, :]])
        assert t.shape == (1, 512)
        nl.store(o, t)
        return o
    np.testing.assert_array_equal(k(a), a[3:4])


def test_mixing_basic_and_advanced_rejected():
    @nki.jit
    def k(x):
        t = nl.load(x[nl.arange(4)[:, None], 0:4])
        o = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, t)
        return o
    with pytest.raises(SyntaxError, match="Mixing basic tensor indexing and advanced tensor "
                                          "indexing is not supported.") as e:
        k(np.ones((4, 4), np.float32))
    assert "err-unsupported-mixing-basic-advanced-tensor-indexing" in str(e.value)


def test_1d_arange_rejected():
    @nki.jit
    def k(x):
        return nl.load(x[nl.arange(4)])
    with pytest.raises(SyntaxError, match="indexing tensor `x` with 1d arange is not supported"):
        k(np.ones((4, 4), np.float32))


def test_static_out_of_bound_message():
    @nki.jit
    def k(x):
        o = nl.ndarray((128, 4096), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, nl.load(x[nl.arange(128)[:, None], nl.arange(4096)[None, :]]))
        return o
    with pytest.raises(IndexError, match=r"Out-of-bound access for tensor `x` on dimension 1: "
                                         r"index range \[0, 4095\] exceed dimension size of 4000"):
        k(np.ones((128, 4000), np.float32))

    @nki.jit
    def k2(x):
        return nl.load(x[0:100, 2:8])
    with pytest.raises(IndexError, match=r"dimension 1: index range \[2, 7\] exceed dimension "
                                         r"size of 4"):
        k2(np.ones((128, 4), np.float32))


@pytest.mark.parametrize("n", [1, 17, 127, 128, 129, 1000])
def test_masked_partial_tile_load_store(n, rng):
    a = rng.standard_normal((n, 64)).astype(np.float32)

    @nki.jit
    def k(x):
        N = x.shape[0]
        o = nl.ndarray((N, 64), nl.float32, buffer=nl.shared_hbm)
        for i in nl.affine_range((N + 127) // 128):
            ip = nl.arange(128)[:, None]
            jf = nl.arange(64)[None, :]
            m = (i * 128 + ip < N)
            t = nl.load(x[i * 128 + ip, jf], mask=m)
            nl.store(o[i * 128 + ip, jf], nl.exp(t, mask=m), mask=m)
        return o
    with nki.measure() as meas:
        got = k(a)
    np.testing.assert_allclose(got, np.exp(a), rtol=1e-6)
    assert meas.hbm_bytes_read == n * 64 * 4 and meas.hbm_bytes_written == n * 64 * 4


def test_mask_keeps_destination_elements():
    a = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)

    @nki.jit
    def k(x):
        t = nl.load(x)
        ip = nl.arange(8)[:, None]
        jf = nl.arange(8)[None, :]
        dst = nl.zeros((8, 8), nl.float32)
        dst[ip, jf] = nl.multiply(t, 2.0, mask=(jf < 3) & (ip >= 2))
        o = nl.ndarray((8, 8), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, dst)
        return o
    ref = np.zeros((8, 8), np.float32)
    ref[2:, :3] = 2 * a[2:, :3]
    np.testing.assert_array_equal(k(a), ref)


def test_mask_loop_only_predicate_enables_whole_instruction():
    a = np.ones((4, 4), np.float32)

    @nki.jit
    def k(x):
        o = nl.ndarray((3, 4, 4), nl.float32, buffer=nl.shared_hbm)
        for i in nl.affine_range(3):
            t = nl.zeros((4, 4), nl.float32)
            t[...] = nl.add(nl.load(x), 1.0, mask=(i > 0) & (i < 2))
            nl.store(o[i], t)
        return o
    o = k(a)
    np.testing.assert_array_equal(o[0], 0)
    np.testing.assert_array_equal(o[1], 2)
    np.testing.assert_array_equal(o[2], 0)


def test_mask_errors():
    a = np.ones((4, 4), np.float32)

    @nki.jit
    def k(x):
        i = nl.arange(4)[:, None]
        return nl.load(x, mask=(i != 2))
    with pytest.raises(SyntaxError, match="'not equal' mask is not supported"):
        k(a)

    @nki.jit
    def k2(x):
        i = nl.arange(4)[:, None]
        if i < 2:
            pass
    with pytest.raises(SyntaxError, match="Control-flow depending on `nl.arange`"):
        k2(a)

    @nki.jit
    def k3(x):
        t = nl.load(x)
        if t:
            pass
    with pytest.raises(SyntaxError, match="dynamic control-flow depending on tensor value"):
        k3(a)

    @nki.jit
    def k4(x):
        i = nl.arange(4)[:, None]
        return nl.load(x, mask=(i % 2 < 1))
    with pytest.raises(ValueError, match="affine"):
        k4(a)


def test_masked_out_of_bound_still_checked_for_unmasked():
    @nki.jit
    def k(x):
        ip = nl.arange(128)[:, None]
        return nl.load(x[ip + 64, nl.arange(1)[None, :]], mask=(ip < 100))
    with pytest.raises(IndexError, match=r"index range \[64, 163\] exceed dimension size of 128"):
        k(np.ones((128, 1), np.float32))


def test_indirect_gather_and_scatter(rng):
    data = rng.standard_normal((64, 32)).astype(np.float32)
    idx = rng.permutation(64)[:16].astype(np.int32).reshape(16, 1)

    @nki.jit
    def k(d, ix):
        it = nl.load(ix)
        ip = nl.arange(16)[:, None]
        jf = nl.arange(32)[None, :]
        g = nl.load(d[it[ip, 0], jf])
        o = nl.ndarray((16, 32), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, g)
        s = nl.ndarray((64, 32), nl.float32, buffer=nl.shared_hbm)
        nl.store(s[nl.arange(64)[:, None], jf], nl.zeros((64, 32), nl.float32))
        nl.store(s[it, jf], g)
        return o, s
    o, s = k(data, idx)
    np.testing.assert_array_equal(o, data[idx[:, 0]])
    ref = np.zeros_like(data)
    ref[idx[:, 0]] = data[idx[:, 0]]
    np.testing.assert_array_equal(s, ref)


def test_indirect_dma_copy_oob_error_and_skip():
    data = np.arange(128 * 512, dtype=np.float32).reshape(128, 512)
    idx = np.array([[0], [129], [5]], np.int32)

    def make(mode):
        @nki.jit
        def k(d, ix):
            it = nl.load(ix)
            dst = nl.zeros((3, 512), nl.float32)
            nisa.dma_copy(dst=dst, src=d[it[nl.arange(3)[:, None], 0], nl.arange(512)[None, :]],
                          oob_mode=mode)
            o = nl.ndarray((3, 512), nl.float32, buffer=nl.shared_hbm)
            nl.store(o, dst)
            return o
        return k
    with pytest.raises(IndexError, match=r"^index 66048 is out of bounds for axis 0 with size "
                                         r"65536$"):
        make(nisa.oob_mode.error)(data, idx)
    o = make(nisa.oob_mode.skip)(data, idx)
    np.testing.assert_array_equal(o[0], data[0])
    np.testing.assert_array_equal(o[1], 0)
    np.testing.assert_array_equal(o[2], data[5])


def test_indirect_index_rules():
    @nki.jit
    def k(d, ix):
        it = nl.load(ix)
        return nl.load(d[nl.arange(4)[:, None], it[0:1, 0:4]])
    with pytest.raises(SyntaxError, match="Indirect indexing on free dimension not supported"):
        k(np.ones((4, 8), np.float32), np.zeros((1, 4), np.int32))

    @nki.jit
    def k2(d, ix):
        it = nl.load(ix)
        return nl.load_transpose2d(d[it, nl.arange(4)[None, :]])
    with pytest.raises(SyntaxError, match="cannot use indirect indexing"):
        k2(np.ones((4, 4), np.float32), np.zeros((4, 1), np.int32))


def test_atomic_rmw_accumulates_duplicates():
    data = np.zeros((8, 4), np.float32)
    idx = np.array([[1], [1], [3]], np.int32)
    val = np.ones((3, 4), np.float32)

    @nki.jit
    def k(d: nki.typing.mutable_tensor, ix, v):
        it = nl.load(ix)
        nl.atomic_rmw(d[it, nl.arange(4)[None, :]], value=nl.load(v), op=np.add)
        return d
    o = k(data, idx, val)
    ref = np.zeros((8, 4), np.float32)
    ref[1] = 2
    ref[3] = 1
    np.testing.assert_array_equal(o, ref)


def test_load_dtype_cast_and_1d_source(rng):
    a = rng.standard_normal(100).astype(np.float32)

    @nki.jit
    def k(x):
        t = nl.load(x[0:100], dtype=nl.bfloat16)
        assert t.shape == (100, 1) and t.dtype == nl.bfloat16
        o = nl.ndarray((100,), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, t)
        return o
    np.testing.assert_array_equal(k(a), a.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_load_transpose2d_and_dma_transpose(rng):
    a = rng.standard_normal((2048, 128)).astype(np.float32)
    b = rng.standard_normal((4, 8, 16)).astype(np.float32)

    @nki.jit
    def k(x, y):
        t = nl.load_transpose2d(x)
        u = nisa.dma_transpose(y)
        o1 = nl.ndarray((128, 2048), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((16, 8, 4), nl.float32, buffer=nl.shared_hbm)
        nl.store(o1, t)
        nl.store(o2, u)
        return o1, o2
    o1, o2 = k(a, b)
    np.testing.assert_array_equal(o1, a.T)
    np.testing.assert_array_equal(o2, b.transpose(2, 1, 0))


def test_dma_copy_sbuf_hbm_and_rmw(rng):
    a = rng.standard_normal((16, 32)).astype(np.float32)

    @nki.jit
    def k(x):
        t = nl.ndarray((16, 32), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        o = nl.ndarray((16, 32), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        nisa.dma_copy(dst=o, src=t, dst_rmw_op=np.add)
        return o
    np.testing.assert_allclose(k(a), 2 * a)


def test_store_scalar_and_broadcast_value():
    @nki.jit
    def k(x):
        o = nl.ndarray((8, 16), nl.float32, buffer=nl.shared_hbm)
        nl.store(o[0:4, :], 1.5)
        nl.store(o[4:8, :], nl.load(x))             # (4, 1) broadcast along the free dim
        return o
    o = k(np.arange(4, dtype=np.float32).reshape(4, 1))
    np.testing.assert_array_equal(o[:4], 1.5)
    np.testing.assert_array_equal(o[4:], np.broadcast_to(np.arange(4)[:, None], (4, 16)))


def test_store_dst_smaller_than_value():
    @nki.jit
    def k(x):
        o = nl.ndarray((128, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, nl.load(x))
        return o
    with pytest.raises(ValueError, match=r"Illegal assignment destination shape in 'a = b': "
                                         r"shape \[128, 1\] of parameter 'a' is smaller"):
        k(np.ones((128, 512), np.float32))


def test_index_tensor_item_assignment_rejected():
    @nki.jit
    def k(x):
        i = nl.arange(4)[:, None]
        i[0] = 1
    with pytest.raises(TypeError, match="'index' tensor does not support item assignment"):
        k(np.ones((4, 4), np.float32))


def test_block_dimension_tensors(rng):
    a = rng.standard_normal((4, 128, 64)).astype(np.float32)

    @nki.jit
    def k(x):
        buf = nl.ndarray((4, nl.par_dim(128), 64), nl.float32, buffer=nl.sbuf)
        for i in nl.affine_range(4):
            buf[i] = nl.load(x[i])
        ps = nl.zeros((2, nl.par_dim(128), 64), nl.float32, buffer=nl.psum)
        for i in nl.affine_range(4):
            ps[i % 2] += buf[i, :, :]
        o = nl.ndarray((2, 128, 64), nl.float32, buffer=nl.shared_hbm)
        for j in nl.affine_range(2):
            nl.store(o[j], ps[j])
        return o
    o = k(a)
    np.testing.assert_allclose(o[0], a[0] + a[2], rtol=1e-6)
    np.testing.assert_allclose(o[1], a[1] + a[3], rtol=1e-6)


def test_block_tensor_view_is_not_a_tile():
    @nki.jit
    def k(x):
        buf = nl.zeros((4, nl.par_dim(128), 64), nl.float32)
        return nl.exp(buf[0:2])
    with pytest.raises(TypeError, match="Failed to infer tile from tensor"):
        k(np.ones((1, 1), np.float32))


def test_free_dim_permutation_via_copy(rng):
    a = rng.standard_normal((16, 4, 8)).astype(np.float32)

    @nki.jit
    def k(x):
        t = nl.load(x)
        p = nl.arange(16)[:, None, None]
        i = nl.arange(8)[None, :, None]
        j = nl.arange(4)[None, None, :]
        u = nl.ndarray((16, 8, 4), nl.float32)
        u[p, i, j] = nl.copy(t[p, j, i])
        o = nl.ndarray((16, 8, 4), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, u)
        return o
    np.testing.assert_array_equal(k(a), a.transpose(0, 2, 1))
