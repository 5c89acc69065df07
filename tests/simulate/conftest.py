"""Shared helpers for the simulator tests."""
import importlib.util
import os
import sys

import numpy as np
import pytest

if importlib.util.find_spec("simulate") is None:     # bare `pytest` from a source checkout
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl


def apply_tile_fn(fn, *arrays, out_dtype=None, out_shape=None, target=None):
    """Run ``fn(*tiles) -> tile`` inside a kernel: loads each (P, F) input, stores the result.

    Returns the host result array (in the output tile's dtype unless out_dtype)."""

    def kernel(*hbm):
        tiles = [nl.load(h) for h in hbm]
        r = fn(*tiles)
        shape = out_shape or r.shape
        out = nl.ndarray(shape, dtype=out_dtype or r.dtype, buffer=nl.shared_hbm)
        nl.store(out, r)
        return out

    opts = {} if target is None else {"platform_target": target}
    return nki.jit(kernel, **opts)(*arrays)


@nki.jit
def tiled_add(a, b):
    """out = a + b over (128, 512) tiles; a, b (P, F) with P % 128 == 0 and F % 512 == 0."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(a.shape[0] // 128):
        for j in nl.affine_range(a.shape[1] // 512):
            x = nl.load(a[i * 128:(i + 1) * 128, j * 512:(j + 1) * 512])
            y = nl.load(b[i * 128:(i + 1) * 128, j * 512:(j + 1) * 512])
            nl.store(out[i * 128:(i + 1) * 128, j * 512:(j + 1) * 512], x + y)
    return out


@nki.jit
def tiled_matmul(lhsT, rhs):
    """out (M, N) fp32 = lhsT (K, M).T @ rhs (K, N), accumulated in PSUM over 128-row K tiles;
    K, M multiples of 128, N a multiple of 512."""
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


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
