"""Tests of the float64 references in host/reference.py.

The references are checked against independent implementations: per-element Python loops
written straight from docs/semantics.md, finite differences, PyTorch (float64 SDPA with explicit
bool masks and autograd), and the worked examples of seed 003. Every test runs with warnings
turned into errors: fully masked rows must produce neither NaN nor a floating-point warning.
"""
import itertools
import math

import ml_dtypes
import numpy as np
import pytest

from host import reference as R

pytestmark = pytest.mark.filterwarnings("error")

BF16 = np.dtype(ml_dtypes.bfloat16)
#: float64 agreement between two exact computations (summation order only).
EXACT_ATOL = 1e-12
#: Central-difference step and the agreement it allows (truncation ~h^2, rounding ~eps/h).
FD_STEP = 1e-6
FD_ATOL = 1e-7


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def randn(rng, *shape):
    return rng.standard_normal(shape)


# ------------------------------------------------------------------------------------------
# Independent brute-force implementations (straight from docs/semantics.md)
# ------------------------------------------------------------------------------------------


def brute_visible(i, j, nq_b, nk_b, causal, window):
    """docs/semantics.md, one (query, key) pair at a time."""
    if i >= nq_b or j >= nk_b:
        return False
    if causal is True:
        causal = "bottom_right"
    off = 0 if causal == "top_left" else nk_b - nq_b
    if causal in ("top_left", "bottom_right") and j > i + off:
        return False
    if window is not None:
        left, right = window
        if left != -1 and j < i + off - left:
            return False
        if right != -1 and j > i + off + right:
            return False
    return True


def brute_mask(nq, nk, batch=1, causal=None, window=None, q_lens=None, kv_lens=None):
    out = np.zeros((batch, nq, nk), dtype=bool)
    for b in range(batch):
        nq_b = nq if q_lens is None else q_lens[b]
        nk_b = nk if kv_lens is None else kv_lens[b]
        for i in range(nq):
            for j in range(nk):
                out[b, i, j] = brute_visible(i, j, nq_b, nk_b, causal, window)
    return out


def brute_attention(q, k, v, mask, scale):
    """Per-element loops: mask (B, Nq, Nk) shared by the heads; GQA by h // (Hq // Hkv)."""
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    o = np.zeros(q.shape)
    lse = np.full((B, Hq, Nq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Nq):
                keys = [j for j in range(k.shape[2]) if mask[b, i, j]]
                if not keys:
                    continue
                s = {j: scale * sum(float(q[b, h, i, d]) * float(k[b, hk, j, d]) for d in range(D))
                     for j in keys}
                m = max(s.values())
                total = sum(math.exp(s[j] - m) for j in keys)
                lse[b, h, i] = m + math.log(total)
                for d in range(D):
                    o[b, h, i, d] = sum(math.exp(s[j] - m) / total * float(v[b, hk, j, d])
                                        for j in keys)
    return o, lse


def masked_attention_f64(q, k, v, mask, scale):
    """Vectorized standard attention with an explicit (B, Nq, Nk) mask (for decode/tree tests)."""
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = scale * q @ np.swapaxes(k, -1, -2)
    s = np.where(mask[:, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return e @ v / e.sum(-1, keepdims=True)


# ------------------------------------------------------------------------------------------
# Masks
# ------------------------------------------------------------------------------------------

CAUSALS = [None, False, True, "top_left", "bottom_right"]
WINDOWS = [None, (-1, -1), (0, 0), (1, 0), (0, 2), (2, -1), (-1, 1), (1, 1), (7, 7)]
SIZES = [(3, 3), (2, 5), (5, 2), (1, 4), (4, 1)]


@pytest.mark.parametrize("nq,nk", SIZES)
def test_mask_matches_brute_force(nq, nk):
    for causal, window in itertools.product(CAUSALS, WINDOWS):
        got = R.attention_mask(nq, nk, causal=causal, window=window)
        want = brute_mask(nq, nk, 1, causal, window)
        assert got.shape == (1, nq, nk) and got.dtype == bool
        np.testing.assert_array_equal(got, want, err_msg=f"causal={causal} window={window}")


@pytest.mark.parametrize("nq,nk", SIZES)
def test_mask_with_lengths_matches_brute_force(nq, nk):
    q_lens = [nq, 0, max(nq - 1, 0), 1]
    kv_lens = [max(nk - 1, 0), nk, nk, 0]
    for causal, window in itertools.product(CAUSALS, WINDOWS):
        got = R.attention_mask(nq, nk, causal=causal, window=window, q_lens=q_lens, kv_lens=kv_lens)
        want = brute_mask(nq, nk, 4, causal, window, q_lens, kv_lens)
        np.testing.assert_array_equal(got, want, err_msg=f"causal={causal} window={window}")


def rows(text):
    return np.array([[c == "1" for c in line.split()] for line in text.strip().splitlines()])


def test_causal_true_is_bottom_right_and_false_is_none():
    np.testing.assert_array_equal(R.attention_mask(3, 5, causal=True),
                                  R.attention_mask(3, 5, causal="bottom_right"))
    np.testing.assert_array_equal(R.attention_mask(3, 5, causal=False),
                                  np.ones((1, 3, 5), dtype=bool))


def test_top_left_vs_bottom_right_when_nq_lt_nk():
    top_left = rows("""
        1 0 0 0
        1 1 0 0""")
    bottom_right = rows("""
        1 1 1 0
        1 1 1 1""")
    np.testing.assert_array_equal(R.attention_mask(2, 4, causal="top_left")[0], top_left)
    np.testing.assert_array_equal(R.attention_mask(2, 4, causal="bottom_right")[0], bottom_right)


def test_top_left_vs_bottom_right_when_nq_gt_nk():
    # bottom_right: the first nq - nk rows see no key at all.
    top_left = rows("""
        1 0
        1 1
        1 1
        1 1""")
    bottom_right = rows("""
        0 0
        0 0
        1 0
        1 1""")
    np.testing.assert_array_equal(R.attention_mask(4, 2, causal="top_left")[0], top_left)
    np.testing.assert_array_equal(R.attention_mask(4, 2, causal="bottom_right")[0], bottom_right)


def test_window_edges():
    # causal + window (1, 0): each query sees itself and one key back; row 0 is clipped at 0.
    np.testing.assert_array_equal(R.attention_mask(4, 4, causal=True, window=(1, 0))[0], rows("""
        1 0 0 0
        1 1 0 0
        0 1 1 0
        0 0 1 1"""))
    # causal caps the right side: (1, 3) with causal equals (1, 0) with causal.
    np.testing.assert_array_equal(R.attention_mask(4, 4, causal=True, window=(1, 3)),
                                  R.attention_mask(4, 4, causal=True, window=(1, 0)))
    # no causal: bidirectional band around the bottom-right diagonal (off = nk - nq = 2).
    np.testing.assert_array_equal(R.attention_mask(2, 4, window=(1, 1))[0], rows("""
        0 1 1 1
        0 0 1 1"""))
    # top_left causal with a window uses offset 0.
    np.testing.assert_array_equal(R.attention_mask(2, 4, causal="top_left", window=(0, -1))[0],
                                  rows("""
        1 0 0 0
        0 1 0 0"""))
    # (-1, 0) without causal is bottom-right causal; (0, -1) is "anti-causal".
    np.testing.assert_array_equal(R.attention_mask(3, 5, window=(-1, 0)),
                                  R.attention_mask(3, 5, causal="bottom_right"))
    np.testing.assert_array_equal(R.attention_mask(3, 3, window=(0, -1))[0], rows("""
        1 1 1
        0 1 1
        0 0 1"""))
    # a window wider than the sequence changes nothing; (-1, -1) is no window.
    np.testing.assert_array_equal(R.attention_mask(3, 3, window=(10, 10)), R.attention_mask(3, 3))
    np.testing.assert_array_equal(R.attention_mask(3, 3, window=(-1, -1)), R.attention_mask(3, 3))


def test_lengths_use_valid_lengths_for_bottom_right():
    # Nq=4, Nk=5, q_len=2, kv_len=3: offset 3 - 2 = 1; rows >= 2 and keys >= 3 invisible.
    got = R.attention_mask(4, 5, causal="bottom_right", q_lens=[2], kv_lens=[3])
    np.testing.assert_array_equal(got[0], rows("""
        1 1 0 0 0
        1 1 1 0 0
        0 0 0 0 0
        0 0 0 0 0"""))
    # top_left ignores the lengths for alignment but still cuts rows and keys.
    got = R.attention_mask(4, 5, causal="top_left", q_lens=[2], kv_lens=[3])
    np.testing.assert_array_equal(got[0], rows("""
        1 0 0 0 0
        1 1 0 0 0
        0 0 0 0 0
        0 0 0 0 0"""))


def test_mask_batch_is_inferred_from_lengths():
    assert R.attention_mask(2, 3, kv_lens=np.array([1, 2, 3])).shape == (3, 2, 3)
    assert R.attention_mask(2, 3, batch=2).shape == (2, 2, 3)
    with pytest.raises(ValueError, match=r"q_lens: expected length B=2"):
        R.attention_mask(2, 3, batch=2, q_lens=[1, 1, 1])


# ------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------

FORWARD_CASES = [
    # (B, Hq, Hkv, Nq, Nk, D, options)
    (1, 1, 1, 3, 3, 2, {}),
    (2, 4, 2, 3, 5, 3, {"causal": True}),
    (2, 4, 1, 5, 3, 3, {"causal": "bottom_right"}),
    (2, 2, 2, 4, 6, 3, {"causal": "top_left", "window": (1, 0)}),
    (2, 3, 3, 4, 4, 2, {"window": (1, 1), "scale": 0.7}),
    (2, 4, 2, 4, 5, 3, {"causal": True, "q_lens": [3, 1], "kv_lens": [5, 2]}),
    (2, 2, 1, 3, 4, 2, {"q_lens": [0, 3], "kv_lens": [4, 0], "scale": -1.5}),
]


def _case(rng, B, Hq, Hkv, Nq, Nk, D):
    return randn(rng, B, Hq, Nq, D), randn(rng, B, Hkv, Nk, D), randn(rng, B, Hkv, Nk, D)


def _mask_options(opts):
    return {key: opts[key] for key in ("causal", "window", "q_lens", "kv_lens") if key in opts}


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_forward_matches_brute_force(rng, case):
    B, Hq, Hkv, Nq, Nk, D, opts = case
    q, k, v = _case(rng, B, Hq, Hkv, Nq, Nk, D)
    o, lse = R.attention_forward(q, k, v, **opts)
    mopts = _mask_options(opts)
    mask = brute_mask(Nq, Nk, B, mopts.get("causal"), mopts.get("window"),
                      mopts.get("q_lens"), mopts.get("kv_lens"))
    want_o, want_lse = brute_attention(q, k, v, mask, opts.get("scale", 1 / math.sqrt(D)))
    assert o.dtype == np.float64 and o.shape == (B, Hq, Nq, D)
    assert lse.dtype == np.float64 and lse.shape == (B, Hq, Nq)
    np.testing.assert_allclose(o, want_o, rtol=0, atol=EXACT_ATOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)],
                               rtol=0, atol=EXACT_ATOL)


def test_fully_masked_rows_are_zero_with_lse_minus_inf(rng):
    # bottom_right with Nq > Nk masks the first rows; kv_lens=0 masks a whole sequence;
    # rows past q_lens are masked too.
    q, k, v = _case(rng, 3, 2, 1, 5, 3, 4)
    opts = dict(causal=True, q_lens=[5, 4, 5], kv_lens=[3, 3, 0])
    o, lse = R.attention_forward(q, k, v, **opts)
    masked = ~R.attention_mask(5, 3, **opts).any(-1)  # (B, Nq)
    assert masked.sum() == 2 + (1 + 1) + 5  # b=1: off = 3 - 4 masks row 0; row 4 >= q_len
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.all(o[np.broadcast_to(masked[:, None], lse.shape)] == 0)
    np.testing.assert_array_equal(np.isneginf(lse), np.broadcast_to(masked[:, None], lse.shape))
    do = randn(rng, *q.shape)
    for grads in (R.attention_backward(do, q, k, v, **opts),
                  R.attention_backward_from_lse(do, q, k, v, o, lse, **opts)):
        dq, dk, dv = grads
        assert not any(np.isnan(g).any() for g in grads)
        assert np.all(dq[np.broadcast_to(masked[:, None], lse.shape)] == 0)
        assert np.all(dk[2] == 0) and np.all(dv[2] == 0)  # kv_lens = 0: nothing flows back


def test_large_scores_do_not_overflow(rng):
    q, k, v = _case(rng, 1, 1, 1, 4, 6, 2)
    q, k = q * 1e3, k * 1e3  # scores ~1e6: exp would overflow without the max subtraction
    o, lse = R.attention_forward(q, k, v, causal=True)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    want_o, want_lse = brute_attention(q, k, v, brute_mask(4, 6, 1, True), 1 / math.sqrt(2))
    np.testing.assert_allclose(o, want_o, atol=EXACT_ATOL)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-14)


def test_default_scale_is_inverse_sqrt_d(rng):
    q, k, v = _case(rng, 1, 2, 2, 3, 4, 9)
    np.testing.assert_array_equal(R.attention_forward(q, k, v)[0],
                                  R.attention_forward(q, k, v, scale=1 / 3)[0])


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_low_precision_inputs_are_upcast_exactly(rng, dtype):
    q, k, v = (x.astype(dtype) for x in _case(rng, 1, 2, 1, 3, 4, 5))
    o, lse = R.attention_forward(q, k, v, causal=True)
    o64, lse64 = R.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    np.testing.assert_array_equal(o, o64)
    np.testing.assert_array_equal(lse, lse64)
    # mixed dtypes are fine for the references (they do not launch kernels)
    R.attention_forward(q, k.astype(np.float32), v, causal=True)


def test_gqa_equals_repeated_kv_heads(rng):
    q, k, v = _case(rng, 2, 6, 2, 4, 5, 3)
    o, lse = R.attention_forward(q, k, v, causal=True)
    o_rep, lse_rep = R.attention_forward(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1),
                                         causal=True)
    np.testing.assert_array_equal(o, o_rep)
    np.testing.assert_array_equal(lse, lse_rep)


# ------------------------------------------------------------------------------------------
# Seed 003: worked example (n=6, d=2, Bq=2, Bk=3) and online softmax traces
# ------------------------------------------------------------------------------------------

SEED_Q = np.array([[1.0, 0.5], [0.8, -0.1], [0.2, 0.9], [-0.3, 0.4], [0.7, 0.6], [0.1, -0.5]])
SEED_K = np.array([[0.3, 0.7], [0.6, 0.2], [-0.1, 0.8], [0.4, -0.3], [0.9, 0.1], [0.2, 0.5]])
SEED_V = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])


def tiled_flash_forward(q, k, v, bq, bk, scale):
    """The seed's prefill algorithm (causal, tile skipping, online softmax), as written there."""
    n, d = q.shape
    out = np.zeros((n, d))
    for q0 in range(0, n, bq):
        rows_ = range(q0, min(q0 + bq, n))
        m = {i: -math.inf for i in rows_}
        s = {i: 0.0 for i in rows_}
        acc = {i: np.zeros(d) for i in rows_}
        for k0 in range(0, n, bk):
            if q0 + bq <= k0:  # every query of the tile precedes every key: skip
                continue
            for i in rows_:
                scores = [scale * q[i] @ k[j] if j <= i else -math.inf
                          for j in range(k0, min(k0 + bk, n))]
                m_new = max(m[i], max(scores))
                corr = math.exp(m[i] - m_new)
                acc[i] *= corr
                s[i] *= corr
                for j, sc in zip(range(k0, k0 + bk), scores):
                    w = math.exp(sc - m_new) if sc != -math.inf else 0.0
                    acc[i] = acc[i] + w * v[j]
                    s[i] += w
                m[i] = m_new
        for i in rows_:
            out[i] = acc[i] / s[i]
    return out


def test_seed003_worked_example():
    q, k, v = (x[None, None] for x in (SEED_Q, SEED_K, SEED_V))
    o, lse = R.attention_forward(q, k, v, causal=True)
    o = o[0, 0]
    # numbers printed in the seed
    np.testing.assert_allclose(o[0], [1.0, 0.0], atol=EXACT_ATOL)
    np.testing.assert_allclose(o[1], [0.449, 0.551], atol=5e-4)
    np.testing.assert_allclose(lse[0, 0, 0], 0.65 / math.sqrt(2), atol=EXACT_ATOL)
    # the whole tiled run equals standard attention (Nq == Nk: both causal alignments agree)
    tiled = tiled_flash_forward(SEED_Q, SEED_K, SEED_V, bq=2, bk=3, scale=1 / math.sqrt(2))
    np.testing.assert_allclose(o, tiled, atol=EXACT_ATOL)
    np.testing.assert_array_equal(o, R.attention_forward(q, k, v, causal="top_left")[0][0, 0])
    mask = brute_mask(6, 6, 1, "top_left")
    np.testing.assert_allclose(o, brute_attention(q, k, v, mask, 1 / math.sqrt(2))[0][0, 0],
                               atol=EXACT_ATOL)


def test_seed003_online_softmax_traces():
    z = np.array([[2.0, 5.0, 1.0, 4.0]])
    np.testing.assert_allclose(R.online_softmax(z)[0], [0.0347, 0.6964, 0.0128, 0.2562], atol=1e-4)
    # single-query online attention example: q = [1, 0], no scaling
    q = np.array([1.0, 0.0])[None, None, None]
    k = np.array([[0.5, 0.3], [0.8, -0.2], [0.1, 0.7]])[None, None]
    v = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])[None, None]
    o, _ = R.attention_forward(q, k, v, scale=1.0)
    np.testing.assert_allclose(o[0, 0, 0], [0.4421, 0.5579], atol=1e-4)


# ------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------

BACKWARD_CASES = [
    (1, 2, 1, 3, 3, 2, {"causal": True}),
    (1, 2, 2, 2, 4, 2, {"window": (1, 0)}),
    (2, 2, 1, 4, 3, 2, {"causal": "bottom_right", "q_lens": [4, 2], "kv_lens": [3, 1]}),
    (1, 1, 1, 3, 4, 3, {"causal": "top_left", "scale": 0.9}),
]


@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_backward_matches_finite_differences(rng, case):
    B, Hq, Hkv, Nq, Nk, D, opts = case
    q, k, v = _case(rng, B, Hq, Hkv, Nq, Nk, D)
    do = randn(rng, B, Hq, Nq, D)
    grads = R.attention_backward(do, q, k, v, **opts)

    def loss(q_, k_, v_):
        return float(np.sum(R.attention_forward(q_, k_, v_, **opts)[0] * do))

    args = [q, k, v]
    for which, grad in enumerate(grads):
        numeric = np.zeros_like(grad)
        for idx in np.ndindex(grad.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += FD_STEP
            minus[which][idx] -= FD_STEP
            numeric[idx] = (loss(*plus) - loss(*minus)) / (2 * FD_STEP)
        np.testing.assert_allclose(grad, numeric, rtol=0, atol=FD_ATOL, err_msg="dq dk dv"[which])


@pytest.mark.parametrize("case", BACKWARD_CASES + FORWARD_CASES)
def test_backward_from_lse_equals_exact_backward(rng, case):
    B, Hq, Hkv, Nq, Nk, D, opts = case
    q, k, v = _case(rng, B, Hq, Hkv, Nq, Nk, D)
    do = randn(rng, B, Hq, Nq, D)
    o, lse = R.attention_forward(q, k, v, **opts)
    exact = R.attention_backward(do, q, k, v, **opts)
    flash = R.attention_backward_from_lse(do, q, k, v, o, lse, **opts)
    for a, b in zip(exact, flash):
        np.testing.assert_allclose(a, b, rtol=0, atol=EXACT_ATOL)
    # float32 statistics (what a kernel returns) are accepted
    R.attention_backward_from_lse(do, q, k, v, o.astype(np.float32), lse.astype(np.float32),
                                  **opts)


def test_backward_from_lse_uses_the_given_statistics(rng):
    q, k, v = _case(rng, 1, 1, 1, 3, 3, 2)
    do = randn(rng, 1, 1, 3, 2)
    o, lse = R.attention_forward(q, k, v)
    # lse = -inf on a row: that row contributes nothing
    lse_cut = lse.copy()
    lse_cut[0, 0, 1] = -np.inf
    dq, dk, dv = R.attention_backward_from_lse(do, q, k, v, o, lse_cut)
    assert np.all(dq[0, 0, 1] == 0)
    dq_ref, _, dv_ref = R.attention_backward(do, q, k, v)
    np.testing.assert_allclose(dq[0, 0, [0, 2]], dq_ref[0, 0, [0, 2]], atol=EXACT_ATOL)
    assert not np.allclose(dv, dv_ref)
    # a shifted lse scales P: dv scales by exp(-shift)
    _, _, dv_shift = R.attention_backward_from_lse(do, q, k, v, o, lse + 1.0)
    np.testing.assert_allclose(dv_shift, dv_ref * math.exp(-1.0), atol=EXACT_ATOL)


# ------------------------------------------------------------------------------------------
# PyTorch cross-checks (float64 SDPA with explicit bool masks; autograd)
# ------------------------------------------------------------------------------------------

TORCH_CASES = [
    (2, 4, 2, 7, 7, 16, {"causal": "top_left"}),
    (2, 8, 2, 5, 9, 8, {"causal": "bottom_right"}),
    (1, 4, 1, 6, 6, 8, {"window": (2, 1)}),
    (2, 2, 2, 9, 4, 8, {"causal": True, "window": (2, -1), "q_lens": [9, 7], "kv_lens": [4, 3]}),
    (1, 3, 3, 5, 8, 4, {"scale": 0.25}),
]


@pytest.mark.parametrize("case", TORCH_CASES)
def test_forward_and_backward_match_torch(rng, case):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    B, Hq, Hkv, Nq, Nk, D, opts = case
    q, k, v = _case(rng, B, Hq, Hkv, Nq, Nk, D)
    do = randn(rng, B, Hq, Nq, D)
    mask = R.attention_mask(Nq, Nk, batch=B, **_mask_options(opts))
    live = mask.any(-1)[:, None, :, None]  # rows with a visible key (SDPA gives NaN otherwise)
    # SDPA's fully masked rows are NaN: give them a harmless key, then zero their output/grad.
    sdpa_mask = mask | ~mask.any(-1, keepdims=True)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    to = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.tensor(sdpa_mask[:, None]),
                                        scale=opts.get("scale"), enable_gqa=Hq != Hkv)
    to = to * torch.tensor(live)
    to.backward(torch.tensor(do))
    o, _ = R.attention_forward(q, k, v, **opts)
    np.testing.assert_allclose(o, to.detach().numpy(), rtol=0, atol=EXACT_ATOL)
    for mine, theirs in zip(R.attention_backward(do, q, k, v, **opts), (tq, tk, tv)):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=0, atol=EXACT_ATOL)


def test_top_left_matches_torch_is_causal(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _case(rng, 1, 2, 2, 4, 6, 8)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(x) for x in (q, k, v)), is_causal=True).numpy()
    np.testing.assert_allclose(R.attention_forward(q, k, v, causal="top_left")[0], want,
                               atol=EXACT_ATOL)


def test_torch_tensors_are_accepted(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _case(rng, 1, 2, 1, 3, 4, 4)
    got = R.attention_forward(*(torch.tensor(x, dtype=torch.bfloat16) for x in (q, k, v)))[0]
    want = R.attention_forward(*(x.astype(BF16) for x in (q, k, v)))[0]
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------------
# Decode and the speculative tree
# ------------------------------------------------------------------------------------------

SEED_PARENTS = [-1, 0, 1, 1, 2, 2, 3, 3, 4]
SEED_TREE = """
    1 0 0 0 0 0 0 0 0
    1 1 0 0 0 0 0 0 0
    1 1 1 0 0 0 0 0 0
    1 1 0 1 0 0 0 0 0
    1 1 1 0 1 0 0 0 0
    1 1 1 0 0 1 0 0 0
    1 1 0 1 0 0 1 0 0
    1 1 0 1 0 0 0 1 0
    1 1 1 0 1 0 0 0 1
"""


def tree_mask_from_parents(parents):
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for t in range(n):
        u = t
        while u >= 0:
            mask[t, u] = True
            u = parents[u]
    return mask


def test_seed003_tree_mask():
    np.testing.assert_array_equal(tree_mask_from_parents(SEED_PARENTS), rows(SEED_TREE))


def test_decode_with_seed_tree_equals_masked_attention(rng):
    tree = tree_mask_from_parents(SEED_PARENTS)
    T, S_max, D = 9, 20, 4
    cache_lens = np.array([9, 15])
    q = randn(rng, 2, 4, T, D)
    kc, vc = randn(rng, 2, 2, S_max, D), randn(rng, 2, 2, S_max, D)
    o, lse = R.decode(q, kc, vc, cache_lens=cache_lens, tree_mask=tree)
    mask = np.zeros((2, T, S_max), dtype=bool)
    for b, n in enumerate(cache_lens):
        start = n - T
        mask[b, :, :start] = True
        mask[b, :, start:n] = tree
    np.testing.assert_array_equal(np.stack([R.decode_mask(T, n, S_max, tree) for n in cache_lens]),
                                  mask)
    np.testing.assert_allclose(o, masked_attention_f64(q, kc, vc, mask, 1 / 2), atol=EXACT_ATOL)
    assert np.isfinite(lse).all()
    # E (token 4) cannot see D (token 3): changing D's value leaves E's output unchanged
    vc2 = vc.copy()
    vc2[:, :, cache_lens[1] - T + 3] += 10.0
    o2, _ = R.decode(q, kc, vc2, cache_lens=cache_lens, tree_mask=tree)
    np.testing.assert_array_equal(o2[1, :, 4], o[1, :, 4])
    assert not np.allclose(o2[1, :, 6], o[1, :, 6])  # G's parent is D


def test_decode_mask_small_example():
    np.testing.assert_array_equal(R.decode_mask(2, 4, 6), rows("""
        1 1 1 0 0 0
        1 1 1 1 0 0"""))
    tree = np.array([[True, True], [False, True]])  # entries above the diagonal are allowed
    np.testing.assert_array_equal(R.decode_mask(2, 2, 3, tree), rows("""
        1 1 0
        0 1 0"""))


def test_decode_without_tree_equals_bottom_right_prefill(rng):
    T, S_max, D = 3, 10, 8
    cache_lens = [3, 7, 10]
    q = randn(rng, 3, 4, T, D)
    kc, vc = randn(rng, 3, 1, S_max, D), randn(rng, 3, 1, S_max, D)
    o, lse = R.decode(q, kc, vc, cache_lens=np.array(cache_lens), scale=0.3)
    for b, n in enumerate(cache_lens):
        o_b, lse_b = R.attention_forward(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n],
                                         causal="bottom_right", scale=0.3)
        np.testing.assert_allclose(o[b], o_b[0], atol=EXACT_ATOL)
        np.testing.assert_allclose(lse[b], lse_b[0], atol=EXACT_ATOL)
    # also equal to prefill over the padded cache with kv_lens
    o_p, lse_p = R.attention_forward(q, kc, vc, causal=True, kv_lens=cache_lens, scale=0.3)
    np.testing.assert_allclose(o, o_p, atol=EXACT_ATOL)


# ------------------------------------------------------------------------------------------
# LSE merge
# ------------------------------------------------------------------------------------------


def _split_results(q, k, v, bounds, kv_len):
    """Attention of q over each key chunk [a, b) of the padded cache with kv_lens."""
    o_parts, lse_parts = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        lens = np.clip(np.asarray(kv_len) - a, 0, b - a)
        o, lse = R.attention_forward(q, k[:, :, a:b], v[:, :, a:b], kv_lens=lens, scale=0.5)
        o_parts.append(o)
        lse_parts.append(lse)
    return np.stack(o_parts), np.stack(lse_parts)


@pytest.mark.parametrize("bounds", [[0, 13], [0, 1, 13], [0, 5, 6, 13], [0, 2, 4, 6, 8, 10, 13]])
def test_merge_of_any_split_equals_unsplit(rng, bounds):
    q, k, v = _case(rng, 2, 2, 1, 3, 13, 4)
    kv_len = [13, 5]  # sequence 1 leaves the last chunks empty (lse = -inf)
    want_o, want_lse = R.attention_forward(q, k, v, kv_lens=kv_len, scale=0.5)
    o_parts, lse_parts = _split_results(q, k, v, bounds, kv_len)
    o, lse = R.merge_partials(o_parts, lse_parts)
    np.testing.assert_allclose(o, want_o, atol=EXACT_ATOL)
    np.testing.assert_allclose(lse, want_lse, atol=EXACT_ATOL)


def test_merge_is_associative(rng):
    q, k, v = _case(rng, 1, 2, 2, 2, 9, 3)
    o_parts, lse_parts = _split_results(q, k, v, [0, 3, 6, 9], [9])
    left = R.merge_partials(*(np.stack(x) for x in zip(
        R.merge_partials(o_parts[:2], lse_parts[:2]), (o_parts[2], lse_parts[2]))))
    right = R.merge_partials(*(np.stack(x) for x in zip(
        (o_parts[0], lse_parts[0]), R.merge_partials(o_parts[1:], lse_parts[1:]))))
    flat = R.merge_partials(o_parts, lse_parts)
    for a, b in ((left, flat), (right, flat)):
        np.testing.assert_allclose(a[0], b[0], atol=EXACT_ATOL)
        np.testing.assert_allclose(a[1], b[1], atol=EXACT_ATOL)


def test_merge_empty_splits():
    o_parts = np.array([[[np.nan, np.inf]], [[1.0, 2.0]]])  # split 0 is empty: its o is ignored
    lse_parts = np.array([[-np.inf], [0.5]])
    o, lse = R.merge_partials(o_parts, lse_parts)
    np.testing.assert_array_equal(o, [[1.0, 2.0]])
    np.testing.assert_array_equal(lse, [0.5])
    o, lse = R.merge_partials(np.ones((3, 2, 4)), np.full((3, 2), -np.inf))
    np.testing.assert_array_equal(o, np.zeros((2, 4)))
    assert np.all(np.isneginf(lse))


def test_merge_weights_by_lse():
    o, lse = R.merge_partials(np.array([[0.0], [1.0]]), np.array([0.0, math.log(3.0)]))
    np.testing.assert_allclose(o, [0.75], atol=EXACT_ATOL)
    np.testing.assert_allclose(lse, math.log(4.0), atol=EXACT_ATOL)


# ------------------------------------------------------------------------------------------
# Softmax and GELU(x W + b)
# ------------------------------------------------------------------------------------------


def test_softmax_matches_brute_force(rng):
    x = randn(rng, 4, 7) * 30
    x[1, 3] = -np.inf
    want = np.array([[math.exp(a - max(r)) / sum(math.exp(b - max(r)) for b in r) for a in r]
                     for r in x.tolist()])
    np.testing.assert_allclose(R.softmax(x), want, rtol=1e-14, atol=0)
    np.testing.assert_allclose(R.online_softmax(x), want, rtol=1e-14, atol=0)
    np.testing.assert_allclose(R.softmax(x.T, axis=0), want.T, rtol=1e-14, atol=0)
    np.testing.assert_allclose(R.softmax(x).sum(-1), 1.0, atol=EXACT_ATOL)


def test_softmax_special_rows():
    x = np.array([[-np.inf, -np.inf], [1e308, 1e308], [0.0, np.inf]])
    p = R.softmax(x)
    np.testing.assert_array_equal(p[0], [0.0, 0.0])  # fully masked row
    np.testing.assert_array_equal(p[1], [0.5, 0.5])  # no overflow
    assert np.isnan(p[2]).all()  # +inf is not a number the softmax can weigh: NaN


def test_online_softmax_bf16_input(rng):
    x = randn(rng, 3, 200).astype(BF16)
    np.testing.assert_array_equal(R.online_softmax(x), R.softmax(x.astype(np.float64)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_gelu_matches_loops(rng, approximate):
    x, w, b = randn(rng, 3, 4), randn(rng, 4, 5), randn(rng, 5)
    want = np.zeros((3, 5))
    for i in range(3):
        for n in range(5):
            z = sum(x[i, kk] * w[kk, n] for kk in range(4)) + b[n]
            if approximate == "none":
                want[i, n] = 0.5 * z * (1 + math.erf(z / math.sqrt(2)))
            else:
                want[i, n] = 0.5 * z * (1 + math.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    got = R.linear_gelu(x, w, b, approximate=approximate)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=0, atol=EXACT_ATOL)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_torch(rng, approximate):
    torch = pytest.importorskip("torch")
    z = np.concatenate([randn(rng, 100) * 4, [0.0, -30.0, 30.0]])
    want = torch.nn.functional.gelu(torch.tensor(z), approximate=approximate).numpy()
    np.testing.assert_allclose(R.gelu(z, approximate), want, rtol=1e-14, atol=1e-15)


# ------------------------------------------------------------------------------------------
# Low-precision baselines and the tolerance rule
# ------------------------------------------------------------------------------------------

#: Unit roundoff (half an ulp of 1.0) of each dtype.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-9, "float16": 2.0**-11}
#: The baseline's max error, in units of (unit roundoff x max |reference|), must lie in this
#: band: it rounds inputs, S, P and o, each costing a few roundoffs; far outside means the
#: rounding is missing (error ~0) or wrong (error >> a few roundoffs).
BASELINE_ERR_BAND = (0.5, 20.0)


def _baseline_case(rng):
    return _case(rng, 1, 4, 2, 64, 96, 32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_forward_baseline_error_has_the_expected_order(rng, dtype):
    q, k, v = _baseline_case(rng)
    opts = dict(causal=True, window=(40, -1))
    ref, ref_lse = R.attention_forward(q, k, v, **opts)
    base, base_lse = R.attention_baseline_lowp(q, k, v, dtype=dtype, return_lse=True, **opts)
    err = R.max_abs_err(base, ref)
    units = err / (UNIT_ROUNDOFF[dtype] * np.abs(ref).max())
    assert BASELINE_ERR_BAND[0] < units < BASELINE_ERR_BAND[1], (dtype, err, units)
    assert base.dtype == np.float64
    np.testing.assert_array_equal(base, base.astype(dtype if dtype != "bfloat16" else BF16))
    assert R.max_abs_err(base_lse, ref_lse) < 50 * UNIT_ROUNDOFF[dtype] * np.abs(ref_lse).max()


def test_forward_baseline_out_dtype(rng):
    q, k, v = _baseline_case(rng)
    base = R.attention_baseline_lowp(q, k, v, dtype="bfloat16", out_dtype=np.float32)
    assert not np.array_equal(base, base.astype(BF16))  # not rounded to bf16 at the end
    np.testing.assert_array_equal(base, base.astype(np.float32))
    ref, _ = R.attention_forward(q, k, v)
    assert R.max_abs_err(base, ref) < R.max_abs_err(
        R.attention_baseline_lowp(q, k, v, dtype="bfloat16"), ref) * 1.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_backward_baseline_error_has_the_expected_order(rng, dtype):
    q, k, v = _baseline_case(rng)
    do = randn(rng, *q.shape)
    opts = dict(causal="top_left")
    refs = R.attention_backward(do, q, k, v, **opts)
    bases = R.attention_backward_baseline_lowp(do, q, k, v, dtype=dtype, **opts)
    for name, ref, base in zip(("dq", "dk", "dv"), refs, bases):
        assert base.shape == ref.shape
        units = R.max_abs_err(base, ref) / (UNIT_ROUNDOFF[dtype] * np.abs(ref).max())
        assert BASELINE_ERR_BAND[0] < units < BASELINE_ERR_BAND[1], (name, dtype, units)


def test_baselines_handle_fully_masked_rows(rng):
    q, k, v = _case(rng, 2, 2, 1, 5, 3, 4)
    opts = dict(causal=True, kv_lens=[3, 0])
    o = R.attention_baseline_lowp(q, k, v, dtype=BF16, **opts)
    ref, _ = R.attention_forward(q, k, v, **opts)
    assert not np.isnan(o).any()
    assert np.all(o[1] == 0) and np.all(o[0, :, :2] == 0)  # kv_lens=0; off = 3 - 5 = -2
    assert np.all(ref[1] == 0) and np.all(ref[0, :, :2] == 0)
    grads = R.attention_backward_baseline_lowp(randn(rng, *q.shape), q, k, v, dtype=BF16, **opts)
    assert not any(np.isnan(g).any() for g in grads)


def test_max_abs_err_conventions():
    ref = np.array([1.0, -np.inf, 2.0])
    assert R.max_abs_err(np.array([1.5, -np.inf, 2.0]), ref) == 0.5
    assert R.max_abs_err(np.array([1.0, 0.0, 2.0]), ref) == np.inf
    assert R.max_abs_err(np.array([1.0, -np.inf, np.nan]), ref) == np.inf
    assert R.max_abs_err(np.array([1.0, np.inf, 2.0]), ref) == np.inf
    assert R.max_abs_err(np.zeros(0), np.zeros(0)) == 0.0
    assert R.max_abs_err(np.array([1.0], dtype=BF16), np.array([1.25])) == 0.25
    with pytest.raises(ValueError, match=r"a: expected the same shape as ref \(3,\), got \(2,\)"):
        R.max_abs_err(np.zeros(2), ref)


def test_tolerance_rule():
    ref = np.array([1.0, 2.0])
    assert R.tolerance(ref, np.array([1.25, 2.0]), floor=1e-3) == 2 * 0.25 + 1e-3
    assert R.atol_floor(np.float32) == 1e-5
    assert R.atol_floor("bfloat16") == 1e-3 and R.atol_floor(np.float16) == 1e-3


# ------------------------------------------------------------------------------------------
# IO counts
# ------------------------------------------------------------------------------------------


def test_io_lower_bound_bytes():
    # q, o: 2*1*8*100*64 elements; k, v: 2*1*2*300*64; bf16; lse 8*100 float32
    want = 2 * (2 * 8 * 100 * 64 + 2 * 2 * 300 * 64) + 4 * 8 * 100
    assert R.io_lower_bound_bytes(1, 8, 2, 100, 300, 64, 2) == want
    assert R.io_lower_bound_bytes(1, 8, 2, 100, 300, 64, 2, lse=False) == want - 4 * 8 * 100
    assert R.io_lower_bound_bytes(3, 1, 1, 5, 5, 4, 4) == 3 * 4 * (4 * 5 * 4) + 3 * 4 * 5


@pytest.mark.parametrize("n,d", [(1, 1), (128, 64), (4096, 128), (1000, 80)])
def test_unfused_attention_bytes_is_the_seed_count(n, d):
    assert R.unfused_attention_bytes(n, d) == 8 * n * d + 8 * n * n  # seed 000, 2-byte elements
    assert R.unfused_attention_bytes(n, d, 4) == 16 * n * d + 16 * n * n
    # general: read Q, K, write S | read S, write P | read P, V, write O
    nq, nk = n, 3 * n + 1
    assert R.unfused_attention_bytes(nq, d, 2, nk=nk) == 2 * (nq * d + nk * d + nq * nk) + 2 * (
        2 * nq * nk) + 2 * (nq * nk + nk * d + nq * d)
    assert R.unfused_attention_bytes(n, d, 2, score_itemsize=4) == 8 * n * d + 16 * n * n
