"""nki.isa (NKI 0.7): instructions write dst; the legacy implementations compute."""
import numpy as np
import pytest

import simulate
from simulate._strict import AccumulationGroupError
from nki07_fixtures import nk, tile_kernel  # noqa: F401 (nk: fixture)


_k = tile_kernel


def test_tensor_copy_casts_to_dst_and_has_no_dtype(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)

    def body(nl, nisa, x):
        y = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y, src=x)
        return y
    out = _k(nki, nl, nisa, body, a.shape, nl.bfloat16)(a)
    import ml_dtypes
    np.testing.assert_array_equal(out, a.astype(ml_dtypes.bfloat16))

    def bad(nl, nisa, x):
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y, src=x, dtype=nl.float32)
        return y
    with pytest.raises(TypeError, match="dtype"):
        _k(nki, nl, nisa, bad, a.shape)(a)


def test_dst_layout_checked(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)

    def bad(nl, nisa, x):
        y = nl.ndarray((128, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y, src=x)
        return y
    with pytest.raises(ValueError, match="same number of elements per partition"):
        _k(nki, nl, nisa, bad, (128, 32))(a)

    def reshaped(nl, nisa, x):          # same partitions, same elements per partition: fine
        y = nl.ndarray((128, 2, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=y, src=x)
        return y
    out = _k(nki, nl, nisa, reshaped, (128, 2, 32))(a)
    np.testing.assert_array_equal(out.reshape(128, 64), a)


def _matmul_kernel(nki, nl, nisa, accs, init=None):
    """``init``: None (nl.ndarray), "zeros" (nl.zeros) or "memset" (nisa.memset of 0)."""
    @nki.jit
    def k(lhsT, rhs):
        K, M = lhsT.shape
        N = rhs.shape[1]
        out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
        ps = (nl.zeros if init == "zeros" else nl.ndarray)((M, N), nl.float32, buffer=nl.psum)
        if init == "memset":
            nisa.memset(ps, 0.0)
        for i, acc in enumerate(accs):
            a = nl.ndarray((128, M), lhsT.dtype, buffer=nl.sbuf)
            b = nl.ndarray((128, N), rhs.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=a, src=lhsT[i * 128:(i + 1) * 128, :])
            nisa.dma_copy(dst=b, src=rhs[i * 128:(i + 1) * 128, :])
            if acc == "default":
                nisa.nc_matmul(ps, a, b)
            else:
                nisa.nc_matmul(dst=ps, stationary=a, moving=b, accumulate=acc)
        r = nl.ndarray((M, N), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=r, src=ps)
        nisa.dma_copy(dst=out, src=r)
        return out
    return k


def test_nc_matmul_accumulate_modes(nk, rng):
    nki, nl, nisa = nk
    lhsT = rng.standard_normal((384, 64)).astype(np.float32)
    rhs = rng.standard_normal((384, 256)).astype(np.float32)
    full = lhsT.T @ rhs
    last = lhsT[256:].T @ rhs[256:]
    tol = dict(rtol=1e-4, atol=1e-3)
    # None: first write overwrites (fresh PSUM holds NaN), later ones accumulate
    np.testing.assert_allclose(_matmul_kernel(nki, nl, nisa, ["default"] * 3)(lhsT, rhs),
                               full, **tol)
    # the stub's hint: accumulate=(i > 0)
    np.testing.assert_allclose(
        _matmul_kernel(nki, nl, nisa, [False, True, True])(lhsT, rhs), full, **tol)
    # False overwrites whatever is there
    np.testing.assert_allclose(
        _matmul_kernel(nki, nl, nisa, [None, None, False])(lhsT, rhs), last, **tol)
    # True on a location nothing initialized: undefined on hardware, refused
    with pytest.raises(ValueError, match="uninitialized"):
        _matmul_kernel(nki, nl, nisa, [True, True, True])(lhsT, rhs)


@pytest.mark.parametrize("init", ["zeros", "memset"])
def test_nc_matmul_accumulate_true_needs_a_group_a_matmul_opened(nk, rng, init):
    """The stub: accumulate=True is "Only valid after the PSUM location has been initialized
    by a matmul with accumulate=False"; a zero fill does not open a group for it (strict),
    while accumulate=None after the zero fill is what AWS's attention_bwd does (legal)."""
    nki, nl, nisa = nk
    lhsT = rng.standard_normal((256, 64)).astype(np.float32)
    rhs = rng.standard_normal((256, 128)).astype(np.float32)
    with pytest.raises(AccumulationGroupError,
                       match=r"accumulate=True.*zero fill.*accumulate=False"):
        _matmul_kernel(nki, nl, nisa, [True, True], init)(lhsT, rhs)
    np.testing.assert_allclose(_matmul_kernel(nki, nl, nisa, [None, None], init)(lhsT, rhs),
                               lhsT.T @ rhs, rtol=1e-4, atol=1e-3)
    with simulate.strict(False):                         # the permissive mode adds
        np.testing.assert_allclose(
            _matmul_kernel(nki, nl, nisa, [True, True], init)(lhsT, rhs), lhsT.T @ rhs,
            rtol=1e-4, atol=1e-3)


def test_nc_matmul_accumulation_groups_are_per_element(nk, rng):
    """A zero fill of some columns leaves the group a matmul opened in the others."""
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 128)).astype(np.float32)

    def body(nl, nisa, x, cols):
        ps = nl.ndarray((64, 128), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps[:, 0:64], stationary=x[:, 0:64], moving=x[:, 0:64],
                       accumulate=False)
        nisa.memset(ps[:, 64:128], 0.0)
        nisa.nc_matmul(dst=ps[:, 0:cols], stationary=x[:, 0:64], moving=x[:, 0:cols],
                       accumulate=True)
        s = nl.ndarray((64, 128), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=s, src=ps)
        return s
    out = _k(nki, nl, nisa, lambda nl, nisa, x: body(nl, nisa, x, 64), (64, 128))(a)
    np.testing.assert_allclose(out[:, :64], 2 * a[:, :64].T @ a[:, :64], rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(out[:, 64:], 0)
    with pytest.raises(AccumulationGroupError, match="zero fill"):
        _k(nki, nl, nisa, lambda nl, nisa, x: body(nl, nisa, x, 128), (64, 128))(a)


def test_nc_matmul_rules_from_core(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)

    def into_sbuf(nl, nisa, x):
        y = nl.ndarray((64, 64), nl.float32, buffer=nl.sbuf)
        nisa.nc_matmul(y, x, x)
        return y
    with pytest.raises(TypeError, match="psum"):
        _k(nki, nl, nisa, into_sbuf, (64, 64))(a)


def test_nc_transpose(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)

    def body(nl, nisa, x):
        p = nl.ndarray((64, 128), nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=p, data=x)
        s = nl.ndarray((64, 128), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=s, src=p)
        return s
    np.testing.assert_array_equal(_k(nki, nl, nisa, body, (64, 128))(a), a.T)

    def to_sbuf(nl, nisa, x):
        s = nl.ndarray((64, 128), nl.float32, buffer=nl.sbuf)
        nisa.nc_transpose(dst=s, data=x)
        return s
    with pytest.raises(TypeError, match="writes PSUM"):
        _k(nki, nl, nisa, to_sbuf, (64, 128))(a)


def test_elementwise_and_reduce(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32)

    def body(nl, nisa, x, y):
        t = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=t, data1=x, data2=y, op=nl.multiply)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0, op1=nl.add,
                           operand1=1.0)
        e = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=t, scale=0.5)
        m = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=m, op=nl.max, data=e, axis=1)
        r = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=r, data=m)
        return r
    out = _k(nki, nl, nisa, body, (128, 1))(a, b)
    ref = 1.0 / np.exp(0.5 * (2 * a * b + 1)).max(axis=1, keepdims=True)
    np.testing.assert_allclose(out, ref, rtol=1e-5)


def test_memset_and_iota(nk):
    nki, nl, nisa = nk

    @nki.jit
    def k(a):
        out = nl.ndarray((2, 4, 6), dtype=nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 6), nl.int32, buffer=nl.sbuf)
        nisa.iota(dst=t, pattern=[[10, 2], [1, 3]], offset=5, channel_multiplier=100)
        nisa.dma_copy(dst=out[0], src=t)
        nisa.memset(dst=t, value=7)
        nisa.dma_copy(dst=out[1], src=t)
        return out
    out = k(np.zeros((1, 1), np.float32))
    c = np.arange(4)[:, None, None]
    w = np.arange(2)[None, :, None]
    x = np.arange(3)[None, None, :]
    np.testing.assert_array_equal(out[0], (5 + 100 * c + 10 * w + x).reshape(4, 6))
    assert (out[1] == 7).all()


def test_dma_copy_refuses_psum(nk, rng):
    nki, nl, nisa = nk

    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        p = nl.zeros(a.shape, nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=out, src=p)
        return out
    with pytest.raises(TypeError, match="PSUM"):
        k(np.zeros((128, 64), np.float32))


def test_cost_same_as_legacy_assignment(nk, rng):
    """nisa.tensor_tensor(dst=...) costs what legacy ``d[...] = nisa.tensor_tensor(...)`` does."""
    nki, nl, nisa = nk
    from simulate import isa as lisa, language as lnl
    a = rng.standard_normal((128, 512)).astype(np.float32)

    def body(nl, nisa, x):
        y = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=y, data1=x, data2=x, op=nl.add)
        return y

    @simulate.jit
    def leg(a):
        out = lnl.ndarray(a.shape, dtype=lnl.bfloat16, buffer=lnl.shared_hbm)
        x = lnl.ndarray(a.shape, a.dtype, buffer=lnl.sbuf)
        lisa.dma_copy(dst=x, src=a)
        y = lnl.ndarray(a.shape, lnl.bfloat16, buffer=lnl.sbuf)
        y[...] = lisa.tensor_tensor(x, x, lnl.add, dtype=lnl.bfloat16)
        lisa.dma_copy(dst=out, src=y)
        return out
    with simulate.measure() as m1:
        r1 = _k(nki, nl, nisa, body, a.shape, nl.bfloat16)(a)
    with simulate.measure() as m2:
        r2 = leg(a)
    np.testing.assert_array_equal(r1, r2)
    assert m1.engine_cycles == m2.engine_cycles and m1.instructions == m2.instructions
    assert m1.estimated_seconds == m2.estimated_seconds
