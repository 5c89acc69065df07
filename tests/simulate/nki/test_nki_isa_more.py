"""nki.isa (NKI 0.7) beyond the first slice: dma_transpose, the accumulation-register
instructions (activation reduce forms, tensor_scalar_reduce, range_select, select_reduce,
exponential), affine_select's pattern form, predicated copy, scan, bn_stats/bn_aggr, the top-8
family, the 0.7 enums. Values against NumPy; per family, the nki.* call costs what the legacy
``dst[...] = nisa.op(...)`` (or in-place legacy call) costs."""
import ml_dtypes
import numpy as np
import pytest

import simulate
from simulate import isa as lisa, language as lnl
from nki07_fixtures import nk, tile_kernel  # noqa: F401 (nk: fixture)

FP32_MIN = np.float32(-3.4028235e38)


_k = tile_kernel


def _leg(body, shape_out, dtype_out=None):
    """The legacy twin of ``_k``: ``body(*tiles) -> sbuf tile`` with neuronxcc.nki APIs."""
    return tile_kernel(simulate, lnl, lisa, lambda nl, nisa, *tiles: body(*tiles), shape_out,
                       dtype_out)


def _same_cost(run_nki, run_leg, target="trn2"):
    with simulate.measure(target=target) as m1:
        r1 = run_nki()
    with simulate.measure(target=target) as m2:
        r2 = run_leg()
    for a, b in zip(r1 if isinstance(r1, tuple) else (r1,), r2 if isinstance(r2, tuple) else (r2,)):
        np.testing.assert_array_equal(a, b)
    assert m1.engine_cycles == m2.engine_cycles
    assert m1.instructions == m2.instructions
    assert m1.estimated_seconds == m2.estimated_seconds
    return m1


# -- enums / versions ---------------------------------------------------------------------------
def test_enums_have_the_07_values(nk):
    nki, nl, nisa = nk
    assert int(nisa.engine.dma) == 4 and int(nisa.engine.vector) == 5
    assert int(nisa.reduce_cmd.load_reduce) == 4
    assert (int(nisa.dge_mode.unknown), int(nisa.dge_mode.none)) == (0, 3)
    assert int(nisa.nc_version.gen4) == 4
    assert nisa.vector_engine is nisa.engine.vector


@pytest.mark.parametrize("target,gen", [("trn2", 3), ("trn3", 4)])
def test_get_nc_version(nk, target, gen):
    nki, nl, nisa = nk
    seen = []

    @nki.jit
    def k(a):
        seen.append((nisa.get_nc_version(), nisa.get_nc_sub_version()))
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a)
        return out
    with simulate.measure(target=target):
        k(np.zeros((1, 1), np.float32))
    assert seen == [(nisa.nc_version(gen), 0)]


# -- dma_transpose ------------------------------------------------------------------------------
def test_dma_transpose_hbm_and_sbuf(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((64, 128)).astype(ml_dtypes.bfloat16)

    @nki.jit
    def k(a):
        out = nl.ndarray((2, 128, 64), a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 64), a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=a)                       # HBM -> SBUF
        nisa.dma_copy(dst=out[0], src=t)
        s = nl.ndarray((64, 128), a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=s, src=a)
        u = nl.ndarray((128, 64), a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(u, s, axes=(1, 0))                  # SBUF -> SBUF
        nisa.dma_copy(dst=out[1], src=u)
        return out
    out = k(a)
    np.testing.assert_array_equal(out[0], a.T)
    np.testing.assert_array_equal(out[1], a.T)


def test_dma_transpose_rules(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((64, 128)).astype(ml_dtypes.bfloat16)

    def run(dst_dtype=None, buffer=None, **kw):
        @nki.jit
        def k(a):
            out = nl.ndarray((128, 64), a.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray((128, 64), dst_dtype or a.dtype, buffer=buffer or nl.sbuf)
            nisa.dma_transpose(dst=t, src=a, **kw)
            return out
        return k(a)
    with pytest.raises(TypeError, match="src.dtype == dst.dtype"):
        run(dst_dtype=nl.float32)
    with pytest.raises(TypeError, match="SBUF"):
        run(buffer=nl.psum)
    with pytest.raises(ValueError, match="axes"):
        run(axes=(0, 1))
    with pytest.raises(ValueError, match="swdge"):
        run(dge_mode=nisa.dge_mode.swdge)
    with pytest.raises(ValueError, match="hwdge transpose constraints"):
        run(dge_mode=nisa.dge_mode.hwdge)                      # 2-D needs src.shape[0] == 16
    with pytest.raises(SyntaxError, match="NeuronCore-v4"):
        run(priority=1)


def test_dma_transpose_hwdge_16_rows(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((16, 128)).astype(np.float16)

    @nki.jit
    def k(a):
        out = nl.ndarray((128, 16), a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 16), a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=a, dge_mode=nisa.dge_mode.hwdge)
        nisa.dma_copy(dst=out, src=t)
        return out
    np.testing.assert_array_equal(k(a), a.T)


def test_dma_transpose_costs_the_legacy_assignment(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((64, 128)).astype(ml_dtypes.bfloat16)

    @nki.jit
    def k(a):
        out = nl.ndarray((128, 64), a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 64), a.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t, src=a)
        nisa.dma_copy(dst=out, src=t)
        return out

    @simulate.jit
    def leg(a):
        out = lnl.ndarray((128, 64), a.dtype, buffer=lnl.shared_hbm)
        t = lnl.ndarray((128, 64), a.dtype, buffer=lnl.sbuf)
        t[...] = lisa.dma_transpose(a)
        lisa.dma_copy(dst=out, src=t)
        return out
    _same_cost(lambda: k(a), lambda: leg(a))


# -- activation's reducing forms ----------------------------------------------------------------
def test_activation_reduce_cmd_sequence(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32)

    def body(nl, nisa, x, y):
        e = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        r = nl.ndarray((128, 4), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=x, reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=r[:, 0:1])
        nisa.activation(dst=e, op=nl.exp, data=y, reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reduce, reduce_res=r[:, 1:2])
        # idle leaves the registers alone; reduce_res reads them out (stub pseudo code)
        nisa.activation(dst=e, op=nl.exp, data=y, reduce_op=nl.add, reduce_res=r[:, 2:3])
        nisa.activation(dst=e, op=nl.copy, data=x, reduce_cmd=nisa.reduce_cmd.reset,
                        reduce_res=r[:, 3:4])
        return r
    out = _k(nki, nl, nisa, body, (128, 4))(a, b)
    sa = np.exp(a).sum(axis=1)
    sb = np.exp(b).sum(axis=1)
    np.testing.assert_allclose(out[:, 0], sa, rtol=1e-5)
    np.testing.assert_allclose(out[:, 1], sa + sb, rtol=1e-5)
    np.testing.assert_allclose(out[:, 2], sa + sb, rtol=1e-5)
    np.testing.assert_array_equal(out[:, 3], 0)


def test_chained_activation_reduction_pays_one_readout(nk, rng):
    """The stub: reducing into the registers costs nothing "except reading out reduce_regs into
    reduce_res": three chained exps of 512 columns cost 3 x 512 ScalarE cycles plus one
    readout (ACT_REDUCE_EXTRA_CYCLES), in either namespace, and sum all three."""
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 1536)).astype(np.float32)

    def body(nl, nisa, x):
        e = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
        r = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        for c, cmd in enumerate((nisa.reduce_cmd.reset_reduce, nisa.reduce_cmd.reduce,
                                 nisa.reduce_cmd.reduce)):
            nisa.activation(dst=e, op=nl.exp, data=x[:, c * 512:(c + 1) * 512],
                            reduce_op=nl.add, reduce_cmd=cmd, reduce_res=r if c == 2 else None)
        return r

    def leg_body(x):
        r = lnl.ndarray((128, 1), lnl.float32, buffer=lnl.sbuf)
        for c, cmd in enumerate((lisa.reduce_cmd.reset_reduce, lisa.reduce_cmd.reduce,
                                 lisa.reduce_cmd.reduce)):
            lisa.activation(lnl.exp, x[:, c * 512:(c + 1) * 512], reduce_op=np.add,
                            reduce_cmd=cmd, reduce_res=r if c == 2 else None)
        return r
    m = _same_cost(lambda: _k(nki, nl, nisa, body, (128, 1))(a),
                   lambda: _leg(leg_body, (128, 1))(a))
    assert m.engine_cycles["scalar"] == 3 * 512 + simulate._hw.ACT_REDUCE_EXTRA_CYCLES


def test_activation_scalar_bias_and_add_only(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)

    def body(nl, nisa, x):
        e = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=x, bias=-1.0, scale=2.0)
        return e
    np.testing.assert_allclose(_k(nki, nl, nisa, body, a.shape)(a), np.exp(2 * a - 1),
                               rtol=1e-6)
    with simulate.measure(target="trn1"), pytest.warns(UserWarning), \
            pytest.raises(TypeError, match="NeuronCore-v3"):
        _k(nki, nl, nisa, body, a.shape)(a)

    def max_reduce(nl, nisa, x):
        e = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        r = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=x, reduce_op=nl.maximum,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=r)
        return r
    with pytest.raises(SyntaxError, match="reduce_op"):
        _k(nki, nl, nisa, max_reduce, (128, 1))(a)


def test_activation_reduce(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 2, 32)).astype(np.float32)
    bias = rng.standard_normal((128, 1)).astype(np.float32)

    def body(nl, nisa, x, b):
        e = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
        r = nl.ndarray((128, 2), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(dst=e, op=nl.exp, data=x, reduce_op=nl.add,
                               reduce_res=r[:, 0:1], bias=b, scale=0.5)
        nisa.activation_reduce(e, nl.exp, x, nl.maximum, None, bias=b)   # registers only
        nisa.activation(dst=e, op=nl.exp, data=x, reduce_res=r[:, 1:2])  # idle: read out
        return r
    out = _k(nki, nl, nisa, body, (128, 2))(a, bias)
    x = a.reshape(128, 64)
    np.testing.assert_allclose(out[:, 0], np.exp(0.5 * x + bias).sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(out[:, 1], np.exp(x + bias).max(axis=1), rtol=1e-6)


def test_activation_reduce_costs_the_legacy_assignment(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 512)).astype(np.float32)
    bias = rng.standard_normal((128, 1)).astype(np.float32)

    def body(nl, nisa, x, b):
        e = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        r = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=x, bias=b, reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=r)
        nisa.activation_reduce(dst=e, op=nl.exp, data=x, reduce_op=nl.add, reduce_res=r,
                               bias=b)
        return r

    def leg(x, b):
        e = lnl.ndarray(x.shape, lnl.bfloat16, buffer=lnl.sbuf)
        r = lnl.ndarray((128, 1), lnl.float32, buffer=lnl.sbuf)
        e[...] = lisa.activation(op=lnl.exp, data=x, bias=b, reduce_op=lnl.add,
                                 reduce_cmd=lisa.reduce_cmd.reset_reduce, reduce_res=r,
                                 dtype=lnl.bfloat16)
        e[...] = lisa.activation_reduce(op=lnl.exp, data=x, reduce_op=lnl.add, reduce_res=r,
                                        bias=b, dtype=lnl.bfloat16)
        return r
    _same_cost(lambda: _k(nki, nl, nisa, body, (128, 1))(a, bias),
               lambda: _leg(leg, (128, 1))(a, bias))


# -- tensor_scalar_reduce -----------------------------------------------------------------------
def test_tensor_scalar_reduce_accumulates(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32)
    init = rng.standard_normal((128, 1)).astype(np.float32)

    def body(nl, nisa, x, y, i0):
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        r = nl.ndarray((128, 5), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=d, data=x, op0=nl.multiply, operand0=2.0,
                                  reduce_op=nl.maximum, reduce_res=r[:, 0:1])
        nisa.tensor_scalar_reduce(dst=d, data=y, op0=nl.multiply, operand0=2.0,
                                  reduce_op=nl.maximum, reduce_res=r[:, 1:2],
                                  reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.tensor_scalar_reduce(dst=d, data=x, op0=nl.add, operand0=1.0, reduce_op=nl.add,
                                  reduce_res=r[:, 2:3], reduce_cmd=nisa.reduce_cmd.load_reduce,
                                  reduce_init=i0)
        nisa.tensor_scalar_reduce(dst=d, data=y, op0=nl.add, operand0=1.0, reduce_op=nl.add,
                                  reduce_res=r[:, 3:4], reduce_cmd=nisa.reduce_cmd.reduce,
                                  reduce_res_negate=True)
        nisa.tensor_scalar_reduce(dst=d, data=y, op0=nl.subtract, operand0=x[:, 0:1],
                                  reduce_op=nl.minimum, reduce_res=r[:, 4:5])
        return r
    out = _k(nki, nl, nisa, body, (128, 5))(a, b, init)
    np.testing.assert_array_equal(out[:, 0], (2 * a).max(axis=1))
    np.testing.assert_array_equal(out[:, 1], np.maximum((2 * a).max(axis=1),
                                                        (2 * b).max(axis=1)))
    s1 = init[:, 0] + (a + 1).sum(axis=1)
    np.testing.assert_allclose(out[:, 2], s1, rtol=1e-5)
    np.testing.assert_allclose(out[:, 3], -(s1 + (b + 1).sum(axis=1)), rtol=1e-5)
    np.testing.assert_array_equal(out[:, 4], (b - a[:, 0:1]).min(axis=1))


def test_tensor_scalar_reduce_rules(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)

    def run(**kw):
        def body(nl, nisa, x):
            d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
            r = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
            args = dict(dst=d, data=x, op0=nl.add, operand0=1.0, reduce_op=nl.add,
                        reduce_res=r)
            args.update(kw)
            nisa.tensor_scalar_reduce(**args)
            return r
        return _k(nki, nl, nisa, body, (128, 1))(a)
    with pytest.raises(ValueError, match="reduce_init"):
        run(reduce_cmd=nisa.reduce_cmd.load_reduce)
    with pytest.raises(ValueError, match="reduce_init"):
        run(reduce_init=1.0)
    with pytest.raises(SyntaxError, match="idle"):
        run(reduce_cmd=nisa.reduce_cmd.idle)
    with pytest.raises(SyntaxError, match="subtract"):
        run(reduce_op=nl.subtract)


def test_tensor_scalar_reduce_costs_the_legacy_assignment(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 512)).astype(np.float32)

    def body(nl, nisa, x):
        d = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        r = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=d, data=x, op0=nl.multiply, operand0=0.5,
                                  reduce_op=nl.maximum, reduce_res=r)
        return r

    def leg(x):
        d = lnl.ndarray(x.shape, lnl.bfloat16, buffer=lnl.sbuf)
        r = lnl.ndarray((128, 1), lnl.float32, buffer=lnl.sbuf)
        d[...] = lisa.tensor_scalar_reduce(data=x, op0=lnl.multiply, operand0=0.5,
                                           reduce_op=lnl.maximum, reduce_res=r,
                                           dtype=lnl.bfloat16)
        return r
    _same_cost(lambda: _k(nki, nl, nisa, body, (128, 1))(a), lambda: _leg(leg, (128, 1))(a))


# -- exponential (NeuronCore-v4) ----------------------------------------------------------------
def _exp_kernel(nki, nl, nisa, with_reduce=True):
    @nki.jit
    def k(a, mx):
        out = nl.ndarray((a.shape[0], a.shape[1] + 2), nl.float32, buffer=nl.shared_hbm)
        x = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=a)
        m = nl.ndarray(mx.shape, mx.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=m, src=mx)
        e = nl.ndarray((a.shape[0], a.shape[1] + 2), nl.float32, buffer=nl.sbuf)
        if with_reduce:
            nisa.exponential(dst=e[:, 0:a.shape[1]], src=x, max_value=m,
                             reduce_cmd=nisa.reduce_cmd.reset_reduce,
                             reduce_res=e[:, a.shape[1]:a.shape[1] + 1])
            nisa.exponential(dst=e[:, 0:a.shape[1]], src=x, max_value=m,
                             reduce_cmd=nisa.reduce_cmd.load_reduce, reduce_init=1.0,
                             reduce_res=e[:, a.shape[1] + 1:])
        else:
            nisa.exponential(dst=e[:, 0:a.shape[1]], src=x, max_value=m)
            nisa.memset(dst=e[:, a.shape[1]:], value=0.0)
        nisa.dma_copy(dst=out, src=e)
        return out
    return k


def test_exponential_on_trn3(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 256)).astype(np.float32)
    mx = a.max(axis=1, keepdims=True)
    with simulate.measure(target="trn3"):
        out = _exp_kernel(nki, nl, nisa)(a, mx)
    ref = np.exp(a - mx)
    np.testing.assert_allclose(out[:, :256], ref, rtol=1e-6)
    np.testing.assert_allclose(out[:, 256], ref.sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(out[:, 257], 1 + ref.sum(axis=1), rtol=1e-5)


def test_exponential_is_trn3_only(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 256)).astype(np.float32)
    with pytest.raises(SyntaxError, match="NeuronCore-v4"):
        with simulate.measure(target="trn2"):
            _exp_kernel(nki, nl, nisa)(a, a[:, :1].copy())


def test_exponential_cost_is_a_quarter_of_scalar_exp(nk, rng):
    """trn3: VectorE and ScalarE both at 1.2 GHz, exponential at 4x ScalarE's exp rate: n/4
    VectorE cycles (MIN_II floor)."""
    nki, nl, nisa = nk
    from simulate import _cost, _hw
    a = rng.standard_normal((128, 2048)).astype(np.float32)
    with simulate.measure(target="trn3") as m:
        _exp_kernel(nki, nl, nisa, with_reduce=False)(a, a[:, :1].copy())
    memset = _cost.ii(2)
    assert m.engine_cycles["vector"] == 2048 / 4 + memset
    assert _cost.vector_exp_cycles(_hw.TRN3, 2048) == 512
    assert _cost.vector_exp_cycles(_hw.TRN3, 8) == _cost.MIN_II


# -- selects ------------------------------------------------------------------------------------
def test_affine_select_pattern(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 2, 64)).astype(np.float32)

    def body(nl, nisa, x):
        y = nl.ndarray((128, 128), nl.float32, buffer=nl.sbuf)
        # keep where offset + p - (64 w + f) >= 0 (causal, with an offset of 3)
        nisa.affine_select(dst=y, pattern=[[-64, 2], [-1, 64]], channel_multiplier=1,
                           on_true_tile=x, on_false_value=-1e30, cmp_op=nl.greater_equal,
                           offset=3)
        return y
    out = _k(nki, nl, nisa, body, (128, 128))(a)
    keep = 3 + np.arange(128)[:, None] - np.arange(128)[None, :] >= 0
    np.testing.assert_array_equal(out, np.where(keep, a.reshape(128, 128), np.float32(-1e30)))

    def eq(nl, nisa, x):                  # default cmp_op: equal
        y = nl.ndarray((128, 128), nl.float32, buffer=nl.sbuf)
        nisa.affine_select(y, [[1, 128]], -1, x, 0.0)
        return y
    out = _k(nki, nl, nisa, eq, (128, 128))(a)
    np.testing.assert_array_equal(out, np.diag(np.diag(a.reshape(128, 128))))

    def bad(nl, nisa, x):
        y = nl.ndarray((128, 128), nl.float32, buffer=nl.sbuf)
        nisa.affine_select(y, [[1, 64]], -1, x, 0.0)
        return y
    with pytest.raises(ValueError, match="pattern"):
        _k(nki, nl, nisa, bad, (128, 128))(a)


def test_affine_select_costs_the_legacy_assignment(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 128)).astype(np.float32)

    def body(nl, nisa, x):
        y = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        nisa.affine_select(y, [[-1, 128]], 1, x, float(FP32_MIN), cmp_op=nl.greater_equal)
        return y

    def leg(x):
        ix, iy = lnl.mgrid[0:128, 0:128]
        y = lnl.ndarray((128, 128), lnl.bfloat16, buffer=lnl.sbuf)
        y[...] = lisa.affine_select(pred=(ix >= iy), on_true_tile=x, on_false_value=FP32_MIN,
                                    dtype=lnl.bfloat16)
        return y
    _same_cost(lambda: _k(nki, nl, nisa, body, (128, 128), nl.bfloat16)(a),
               lambda: _leg(leg, (128, 128), lnl.bfloat16)(a))


def test_range_select(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)
    lo = rng.integers(0, 32, (128, 1)).astype(np.float32)
    hi = lo + rng.integers(1, 32, (128, 1)).astype(np.float32)

    def body(nl, nisa, x, b0, b1):
        y = nl.ndarray((128, 66), nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=y[:, 0:64], on_true_tile=x, comp_op0=nl.greater_equal,
                          comp_op1=nl.less, bound0=b0, bound1=b1, reduce_res=y[:, 64:65],
                          range_start=2)
        nisa.range_select(dst=y[:, 0:64], on_true_tile=x, comp_op0=nl.greater_equal,
                          comp_op1=nl.less, bound0=b0, bound1=b1, reduce_res=y[:, 65:66],
                          on_false_value=float(FP32_MIN))
        return y
    out = _k(nki, nl, nisa, body, (128, 66))(a, lo, hi)
    j = np.arange(64)[None, :]
    keep0 = (j + 2 >= lo) & (j + 2 < hi)
    keep1 = (j >= lo) & (j < hi)
    np.testing.assert_array_equal(out[:, 64], np.where(keep0, a, FP32_MIN).max(axis=1))
    np.testing.assert_array_equal(out[:, :64], np.where(keep1, a, FP32_MIN))
    np.testing.assert_array_equal(out[:, 65], np.where(keep1, a, FP32_MIN).max(axis=1))


def test_select_reduce_and_predicated_copy(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 64)).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32)
    p = (rng.random((128, 64)) < 0.5).astype(np.uint8)
    f = rng.standard_normal((128, 1)).astype(np.float32)

    def body(nl, nisa, x, y, pr, fv):
        d = nl.ndarray((128, 130), nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(dst=d[:, 0:64], predicate=pr, on_true=x, on_false=fv,
                           reduce_res=d[:, 128:129], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.select_reduce(dst=d[:, 64:128], predicate=pr, on_true=y, on_false=-5.0,
                           reverse_pred=True, reduce_res=d[:, 129:130],
                           reduce_cmd=nisa.reduce_cmd.reduce)
        nisa.tensor_copy_predicated(dst=d[:, 64:128], src=x, predicate=pr)
        return d
    out = _k(nki, nl, nisa, body, (128, 130))(a, b, p, f)
    s0 = np.where(p != 0, a, f)
    s1 = np.where(p == 0, b, np.float32(-5.0))
    np.testing.assert_array_equal(out[:, :64], s0)
    np.testing.assert_array_equal(out[:, 64:128], np.where(p != 0, a, s1))
    np.testing.assert_array_equal(out[:, 128], s0.max(axis=1))
    np.testing.assert_array_equal(out[:, 129], np.maximum(s0.max(axis=1), s1.max(axis=1)))

    def bad_pred(nl, nisa, x, y, pr, fv):
        d = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy_predicated(dst=d, src=x, predicate=y)     # float predicate
        return d
    with pytest.raises(TypeError, match="predicate"):
        _k(nki, nl, nisa, bad_pred, (128, 64))(a, b, p, f)

    def bad_dtype(nl, nisa, x, y, pr, fv):
        d = nl.ndarray((128, 64), nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy_predicated(dst=d, src=x, predicate=pr)
        return d
    with pytest.raises(TypeError, match="share the data type"):
        _k(nki, nl, nisa, bad_dtype, (128, 64), nl.bfloat16)(a, b, p, f)


def test_in_place_selects_cost_the_legacy_calls(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 512)).astype(np.float32)
    p = (rng.random((128, 512)) < 0.5).astype(np.uint8)

    def body(nl, nisa, x, pr):
        d = nl.ndarray((128, 513), nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(dst=d[:, 0:512], predicate=pr, on_true=x, on_false=0.0,
                           reduce_res=d[:, 512:513], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.tensor_copy_predicated(dst=d[:, 0:512], src=x, predicate=pr, reverse_pred=True)
        return d

    def leg(x, pr):
        d = lnl.ndarray((128, 513), lnl.float32, buffer=lnl.sbuf)
        lisa.select_reduce(dst=d[:, 0:512], predicate=pr, on_true=x, on_false=0.0,
                           reduce_res=d[:, 512:513], reduce_cmd=lisa.reduce_cmd.reset_reduce)
        lisa.tensor_copy_predicated(dst=d[:, 0:512], src=x, predicate=pr, reverse_pred=True)
        return d
    _same_cost(lambda: _k(nki, nl, nisa, body, (128, 513))(a, p),
               lambda: _leg(leg, (128, 513))(a, p))


# -- scalar_tensor_tensor / scan ----------------------------------------------------------------
def test_scalar_tensor_tensor_and_scan(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 32)).astype(np.float32)
    b = rng.standard_normal((128, 32)).astype(np.float32)

    def body(nl, nisa, x, y):
        d = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=d[:, 0:32], data=x, op0=nl.subtract, operand0=x[:, 0:1],
                                  op1=nl.multiply, operand1=y)
        nisa.tensor_tensor_scan(dst=d[:, 32:64], data0=x, data1=y, initial=0.5,
                                op0=nl.multiply, op1=nl.add)
        return d
    out = _k(nki, nl, nisa, body, (128, 64))(a, b)
    np.testing.assert_allclose(out[:, :32], (a - a[:, :1]) * b, rtol=1e-6)
    r = np.float32(0.5) * np.ones(128, np.float32)
    for i in range(32):
        r = a[:, i] * r + b[:, i]
        np.testing.assert_allclose(out[:, 32 + i], r, rtol=1e-5)

    def bitvec(nl, nisa, x, y):
        d = nl.ndarray((128, 32), nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=d, data=x, op0=nl.bitwise_and, operand0=1,
                                  op1=nl.add, operand1=y)
        return d
    with pytest.raises(SyntaxError, match="arithmetic"):
        _k(nki, nl, nisa, bitvec, (128, 32))(a, b)


def test_vector_family_costs_the_legacy_assignment(nk, rng):
    """scalar_tensor_tensor, tensor_tensor_scan, bn_stats/bn_aggr, max8 / find_index8 /
    match_replace8 through either front end."""
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 512)).astype(ml_dtypes.bfloat16)

    def body(nl, nisa, x):
        d = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=d, data=x, op0=nl.subtract, operand0=1.0,
                                  op1=nl.multiply, operand1=x)
        nisa.tensor_tensor_scan(dst=d, data0=x, data1=d, initial=0.0, op0=nl.multiply,
                                op1=nl.add)
        st = nl.ndarray((128, 6), nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(dst=st, data=d)
        ag = nl.ndarray((128, 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=ag, data=st)
        m8 = nl.ndarray((128, 8), nl.bfloat16, buffer=nl.sbuf)
        nisa.max8(dst=m8, src=x)
        ix = nl.ndarray((128, 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=ix, data=x, vals=m8)
        nisa.nc_match_replace8(dst=d, data=x, vals=m8, imm=0.0, dst_idx=ix)
        return d

    def leg(x):
        d = lnl.ndarray((128, 512), lnl.bfloat16, buffer=lnl.sbuf)
        d[...] = lisa.scalar_tensor_tensor(data=x, op0=lnl.subtract, operand0=1.0,
                                           op1=lnl.multiply, operand1=x, dtype=lnl.bfloat16)
        d[...] = lisa.tensor_tensor_scan(x, d, 0.0, lnl.multiply, lnl.add, dtype=lnl.bfloat16)
        st = lnl.ndarray((128, 6), lnl.float32, buffer=lnl.sbuf)
        st[...] = lisa.bn_stats(d, dtype=lnl.float32)
        ag = lnl.ndarray((128, 2), lnl.float32, buffer=lnl.sbuf)
        ag[...] = lisa.bn_aggr(st, dtype=lnl.float32)
        m8 = lnl.ndarray((128, 8), lnl.bfloat16, buffer=lnl.sbuf)
        m8[...] = lisa.max8(src=x, dtype=lnl.bfloat16)
        ix = lnl.ndarray((128, 8), lnl.uint32, buffer=lnl.sbuf)
        ix[...] = lisa.nc_find_index8(data=x, vals=m8, dtype=lnl.uint32)
        d[...] = lisa.nc_match_replace8(data=x, vals=m8, imm=0.0, dst_idx=ix,
                                        dtype=lnl.bfloat16)
        return d
    _same_cost(lambda: _k(nki, nl, nisa, body, (128, 512), nl.bfloat16)(a),
               lambda: _leg(leg, (128, 512), lnl.bfloat16)(a))


# -- statistics and top-8 -----------------------------------------------------------------------
def test_bn_stats_aggr(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 1024)).astype(np.float32)

    def body(nl, nisa, x):
        st = nl.ndarray((128, 12), nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(dst=st[:, 0:6], data=x[:, 0:512])
        nisa.bn_stats(dst=st[:, 6:12], data=x[:, 512:1024])
        ag = nl.ndarray((128, 2), nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=ag, data=st)
        return ag
    out = _k(nki, nl, nisa, body, (128, 2))(a)
    np.testing.assert_allclose(out[:, 0], a.mean(axis=1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out[:, 1], a.var(axis=1), rtol=1e-4)

    def bad(nl, nisa, x):
        st = nl.ndarray((128, 4), nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(dst=st, data=x[:, 0:512])
        return st
    with pytest.raises(ValueError, match="elements per partition"):
        _k(nki, nl, nisa, bad, (128, 4))(a)


def test_top8_family(nk, rng):
    nki, nl, nisa = nk
    a = rng.permutation(128 * 64).reshape(128, 64).astype(np.float32)

    def body(nl, nisa, x):
        m8 = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=m8, src=x)
        ix = nl.ndarray((128, 8), nl.uint16, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=ix, data=x, vals=m8)
        r = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        i2 = nl.ndarray((128, 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_match_replace8(dst=r, data=x, vals=m8, imm=-1.0, dst_idx=i2)
        out = nl.ndarray((128, 88), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out[:, 0:8], src=m8)
        nisa.tensor_copy(dst=out[:, 8:16], src=ix)
        nisa.tensor_copy(dst=out[:, 16:80], src=r)
        nisa.tensor_copy(dst=out[:, 80:88], src=i2)
        return out
    out = _k(nki, nl, nisa, body, (128, 88))(a)
    top = -np.sort(-a, axis=1)[:, :8]
    idx = np.argsort(-a, axis=1)[:, :8]
    np.testing.assert_array_equal(out[:, 0:8], top)
    np.testing.assert_array_equal(out[:, 8:16], idx)
    rep = a.copy()
    np.put_along_axis(rep, idx, -1.0, axis=1)
    np.testing.assert_array_equal(out[:, 16:80], rep)
    np.testing.assert_array_equal(out[:, 80:88], idx)

    def bad(nl, nisa, x):
        m8 = nl.ndarray((128, 2, 4), nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=m8, src=x)
        return m8
    with pytest.raises(ValueError, match="2-D"):
        _k(nki, nl, nisa, bad, (128, 2, 4))(a)


def test_duplicate_vals_pairing(nk):
    """The stub's example: data [1, 2, 3, 4, 8 x 7], vals [3, 8 x 7]: nc_match_replace8 gives
    dst_idx [2, 10, 9, 8, 7, 6, 5, 4]; nc_find_index8 pairs the repeats ascending."""
    nki, nl, nisa = nk
    data = np.array([[1, 2, 3, 4] + [8] * 7], np.float32)
    vals = np.array([[3] + [8] * 7], np.float32)

    def body(nl, nisa, x, v):
        out = nl.ndarray((1, 16), nl.uint32, buffer=nl.sbuf)
        r = nl.ndarray((1, 11), nl.float32, buffer=nl.sbuf)
        nisa.nc_match_replace8(dst=r, data=x, vals=v, imm=0.0, dst_idx=out[:, 0:8])
        nisa.nc_find_index8(dst=out[:, 8:16], data=x, vals=v)
        return out
    out = _k(nki, nl, nisa, body, (1, 16), nl.uint32)(data, vals)
    assert out[0, :8].tolist() == [2, 10, 9, 8, 7, 6, 5, 4]
    assert out[0, 8:].tolist() == [2, 4, 5, 6, 7, 8, 9, 10]


# -- cross-partition ----------------------------------------------------------------------------
def test_stream_shuffle_and_partition_reduce(nk, rng):
    nki, nl, nisa = nk
    a = rng.standard_normal((64, 16)).astype(np.float32)
    mask = [31 - i for i in range(32)]
    mask[5] = 255

    def body(nl, nisa, x):
        y = nl.ndarray((64, 16), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=y, value=7.0)
        nisa.nc_stream_shuffle(dst=y, src=x, shuffle_mask=mask)
        s = nl.ndarray((1, 16), nl.float32, buffer=nl.sbuf)
        nisa.tensor_partition_reduce(dst=s, op=nl.add, data=x)
        out = nl.ndarray((65, 16), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out[0:64], src=y)
        nisa.tensor_copy(dst=out[64:65], src=s)
        return out
    out = _k(nki, nl, nisa, body, (65, 16))(a)
    ref = np.concatenate([a[0:32][::-1], a[32:64][::-1]])
    ref[5] = ref[37] = 7.0
    np.testing.assert_array_equal(out[:64], ref)
    np.testing.assert_allclose(out[64], a.sum(axis=0), rtol=1e-5)


# -- virtual registers --------------------------------------------------------------------------
def test_registers(nk):
    nki, nl, nisa = nk

    @nki.jit
    def k(a):
        out = nl.ndarray((1, 4), nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        r0 = nisa.register_alloc(5)
        r1 = nisa.register_alloc()
        nisa.register_load(r1, t)
        r2 = nisa.register_alloc()
        nisa.register_move(r2, r1)
        r3 = nisa.register_alloc(0)
        nisa.register_move(r3, 9)
        o = nl.ndarray((1, 4), nl.int32, buffer=nl.sbuf)
        for j, r in enumerate((r0, r1, r2, r3)):
            nisa.register_store(o[0:1, j:j + 1], r)
        with pytest.raises(TypeError):
            int(r1)
        nisa.dma_copy(dst=out, src=o)
        return out
    out = k(np.array([[42]], np.int32))
    assert out.tolist() == [[5, 42, 42, 9]]

    @nki.jit
    def bad(a):
        nisa.register_store(a, nisa.register_alloc())
        return a
    with pytest.raises(ValueError, match="never written"):
        bad(np.zeros((1, 1), np.int32))


def test_dma_engine_enum_as_the_stub_numbers_it(nk):
    """nki-library's attention_tkg imports ``nisa.dma_engine`` (sendrecv's transfer engine)."""
    nki, nl, nisa = nk
    assert (int(nisa.dma_engine.dma), int(nisa.dma_engine.gpsimd_dma)) == (1, 2)


# -- random numbers -----------------------------------------------------------------------------
def test_set_rng_seed_and_dropout_are_the_legacy_draw(nk, rng):
    """nisa.set_rng_seed + nisa.dropout (0.7) draw what the legacy nl.random_seed +
    nisa.dropout draw, at the same cost; a reseed repeats the draw; the stub's rules."""
    nki, nl, nisa = nk
    x = rng.standard_normal((128, 96)).astype(np.float32)
    seed = np.array([[1234]], np.int32)

    def body(nl, nisa, t, s):
        d = nl.ndarray((128, 192), nl.float32, buffer=nl.sbuf)
        for half in (0, 96):
            nisa.set_rng_seed(src_seeds=s)
            nisa.dropout(dst=d[:, half:half + 96], data=t, prob=0.25)
        return d

    def legacy(t, s):
        d = lnl.ndarray((128, 192), lnl.float32, buffer=lnl.sbuf)
        for half in (0, 96):
            lnl.random_seed(seed=s)
            d[:, half:half + 96] = lisa.dropout(t, 0.25)
        return d

    m = _same_cost(lambda: _k(nki, nl, nisa, body, (128, 192))(x, seed),
                   lambda: _leg(legacy, (128, 192))(x, seed))
    out = _k(nki, nl, nisa, body, (128, 192))(x, seed)
    np.testing.assert_array_equal(out[:, :96], out[:, 96:])
    kept = out[:, :96] != 0
    np.testing.assert_array_equal(out[:, :96][kept], x[kept])
    assert 0.6 < kept.mean() < 0.9 and m.instructions["vector"] >= 2

    def bad_dtype(nl, nisa, t, s):
        d = nl.ndarray((128, 96), nl.bfloat16, buffer=nl.sbuf)
        nisa.dropout(dst=d, data=t, prob=0.5)
        return d
    with pytest.raises(Exception, match="dropout"):
        _k(nki, nl, nisa, bad_dtype, (128, 96), np.float32)(x, seed)

    def bad_seed(nl, nisa, t, s):
        nisa.set_rng_seed(src_seeds=t[0:1, 0:2])
        return t
    with pytest.raises(Exception, match=r"set_rng_seed.*\[1, 1\]"):
        _k(nki, nl, nisa, bad_seed, (128, 96))(x, seed)
