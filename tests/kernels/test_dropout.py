"""Attention dropout (FlashAttention appendix Algorithms 2 and 4) in the forward and backward
kernels, through the NumPy API.

The forward's debug output (``return_dropout_mask=True``) is the keep mask the kernel drew; the
float64 reference computes O and the gradients with exactly that mask. The backward never sees
the mask: it regenerates it from the seed, so matching the reference's gradients under the
forward's mask is the forward/backward consistency check.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import host
from _attention_inputs import attention_inputs
from host import reference as ref
from nki_kernels import tiles
from nki_kernels.nki import API_ENV_VAR, BACKEND

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)

pytestmark = pytest.mark.skipif(BACKEND != "simulate",
                                reason="the debug mask and exact checks use the simulator")


@pytest.fixture(autouse=True)
def _legacy_namespace(monkeypatch):
    """These tests trace the kernels through the legacy namespace (the forward is one source
    for both; tests/kernels/test_forward.py runs it through nki.* as well)."""
    monkeypatch.setenv(API_ENV_VAR, "legacy")


def _close(got, want, tol):
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    assert err <= tol, f"max abs err {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("opts", [
    dict(),
    dict(causal="top_left"),
    dict(causal="bottom_right", window=(40, -1)),
    dict(causal="top_left", q_lens=[300, 90], kv_lens=[170, 260]),
    # bottom_right with lengths: the kernel rotates the sequences; the mask comes back in
    # the caller's positions
    dict(causal="bottom_right", q_lens=[300, 90], kv_lens=[170, 260]),
    dict(causal="bottom_right", q_lens=[300, 90], kv_lens=[170, 260], softcap=3.0,
         alibi_slopes=np.array([0.1, 0.05, 0.02, 0.01]), sinks=np.array([0.5, -1.0, 2.0, 0.0])),
], ids=["plain", "causal", "window", "lengths", "rotated", "rotated-mods"])
def test_forward_and_backward_match_the_reference_under_the_kernels_mask(opts):
    """fp32 operands: O, LSE and dQ/dK/dV equal the float64 reference's under the mask the
    forward drew (the backward regenerated it from the seed alone); GQA, partial tiles."""
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 300, 260, 48
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, D)
    kw = dict(mixed_precision=False, dropout_p=0.3, seed=77, lnc=1, **opts)
    o, lse, mask = host.flash_attention(q, k, v, return_lse=True, return_dropout_mask=True,
                                        **kw)
    ro, rlse = ref.attention_forward(q, k, v, dropout_p=0.3, dropout_mask=mask, **opts)
    _close(o, ro, 1e-5)
    np.testing.assert_allclose(lse, rlse, atol=1e-5)
    grads = host.flash_attention_backward(do, q, k, v, o, lse, **kw)
    want = ref.attention_backward(do, q, k, v, dropout_p=0.3, dropout_mask=mask, **opts)
    assert len(grads) == len(want)
    for g, w in zip(grads, want):
        _close(g, w, 1e-4)


def test_lse_is_that_of_the_undropped_softmax():
    """(With dropout the row sums come from the fp32 exp instead of the matmul-precision P
    column, hence a last-bit tolerance.)"""
    q, k, v, _ = attention_inputs(1, 2, 2, 200, 200, 32)
    _, lse_d = host.flash_attention(q, k, v, return_lse=True, dropout_p=0.5, seed=1)
    _, lse = host.flash_attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(lse_d, lse, atol=2e-3)


def test_keep_rate_is_binomial():
    """Over 2 x 2 x 512 x 512 drawn entries the keep rate is within 5 standard deviations of
    1 - p."""
    q, k, v, _ = attention_inputs(2, 2, 2, 512, 512, 16, BF16)
    p = 0.2
    _, mask = host.flash_attention(q, k, v, dropout_p=p, seed=5, return_dropout_mask=True)
    n = mask.size
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(mask.mean() - (1 - p)) <= 5 * sd


def test_same_seed_same_output_other_seed_other_mask():
    q, k, v, _ = attention_inputs(1, 2, 1, 256, 256, 32, BF16)
    a = host.flash_attention(q, k, v, dropout_p=0.1, seed=11, return_dropout_mask=True)
    b = host.flash_attention(q, k, v, dropout_p=0.1, seed=11, return_dropout_mask=True)
    c = host.flash_attention(q, k, v, dropout_p=0.1, seed=12, return_dropout_mask=True)
    np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
    np.testing.assert_array_equal(a[1], b[1])
    assert (a[1] != c[1]).mean() > 0.05


def test_p_zero_is_bit_identical_to_no_dropout():
    q, k, v, do = attention_inputs(1, 2, 2, 200, 300, 64, BF16)
    o0, lse0 = host.flash_attention(q, k, v, return_lse=True, causal=True)
    o1, lse1 = host.flash_attention(q, k, v, return_lse=True, causal=True, dropout_p=0.0,
                                    seed=3)
    assert o0.tobytes() == o1.tobytes() and lse0.tobytes() == lse1.tobytes()
    g0 = host.flash_attention_backward(do, q, k, v, o0, lse0, causal=True)
    g1 = host.flash_attention_backward(do, q, k, v, o0, lse0, causal=True, dropout_p=0.0)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(g0, g1))


def test_mask_does_not_depend_on_tiling_schedule_or_cores():
    """Streaming K/V instead of resident, LNC=2 instead of 1, several backward passes: the same
    mask, the same outputs."""
    q, k, v, do = attention_inputs(1, 2, 1, 640, 640, 32)
    kw = dict(mixed_precision=False, dropout_p=0.25, seed=9, causal=True)
    o1, lse1, m1 = host.flash_attention(q, k, v, return_lse=True, return_dropout_mask=True,
                                        lnc=1, **kw)
    o2, m2 = host.flash_attention(q, k, v, return_dropout_mask=True, lnc=2,
                                  tiles=tiles.ForwardTiles(kv_resident=False, q_group=2), **kw)
    seen = np.tril(np.ones((640, 640), bool))          # causal: the drawn units that matter
    np.testing.assert_array_equal(m1[..., seen], m2[..., seen])
    np.testing.assert_allclose(o1, o2, atol=1e-6)
    from host._launch import launch
    from nki_kernels.attention.backward import flash_attn_bwd
    one = host.flash_attention_backward(do, q, k, v, o1, lse1, lnc=1, **kw)
    many = launch(flash_attn_bwd, (1, 1), q, k, v, o1, do, lse1, scale=32 ** -0.5,
                  causal="bottom_right", mixed_precision=False, rows_per_pass=256,
                  dropout_p=0.25, seed=np.array([9], np.int32))
    for a, b in zip(one, many):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("p,seed,err,match", [
    (1.0, 1, ValueError, r"dropout_p: expected a probability in \[0, 1\), got 1.0"),
    (-0.1, 1, ValueError, "dropout_p: expected a probability"),
    (0.1, None, ValueError, "seed"),
    (0.1, 2 ** 31, ValueError, "seed"),
    ("0.1", 1, TypeError, "dropout_p: expected a real number"),
])
def test_bad_dropout_arguments(p, seed, err, match):
    q, k, v, _ = attention_inputs(1, 1, 1, 8, 8, 8)
    with pytest.raises(err, match=match):
        host.flash_attention(q, k, v, dropout_p=p, seed=seed)


def test_mask_needs_dropout():
    q, k, v, _ = attention_inputs(1, 1, 1, 8, 8, 8)
    with pytest.raises(ValueError, match="return_dropout_mask: needs dropout_p > 0"):
        host.flash_attention(q, k, v, return_dropout_mask=True)


@pytest.mark.parametrize("opts", [
    dict(B=2, Hq=4, Hkv=2, Nq=300, Nk=700, causal=True),
    dict(B=1, Hq=2, Hkv=1, Nq=129, Nk=1000, window=(300, 50)),
    dict(B=1, Hq=1, Hkv=1, Nq=200, Nk=200, softcap=10.0, sinks=True),
    # no band: four 2048-key blocks whose row maxima ScalarE and VectorE split 4:0 and 3:1 in
    # turn (tiles.FWD_NKI_DROPOUT_MAX_ACT_SHARE counted over the group on trn2)
    dict(B=1, Hq=1, Hkv=1, Nq=256, Nk=4096),
    dict(B=2, Hq=2, Hkv=1, Nq=300, Nk=260, causal="top_left", q_lens=[300, 90],
         kv_lens=[170, 260]),
    dict(B=2, Hq=2, Hkv=1, Nq=300, Nk=260, causal="bottom_right", q_lens=[300, 90],
         kv_lens=[170, 0], softcap=3.0, alibi=True),
])
def test_nki_namespace_draws_the_legacy_mask(opts, monkeypatch):
    """Through nki.* (nisa.set_rng_seed + nisa.dropout, the unit numbers read from the index
    table) the forward draws the legacy trace's keep mask and gives its outputs bit for bit
    (the backward, legacy, regenerates that mask); with runtime lengths too, in place and
    rotated, where the padding keys are masked on the scores by the key-length row."""
    opts = dict(opts)
    B, Hq, Hkv, Nq, Nk = (opts.pop(n) for n in ("B", "Hq", "Hkv", "Nq", "Nk"))
    q, k, v, _ = attention_inputs(B, Hq, Hkv, Nq, Nk, 64, F32, seed=Nq + Nk)
    if opts.pop("sinks", False):
        opts["sinks"] = np.linspace(-1.0, 1.0, Hq).astype(np.float32)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = np.linspace(0.5, 0.1, Hq).astype(np.float32)
    runs = {}
    for api in ("legacy", "nki"):
        monkeypatch.setenv(API_ENV_VAR, api)
        runs[api] = host.flash_attention(q, k, v, return_lse=True, return_dropout_mask=True,
                                         dropout_p=0.2, seed=77, lnc=1, **opts)
    for a, b in zip(runs["legacy"], runs["nki"]):
        np.testing.assert_array_equal(a, b)
