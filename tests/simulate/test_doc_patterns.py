"""Patterns from AWS's legacy documentation examples (aws-neuron-sdk 49ee15c5,
general/nki/test) and the nki-samples layernorm tutorial, each reproduced in a kernel of our own:
AWS documents and runs them, so the simulator must accept them -- without relaxing the documented
rules around them. docs/simulator.md ("AWS's legacy kernels and tests") has the tally."""
import warnings

import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
from simulate._index import MaskAndWarning


# --- start-partition rule: immediates move no data across partitions ----------------------
def test_immediate_element_writes_at_any_partition():
    # D26 arch guide: the start-partition rule is where the allocator places tensors and which
    # partition shifts an engine makes from a source to a destination; an immediate has no source
    @nki.jit
    def k():
        t = nl.zeros((32, 4), dtype=nl.int32)
        for i in nl.static_range(32):
            for j in nl.static_range(4):
                t[i, j] = i * 10 + j
        out = nl.ndarray((32, 4), dtype=nl.int32, buffer=nl.shared_hbm)
        nl.store(out, t)
        return out
    np.testing.assert_array_equal(k(), np.arange(32)[:, None] * 10 + np.arange(4))


def test_tile_sourced_write_at_unaligned_partition_still_refused():
    @nki.jit
    def k():
        t = nl.zeros((32, 4), dtype=nl.float32)
        t[3, 0:4] = nl.exp(nl.zeros((1, 4), dtype=nl.float32))   # partition shift 0 -> 3
    with pytest.raises(ValueError, match="start partition 3"):
        k()


def test_immediate_write_with_partition_stride_still_refused():
    @nki.jit
    def k():
        t = nl.zeros((32, 4), dtype=nl.float32)
        t[0:32:2, 0:4] = 1.0
    with pytest.raises(ValueError, match="unit stride"):
        k()


# --- `and` between mask predicates ---------------------------------------------------------
def test_mask_written_with_python_and_keeps_its_right_operand():
    # AWS's nc_match_replace8 example writes mask=(ix < a and iy < b); its known issues say
    # `and` is unsupported for masks (use &). Python's `and` yields the right operand.
    @nki.jit
    def k(x):
        ix, iy = nl.mgrid[0:8, 0:16]
        t = nl.load(x)
        out = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        r = nl.ndarray((8, 16), dtype=nl.float32)
        r[...] = nl.multiply(t, 0.0)
        r[ix, iy] = nl.add(t, 1.0, mask=(ix < 2 and iy < 4))
        nl.store(out, r)
        return out
    x = np.zeros((8, 16), np.float32)
    with pytest.warns(MaskAndWarning, match="use `&`"):
        got = k(x)
    want = np.zeros((8, 16), np.float32)
    want[:, :4] = 1.0                                       # every row: `ix < 2` is dropped
    np.testing.assert_array_equal(got, want)


def test_if_on_a_predicate_is_still_control_flow_error():
    @nki.jit
    def k(x):
        ix = nl.arange(8)[:, None]
        if ix < 4:
            pass
    with pytest.raises(SyntaxError, match="Control-flow depending on `nl.arange`"):
        k(np.zeros((8, 8), np.float32))


def test_mask_and_warning_not_raised_for_ampersand():
    @nki.jit
    def k(x):
        ix, iy = nl.mgrid[0:8, 0:16]
        out = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out[ix, iy], nl.load(x[ix, iy]), mask=(ix < 2) & (iy < 4))
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("error", MaskAndWarning)
        k(np.zeros((8, 16), np.float32))


# --- masks over an instruction's input indices ----------------------------------------------
def test_max8_mask_over_input_columns():
    @nki.jit
    def k(x):
        ix, iy = nl.mgrid[0:16, 0:64]
        t = nl.load(x)
        out = nl.ndarray((16, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nisa.max8(src=t[ix, iy], mask=(iy < 32)))
        return out
    x = np.random.default_rng(0).random((16, 64), dtype=np.float32)
    x[:, 40] = 5.0                                          # masked out: must not be found
    np.testing.assert_array_equal(k(x), -np.sort(-x[:, :32], axis=1)[:, :8])


def test_match_replace8_mask_over_data_rows_and_columns():
    @nki.jit
    def k(x):
        ix, iy = nl.mgrid[0:16, 0:64]
        t = nl.load(x)
        idx = nisa.memset(shape=(16, 8), value=0, dtype=nl.uint32)
        top = nisa.max8(src=t[ix, iy], mask=(ix < 8) & (iy < 32))
        r = nisa.nc_match_replace8(dst_idx=idx[:, :], data=t[ix, iy], vals=top, imm=-1.0,
                                   mask=(ix < 8) & (iy < 32))
        o1 = nl.ndarray((16, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray((16, 8), dtype=nl.uint32, buffer=nl.shared_hbm)
        nl.store(o1, r)
        nl.store(o2, idx)
        return o1, o2
    x = np.random.default_rng(1).random((16, 64), dtype=np.float32)
    got, gidx = k(x)
    order = np.argsort(-x[:8, :32], axis=1, kind="stable")[:, :8]
    want = x[:8, :32].copy()
    np.put_along_axis(want, order, -1.0, axis=1)
    np.testing.assert_array_equal(got[:8, :32], want)
    np.testing.assert_array_equal(np.sort(gidx[:8], axis=1), np.sort(order, axis=1))
    np.testing.assert_array_equal(gidx[8:], 0)              # masked-out rows keep the memset


def test_bn_stats_mask_over_input_tail_that_is_out_of_bounds():
    # nki-samples layernorm v2: bn_stats over fixed 512-wide chunks of a 1000-wide row, the
    # last chunk's out-of-range columns masked off in the input's index
    F, W = 1000, 512
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 2), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        ip = nl.arange(128)[:, None]
        jf = nl.arange(W)[None, :]
        i6 = nl.arange(6)[None, :]
        st = nl.ndarray((128, 12), dtype=nl.float32)
        for j in nl.affine_range(2):
            st[ip, j * 6 + i6] = nisa.bn_stats(t[ip, j * W + jf], mask=(j * W + jf < F))
        nl.store(out, nisa.bn_aggr(st))
        return out
    x = np.random.default_rng(2).random((128, F), dtype=np.float32)
    got = k(x)
    np.testing.assert_allclose(got[:, 0], x.mean(axis=1), rtol=1e-5)
    np.testing.assert_allclose(got[:, 1], x.var(axis=1), rtol=1e-4)


def test_bn_stats_unmasked_out_of_bounds_still_refused():
    @nki.jit
    def k(x):
        t = nl.load(x)
        ip = nl.arange(128)[:, None]
        jf = nl.arange(512)[None, :]
        nisa.bn_stats(t[ip, 512 + jf])
    with pytest.raises(IndexError, match="Out-of-bound access"):
        k(np.zeros((128, 1000), np.float32))


# --- on-chip tensors returned by a mode="simulation" kernel ----------------------------------
def test_simulation_mode_kernel_may_return_an_sbuf_tile():
    @nki.jit(mode="simulation")
    def k(x):
        t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        t[...] = nl.add(nl.load(x), 1.0)
        return t
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(k(x), x + 1)


def test_device_mode_kernel_may_not_return_an_sbuf_tile():
    @nki.jit
    def k(x):
        t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        t[...] = nl.add(nl.load(x), 1.0)
        return t
    with pytest.raises(TypeError, match="kernel outputs must be HBM tensors"):
        k(np.zeros((4, 8), np.float32))
