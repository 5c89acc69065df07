"""nki.* pieces added for AWS's own examples: ``nki.typing`` (the SDK's average_pool2d example
imports it) and the MX instructions of NeuronCore-v4 (``nisa.quantize_mx``,
``nisa.nc_matmul_mx``, the ``*_x4`` packed dtypes, ``.ap(dtype=)`` reinterpretation of raw
integer storage). Values against NumPy written here from the stub's docstrings."""
import ml_dtypes
import numpy as np
import pytest

import simulate
from nki07_fixtures import nk  # noqa: F401 (nk: fixture)


def test_typing_tensor_annotation(nk):
    nki, nl, nisa = nk
    import nki.typing as nt
    from nki.typing import tensor

    @nki.jit
    def k(x: nt.tensor[4, 8]):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    assert np.array_equal(k(x), x)
    assert tensor is nt.tensor and repr(nt.tensor[4, 8]) == "nt.tensor[4, 8]"


# -- MX: helpers written here from the stub's docstrings ------------------------------------------
E5M2 = ml_dtypes.float8_e5m2


def _np_quantize(x, emax=15):
    """[P, F] -> (fp8 values [P, F], biased exponents [P//8, F//4]): scale 2**(floor(log2 amax)
    - (emax - 1)) per 8x4 group, 2**-127 for an all-zero group."""
    P, F = x.shape
    amax = np.abs(x).reshape(P // 8, 8, F // 4, 4).max(axis=(1, 3)).astype(np.float64)
    e = np.full(amax.shape, -127)
    nz = amax > 0
    e[nz] = np.floor(np.log2(amax[nz])) - (emax - 1)
    s = np.repeat(np.repeat(2.0 ** e, 8, 0), 4, 1)
    return (x / s).astype(np.float32).astype(E5M2), e + 127


def _pack(q):                 # fp8 [P, F] -> uint32 [P, F//4], element k in byte k
    return np.ascontiguousarray(q).view(np.uint32)


def _spread(exps, P):         # [P//8, F] -> [P, F] uint8 with group g on 32*(g//4) + g%4
    out = np.zeros((P, exps.shape[1]), np.uint8)
    for g in range(P // 8):
        out[32 * (g // 4) + g % 4] = exps[g]
    return out


def _mx_kernel(nki, nl, nisa, with_quantize):
    @nki.jit
    def k(st_bits, st_scale, mv):
        P, M = st_bits.shape
        st = nl.ndarray((P, M), dtype=nl.float8_e5m2_x4, buffer=nl.sbuf)
        nisa.dma_copy(dst=st, src=st_bits.ap(dtype=nl.float8_e5m2_x4,
                                             pattern=[[M, P], [1, M]], offset=0))
        ss = nl.ndarray(st_scale.shape, dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=ss, src=st_scale)
        if with_quantize:
            src = nl.ndarray(mv.shape, dtype=mv.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=src, src=mv)
            m = nl.ndarray((P, mv.shape[1] // 4), dtype=nl.float8_e5m2_x4, buffer=nl.sbuf)
            ms = nl.ndarray((P, mv.shape[1] // 4), dtype=nl.uint8, buffer=nl.sbuf)
            nisa.quantize_mx(dst=m, src=src, dst_scale=ms)
        else:
            m, ms = st, ss
        ps = nl.ndarray((M, m.shape[1]), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=ps, stationary=st, moving=m, stationary_scale=ss,
                          moving_scale=ms)
        sb = nl.ndarray(ps.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=ps)
        out = nl.ndarray(ps.shape, dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=sb)
        return out
    return k


def _mx_inputs(P=64, M=16, N=32, seed=0):
    r = np.random.default_rng(seed)
    st = r.standard_normal((P, M * 4)).astype(np.float32)
    st[:8, :4] = 0.0                                   # an all-zero group
    mv = r.standard_normal((P, N * 4)).astype(np.float32).astype(ml_dtypes.bfloat16)
    sq, se = _np_quantize(st)
    return st, sq, se, mv


def _deq(q, e):               # fp8 [P, F*4], exps [P//8, F] -> [P, F, 4] float64
    P = q.shape[0]
    v = q.astype(np.float64).reshape(P, -1, 4)
    return v * (2.0 ** (np.repeat(e.astype(np.float64), 8, 0) - 127))[..., None]


def test_quantize_mx_and_nc_matmul_mx_values(nk):
    nki, nl, nisa = nk
    st, sq, se, mv = _mx_inputs()
    mq, me = _np_quantize(mv.astype(np.float32))
    want = np.einsum("kiq,kjq->ij", _deq(sq, se), _deq(mq, me))
    k = _mx_kernel(nki, nl, nisa, True)
    with simulate.measure(target="trn3"):
        got = k(_pack(sq), _spread(se, 64), mv)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the zero group's scale is 2**-127 (biased 0) and the dequantized input is close to st
    assert se[0, 0] == 0
    np.testing.assert_allclose(_deq(sq, se).reshape(st.shape), st, rtol=0.13, atol=1e-30)


def test_nc_matmul_mx_fp4_and_scale_rows(nk):
    nki, nl, nisa = nk
    P, M, N = 32, 8, 8
    r = np.random.default_rng(1)
    vals = r.choice(np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -1, -6], np.float32),
                    size=(P, M * 4)).astype(ml_dtypes.float4_e2m1fn)
    nib = vals.view(np.uint8).reshape(P, M, 4).astype(np.uint16) & 0xF
    bits = (nib[..., 0] | nib[..., 1] << 4 | nib[..., 2] << 8 | nib[..., 3] << 12)
    raw = np.ascontiguousarray(bits.astype("<u2")).view(np.uint8)     # [P, 2M] bytes
    exps = r.integers(120, 130, size=(P // 8, M)).astype(np.uint8)

    @nki.jit
    def k(b, e):
        d = nl.ndarray((P, M), dtype=nl.float4_e2m1fn_x4, buffer=nl.sbuf)
        nisa.dma_copy(dst=d, src=b.ap(dtype=nl.float4_e2m1fn_x4, pattern=[[M, P], [1, M]]))
        s = nl.ndarray((P // 8, M), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.dma_copy(dst=s, src=e)
        ps = nl.ndarray((M, M), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul_mx(dst=ps, stationary=d, moving=d, stationary_scale=s, moving_scale=s)
        sb = nl.ndarray((M, M), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=sb, src=ps)
        out = nl.ndarray((M, M), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=sb)
        return out

    dq = _deq(vals.astype(np.float32), exps)
    want = np.einsum("kiq,kjq->ij", dq, dq).astype(np.float32)
    with simulate.measure(target="trn3"):
        got = k(raw, exps)
    np.testing.assert_allclose(got, want.astype(ml_dtypes.bfloat16).astype(np.float32),
                               rtol=1e-2)


def test_mx_rules_and_cost(nk):
    nki, nl, nisa = nk
    st, sq, se, mv = _mx_inputs()
    k = _mx_kernel(nki, nl, nisa, False)
    with pytest.raises(Exception, match="NeuronCore-v4"):
        with simulate.measure(target="trn2"):
            k(_pack(sq), _spread(se, 64), mv)
    # scales not spread over the quadrants: only P//8 = 8 rows for 64 partitions
    with pytest.raises(Exception, match="quadrant"):
        with simulate.measure(target="trn3"):
            k(_pack(sq), se.astype(np.uint8), mv)
    # TensorE time: one MX matmul costs what a bf16 nc_matmul of the same M x N costs (315
    # MXFP8 TFLOPS = 4 x 79 BF16 with 4x the contraction per row)
    with simulate.measure(target="trn3") as m:
        k(_pack(sq), _spread(se, 64), mv)
    from simulate import _cost
    assert m.engine_cycles["tensor"] == _cost.matmul_cycles(16, 16, False)


def test_ap_dtype_reinterpret_is_hbm_raw_bits_only(nk):
    nki, nl, nisa = nk

    @nki.jit
    def k(x):
        t = nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        t.ap(dtype=nl.int32, pattern=[[2, 2], [1, 2]])
        return x

    with pytest.raises(NotImplementedError, match="only integer / MX packed"):
        k(np.zeros((2, 2), np.float32))
