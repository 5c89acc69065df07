"""Plain low-precision NumPy implementations: the baselines of the tolerance rule for the fused
kernels (docs/semantics.md, "Tolerance rule", adapted).

A kernel's max abs error against the float64 reference must be at most
``2 * max|baseline - reference| + floor``, where the baseline is what a plain framework would get
computing the same thing in the kernel's matmul operand precision: inputs rounded to that dtype,
each operator's result rounded to it (fp32 accumulation inside matmuls and reductions), the output
rounded to the output dtype. The floor is 1e-5 for fp32 operands and 1e-3 otherwise
(``host.reference.atol_floor``).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from host import reference

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": BF16, "float16": np.dtype(np.float16)}


def _r(x, dtype):
    """Round to ``dtype`` and come back as float32."""
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(dtype).astype(np.float32)


def mm_dtype(dtype, mixed_precision=True):
    """The kernels' matmul operand dtype for an input dtype (docs/semantics.md, Precision)."""
    dtype = np.dtype(dtype)
    return BF16 if (dtype == np.float32 and mixed_precision) else dtype


def linear_gelu_baseline(x, w, b, *, dtype, out_dtype, approximate="none"):
    """GELU(x @ w + b) as three plain operators in ``dtype``: matmul (fp32 accumulate, rounded),
    bias add (rounded), GELU (fp32, rounded to ``out_dtype``)."""
    z = _r(_r(x, dtype) @ _r(w, dtype), dtype)
    z = _r(z + _r(b, dtype), dtype)
    return reference.gelu(z, approximate).astype(np.float32).astype(out_dtype).astype(np.float64)


def softmax_baseline(x, *, dtype):
    """Row softmax of x rounded to ``dtype``, computed in fp32, rounded to ``dtype``."""
    x32 = _r(x, dtype)
    m = x32.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):           # an all -inf row: NaN, as eager frameworks
        e = np.exp(x32 - m)
    return (e / e.sum(axis=-1, keepdims=True)).astype(dtype).astype(np.float64)


def tolerance(ref, baseline, operand_dtype):
    return reference.tolerance(ref, baseline, floor=reference.atol_floor(operand_dtype))


def randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def linear_inputs(rng, M, K, N, dtype):
    """x, w, b scaled so x @ w + b is O(1) (GELU's interesting range)."""
    x = randn(rng, (M, K), dtype)
    w = randn(rng, (K, N), dtype, scale=1.0 / math.sqrt(K))
    b = randn(rng, (N,), dtype, scale=0.5)
    return x, w, b
