"""Score modifiers in the float64 references: soft-capping, ALiBi slopes, attention sinks."""
import numpy as np
import pytest

from host import reference as ref
from host.validation import check_score_mods


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


def _naive(q, k, v, scale, mask, softcap=None, slopes=None, sinks=None, qpos=None):
    """Loop-free but independent formulation: concatenate the sink as an extra logit column."""
    s = scale * q @ np.swapaxes(k, -1, -2)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if slopes is not None:
        j = np.arange(s.shape[-1])
        s = s - slopes[None, :, None, None] * np.abs(qpos[:, None, :, None] - j)
    s = np.where(mask, s, -np.inf)
    if sinks is not None:
        col = np.broadcast_to(sinks[None, :, None, None], s.shape[:-1] + (1,))
        s = np.concatenate([s, col], axis=-1)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    p = e / e.sum(-1, keepdims=True)
    lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_forward_mods_match_naive(causal):
    B, H, Nq, Nk, D = 2, 3, 9, 13, 8
    q, k, v = _rand((B, H, Nq, D), 1), _rand((B, H, Nk, D), 2), _rand((B, H, Nk, D), 3)
    slopes, sinks = np.array([0.5, 0.25, 0.125]), np.array([0.3, -1.0, 2.0])
    o, lse = ref.attention_forward(q, k, v, causal=causal, softcap=1.5, alibi_slopes=slopes,
                                   sinks=sinks)
    mask = ref.attention_mask(Nq, Nk, batch=B, causal=causal)[:, None]
    off = 0 if causal == "top_left" else Nk - Nq
    qpos = np.broadcast_to(np.arange(Nq) + off, (B, Nq)).astype(float)
    o2, lse2 = _naive(q, k, v, 1 / np.sqrt(D), mask, 1.5, slopes, sinks, qpos)
    np.testing.assert_allclose(o, o2, atol=1e-12)
    np.testing.assert_allclose(lse, lse2, atol=1e-12)


def test_block_sparse_mods_match_naive():
    """With a block pattern the modifiers apply to the active blocks' scores; a row whose
    blocks are all inactive keeps only the sink (o = 0, lse = sink)."""
    from host import block_sparse as bs
    B, H, Nq, Nk, D = 1, 2, 300, 260, 8
    q, k, v = _rand((B, H, Nq, D), 1), _rand((B, H, Nk, D), 2), _rand((B, H, Nk, D), 3)
    slopes, sinks = np.array([0.5, 0.125]), np.array([0.3, -1.0])
    pattern = np.array([[True, False, True], [False, False, False], [True, True, False]])
    block = np.broadcast_to(pattern, (B, H, 3, 3))
    o, lse = ref.attention_forward(q, k, v, causal=True, softcap=1.5, alibi_slopes=slopes,
                                   sinks=sinks, block_mask=block)
    mask = ref.attention_mask(Nq, Nk, batch=B, causal=True)[:, None] & bs.expand(block, Nq, Nk)
    qpos = np.broadcast_to(np.arange(Nq) + Nk - Nq, (B, Nq)).astype(float)
    o2, lse2 = _naive(q, k, v, 1 / np.sqrt(D), mask, 1.5, slopes, sinks, qpos)
    np.testing.assert_allclose(o, o2, atol=1e-12)
    np.testing.assert_allclose(lse, lse2, atol=1e-12)
    assert np.all(o[:, :, 128:256] == 0)
    np.testing.assert_allclose(lse[0, :, 128:256], np.broadcast_to(sinks[:, None], (2, 128)))


def test_sink_row_without_keys():
    q, k, v = _rand((1, 1, 4, 4), 1), _rand((1, 1, 4, 4), 2), _rand((1, 1, 4, 4), 3)
    # a real row that sees no key: o = 0, lse = the sink
    o, lse = ref.attention_forward(q, k, v, kv_lens=[0], sinks=np.array([0.7]))
    assert np.all(o == 0) and np.allclose(lse, 0.7)
    # a padding row (past q_lens) is not a row: lse = -inf with or without a sink
    o, lse = ref.attention_forward(q, k, v, q_lens=[2], sinks=np.array([0.7]))
    assert np.all(o[0, 0, 2:] == 0) and np.all(np.isneginf(lse[0, 0, 2:]))
    o, lse = ref.attention_forward(q, k, v, q_lens=[2])
    assert np.all(np.isneginf(lse[0, 0, 2:]))


def _fd_check(loss, arrays, grads, points, eps=1e-6):
    for which, idx in points:
        plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
        plus[which][idx] += eps
        minus[which][idx] -= eps
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert abs(fd - grads[which][idx]) < 2e-6 * max(1.0, abs(fd)), (which, idx)


def test_backward_mods_finite_differences():
    B, H, Hkv, N, D = 1, 4, 2, 11, 6
    q, k, v, do = _rand((B, H, N, D), 1), _rand((B, Hkv, N, D), 2), _rand((B, Hkv, N, D), 3), \
        _rand((B, H, N, D), 4)
    slopes = np.array([0.5, 0.2, 0.1, 0.05])
    opts = dict(causal=True, window=(4, -1), softcap=2.0, alibi_slopes=slopes)

    def loss(q_, k_, v_, sinks_):
        o, _ = ref.attention_forward(q_, k_, v_, sinks=sinks_, **opts)
        return float(np.sum(o * do))

    sinks = np.array([0.1, -0.5, 1.0, 0.0])
    grads = ref.attention_backward(do, q, k, v, sinks=sinks, **opts)
    assert len(grads) == 4 and grads[3].shape == (H,)
    _fd_check(loss, [q, k, v, sinks], grads,
              [(0, (0, 1, 5, 3)), (1, (0, 0, 7, 2)), (2, (0, 1, 3, 4)), (3, (2,)), (3, (0,))])
    o, lse = ref.attention_forward(q, k, v, sinks=sinks, **opts)
    from_lse = ref.attention_backward_from_lse(do, q, k, v, o, lse, sinks=sinks, **opts)
    for a, b in zip(from_lse, grads):
        np.testing.assert_allclose(a, b, atol=1e-12)


def test_decode_mods_match_forward_bottom_right():
    B, Hq, Hkv, T, S, D = 2, 4, 2, 3, 20, 8
    q = _rand((B, Hq, T, D), 1)
    kc, vc = _rand((B, Hkv, S, D), 2), _rand((B, Hkv, S, D), 3)
    lens = np.array([7, 20])
    slopes, sinks = np.linspace(0.1, 0.4, Hq), np.linspace(-1, 1, Hq)
    o, lse = ref.decode(q, kc, vc, cache_lens=lens, softcap=3.0, alibi_slopes=slopes,
                        sinks=sinks)
    for b in range(B):
        L = lens[b]
        o2, lse2 = ref.attention_forward(q[b:b + 1], kc[b:b + 1, :, :L], vc[b:b + 1, :, :L],
                                         causal="bottom_right", softcap=3.0,
                                         alibi_slopes=slopes, sinks=sinks)
        np.testing.assert_allclose(o[b:b + 1], o2, atol=1e-12)
        np.testing.assert_allclose(lse[b:b + 1], lse2, atol=1e-12)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(softcap=-1.0), ValueError, "softcap: expected a finite number > 0"),
    (dict(softcap=float("inf")), ValueError, "softcap: expected a finite number"),
    (dict(softcap="1"), TypeError, "softcap: expected None or a real number"),
    (dict(alibi_slopes=np.ones(3)), ValueError, r"alibi_slopes: expected shape \(Hq,\) = \(4,\)"),
    (dict(alibi_slopes=np.array([1, 2, 3, np.nan])), ValueError, "alibi_slopes: values must be finite"),
    (dict(sinks=np.ones((2, 4))), ValueError, r"sinks: expected shape \(Hq,\) = \(4,\)"),
    (dict(sinks=np.ones(4, np.int32)), TypeError, "sinks: dtype int32 is not supported"),
])
def test_check_score_mods_errors(kwargs, exc, match):
    args = dict(softcap=None, alibi_slopes=None, sinks=None)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        check_score_mods(args["softcap"], args["alibi_slopes"], args["sinks"], 2, 4)


def test_check_score_mods_accepts():
    mods = check_score_mods(0, np.ones((2, 4), np.float32), None, 2, 4)
    assert mods.softcap is None and mods.alibi_slopes.shape == (2, 4) and mods.any
    assert not check_score_mods(None, None, None, 1, 1).any
