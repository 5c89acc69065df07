"""Shared helpers for the simulator tests."""
import importlib.util
import os
import sys

import numpy as np
import pytest

if importlib.util.find_spec("simulate") is None:     # bare `pytest` from a source checkout
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import simulate as nki
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


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
