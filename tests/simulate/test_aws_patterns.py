"""Patterns AWS's legacy kernels (nki-samples 0898a77) rely on, each reproduced in a kernel of
our own: the simulator must accept them because neuronx-cc does. docs/simulator.md has the tally
of AWS's suite on the simulator (benchmarks/aws_acceptance.py)."""
import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl


def test_hbm_reshape_takes_shape_keyword():
    @nki.jit
    def k(x):
        out = nl.ndarray((2, 64), dtype=x.dtype, buffer=nl.shared_hbm)
        flat = x.reshape(shape=(2, 64))
        nl.store(out, nl.load(flat))
        return out
    x = np.arange(128, dtype=np.float32).reshape(2, 8, 8)
    np.testing.assert_array_equal(k(x), x.reshape(2, 64))


def test_hbm_reshape_refuses_both_forms_at_once():
    @nki.jit
    def k(x):
        x.reshape((2, 64), shape=(2, 64))
    with pytest.raises(TypeError, match="positionally or as shape="):
        k(np.zeros((2, 8, 8), np.float32))


def test_rank1_tile_indexed_as_partition_column():
    # a (P, F) buffer sliced to (P,) with an integer column, then indexed [:, 0] again
    @nki.jit
    def k(x):
        buf = nl.load(x)                                   # (128, 4)
        col = buf[:, 2]                                    # (128,)  a partition vector
        out = nl.ndarray((128, 1), dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 1), dtype=x.dtype)
        t[...] = nl.multiply(col[:, 0], 2.0)
        col[:, 0] = nl.add(t, 1.0)                          # writes through to buf[:, 2]
        nl.store(out, buf[:, 2:3])
        return out
    x = np.random.default_rng(0).standard_normal((128, 4)).astype(np.float32)
    np.testing.assert_allclose(k(x)[:, 0], x[:, 2] * 2 + 1, rtol=1e-6)


def test_indirect_gather_after_scalar_block_index():
    # data[b, idx_tile, i_f]: the scalar b is a block dim, so idx_tile indexes the partition dim
    @nki.jit
    def k(data, idx):
        out = nl.ndarray((2, 128, 8), dtype=data.dtype, buffer=nl.shared_hbm)
        it = nl.load(idx)
        jf = nl.arange(8)[None, :]
        ip = nl.arange(128)[:, None]
        for b in nl.affine_range(2):
            nl.store(out[b, ip, jf], value=nl.load(data[b, it, jf]))
        return out
    rng = np.random.default_rng(1)
    data = rng.standard_normal((2, 300, 8)).astype(np.float32)
    idx = rng.integers(0, 300, (128, 1)).astype(np.int32)
    np.testing.assert_array_equal(k(data, idx), data[:, idx[:, 0], :])


def test_indirect_index_on_a_true_free_dim_is_still_refused():
    @nki.jit
    def k(data, idx):
        it = nl.load(idx)
        return nl.load(data[nl.arange(4)[:, None], it])
    with pytest.raises(nki.NKISyntaxError, match="free dimension"):
        k(np.zeros((4, 300), np.float32), np.zeros((4, 1), np.int32))


def test_integer_true_division_is_fractional():
    # floor(pos / w) must be the floor of the true quotient (AWS resize_nearest relies on it)
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 2), dtype=nl.int32, buffer=nl.shared_hbm)
        pos = nisa.iota(nl.arange(128)[:, None] + 2176, dtype=nl.int32)
        q = pos / 38
        r = nl.ndarray((128, 2), dtype=nl.int32)
        r[:, 0:1] = nl.floor(q, dtype=nl.int32)
        r[:, 1:2] = nl.divide(pos, 38, dtype=nl.int32)    # an explicit dtype still rounds
        nl.store(out, r)
        return out
    o = k(np.zeros(1, np.float32))
    pos = np.arange(2176, 2176 + 128)
    np.testing.assert_array_equal(o[:, 0], pos // 38)
    np.testing.assert_array_equal(o[:, 1], np.rint(pos / 38))
