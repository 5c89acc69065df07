"""Integration: a single-head flash-attention forward written with the legacy flash_fwd idioms
(spec §15): trace sub-kernel writing into a passed PSUM tile, online softmax with
activation_reduce, affine_select with loop offsets, TensorE transposes into fp32 PSUM, PSUM
accumulation of P^T V, Python `if` on loop indices, random_seed from a tile."""
import ml_dtypes
import numpy as np
import pytest

import simulate as nki
import simulate.language as nl
import simulate.isa as nisa


@nki.jit(mode="trace")
def _qk_block(q_T, k_T, qk_psum):
    qk_psum[:, :] = nl.matmul(q_T, k_T, transpose_x=True)          # [128 q, 512 k]


@nki.jit
def flash_fwd(q, k, v, seed, softmax_scale, causal):
    """o = softmax(q k^T * scale [+ causal mask]) v; q, k, v: (N, d) bf16; o fp32."""
    N, d = q.shape
    o = nl.ndarray((N, d), dtype=nl.float32, buffer=nl.shared_hbm)
    nl.random_seed(seed=nl.load(seed))
    for i in nl.affine_range(N // 128):
        q_T = nl.load_transpose2d(q[nl.ds(i * 128, 128), :])        # (d, 128)
        m_i = nl.full((128, 1), nl.fp32.min, nl.float32)
        l_i = nl.zeros((128, 1), nl.float32)
        acc = nl.zeros((128, d), nl.float32)
        for j in nl.sequential_range(N // 512):
            if causal and j * 512 > i * 128 + 127:
                continue
            k_T = nl.load_transpose2d(k[nl.ds(j * 512, 512), :])    # (d, 512)
            qk = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            _qk_block(q_T, k_T, qk)
            s = nl.multiply(qk, softmax_scale)
            if causal:
                ip, jf = nl.mgrid[0:128, 0:512]
                s = nisa.affine_select(pred=(i * 128 + ip >= j * 512 + jf), on_true_tile=s,
                                       on_false_value=nl.fp32.min, dtype=nl.float32)
            m_new = nl.maximum(m_i, nisa.tensor_reduce(np.max, s, axis=(1,)))
            neg_m = nl.multiply(m_new, -1.0)
            row_sum = nl.ndarray((128, 1), nl.float32)
            p = nisa.activation_reduce(op=nl.exp, data=s, bias=neg_m, reduce_op=nl.add,
                                       reduce_res=row_sum, dtype=nl.bfloat16)
            p = nl.dropout(p, rate=0.0)
            alpha = nisa.activation(op=nl.exp, data=m_i, bias=neg_m)
            l_i[...] = nl.add(nl.multiply(l_i, alpha), row_sum)
            pv = nl.zeros((128, d), nl.float32, buffer=nl.psum)
            for b in nl.affine_range(4):
                pT_ps = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
                pT_ps[...] = nisa.nc_transpose(p[:, nl.ds(b * 128, 128)])
                pT = nl.copy(pT_ps, dtype=nl.bfloat16)
                v_t = nl.load(v[nl.ds(j * 512 + b * 128, 128), :])
                pv += nisa.nc_matmul(pT, v_t)
            acc[...] = nl.add(nl.multiply(acc, alpha), pv)
            m_i[...] = m_new
        nl.store(o[nl.ds(i * 128, 128), :], nl.divide(acc, l_i))
    return o


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_flash_forward_matches_reference(causal, target, rng):
    N, d = 1024, 64
    q, k, v = (rng.standard_normal((N, d)).astype(ml_dtypes.bfloat16) for _ in range(3))
    scale = 1 / np.sqrt(d)
    with nki.measure(target=target) as m:
        o = flash_fwd(q, k, v, np.array([[7]], np.int32), scale, causal)
    s = q.astype(np.float64) @ k.astype(np.float64).T * scale
    if causal:
        s = np.where(np.tril(np.ones((N, N), bool)), s, -np.inf)
    p = np.exp(s - s.max(1, keepdims=True))
    ref = (p / p.sum(1, keepdims=True)) @ v.astype(np.float64)
    # P is rounded to bf16 before P V (as on device): error ~ 2^-8 relative
    np.testing.assert_allclose(o, ref, atol=2e-2, rtol=0)
    n_q = N // 128
    kv_tiles = sum(sum(1 for j in range(N // 512) if not (causal and j * 512 > i * 128 + 127))
                   for i in range(n_q))
    assert m.per_tensor["q"]["read"] == N * d * 2
    assert m.per_tensor["k"]["read"] == kv_tiles * 512 * d * 2
    assert m.per_tensor["v"]["read"] == kv_tiles * 512 * d * 2
    assert m.hbm_bytes_written == N * d * 4
    assert m.peak_psum_banks <= 8
