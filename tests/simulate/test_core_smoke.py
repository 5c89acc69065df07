"""Smoke tests of the simulator core: load/store, nc_matmul with PSUM accumulation, measure."""
import numpy as np
import ml_dtypes

import simulate as nki
import simulate.language as nl
import simulate.isa as nisa


@nki.jit
def _tiled_add(a, b):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(a.shape[0] // 128):
        for j in nl.affine_range(a.shape[1] // 512):
            x = nl.load(a[i * 128:(i + 1) * 128, j * 512:(j + 1) * 512])
            y = nl.load(b[i * 128:(i + 1) * 128, j * 512:(j + 1) * 512])
            nl.store(out[i * 128:(i + 1) * 128, j * 512:(j + 1) * 512], x + y)
    return out


def test_tiled_add_values_and_exact_bytes():
    rng = np.random.default_rng(0)
    a = rng.random((512, 2048), dtype=np.float32)
    b = rng.random((512, 2048), dtype=np.float32)
    with nki.measure(target="trn2") as m:
        c = _tiled_add(a, b)
    np.testing.assert_array_equal(c, a + b)
    assert m.hbm_bytes_read == 8388608
    assert m.hbm_bytes_written == 4194304
    assert m.per_tensor["a"]["read"] == 4194304


@nki.jit
def _mm(lhsT, rhs):
    K, M = lhsT.shape
    _, N = rhs.shape
    out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // 128):
        for n in nl.affine_range(N // 512):
            ps = nl.zeros((128, 512), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // 128):
                lt = nl.load(lhsT[k * 128:(k + 1) * 128, m * 128:(m + 1) * 128])
                rt = nl.load(rhs[k * 128:(k + 1) * 128, n * 512:(n + 1) * 512])
                ps += nisa.nc_matmul(lt, rt)
            nl.store(out[m * 128:(m + 1) * 128, n * 512:(n + 1) * 512], value=nl.copy(ps))
    return out


def test_matmul_bf16_psum_fp32():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((256, 128)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((256, 512)).astype(ml_dtypes.bfloat16)
    c = _mm(a, b)
    ref = a.astype(np.float64).T @ b.astype(np.float64)
    assert c.dtype == np.float32
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-4)
