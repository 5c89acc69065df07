"""Kernels of nki_kernels/fused against the float64 references (host.reference).

Tolerance rule (docs/semantics.md, adapted to these kernels; see _fused_baselines): max abs error
<= 2 x the error of a plain NumPy implementation in the kernel's matmul operand precision
(each operator's result rounded to that dtype) + a floor of 1e-5 (fp32 operands) or 1e-3.
"""
import os

import numpy as np
import pytest

from _fused_baselines import (DTYPES, linear_gelu_baseline, linear_inputs, mm_dtype,
                              randn, softmax_baseline, tolerance)
from host import reference
from host._launch import launch
from nki_kernels import tiles
from nki_kernels.fused import linear_gelu as lg
from nki_kernels.fused import softmax as sm
from nki_kernels.nki import API_ENV_VAR, BACKEND


def _f64(a):
    return np.asarray(a, dtype=np.float64)


def _check(out, ref, base, operand_dtype):
    err = reference.max_abs_err(out, ref)
    tol = tolerance(ref, base, operand_dtype)
    assert err <= tol, f"max abs error {err:.3e} > tolerance {tol:.3e}"


@pytest.fixture(params=["legacy", "nki"])
def api(request, monkeypatch):
    """The fused kernels are written once (nki_kernels.port): every test of them runs through
    both NKI namespaces (NKI_FLASH_API), same tolerance rule."""
    monkeypatch.setenv(API_ENV_VAR, request.param)
    return request.param


def _run(kernel, *args, **kw):
    """Launch on grid (1,); on the simulator, check the namespace asked for is the one that
    ran."""
    if BACKEND != "simulate":
        return launch(kernel, (1,), *args, **kw)
    import simulate

    with simulate.measure() as m:
        out = launch(kernel, (1,), *args, **kw)
    assert m.api == os.environ[API_ENV_VAR]
    return out


# --------------------------------------------------------------------------------------------
# GELU(x @ W + b)
# --------------------------------------------------------------------------------------------

LINEAR_CASES = [
    # M, K, N, dtype, mixed_precision, approximate, blocks (None = tiles.linear_gelu_blocks)
    (1, 1, 1, "bfloat16", True, "none", None),
    (200, 300, 600, "bfloat16", True, "none", None),
    (200, 300, 600, "float16", True, "tanh", (128, 256)),   # 2 m-blocks, 3 n-blocks
    (130, 257, 129, "float32", False, "none", None),          # fp32 operands
    (130, 257, 129, "float32", True, "tanh", None),           # bf16 operands, fp32 out
    (150, 260, 520, "bfloat16", True, "none", (0, 0)),        # streaming variant (long K)
]


@pytest.mark.parametrize("M,K,N,dtype,mixed,approximate,blocks", LINEAR_CASES)
def test_linear_gelu_fused(M, K, N, dtype, mixed, approximate, blocks, api):
    rng = np.random.default_rng(M * 7 + K)
    dt = DTYPES[dtype]
    x, w, b = linear_inputs(rng, M, K, N, dt)
    mm = mm_dtype(dt, mixed)
    if blocks is None:
        blocks = tiles.linear_gelu_blocks(M, K, N, mm.itemsize)
    y = _run(lg.linear_gelu_fused, x, w, b, approximate=approximate, mm_dtype=mm.name,
             block_m=blocks[0], block_n=blocks[1])
    assert y.shape == (M, N) and y.dtype == dt
    ref = reference.linear_gelu(x, w, b, approximate=approximate)
    base = linear_gelu_baseline(x, w, b, dtype=mm, out_dtype=dt, approximate=approximate)
    _check(y, ref, base, mm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_unfused_pipeline_steps(dtype, api):
    """matmul -> bias add -> GELU, each kernel checked on its own and end to end."""
    rng = np.random.default_rng(3)
    dt = DTYPES[dtype]
    M, K, N = 140, 200, 530
    x, w, b = linear_inputs(rng, M, K, N, dt)
    mm = mm_dtype(dt, True)
    bm, bn = tiles.linear_gelu_blocks(M, K, N, mm.itemsize)
    z = _run(lg.matmul_kernel, x, w, mm_dtype=mm.name, block_m=bm, block_n=bn)
    assert z.dtype == dt
    z_ref = _f64(x) @ _f64(w)
    z_base = (x.astype(mm).astype(np.float32) @ w.astype(mm).astype(np.float32)).astype(dt)
    _check(z, z_ref, _f64(z_base), mm)

    zb = _run(lg.bias_add_kernel, z, b)
    zb_ref = _f64(z) + _f64(b)
    _check(zb, zb_ref, _f64((z.astype(np.float32) + b.astype(np.float32)).astype(dt)), dt)

    y = _run(lg.gelu_kernel, zb, approximate="tanh")
    y_ref = reference.gelu(zb, "tanh")
    _check(y, y_ref, _f64(y_ref.astype(np.float32).astype(dt)), dt)

    ref = reference.linear_gelu(x, w, b, approximate="tanh")
    base = linear_gelu_baseline(x, w, b, dtype=mm, out_dtype=dt, approximate="tanh")
    _check(y, ref, base, mm)


# --------------------------------------------------------------------------------------------
# Row softmax
# --------------------------------------------------------------------------------------------

def _softmax(x, algorithm, chunk, resident, zero_masked_rows=False):
    return _run(sm.softmax_kernel, x, algorithm=algorithm, chunk=chunk, resident=resident,
                zero_masked_rows=zero_masked_rows)


@pytest.mark.parametrize("algorithm", sm.ALGORITHMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_softmax_streamed(algorithm, dtype, api):
    """Rows streamed in chunks of 256 columns (3 full chunks + a 232-column tail), 130 rows."""
    rng = np.random.default_rng(11)
    dt = DTYPES[dtype]
    x = randn(rng, (130, 1000), dt, scale=4.0)
    x[5, 700:] += np.asarray(30.0, dtype=dt)   # the row max appears late: rescaling matters
    y = _softmax(x, algorithm, 256, False)
    assert y.shape == x.shape and y.dtype == dt
    _check(y, reference.online_softmax(x), softmax_baseline(x, dtype=dt), dt)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softmax_resident(dtype, api):
    rng = np.random.default_rng(12)
    dt = DTYPES[dtype]
    x = randn(rng, (129, 300), dt, scale=3.0)
    y = _softmax(x, "online", 300, True)
    _check(y, reference.online_softmax(x), softmax_baseline(x, dtype=dt), dt)


@pytest.mark.parametrize("resident", [True, False])
def test_softmax_infinities_and_tiny_shapes(resident, api):
    """-inf entries are zeros, an all -inf row is zeros (no NaN); 1 x 1 and 1-column rows."""
    x = np.random.default_rng(13).standard_normal((3, 40)).astype(np.float32) * 100.0
    x[0, ::3] = -np.inf
    x[1, :] = -np.inf                 # row 1 entirely -inf, row 2 large magnitudes
    chunk = 40 if resident else 16
    y = _softmax(x, "online", chunk, resident)
    ref = reference.online_softmax(x)
    assert np.isfinite(y).all()
    assert np.all(y[1] == 0) and np.all(y[0, ::3] == 0)
    rows = [0, 2]   # the plain baseline gives NaN for the all -inf row (checked above instead)
    _check(y[rows], ref[rows], softmax_baseline(x[rows], dtype=np.float32), np.float32)
    for shape in [(1, 1), (5, 1)]:
        one = np.ones(shape, np.float32)
        assert np.allclose(_softmax(one, "two_pass", 1, resident), 1.0)


def test_softmax_zero_masked_rows(api):
    """The attention flavour: a row of fp32.min (a query that sees no key) outputs zeros."""
    x = np.random.default_rng(14).standard_normal((4, 70)).astype(np.float32)
    x[2, :] = np.finfo(np.float32).min
    x[3, 10:] = np.finfo(np.float32).min
    for resident, chunk in ((True, 70), (False, 32)):
        y = _softmax(x, "online", chunk, resident, zero_masked_rows=True)
        assert np.all(y[2] == 0) and np.all(y[3, 10:] == 0)
        ref = reference.online_softmax(x[[0, 1, 3]])
        assert reference.max_abs_err(y[[0, 1, 3]], ref) < 1e-5
