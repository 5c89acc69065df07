"""Smoke tests of the simulator core: load/store, nc_matmul with PSUM accumulation, measure."""
import numpy as np
import ml_dtypes

import simulate as nki
from conftest import tiled_add, tiled_matmul


def test_tiled_add_values_and_exact_bytes():
    rng = np.random.default_rng(0)
    a = rng.random((512, 2048), dtype=np.float32)
    b = rng.random((512, 2048), dtype=np.float32)
    with nki.measure(target="trn2") as m:
        c = tiled_add(a, b)
    np.testing.assert_array_equal(c, a + b)
    assert m.hbm_bytes_read == 8388608
    assert m.hbm_bytes_written == 4194304
    assert m.per_tensor["a"]["read"] == 4194304


def test_matmul_bf16_psum_fp32():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((256, 128)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((256, 512)).astype(ml_dtypes.bfloat16)
    c = tiled_matmul(a, b)
    ref = a.astype(np.float64).T @ b.astype(np.float64)
    assert c.dtype == np.float32
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-4)
