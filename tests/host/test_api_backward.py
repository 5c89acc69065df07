"""host.flash_attention_backward: forward kernel -> backward kernel against the float64
gradients, validation errors, and exact HBM traffic.

Tolerance rule (docs/semantics.md): max abs error of each gradient against
``host.reference.attention_backward`` (float64) at most ``2 * err_baseline + atol_floor`` with
the baseline ``attention_backward_baseline_lowp`` in the matmul operand dtype and the floor
1e-3 (bf16/fp16 operands) or 1e-5 (fp32 operands). Here o and lse come from the forward kernel
(host.flash_attention), as in training.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import host
from _attention_inputs import attention_inputs
from host import reference as ref
from nki_kernels.nki import BACKEND

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

needs_measure = pytest.mark.skipif(BACKEND != "simulate",
                                   reason="simulate.measure needs the bundled simulator")


def _inputs(B, Hq, Hkv, Nq, Nk, D, dtype=BF16, seed=0):
    return attention_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed)


def _train_step(q, k, v, do, **opts):
    o, lse = host.flash_attention(q, k, v, return_lse=True, **opts)
    return host.flash_attention_backward(do, q, k, v, o, lse, **opts)


def _check(got, q, k, v, do, mixed_precision=True, **mask_opts):
    exact = ref.attention_backward(do, q, k, v, **mask_opts)
    op = BF16 if (q.dtype == F32 and mixed_precision) else q.dtype
    base = ref.attention_backward_baseline_lowp(do, q, k, v, dtype=op, out_dtype=q.dtype,
                                                **mask_opts)
    for name, g, e, b in zip(("dq", "dk", "dv"), got, exact, base):
        assert g.shape == e.shape and g.dtype == q.dtype, (name, g.shape, g.dtype)
        err = ref.max_abs_err(g, e)
        tol = ref.tolerance(e, b, floor=ref.atol_floor(op))
        assert err <= tol, f"{name}: max abs err {err:.3g} > tolerance {tol:.3g}"


# --------------------------------------------------------------------------------------------
# forward kernel -> backward kernel
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Hq,Hkv,Nq,Nk,D,opts", [
    (2, 2, 127, 129, 64, dict()),
    (8, 2, 100, 230, 32, dict(causal="bottom_right")),
    (4, 1, 200, 90, 80, dict(causal="bottom_right")),          # MQA, rows with no key
    (2, 1, 150, 150, 128, dict(causal="top_left", window=(40, -1))),
    (2, 2, 96, 300, 16, dict(window=(20, 30))),
])
def test_forward_then_backward(Hq, Hkv, Nq, Nk, D, opts):
    q, k, v, do = _inputs(1, Hq, Hkv, Nq, Nk, D, seed=Nq + Nk)
    _check(_train_step(q, k, v, do, **opts), q, k, v, do, **opts)


def test_padded_batch():
    q, k, v, do = _inputs(3, 4, 2, 100, 120, 32, seed=5)
    opts = dict(causal=True, q_lens=np.array([100, 37, 0]), kv_lens=[120, 0, 64])
    got = _train_step(q, k, v, do, **opts)
    _check(got, q, k, v, do, **opts)
    dq, dk, dv = (np.asarray(x, np.float64) for x in got)
    assert not dq[1, :, 37:].any() and not dq[2].any() and not dq[1].any()
    assert not dk[1].any() and not dv[1].any() and not dk[2, :, 64:].any()


def test_causal_true_is_bottom_right():
    q, k, v, do = _inputs(1, 2, 1, 70, 100, 32, seed=6)
    o, lse = host.flash_attention(q, k, v, causal="bottom_right", return_lse=True)
    a = host.flash_attention_backward(do, q, k, v, o, lse, causal=True)
    b = host.flash_attention_backward(do, q, k, v, o, lse, causal="bottom_right")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("dtype,mixed_precision", [(F32, False), (F32, True), (F16, True)])
def test_dtypes(dtype, mixed_precision):
    q, k, v, do = _inputs(2, 2, 1, 60, 140, 32, dtype, seed=7)
    opts = dict(causal="top_left", scale=0.2, mixed_precision=mixed_precision)
    got = _train_step(q, k, v, do, **opts)
    opts.pop("mixed_precision")
    _check(got, q, k, v, do, mixed_precision=mixed_precision, **opts)


def test_lse_minus_inf_rows_contribute_nothing():
    """A row whose given lse is -inf gets zero gradients, without NaN (the reference's
    attention_backward_from_lse rule), even if its keys are visible."""
    q, k, v, do = _inputs(1, 1, 1, 64, 64, 32, seed=8)
    o, lse = ref.attention_forward(q, k, v)
    o, lse = o.astype(BF16), lse.astype(np.float32)
    lse[0, 0, 10] = -np.inf
    got = host.flash_attention_backward(do, q, k, v, o, lse)
    want = ref.attention_backward_from_lse(do, q, k, v, o, lse)
    dq = np.asarray(got[0], np.float64)
    assert np.isfinite(dq).all() and not dq[0, 0, 10].any()
    for g, w in zip(got, want):
        assert ref.max_abs_err(g, w) < 3e-2


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _valid():
    q, k, v, do = _inputs(1, 2, 1, 8, 8, 16, seed=9)
    o = q.copy()
    lse = np.zeros((1, 2, 8), np.float32)
    return dict(do=do, q=q, k=k, v=v, o=o, lse=lse)


@pytest.mark.parametrize("change,exc,message", [
    (dict(do=np.zeros((1, 2, 9, 16), BF16)), ValueError, "do: expected the same shape as q"),
    (dict(o=np.zeros((1, 2, 8, 16), F16)), TypeError, "o: dtype float16 does not match q"),
    (dict(lse=np.zeros((1, 2, 8), np.float64)), TypeError,
     "lse: dtype float64 is not supported; allowed: float32"),
    (dict(lse=np.zeros((1, 2, 7), np.float32)), ValueError,
     "lse: expected shape (B, Hq, Nq) = (1, 2, 8)"),
    (dict(lse=np.zeros((1, 2), np.float32)), ValueError, "lse: expected a 3-D array"),
    (dict(k=np.zeros((1, 3, 8, 16), BF16), v=np.zeros((1, 3, 8, 16), BF16)), ValueError,
     "Hkv=3 kv heads must divide"),
    (dict(do=[[0.0]]), TypeError, "do: expected a numpy.ndarray or torch.Tensor"),
    (dict(q=np.zeros((1, 2, 8, 300), BF16), do=np.zeros((1, 2, 8, 300), BF16),
          o=np.zeros((1, 2, 8, 300), BF16), k=np.zeros((1, 1, 8, 300), BF16),
          v=np.zeros((1, 1, 8, 300), BF16)), ValueError, "head dim D must be in [1, 256]"),
])
def test_bad_arrays(change, exc, message):
    args = _valid()
    args.update(change)
    with pytest.raises(exc, match=_re(message)):
        host.flash_attention_backward(args["do"], args["q"], args["k"], args["v"], args["o"],
                                      args["lse"])


@pytest.mark.parametrize("opts,exc,message", [
    (dict(causal="yes"), ValueError, "causal: expected None, False, True"),
    (dict(causal=1), TypeError, "causal: expected None, False, True"),
    (dict(window=(3,)), ValueError, "window: expected a (left, right) pair"),
    (dict(window=(-2, 0)), ValueError, "window: left must be >= -1"),
    (dict(kv_lens=[9]), ValueError, "kv_lens: values must be in [0, Nk=8], got 9 at index 0"),
    (dict(q_lens=[1, 2]), ValueError, "q_lens: expected length B=1"),
    (dict(q_lens=np.array([1.0])), TypeError, "q_lens: expected an integer array"),
    (dict(scale=float("nan")), ValueError, "scale: expected a finite real number"),
    (dict(scale="0.1"), TypeError, "scale: expected None or a finite real number"),
    (dict(mixed_precision="no"), TypeError, "mixed_precision: expected True or False"),
])
def test_bad_options(opts, exc, message):
    a = _valid()
    with pytest.raises(exc, match=_re(message)):
        host.flash_attention_backward(a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"], **opts)


def _re(text):
    import re
    return re.escape(text)


# --------------------------------------------------------------------------------------------
# HBM traffic
# --------------------------------------------------------------------------------------------


@needs_measure
@pytest.mark.parametrize("target,dtype,mixed,shape,lens", [
    ("trn2", BF16, True, (2, 4, 2, 300, 200, 64), None),
    ("trn1", BF16, True, (3, 2, 1, 100, 130, 32), ([100, 0, 33], [5, 130, 0])),
    # fp32 operands, D = 256 on trn1: 3840 rows fit, 4 heads x 1024 rows need two passes.
    ("trn1", F32, False, (1, 4, 1, 1024, 128, 256), None),
])
def test_hbm_bytes(target, dtype, mixed, shape, lens):
    import simulate
    B, Hq, Hkv, Nq, Nk, D = shape
    q, k, v, do = _inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed=10)
    q_lens, kv_lens = lens if lens else (None, None)
    o, lse = ref.attention_forward(q, k, v, q_lens=q_lens, kv_lens=kv_lens)
    o, lse = o.astype(dtype), lse.astype(np.float32)
    with simulate.measure(target=target) as m:
        host.flash_attention_backward(do, q, k, v, o, lse, q_lens=q_lens, kv_lens=kv_lens,
                                      mixed_precision=mixed)
    want = host.flash_attention_backward_hbm_bytes(
        B, Hq, Hkv, Nq, Nk, D, dtype.itemsize, q_lens=q_lens, kv_lens=kv_lens,
        mixed_precision=mixed, target=target)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == want


@needs_measure
@pytest.mark.parametrize("target,dtype,mixed,shape,causal,window", [
    # bottom_right with lengths: rows and keys rotated, outputs scattered back
    ("trn2", BF16, True, (3, 4, 2, 150, 200, 64), "bottom_right", None),
    ("trn1", BF16, True, (2, 2, 1, 100, 70, 32), None, (20, 5)),
    # two passes over K/V (dK/dV partial sums through HBM) with rotated keys
    ("trn1", F32, False, (2, 4, 1, 1024, 128, 256), "bottom_right", None),
])
def test_hbm_bytes_with_lengths_and_masks(target, dtype, mixed, shape, causal, window):
    """The formula holds with every mask kind: padding is never read (gathers), every output
    row written once (plain or scattered stores), one int32 per program per length array."""
    import simulate
    B, Hq, Hkv, Nq, Nk, D = shape
    q, k, v, do = _inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed=11)
    rng = np.random.default_rng(12)
    q_lens = rng.integers(0, Nq + 1, B)
    kv_lens = rng.integers(0, Nk + 1, B)
    q_lens[0], kv_lens[-1] = Nq, 0
    opts = dict(causal=causal, window=window, q_lens=q_lens, kv_lens=kv_lens)
    o, lse = ref.attention_forward(q, k, v, **opts)
    o, lse = o.astype(dtype), lse.astype(np.float32)
    with simulate.measure(target=target) as m:
        got = host.flash_attention_backward(do, q, k, v, o, lse, mixed_precision=mixed, **opts)
    want = host.flash_attention_backward_hbm_bytes(
        B, Hq, Hkv, Nq, Nk, D, dtype.itemsize, causal=causal, window=window, q_lens=q_lens,
        kv_lens=kv_lens, mixed_precision=mixed, target=target)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == want
    _check(got, q, k, v, do, mixed_precision=mixed, **opts)


@needs_measure
@pytest.mark.parametrize("B,Hkv,spread", [(1, 2, True), (2, 1, True), (1, 1, False)])
def test_lnc2_spreads_programs_over_the_two_cores(B, Hkv, spread):
    """trn2 LNC=2: kv heads (or sequences) go to the two cores, halving the modeled time with
    the same gradients and bytes; one (sequence, kv head) program stays on one core."""
    import simulate
    q, k, v, do = _inputs(B, 2 * Hkv, Hkv, 256, 256, 64, BF16, seed=13)
    o, lse = ref.attention_forward(q, k, v, causal="bottom_right")
    o, lse = o.astype(BF16), lse.astype(np.float32)
    runs = {}
    for lnc in (1, 2):
        with simulate.measure(target="trn2") as m:
            runs[lnc] = host.flash_attention_backward(do, q, k, v, o, lse, causal=True, lnc=lnc)
        runs[lnc, "m"] = m
    for a, b in zip(runs[1], runs[2]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    m1, m2 = runs[1, "m"], runs[2, "m"]
    assert (m1.hbm_bytes_read, m1.hbm_bytes_written) == (m2.hbm_bytes_read, m2.hbm_bytes_written)
    t1, t2 = m1.modeled_seconds[0], m2.modeled_seconds[0]
    if spread:
        assert t2 == pytest.approx(t1 / 2, rel=1e-6)
    else:
        assert t2 == t1
