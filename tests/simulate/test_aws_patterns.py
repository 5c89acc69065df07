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


# ---------------------------------------------------------------------------------------------
# nc_transpose with the engine left to the compiler (AWS SD attention, flash_attn_bwd)
# ---------------------------------------------------------------------------------------------
def _transpose_kernel(into):
    @nki.jit
    def k(x, w):
        xt = nl.load(x)
        wt = nl.load(w)
        out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        if into == "sbuf":
            t = nl.ndarray((128, 128), dtype=nl.bfloat16)
            t[...] = nisa.nc_transpose(xt)
        elif into == "psum":
            t = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.psum)
            t[...] = nisa.nc_transpose(xt)
            t = nl.copy(t, dtype=nl.bfloat16)
        else:                                    # a temporary used straight as an operand
            t = nisa.nc_transpose(xt)
        p = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum)
        p[...] = nisa.nc_matmul(t, wt)
        nl.store(out, nl.copy(p))
        return out
    return k


@pytest.mark.parametrize("into", ["sbuf", "psum", "temporary"])
def test_unspecified_engine_transpose_lands_where_it_is_used(into):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((128, 128)).astype(np.float32)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    import ml_dtypes
    xb = x.astype(ml_dtypes.bfloat16)
    with nki.measure() as m:
        o = _transpose_kernel(into)(xb, w.astype(ml_dtypes.bfloat16))
    ref = xb.astype(np.float32) @ w.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(o, ref, rtol=2e-2, atol=2e-2)
    assert m.instructions["tensor"] == 2
    # the PSUM -> SBUF evacuation is an instruction whichever way it is written
    assert m.instructions["vector"] >= 2


def test_explicit_tensor_engine_transpose_into_sbuf_is_refused():
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 128), dtype=nl.float32)
        t[...] = nisa.nc_transpose(nl.load(x), engine=nisa.tensor_engine)
    with pytest.raises(nki.NKIError, match="must be psum"):
        k(np.zeros((128, 128), np.float32))


# ---------------------------------------------------------------------------------------------
# nl.loop_reduce inside other loops (AWS flash_attn_bwd dq reduction)
# ---------------------------------------------------------------------------------------------
def test_loop_reduce_keeps_one_accumulator_per_outer_iteration():
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 2, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        red = nl.zeros((2, nl.par_dim(128), 4), dtype=nl.float32)
        for i in nl.affine_range(3):
            for j in nl.affine_range(2):
                t = nl.load(x[:, j, i, :])
                # written without i in the index: a reduction over i, not a race
                red[j, :, :] = nl.loop_reduce(t, op=np.add, loop_indices=(i,),
                                              dtype=nl.float32)
        for j in nl.affine_range(2):
            nl.store(out[:, j, :], red[j])
        return out
    x = np.random.default_rng(3).random((128, 2, 3, 4)).astype(np.float32)
    o = k(x)
    np.testing.assert_allclose(o, x.sum(2), rtol=1e-6)


def test_plain_copy_without_the_loop_index_is_still_an_output_dependency():
    @nki.jit
    def k(x):
        red = nl.zeros((nl.par_dim(128), 4), dtype=nl.float32)
        for i in nl.affine_range(3):
            red[...] = nl.load(x[:, i, :])
    with pytest.raises(nki.NKISyntaxError, match="output dependencies"):
        k(np.zeros((128, 3, 4), np.float32))


# ---------------------------------------------------------------------------------------------
# direct allocation (AWS allocated SD attention): placement sizes, not logical sizes
# ---------------------------------------------------------------------------------------------
def test_psum_mod_alloc_wraps_block_indices_into_its_banks():
    import simulate.compiler as ncc

    @nki.jit
    def k(x):
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        # 2 x 8 logical blocks of one bank each, placed on 2 x 4 = 8 physical banks
        p = nl.ndarray((2, 8, nl.par_dim(128), 512), dtype=nl.float32,
                       buffer=ncc.psum.mod_alloc(base_bank=0, num_bank_tiles=(2, 4)))
        p[1, 7] = nl.load(x)
        nl.store(out, nl.copy(p[1, 7]))
        return out
    x = np.ones((128, 512), np.float32)
    np.testing.assert_array_equal(k(x), x)


def test_direct_allocation_past_the_end_is_refused():
    import simulate.compiler as ncc

    @nki.jit
    def k():
        nl.ndarray((2, nl.par_dim(128), 512), dtype=nl.float32,
                   buffer=ncc.psum.mod_alloc(base_bank=7, num_bank_tiles=(2,)))
    with pytest.raises(nki.NKIError, match="Allocated memory out of bound"):
        k()


def test_psum_alloc_function_counts_the_banks_it_names():
    import simulate.compiler as ncc

    def addr(bank_map, idx, pdim_size, fdim_size):
        return (bank_map[idx], 0, 0)

    import functools

    @nki.jit
    def k(x):
        out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        a = nl.ndarray((2, nl.par_dim(128), 512), dtype=nl.float32,
                       buffer=ncc.psum.alloc(functools.partial(addr, bank_map={(0,): 1, (1,): 5})))
        b = nl.ndarray((2, nl.par_dim(128), 512), dtype=nl.float32,
                       buffer=ncc.psum.alloc(functools.partial(addr, bank_map={(0,): 8, (1,): 2})))
        return out
    with pytest.raises(nki.NKIError, match="placed at 2..9 banks"):
        k(np.zeros((128, 512), np.float32))


# ---------------------------------------------------------------------------------------------
# TensorE accumulation into a PSUM tile that was never written (AWS allocated rmsnorm_qkv)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["tensor", "vector"])
def test_first_matmul_into_an_unwritten_psum_tile_overwrites(engine):
    @nki.jit
    def k(a, b):
        out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        at = nl.load(a)
        bt = nl.load(b)
        acc = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.psum)   # not zeroed
        for kk in nl.affine_range(2):
            if engine == "tensor":
                acc[...] += nisa.nc_matmul(at[:, nl.ds(kk * 128, 128)], bt)
            else:
                acc[...] += nl.copy(bt)                  # a VectorE add onto garbage
        nl.store(out, nl.copy(acc))
        return out
    rng = np.random.default_rng(4)
    a = rng.standard_normal((128, 256)).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32)
    o = k(a, b)
    if engine == "tensor":
        ref = a[:, :128].T @ b + a[:, 128:].T @ b
        np.testing.assert_allclose(o, ref, rtol=1e-4, atol=1e-3)
    else:
        assert np.isnan(o).all()                        # the uninitialised value is garbage


def test_loop_reduce_of_a_partition_vector():
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 2), dtype=nl.float32, buffer=nl.shared_hbm)
        acc = nl.zeros((nl.par_dim(128), 2), dtype=nl.float32)
        for j in nl.affine_range(2):
            for i in nl.affine_range(3):
                row = nl.sum(nl.load(x[:, j, i, :]), axis=1)            # (128,)
                acc[:, j] = nl.loop_reduce(row, op=np.add, loop_indices=(i,),
                                           dtype=nl.float32)
        nl.store(out, acc)
        return out
    x = np.random.default_rng(5).random((128, 2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(k(x), x.sum(axis=(2, 3)), rtol=1e-5)


@pytest.mark.parametrize("target", ["trn2", "trn1"])
def test_tensor_tensor_column_broadcast_on_trn2_only(target):
    # AWS's trn2-only double_row_matmul scales [128, F] by a [128, 1] column with tensor_tensor
    @nki.jit(platform_target=target)
    def k(x, s):
        out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nisa.tensor_tensor(nl.load(x), nl.load(s), nl.multiply))
        return out
    rng = np.random.default_rng(6)
    x = rng.standard_normal((128, 64)).astype(np.float32)
    s = rng.standard_normal((128, 1)).astype(np.float32)
    if target == "trn2":
        np.testing.assert_allclose(k(x, s), x * s, rtol=1e-6)
    else:
        with pytest.raises(nki.NKIError, match="mismatched shapes"):
            k(x, s)
