"""Inputs and the tolerance check shared by the decode API tests (contiguous and paged)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from host import reference

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def inputs(B=2, Hq=8, Hkv=2, T=3, S_max=128, D=32, dtype=BF16, seed=0):
    """Random q ``(B, Hq, T, D)`` and contiguous caches ``(B, Hkv, S_max, D)``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, T, D)).astype(np.float32).astype(dtype)
    k = rng.standard_normal((B, Hkv, S_max, D)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((B, Hkv, S_max, D)).astype(np.float32).astype(dtype)
    return q, k, v


def assert_within_rule(q, k, v, lens, o, *, table=None, tree=None, mm=BF16):
    """The tolerance rule: ``o``'s error <= 2 x the plain ``mm``-precision baseline's + floor."""
    ref = reference.decode(q, k, v, cache_lens=lens, tree_mask=tree, block_table=table)[0]
    base = reference.decode_baseline_lowp(q, k, v, cache_lens=lens, dtype=mm, out_dtype=q.dtype,
                                          tree_mask=tree, block_table=table)
    tol = reference.tolerance(ref, base, floor=reference.atol_floor(mm))
    assert reference.max_abs_err(o, ref) <= tol
