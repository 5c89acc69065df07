"""Block-sparse flash attention (FlashAttention section 3.3, appendix Algorithm 5): forward and
backward kernels through the NumPy API, against the float64 reference restricted to the same
pattern, with the traffic that proves inactive blocks are skipped.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import host
from _attention_inputs import attention_inputs
import simulate
from host import block_sparse as bs
from host import reference as ref
from nki_kernels.attention.block_sparse import block_sparse_attention_fwd
from nki_kernels.attention.block_sparse_bwd import block_sparse_attention_bwd
from nki_kernels.nki import BACKEND

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)

pytestmark = pytest.mark.skipif(BACKEND != "simulate",
                                reason="exact byte counts and program sizes use the simulator")


def _pattern(b, h, Nq, Nk, density, seed=1):
    nqt, nkt = bs.block_grid(Nq, Nk)
    return np.random.default_rng(seed).random((b, h, nqt, nkt)) < density


def _err(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)))


def _fwd_bwd(q, k, v, do, mask, **kw):
    o, lse = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                  mixed_precision=False, **kw)
    grads = host.flash_attention_backward(do, q, k, v, o, lse, block_mask=mask,
                                          mixed_precision=False, **kw)
    return o, lse, grads


CASES = [
    dict(),
    dict(causal="bottom_right"),
    dict(causal="top_left", window=(130, -1)),
    dict(window=(100, 20)),
    dict(causal=True, kv_lens=[250, 300], q_lens=[200, 17]),
    dict(window=(50, -1), kv_lens=[250, 3], q_lens=[200, 300]),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(map(str, kw)) or "plain")
def test_matches_reference_with_masks_and_gqa(kw):
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 300, 390, 32
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, D)
    mask = _pattern(B, Hq, Nq, Nk, 0.5)
    o, lse, grads = _fwd_bwd(q, k, v, do, mask, **kw)
    kw_ref = {**kw, "causal": kw.get("causal") if kw.get("causal") is not True
              else "bottom_right"}
    ro, rl = ref.attention_forward(q, k, v, block_mask=mask, **kw_ref)
    assert _err(o, ro) < 2e-6
    assert np.array_equal(np.isinf(lse), np.isinf(rl))
    fin = np.isfinite(rl)
    assert np.max(np.abs(lse[fin] - rl[fin])) < 2e-6
    for got, want in zip(grads, ref.attention_backward(do, q, k, v, block_mask=mask, **kw_ref)):
        assert _err(got, want) < 1e-5 * max(1.0, np.abs(want).max())


def test_index_form_equals_dense_form_and_broadcasts():
    """FlexAttention's (num_blocks, indices) with a larger bound (padding slots) gives the
    same result as the dense mask; a (1, 1, ...) pattern broadcasts over batch and heads."""
    B, Hq, Hkv, Nq, Nk, D = 2, 2, 1, 256, 520, 16
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, D, seed=3)
    mask = _pattern(1, 1, Nq, Nk, 0.4, seed=4)
    mask[..., 0, :] = False                       # a query tile with no block at all
    index = bs.dense_to_index(mask, max_blocks=5)
    o1, l1, g1 = _fwd_bwd(q, k, v, do, mask, causal="bottom_right")
    o2, l2, g2 = _fwd_bwd(q, k, v, do, tuple(index), causal="bottom_right")
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert np.all(o1[:, :, :128] == 0) and np.all(np.isneginf(l1[:, :, :128]))
    assert np.all(g1[0][:, :, :128] == 0)


def test_fully_masked_rows_are_zero_not_nan():
    """Rows whose active blocks are all hidden by causality, and key blocks no query sees."""
    B, Hq, Hkv, Nq, Nk, D = 1, 1, 1, 256, 256, 16
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, D, seed=5)
    mask = np.zeros((1, 1, 2, 2), bool)
    mask[0, 0, 0, 1] = True              # tile 0 sees only keys it cannot see causally
    mask[0, 0, 1, 1] = True
    o, lse, (dq, dk, dv) = _fwd_bwd(q, k, v, do, mask, causal="top_left")
    assert np.all(o[0, 0, :128] == 0) and np.all(np.isneginf(lse[0, 0, :128]))
    for x in (o, dq, dk, dv):
        assert np.all(np.isfinite(x))
    assert np.all(dk[0, 0, :128] == 0) and np.all(dv[0, 0, :128] == 0)


def test_inactive_blocks_are_never_read():
    """Non-finite K/V in inactive blocks cannot reach any row (they are not loaded), and the
    K/V bytes read are exactly those of the active (query tile, key block) pairs."""
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 384, 300, 32
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, D, seed=6)
    mask = np.zeros((1, 1, 3, 3), bool)
    mask[0, 0, :, 0] = True
    mask[0, 0, 2, 2] = True
    k[:, :, 128:256] = np.nan                       # key block 1: inactive everywhere
    v[:, :, 128:256] = np.inf
    with simulate.measure() as m:
        o = host.flash_attention(q, k, v, block_mask=mask, mixed_precision=False)
    assert np.all(np.isfinite(o))
    rows = [128, 128, Nk - 256]
    active = [(i, j) for i in range(3) for j in range(3) if mask[0, 0, i, j]]
    want = Hq * sum(rows[j] for _, j in active) * D * 4
    per = m.per_tensor
    assert per["k"]["read"] == want and per["v"]["read"] == want
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 128:256] = 0.0
    v2[:, :, 128:256] = 0.0
    np.testing.assert_array_equal(o, host.flash_attention(q, k2, v2, block_mask=mask,
                                                          mixed_precision=False))


def test_bf16_and_float32_inputs_with_bf16_matmuls():
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 2, 256, 256, 64
    q, k, v, _ = attention_inputs(B, Hq, Hkv, Nq, Nk, D, dtype=BF16, seed=7)
    mask = _pattern(B, Hq, Nq, Nk, 0.6, seed=8)
    mask[..., 0] = True
    o = host.flash_attention(q, k, v, block_mask=mask, causal=True)
    ro, _ = ref.attention_forward(q, k, v, block_mask=mask, causal="bottom_right")
    assert o.dtype == BF16 and _err(o, ro) < 3e-2
    q32, k32, v32 = (x.astype(F32) for x in (q, k, v))
    o32 = host.flash_attention(q32, k32, v32, block_mask=mask, causal=True)
    assert o32.dtype == F32 and _err(o32, ro) < 3e-2


def test_dropout_mask_is_the_dense_kernels_and_gradients_match():
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 300, 260, 32
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, D, seed=9)
    mask = _pattern(1, Hq, Nq, Nk, 0.6, seed=10)
    kw = dict(causal=True, dropout_p=0.3, seed=12345, mixed_precision=False)
    o, lse, keep = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                        return_dropout_mask=True, **kw)
    ro, _ = ref.attention_forward(q, k, v, causal="bottom_right", block_mask=mask,
                                  dropout_p=0.3, dropout_mask=keep)
    assert _err(o, ro) < 2e-6
    grads = host.flash_attention_backward(do, q, k, v, o, lse, block_mask=mask, **kw)
    want = ref.attention_backward(do, q, k, v, causal="bottom_right", block_mask=mask,
                                  dropout_p=0.3, dropout_mask=keep)
    for got, w in zip(grads, want):
        assert _err(got, w) < 1e-5 * max(1.0, np.abs(w).max())
    # the units are keyed by (sequence, head, query tile, key block): the dense kernel draws
    # the same bits wherever a row can see the key
    _, dense_keep = host.flash_attention(q, k, v, return_dropout_mask=True, lnc=1, **kw)
    vis = bs.expand(mask, Nq, Nk) & ref.attention_mask(Nq, Nk, causal="bottom_right")
    vis = np.broadcast_to(vis, keep.shape)
    assert np.array_equal(keep[vis], dense_keep[vis])


def test_program_size_does_not_grow_with_n():
    """One compilation per class structure: a uniform pattern is one class at any N (the
    program depends on N only through the step width, min(4, blocks per tile))."""
    sizes = []
    for N in (4096, 16384):
        q, k, v, do = attention_inputs(1, 1, 1, N, N, 64, dtype=BF16)
        sp = bs.check_block_mask(bs.fixed_density(N // 128, N // 128, 0.25), 1, 1, N, N)
        t = bs.launch_tables(sp, group=1)
        kw = dict(scale=0.125, mm_dtype="bfloat16")
        fwd = simulate.program_size(block_sparse_attention_fwd[1, 1], q, k, v, t.q.meta,
                                    classes=t.q.classes, **kw)
        o = np.zeros_like(q)
        lse = np.zeros(q.shape[:3], np.float32)
        bwd = simulate.program_size(block_sparse_attention_bwd[1, 1], q, k, v, o, do, lse,
                                    t.q.meta, t.k.meta, classes_q=t.q.classes,
                                    classes_k=t.k.classes, **kw)
        sizes.append((fwd, bwd))
    assert sizes[0] == sizes[1]
    assert max(sizes[0]) < 20000


@pytest.mark.parametrize("kw, match", [
    (dict(tiles=object()), "tiles: not used by the block-sparse kernel"),
    (dict(sbuf_budget=1000), "sbuf_budget: not used"),
    (dict(lnc=2), "lnc: the block-sparse kernel runs on one NeuronCore"),
])
def test_options_the_block_sparse_kernel_does_not_take_are_refused(kw, match):
    q, k, v, _ = attention_inputs(1, 1, 1, 256, 256, 16)
    mask = np.array([[[[True, False], [True, True]]]])
    with pytest.raises(ValueError, match=match):
        host.flash_attention(q, k, v, block_mask=mask, **kw)


def test_a_dense_pattern_with_every_block_is_dense_attention():
    """All blocks active (given densely): the dense kernel runs, bit for bit."""
    q, k, v, do = attention_inputs(1, 2, 1, 300, 200, 16)
    full = np.ones((1, 1, 3, 2), bool)
    o, lse = host.flash_attention(q, k, v, block_mask=full, causal=True, return_lse=True)
    o2, lse2 = host.flash_attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(o, o2)
    g = host.flash_attention_backward(do, q, k, v, o, lse, block_mask=full, causal=True)
    for a, b in zip(g, host.flash_attention_backward(do, q, k, v, o, lse, causal=True)):
        np.testing.assert_array_equal(a, b)
