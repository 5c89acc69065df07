"""nki.isa instructions against NumPy references (spec §9)."""
import ml_dtypes
import numpy as np
import pytest

import simulate as nki
import simulate.language as nl
import simulate.isa as nisa
from conftest import apply_tile_fn


def _psum_out(fn, *arrays, shape, dtype=np.float32, target=None):
    """Run fn(*tiles) -> tile produced in PSUM; copy it out through SBUF."""
    def kernel(*hbm):
        tiles = [nl.load(h) for h in hbm]
        ps = nl.ndarray(shape, dtype=dtype, buffer=nl.psum)
        ps[...] = fn(*tiles)
        out = nl.ndarray(shape, dtype=dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.copy(ps))
        return out
    opts = {} if target is None else {"platform_target": target}
    return nki.jit(kernel, **opts)(*arrays)


@pytest.mark.parametrize("dt", [np.float32, ml_dtypes.bfloat16, np.float16,
                                ml_dtypes.float8_e4m3, ml_dtypes.float8_e5m2])
def test_nc_matmul_dtypes(dt, rng):
    s = rng.standard_normal((128, 96)).astype(dt)
    m = rng.standard_normal((128, 300)).astype(dt)
    got = _psum_out(nisa.nc_matmul, s, m, shape=(96, 300))
    ref = s.astype(np.float64).T @ m.astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_nc_matmul_multi_free_dims(rng):
    s = rng.standard_normal((64, 32)).astype(np.float32)
    m = rng.standard_normal((64, 4, 16)).astype(np.float32)
    got = _psum_out(nisa.nc_matmul, s, m, shape=(32, 4, 16))
    np.testing.assert_allclose(got, np.einsum("km,kab->mab", s, m), rtol=1e-5, atol=1e-5)


def test_nc_matmul_double_row_gen3(rng):
    s = rng.standard_normal((64, 2, 32)).astype(ml_dtypes.float8_e5m2)
    m = rng.standard_normal((64, 2, 128)).astype(ml_dtypes.float8_e5m2)
    got = _psum_out(lambda a, b: nisa.nc_matmul(a, b, perf_mode="double_row_gen3"), s, m,
                    shape=(32, 128), target="trn2")
    ref = np.einsum("krm,krn->mn", s.astype(np.float64), m.astype(np.float64))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(SyntaxError, match="min target trn2"):
        _psum_out(lambda a, b: nisa.nc_matmul(a, b, perf_mode="double_row_gen3"), s, m,
                  shape=(32, 128), target="trn1")


def test_nc_matmul_tile_position_validation(rng):
    s = rng.standard_normal((32, 32)).astype(np.float32)
    m = rng.standard_normal((32, 64)).astype(np.float32)
    got = _psum_out(lambda a, b: nisa.nc_matmul(a, b, tile_position=(32, 0), tile_size=(32, 64)),
                    s, m, shape=(32, 64))
    np.testing.assert_allclose(got, s.T @ m, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiples of 32"):
        _psum_out(lambda a, b: nisa.nc_matmul(a, b, tile_position=(16, 0), tile_size=(32, 32)),
                  s, m, shape=(32, 64))
    with pytest.raises(ValueError, match="cannot be 32 in both"):
        _psum_out(lambda a, b: nisa.nc_matmul(a, b, tile_position=(0, 0), tile_size=(32, 32)),
                  s, m, shape=(32, 64), target="trn1")


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_nc_transpose_tensor_engine(target, rng):
    x = rng.standard_normal((128, 96)).astype(np.float32)
    got = _psum_out(lambda t: nisa.nc_transpose(t, engine=nisa.tensor_engine), x,
                    shape=(96, 128), target=target)
    np.testing.assert_array_equal(got, x.T)


def test_nc_transpose_nan_smears_on_trn1_only():
    x = np.ones((64, 64), np.float32)
    x[3, 5] = np.nan
    f = (lambda t: nisa.nc_transpose(t, engine=nisa.tensor_engine))
    g1 = _psum_out(f, x, shape=(64, 64), target="trn1")
    g2 = _psum_out(f, x, shape=(64, 64), target="trn2")
    assert np.isnan(g1[5]).all()                 # row 5 of x.T is smeared on NeuronCore-v2
    assert np.isnan(g2).sum() == 1 and np.isnan(g2[5, 3])


def test_nc_transpose_vector_engine(rng):
    x = rng.standard_normal((32, 16)).astype(ml_dtypes.bfloat16)
    got = apply_tile_fn(nisa.nc_transpose, x)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, x.T)


def test_nc_transpose_bf16_psum_allowed_on_trn2_only(rng):
    x = rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    f = (lambda t: nisa.nc_matmul(t, t, is_transpose=True))
    with pytest.raises(TypeError, match="PSUM tensor for writes"):
        _psum_out(f, x, shape=(64, 64), dtype=nl.bfloat16, target="trn1")
    _psum_out(f, x, shape=(64, 64), dtype=nl.bfloat16, target="trn2")


def test_activation_scale_bias_and_reduce(rng):
    x = rng.standard_normal((128, 64)).astype(np.float32)
    b = rng.standard_normal((128, 1)).astype(np.float32)
    s = rng.uniform(0.5, 1.5, (128, 1)).astype(np.float32)

    @nki.jit
    def k(xh, bh, sh):
        xt, bt, st = nl.load(xh), nl.load(bh), nl.load(sh)
        red = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        y = nisa.activation(op=nl.exp, data=xt, bias=bt, scale=st, reduce_op=np.add,
                            reduce_res=red, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        y2 = nisa.activation_reduce(op=np.tanh, data=xt, reduce_op=nl.add, reduce_res=red,
                                    scale=2.0)
        o1 = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((128, 1), nl.float32, buffer=nl.shared_hbm)
        o3 = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        nl.store(o1, y)
        nl.store(o2, red)
        nl.store(o3, y2)
        return o1, o2, o3
    y, red, y2 = k(x, b, s)
    ref = np.exp(x * s + b)
    np.testing.assert_allclose(y, ref, rtol=1e-5)
    np.testing.assert_allclose(y2, np.tanh(2 * x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(red[:, 0], np.tanh(2 * x).sum(1), rtol=1e-4, atol=1e-5)


def test_activation_accumulator_commands(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)

    @nki.jit
    def k(xh):
        xt = nl.load(xh)
        red = nl.ndarray((8, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(nl.copy, xt, reduce_op=np.add, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(nl.copy, xt, reduce_op=np.add, reduce_cmd=nisa.reduce_cmd.reduce,
                        reduce_res=red)
        o = nl.ndarray((8, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, red)
        return o
    np.testing.assert_allclose(k(x)[:, 0], 2 * x.sum(1), rtol=1e-5, atol=1e-5)


def test_activation_parameter_errors(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    with pytest.raises(TypeError, match="'scale' param of 'activation' must be a scalar or "
                                        "vector of type float32"):
        apply_tile_fn(lambda t: nisa.activation(nl.exp, t, scale=nl.copy(t[:, 0:1],
                                                                          dtype=nl.bfloat16)), x)
    with pytest.raises(SyntaxError, match="can only be a scalar or a vector in partition"):
        apply_tile_fn(lambda t: nisa.activation(nl.exp, t, scale=t), x)
    with pytest.raises(TypeError, match="'bias' param of 'activation' must be a vector of type"):
        apply_tile_fn(lambda t: nisa.activation(nl.exp, t, bias=nl.copy(t[:, 0:1],
                                                                        dtype=nl.int32)), x)
    with pytest.raises(SyntaxError, match="not supported in 'activation'"):
        apply_tile_fn(lambda t: nisa.activation(nl.maximum, t), x)
    with pytest.raises(SyntaxError, match="reciprocal with a bias"):
        apply_tile_fn(lambda t: nisa.activation(nl.reciprocal, t, bias=nl.copy(t[:, 0:1])), x,
                      target="trn1")
    with pytest.raises(SyntaxError, match="NeuronCore-v2 only supports add"):
        apply_tile_fn(lambda t: nisa.activation_reduce(nl.exp, t, reduce_op=np.max,
                                                       reduce_res=nl.ndarray((8, 1), nl.float32)),
                      x, target="trn1")


@pytest.mark.parametrize("op,ref", [(np.add, np.sum), (np.max, np.max), (nl.minimum, np.min),
                                    (np.multiply, np.prod)])
@pytest.mark.parametrize("negate", [False, True])
def test_tensor_reduce(op, ref, negate, rng):
    x = rng.uniform(0.9, 1.1, (64, 4, 32)).astype(np.float32)
    got = apply_tile_fn(lambda t: nisa.tensor_reduce(op, t, axis=(1, 2), negate=negate), x)
    r = ref(x.astype(np.float64), axis=(1, 2))
    np.testing.assert_allclose(got, -r if negate else r, rtol=1e-5)
    got = apply_tile_fn(lambda t: nisa.tensor_reduce(op, t, axis=-1, keepdims=True), x)
    np.testing.assert_allclose(got, ref(x.astype(np.float64), axis=2, keepdims=True), rtol=1e-5)


def test_tensor_reduce_rules(rng):
    x = rng.uniform(size=(8, 4, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="consecutive free axes ending at the last"):
        apply_tile_fn(lambda t: nisa.tensor_reduce(np.add, t, axis=1), x)
    with pytest.raises(SyntaxError, match="negate option"):
        xi = (x * 10).astype(np.int32)
        apply_tile_fn(lambda t: nisa.tensor_reduce(np.bitwise_or, t, axis=2, negate=True), xi)
    with pytest.raises(SyntaxError, match="requires an integer"):
        apply_tile_fn(lambda t: nisa.tensor_reduce(np.bitwise_or, t, axis=2), x)


def test_tensor_partition_reduce(rng):
    x = rng.standard_normal((128, 32, 4)).astype(np.float32)
    got = apply_tile_fn(lambda t: nisa.tensor_partition_reduce(np.add, t), x)
    np.testing.assert_allclose(got, x.sum(0, keepdims=True), rtol=1e-5, atol=1e-5)
    got = apply_tile_fn(lambda t: nisa.tensor_partition_reduce(np.max, t), x)
    np.testing.assert_array_equal(got, x.max(0, keepdims=True))
    with pytest.raises(SyntaxError, match="par_reduce does not support"):
        apply_tile_fn(lambda t: nisa.tensor_partition_reduce(np.multiply, t), x)


@pytest.mark.parametrize("op,ref", [(np.add, np.add), (np.subtract, np.subtract),
                                    (nl.multiply, np.multiply), (np.maximum, np.maximum),
                                    (nl.divide, np.divide), (nl.power, np.power)])
def test_tensor_tensor(op, ref, rng):
    a = rng.uniform(0.5, 2, (64, 32)).astype(np.float32)
    b = rng.uniform(0.5, 2, (64, 32)).astype(np.float32)
    got = apply_tile_fn(lambda x, y: nisa.tensor_tensor(x, y, op), a, b)
    np.testing.assert_allclose(got, ref(a.astype(np.float64), b), rtol=1e-6)


def test_tensor_tensor_rules_and_int_exact(rng):
    a = np.full((4, 4), 2 ** 24 + 1, np.int32)
    got = apply_tile_fn(lambda x, y: nisa.tensor_tensor(x, y, np.add), a, a)
    np.testing.assert_array_equal(got, a + a)                  # GpSimd int32 add is exact
    f = np.ones((4, 4), np.float32)
    g = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="number of partitions .* mismatch"):
        apply_tile_fn(lambda x, y: nisa.tensor_tensor(x, y, np.add), f, g)
    h = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="mismatched shapes"):
        apply_tile_fn(lambda x, y: nisa.tensor_tensor(x, y, np.add), f, h)


def test_tensor_scalar_forms(rng):
    x = rng.uniform(1, 2, (64, 32)).astype(np.float32)
    v = rng.uniform(1, 2, (64, 1)).astype(np.float32)
    got = apply_tile_fn(lambda t: nisa.tensor_scalar(t, np.subtract, 1.0, reverse0=True), x)
    np.testing.assert_allclose(got, 1 - x, rtol=1e-6)
    got = apply_tile_fn(lambda t, w: nisa.tensor_scalar(t, np.multiply, w, op1=np.add,
                                                        operand1=3.0), x, v)
    np.testing.assert_allclose(got, x * v + 3, rtol=1e-6)
    got = apply_tile_fn(lambda t, w: nisa.tensor_scalar(t, nl.divide, w, op1=np.subtract,
                                                        operand1=2.0, reverse1=True), x, v)
    np.testing.assert_allclose(got, 2 - x / v, rtol=1e-6)
    with pytest.raises(SyntaxError, match="only supports"):
        apply_tile_fn(lambda t: nisa.tensor_scalar(t, np.subtract, 1.0,
                                                   engine=nisa.scalar_engine), x)


def test_scalar_tensor_tensor_and_tensor_scalar_reduce(rng):
    x = rng.uniform(1, 2, (64, 32)).astype(np.float32)
    y = rng.uniform(1, 2, (64, 32)).astype(np.float32)
    got = apply_tile_fn(lambda a, b: nisa.scalar_tensor_tensor(
        data=a, op0=np.subtract, operand0=0.5, op1=np.multiply, operand1=b), x, y)
    np.testing.assert_allclose(got, (x - 0.5) * y, rtol=1e-6)

    @nki.jit
    def k(a):
        t = nl.load(a)
        red = nl.ndarray((64, 1), nl.float32)
        r = nisa.tensor_scalar_reduce(data=t, op0=np.multiply, operand0=2.0, reduce_op=np.max,
                                      reduce_res=red)
        o1 = nl.ndarray((64, 32), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((64, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(o1, r)
        nl.store(o2, red)
        return o1, o2
    r, red = k(x)
    np.testing.assert_allclose(r, 2 * x)
    np.testing.assert_allclose(red[:, 0], (2 * x).max(1))


def test_tensor_tensor_scan(rng):
    a = rng.uniform(0.5, 1, (16, 64)).astype(np.float32)
    b = rng.uniform(0, 1, (16, 64)).astype(np.float32)
    got = apply_tile_fn(lambda x, y: nisa.tensor_tensor_scan(x, y, initial=0.5, op0=np.multiply,
                                                             op1=np.add), a, b)
    ref = np.empty_like(a)
    r = np.full(16, 0.5, np.float32)
    for i in range(64):
        r = (a[:, i] * r + b[:, i]).astype(np.float32)
        ref[:, i] = r
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_tensor_copy_and_engines(rng):
    x = rng.standard_normal((32, 8)).astype(np.float32)
    for eng in (nisa.vector_engine, nisa.scalar_engine, nisa.gpsimd_engine):
        got = apply_tile_fn(lambda t: nisa.tensor_copy(t, engine=eng, dtype=nl.bfloat16), x)
        np.testing.assert_array_equal(got, x.astype(ml_dtypes.bfloat16))
    big = np.full((2, 2), 2 ** 24 + 1, np.int32)
    got = apply_tile_fn(lambda t: nisa.tensor_copy(t, engine=nisa.scalar_engine), big,
                        target="trn1")
    assert got[0, 0] == 2 ** 24                       # v2 ScalarE copies go through fp32
    got = apply_tile_fn(lambda t: nisa.tensor_copy(t, engine=nisa.scalar_engine), big,
                        target="trn2")
    assert got[0, 0] == 2 ** 24 + 1


def test_tensor_copy_dynamic_src_dst(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    off = np.array([[5]], np.int32)

    @nki.jit
    def k(xh, oh):
        src = nl.load(xh)
        offs = nl.load(oh)
        ix, iy = nl.mgrid[0:4, 0:8]
        got = nisa.tensor_copy_dynamic_src(src[ix, offs[0, 0] + iy])
        dst = nl.zeros((4, 64), nl.float32)
        nisa.tensor_copy_dynamic_dst(dst=dst[ix, offs[0, 0] + iy], src=got)
        o1 = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((4, 64), nl.float32, buffer=nl.shared_hbm)
        nl.store(o1, got)
        nl.store(o2, dst)
        return o1, o2
    a, b = k(x, off)
    np.testing.assert_array_equal(a, x[:, 5:13])
    ref = np.zeros_like(x)
    ref[:, 5:13] = x[:, 5:13]
    np.testing.assert_array_equal(b, ref)


def test_tensor_copy_predicated(rng):
    x = rng.standard_normal((16, 8)).astype(np.float32)
    p = (rng.random((16, 8)) > 0.5).astype(np.uint8)

    @nki.jit
    def k(xh, ph):
        src, pred = nl.load(xh), nl.load(ph)
        dst = nl.zeros((16, 8), nl.float32)
        nisa.tensor_copy_predicated(src=src, dst=dst, predicate=pred)
        dst2 = nl.zeros((16, 8), nl.float32)
        nisa.tensor_copy_predicated(src=7.0, dst=dst2, predicate=pred, reverse_pred=True)
        o = nl.ndarray((2, 16, 8), nl.float32, buffer=nl.shared_hbm)
        nl.store(o[0], dst)
        nl.store(o[1], dst2)
        return o
    o = k(x, p)
    np.testing.assert_array_equal(o[0], np.where(p, x, 0))
    np.testing.assert_array_equal(o[1], np.where(p, 0, 7))


def test_reciprocal_iota_memset():
    x = np.array([[2.0, 4.0]], np.float32)
    np.testing.assert_array_equal(apply_tile_fn(nisa.reciprocal, x), 1 / x)

    @nki.jit
    def k():
        i = nisa.iota(nl.arange(128)[:, None] * 4 + nl.arange(512)[None, :], dtype=nl.int32)
        m = nisa.memset((128, 4), 2.5, nl.float32)
        o1 = nl.ndarray((128, 512), nl.int32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((128, 4), nl.float32, buffer=nl.shared_hbm)
        nl.store(o1, i)
        nl.store(o2, m)
        return o1, o2
    i, m = k()
    np.testing.assert_array_equal(i, np.arange(128)[:, None] * 4 + np.arange(512)[None, :])
    np.testing.assert_array_equal(m, 2.5)


def test_affine_select_causal(rng):
    x = rng.standard_normal((128, 128)).astype(np.float32)

    def f(t):
        ix, iy = nl.mgrid[0:128, 0:128]
        return nisa.affine_select(pred=(ix >= iy), on_true_tile=t, on_false_value=nl.fp32.min,
                                  dtype=nl.float32)
    got = apply_tile_fn(f, x)
    np.testing.assert_array_equal(got, np.where(np.tril(np.ones((128, 128), bool)), x,
                                                np.float32(-3.4028235e38)))


def test_range_select_and_select_reduce(rng):
    x = rng.standard_normal((8, 32)).astype(np.float32)
    lo = np.full((8, 1), 4.0, np.float32)
    hi = np.full((8, 1), 10.0, np.float32)

    @nki.jit(platform_target="trn2")
    def k(xh, loh, hih):
        t, b0, b1 = nl.load(xh), nl.load(loh), nl.load(hih)
        red = nl.ndarray((8, 1), nl.float32)
        r = nisa.range_select(on_true_tile=t, comp_op0=np.greater_equal, comp_op1=np.less,
                              bound0=b0, bound1=b1, reduce_cmd=nisa.reduce_cmd.reset_reduce,
                              reduce_res=red)
        o1 = nl.ndarray((8, 32), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((8, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(o1, r)
        nl.store(o2, red)
        return o1, o2
    r, red = k(x, lo, hi)
    j = np.arange(32)
    keep = (j >= 4) & (j < 10)
    np.testing.assert_array_equal(r, np.where(keep, x, np.float32(-3.4028235e38)))
    np.testing.assert_array_equal(red[:, 0], x[:, 4:10].max(1))
    with pytest.raises(SyntaxError, match="requires min target trn2"):
        nki.jit(k.func, platform_target="trn1")(x, lo, hi)

    p = (rng.random((8, 32)) > 0.5).astype(np.uint8)

    @nki.jit
    def k2(xh, ph):
        t, pred = nl.load(xh), nl.load(ph)
        dst = nl.ndarray((8, 32), nl.float32)
        red = nl.ndarray((8, 1), nl.float32)
        nisa.select_reduce(dst=dst, predicate=pred, on_true=t, on_false=-1.0, reduce_res=red,
                           reduce_cmd=nisa.reduce_cmd.reset_reduce)
        o1 = nl.ndarray((8, 32), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((8, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(o1, dst)
        nl.store(o2, red)
        return o1, o2
    d, red = k2(x, p)
    ref = np.where(p, x, -1)
    np.testing.assert_array_equal(d, ref)
    np.testing.assert_array_equal(red[:, 0], ref.max(1))


def test_bn_stats_bn_aggr(rng):
    x = rng.standard_normal((128, 1000)).astype(np.float32)

    def f(t):
        s0 = nisa.bn_stats(t[:, 0:500])
        s1 = nisa.bn_stats(t[:, 500:1000])
        stats = nl.ndarray((128, 12), nl.float32)
        stats[:, 0:6] = s0
        stats[:, 6:12] = s1
        return nisa.bn_aggr(stats)
    got = apply_tile_fn(f, x)
    np.testing.assert_allclose(got[:, 0], x.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[:, 1], x.var(1), rtol=1e-5)
    st = apply_tile_fn(nisa.bn_stats, x[:, :7])
    np.testing.assert_allclose(st[0], [4, x[0, 0:7:2].mean(), x[0, 0:7:2].var() * 4,
                                       3, x[0, 1:7:2].mean(), x[0, 1:7:2].var() * 3], rtol=1e-5)
    with pytest.raises(ValueError, match="exceed architecture limitation of 512"):
        apply_tile_fn(nisa.bn_stats, x)


def test_max8_find_index8_match_replace8(rng):
    x = rng.permutation(128 * 64).reshape(128, 64).astype(np.float32)

    @nki.jit
    def k(xh):
        t = nl.load(xh)
        top = nisa.max8(src=t)
        idx = nisa.nc_find_index8(data=t, vals=top)
        di = nl.ndarray((128, 8), nl.uint32)
        rep = nisa.nc_match_replace8(data=t, vals=top, imm=-1.0, dst_idx=di)
        o1 = nl.ndarray((128, 8), nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((128, 8), nl.uint32, buffer=nl.shared_hbm)
        o3 = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        o4 = nl.ndarray((128, 8), nl.uint32, buffer=nl.shared_hbm)
        nl.store(o1, top)
        nl.store(o2, idx)
        nl.store(o3, rep)
        nl.store(o4, di)
        return o1, o2, o3, o4
    top, idx, rep, di = k(x)
    order = np.argsort(-x, axis=1)[:, :8]
    np.testing.assert_array_equal(top, np.take_along_axis(x, order, 1))
    np.testing.assert_array_equal(idx, order)
    np.testing.assert_array_equal(di, order)
    ref = x.copy()
    np.put_along_axis(ref, order, -1.0, 1)
    np.testing.assert_array_equal(rep, ref)


def test_nc_stream_shuffle(rng):
    x = rng.standard_normal((64, 4)).astype(np.float32)
    mask = [(i + 1) % 32 for i in range(31)] + [255]

    @nki.jit
    def k(xh):
        t = nl.load(xh)
        dst = nl.zeros((64, 4), nl.float32)
        nisa.nc_stream_shuffle(src=t, dst=dst, shuffle_mask=mask)
        o = nl.ndarray((64, 4), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, dst)
        return o
    got = k(x)
    ref = np.zeros_like(x)
    for p in range(64):
        q, i = divmod(p, 32)
        if mask[i] != 255:
            ref[p] = x[q * 32 + mask[i]]
    np.testing.assert_array_equal(got, ref)


def test_local_gather(rng):
    src = rng.standard_normal((32, 64)).astype(np.float32)
    idx = rng.integers(0, 60, (32, 2)).astype(np.uint16)

    def f(s, i):
        return nisa.local_gather(s, i, num_elem_per_idx=2)
    got = apply_tile_fn(f, src, idx)
    for g in range(2):
        flat = idx[g * 16:(g + 1) * 16].T.reshape(-1).astype(int)
        cols = (flat[:, None] + np.arange(2)).reshape(-1)
        np.testing.assert_array_equal(got[g * 16:(g + 1) * 16], src[g * 16:(g + 1) * 16][:, cols])


def test_sequence_bounds():
    seg = np.array([[1, 1, 2, 2, 2, 0, 3]], np.float32)
    got = apply_tile_fn(lambda s: nisa.sequence_bounds(segment_ids=s), seg)
    np.testing.assert_array_equal(got[0, 0], [0, 0, 2, 2, 2, 7, 6])
    np.testing.assert_array_equal(got[0, 1], [2, 2, 5, 5, 5, -1, 7])


def test_isa_dropout(rng):
    x = np.ones((32, 64), np.float32)
    got = apply_tile_fn(lambda t: nisa.dropout(t, 0.0), x)
    np.testing.assert_array_equal(got, x)
    got = apply_tile_fn(lambda t: nisa.dropout(t, 1.0), x)
    np.testing.assert_array_equal(got, 0)


def test_get_nc_version_per_target():
    seen = {}

    def kern(a):
        seen["v"] = nisa.get_nc_version()
        o = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(o, nl.load(a))
        return o
    a = np.ones((2, 2), np.float32)
    nki.jit(kern, platform_target="trn1")(a)
    assert seen["v"] == nisa.nc_version.gen2
    nki.jit(kern, platform_target="trn2")(a)
    assert seen["v"] == nisa.nc_version.gen3 and seen["v"] >= nisa.nc_version.gen3


def test_inplace_instructions_honour_array_masks(rng):
    x = rng.standard_normal((64, 4)).astype(np.float32)

    @nki.jit
    def k(xh):
        t = nl.load(xh)
        dst = nl.zeros((64, 4), nl.float32)
        ip = nl.arange(64)[:, None]
        nisa.nc_stream_shuffle(src=t, dst=dst, shuffle_mask=list(range(32)), mask=(ip < 40))
        o = nl.ndarray((64, 4), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, dst)
        return o
    got = k(x)
    np.testing.assert_array_equal(got[:40], x[:40])
    np.testing.assert_array_equal(got[40:], 0)
