"""nki.language semantics against NumPy (spec §7-§8, §11)."""
import math

import ml_dtypes
import numpy as np
import pytest

import simulate as nki
import simulate.language as nl
from conftest import apply_tile_fn

erf = np.vectorize(math.erf)


def _sig(x):
    return 1 / (1 + np.exp(-x))


UNARY_REF = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x),
    "reciprocal": lambda x: 1 / x, "sin": np.sin, "cos": np.cos, "tan": np.tan,
    "tanh": np.tanh, "arctan": np.arctan, "sigmoid": _sig, "relu": lambda x: np.maximum(x, 0),
    "gelu": lambda x: 0.5 * x * (1 + erf(x / np.sqrt(2))),
    "gelu_dx": lambda x: 0.5 * (1 + erf(x / np.sqrt(2))) + x * np.exp(-x * x / 2) / np.sqrt(
        2 * np.pi),
    "gelu_apprx_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (
        x + 0.044715 * x ** 3))),
    "gelu_apprx_sigmoid": lambda x: x * _sig(1.702 * x),
    "silu": lambda x: x * _sig(x), "silu_dx": lambda x: _sig(x) * (1 + x * (1 - _sig(x))),
    "erf": erf, "erf_dx": lambda x: 2 / np.sqrt(np.pi) * np.exp(-x * x),
    "softplus": lambda x: np.log1p(np.exp(x)), "mish": lambda x: x * np.tanh(np.log1p(np.exp(x))),
    "square": np.square, "abs": np.abs, "negative": np.negative, "sign": np.sign,
    "trunc": np.trunc, "floor": np.floor, "ceil": np.ceil,
}
POSITIVE = {"log", "sqrt", "rsqrt", "reciprocal"}


@pytest.mark.parametrize("name", sorted(UNARY_REF))
def test_unary_matches_numpy(name, rng):
    x = rng.uniform(-3, 3, (128, 64)).astype(np.float32)
    if name in POSITIVE:
        x = np.abs(x) + 0.1
    got = apply_tile_fn(getattr(nl, name), x)
    ref = UNARY_REF[name](x.astype(np.float64))
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)


def test_erf_accuracy_no_scipy():
    from simulate._ops import erf as sim_erf
    x = np.linspace(-6, 6, 20001)
    assert np.abs(sim_erf(x) - erf(x)).max() < 2e-7
    small = np.array([1e-8, 1e-5, 1e-3])
    np.testing.assert_allclose(sim_erf(small), erf(small), rtol=1e-9)


BINARY_REF = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "power": np.power, "mod": np.mod,
    "fmod": np.fmod,
}


@pytest.mark.parametrize("name", sorted(BINARY_REF))
@pytest.mark.parametrize("yshape", [(128, 64), (128, 1), (1, 64), (1, 1)])
def test_binary_broadcasting(name, yshape, rng):
    x = rng.uniform(0.5, 2, (128, 64)).astype(np.float32)
    y = rng.uniform(0.5, 2, yshape).astype(np.float32)
    got = apply_tile_fn(getattr(nl, name), x, y)
    np.testing.assert_allclose(got, BINARY_REF[name](x.astype(np.float64), y), rtol=2e-6)


@pytest.mark.parametrize("name,ref", [("equal", np.equal), ("not_equal", np.not_equal),
                                      ("greater", np.greater), ("greater_equal", np.greater_equal),
                                      ("less", np.less), ("less_equal", np.less_equal),
                                      ("logical_and", np.logical_and),
                                      ("logical_or", np.logical_or),
                                      ("logical_xor", np.logical_xor)])
def test_comparisons_and_logical_are_bool(name, ref, rng):
    x = rng.integers(0, 3, (64, 32)).astype(np.float32)
    y = rng.integers(0, 3, (64, 32)).astype(np.float32)
    got = apply_tile_fn(getattr(nl, name), x, y)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, ref(x, y))


@pytest.mark.parametrize("name,ref", [("bitwise_and", np.bitwise_and),
                                      ("bitwise_or", np.bitwise_or),
                                      ("bitwise_xor", np.bitwise_xor),
                                      ("left_shift", np.left_shift)])
def test_bitwise_int(name, ref, rng):
    x = rng.integers(0, 1000, (32, 16)).astype(np.int32)
    y = rng.integers(0, 8, (32, 16)).astype(np.int32)
    got = apply_tile_fn(getattr(nl, name), x, y)
    np.testing.assert_array_equal(got, ref(x, y))


def test_right_shift_is_logical(rng):
    x = np.array([[-8, 16, -1]], np.int32)
    got = apply_tile_fn(lambda a: nl.right_shift(a, 1), x)
    np.testing.assert_array_equal(got, (x.view(np.uint32) >> 1).view(np.int32))


def test_bitwise_on_float_rejected():
    x = np.ones((4, 4), np.float32)
    with pytest.raises(SyntaxError, match="integer"):
        apply_tile_fn(lambda a: nl.bitwise_and(a, a), x)


def test_invert_and_logical_not():
    x = np.array([[0, 1, 5]], np.int32)
    np.testing.assert_array_equal(apply_tile_fn(nl.invert, x), np.invert(x))
    got = apply_tile_fn(nl.logical_not, x)
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, x == 0)


def test_operator_overloads_map_to_nl(rng):
    x = rng.uniform(1, 2, (16, 8)).astype(np.float32)
    y = rng.uniform(1, 2, (16, 8)).astype(np.float32)
    got = apply_tile_fn(lambda a, b: (a + b) * 2 - b / a + (1 - a) + a ** 2 + (-a), x, y)
    np.testing.assert_allclose(got, (x + y) * 2 - y / x + (1 - x) + x ** 2 - x, rtol=1e-6)
    got = apply_tile_fn(lambda a, b: a < b, x, y)
    np.testing.assert_array_equal(got, x < y)


def test_rank1_partition_vector_broadcasts_as_column(rng):
    x = rng.standard_normal((128, 512)).astype(np.float32)

    def f(t):
        s = nl.sum(t, axis=1)              # (128,) partition vector
        assert s.shape == (128,)
        return t - s / 512                  # (128, 512) - (128,) -> per-row
    got = apply_tile_fn(f, x)
    np.testing.assert_allclose(got, x - x.sum(1, keepdims=True) / 512, rtol=1e-5, atol=1e-5)


def test_where(rng):
    x = rng.standard_normal((32, 16)).astype(np.float32)
    got = apply_tile_fn(lambda a: nl.where(a > 0, a, 0.0), x)
    np.testing.assert_array_equal(got, np.where(x > 0, x, 0))


@pytest.mark.parametrize("fn,ref,keepdims", [
    (f, r, k) for f, r in [("sum", np.sum), ("max", np.max), ("min", np.min), ("prod", np.prod),
                           ("mean", np.mean)] for k in (False, True)] + [("var", np.var, False)])
@pytest.mark.parametrize("axis", [1, -1, [1, 2], (2,), [2, 1]])
def test_reductions(fn, ref, axis, keepdims, rng):
    x = rng.uniform(0.9, 1.1, (16, 8, 4)).astype(np.float32)
    kw = {"keepdims": keepdims} if fn != "var" else {}      # nl.var has no keepdims (stub)
    got = apply_tile_fn(lambda a: getattr(nl, fn)(a, axis=axis, **kw), x)
    ax = tuple(a % 3 for a in (axis if isinstance(axis, (list, tuple)) else [axis]))
    np.testing.assert_allclose(got, ref(x.astype(np.float64), axis=ax, keepdims=keepdims),
                               rtol=1e-5, atol=1e-7)


def test_reduction_axis0_rejected():
    with pytest.raises(ValueError, match="partition dimension"):
        apply_tile_fn(lambda a: nl.sum(a, axis=0), np.ones((4, 4), np.float32))


def test_mean_int_gives_fp32_and_all_gives_bool():
    x = np.array([[1, 2], [3, 4]], np.int32)
    got = apply_tile_fn(lambda a: nl.mean(a, axis=1), x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [1.5, 3.5])
    got = apply_tile_fn(lambda a: nl.all(a > 1, axis=1), x)
    np.testing.assert_array_equal(got, [False, True])


@pytest.mark.parametrize("transpose_x", [False, True])
def test_nl_matmul(transpose_x, rng):
    a = rng.standard_normal((128, 64)).astype(np.float32)   # [M, K] or [K, M]
    b = rng.standard_normal((128 if transpose_x else 64, 256)).astype(np.float32)

    def f(x, y):
        r = nl.matmul(x, y, transpose_x=transpose_x)
        return nl.copy(r)
    got = apply_tile_fn(f, a, b)
    ref = (a.T if transpose_x else a).astype(np.float64) @ b
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_transpose_and_copy_cast(rng):
    a = rng.standard_normal((64, 32)).astype(np.float32)
    np.testing.assert_array_equal(apply_tile_fn(nl.transpose, a), a.T)
    got = apply_tile_fn(lambda t: nl.copy(t, dtype=nl.bfloat16), a)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, a.astype(ml_dtypes.bfloat16))


def test_softmax_and_rms_norm(rng):
    x = rng.standard_normal((128, 96)).astype(np.float32)
    w = rng.standard_normal((1, 96)).astype(np.float32)
    got = apply_tile_fn(lambda t: nl.softmax(t, axis=1), x)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    got = apply_tile_fn(lambda t, ww: nl.rms_norm(t, ww, axis=1, n=96), x, w)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_dropout_rand_seed_are_deterministic(rng):
    x = np.ones((128, 64), np.float32)

    def f(t):
        nl.random_seed(seed=7)
        return nl.dropout(t, rate=0.5)
    a = apply_tile_fn(f, x)
    b = apply_tile_fn(f, x)
    np.testing.assert_array_equal(a, b)
    assert set(np.unique(a)) == {0.0, 1.0}          # no 1/(1-p) rescale
    assert 0.4 < (a == 0).mean() < 0.6
    r = apply_tile_fn(lambda t: nl.rand((128, 64), dtype=nl.float32), x)
    assert r.min() >= 0 and r.max() < 1


def test_broadcast_to_and_expand_dims(rng):
    x = rng.standard_normal((1, 32)).astype(np.float32)
    got = apply_tile_fn(lambda t: t.broadcast_to((128, 32)), x)
    np.testing.assert_array_equal(got, np.broadcast_to(x, (128, 32)))
    y = rng.standard_normal((8, 32)).astype(np.float32)
    got = apply_tile_fn(lambda t: nl.copy(nl.expand_dims(t, 2)), y)
    assert got.shape == (8, 32, 1)


def test_static_cast_finfo_tile_size_constants():
    x = np.array([1.0 + 2 ** -10, 3.3], np.float64)
    y = nl.static_cast(x, nl.bfloat16)
    assert y.dtype == ml_dtypes.bfloat16 and float(y[0]) == 1.0
    assert nl.finfo(nl.bfloat16).max == float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert nl.fp32.min == np.float32(-3.4028235e38)
    assert nl.tile_size.pmax == 128 and nl.tile_size.psum_fmax == 512
    assert nl.tile_size.gemm_stationary_fmax == 128 and nl.tile_size.gemm_moving_fmax == 512
    assert nl.tile_size.bn_stats_fmax == 512
    assert nl.bfloat16 == np.dtype(ml_dtypes.bfloat16) and nl.float32 == np.float32


def test_device_print(capsys):
    @nki.jit
    def k(a):
        t = nl.load(a)
        nl.device_print("value:", t)
        o = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(o, t)
        return o
    k(np.arange(4, dtype=np.float32).reshape(2, 2))
    assert "value:" in capsys.readouterr().out


def test_loop_reduce_accumulates_over_loop():
    x = np.arange(4 * 8, dtype=np.float32).reshape(4, 1, 8)

    @nki.jit
    def k(a):
        out = nl.ndarray((1, 8), nl.float32, buffer=nl.shared_hbm)
        acc = None
        for i in nl.affine_range(4):
            t = nl.load(a[i])
            acc = nl.loop_reduce(t, op=np.add, loop_indices=[i])
        nl.store(out, acc)
        return out
    np.testing.assert_array_equal(k(x), x.sum(0))
    np.testing.assert_array_equal(k(x), x.sum(0))    # restarts on a new launch


def test_gather_flattened(rng):
    d = rng.standard_normal((16, 4, 8)).astype(np.float32)
    idx = rng.integers(0, 32, (16, 10)).astype(np.uint32)
    got = apply_tile_fn(nl.gather_flattened, d, idx)
    np.testing.assert_array_equal(got, np.take_along_axis(d.reshape(16, -1), idx.astype(int), 1))
