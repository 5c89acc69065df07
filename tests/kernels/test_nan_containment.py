"""A non-finite key a row cannot see never reaches that row (the forward's band masks select
rather than add): the rows before a NaN key under a causal mask, or outside its window, give
exactly what they give when that key is finite. Dense and block-sparse forwards; and a
non-finite hidden value (forward) or key/value (backward dQ) likewise."""
import numpy as np
import pytest

import host
from nki_kernels.nki import API_ENV_VAR, BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "simulate", reason="simulator runs")


@pytest.fixture(autouse=True)
def _legacy_namespace(monkeypatch):
    """These tests trace the kernels through the legacy namespace (the forward is one source
    for both; tests/kernels/test_forward.py runs it through nki.* as well)."""
    monkeypatch.setenv(API_ENV_VAR, "legacy")


def _qkv(Nq, Nk, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 2, Nq, 32)).astype(np.float32)
    k = rng.standard_normal((1, 1, Nk, 32)).astype(np.float32)
    v = rng.standard_normal((1, 1, Nk, 32)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kw, hidden", [
    (dict(causal="top_left"), slice(0, 250)),                  # rows before key 250
    (dict(window=(20, 20)), slice(0, 229)),                     # rows farther than 20 away
    (dict(causal="top_left", block_mask=np.tril(np.ones((3, 3), bool))[None, None]),
     slice(0, 250)),
])
@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_a_non_finite_hidden_key_does_not_reach_the_rows_that_cannot_see_it(kw, hidden, bad, api,
                                                                            monkeypatch):
    """Also through nki.* (the forward and the block-sparse forward), where the band's
    blocks that legacy predicates off run and their scores are selected away."""
    monkeypatch.setenv(API_ENV_VAR, api)
    q, k, v = _qkv(300, 300)
    clean = host.flash_attention(q, k, v, mixed_precision=False, **kw)
    k[0, 0, 250] = bad
    got = host.flash_attention(q, k, v, mixed_precision=False, **kw)
    np.testing.assert_array_equal(got[:, :, hidden], clean[:, :, hidden])
    assert np.isfinite(got[:, :, hidden]).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("block_mask", [None, np.ones((1, 1, 3, 3), bool)],
                         ids=["dense", "block-sparse"])
@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_rows_past_q_len_give_zeros_whatever_the_keys_hold(block_mask, bad, api, monkeypatch):
    """Rows past q_len see no key: zeros and lse -inf even when a key within kv_len is
    non-finite (their scores meet it; the finalize selects them away rather than multiplying
    by 0, which kept the NaN); the other rows as with a finite key, but the row that sees it."""
    monkeypatch.setenv(API_ENV_VAR, api)
    q, k, v = _qkv(300, 300)
    kw = dict(q_lens=np.array([200], np.int32), kv_lens=np.array([280], np.int32),
              mixed_precision=False, return_lse=True, block_mask=block_mask)
    clean, _ = host.flash_attention(q, k, v, **kw)
    k[0, 0, 250] = bad
    got, lse = host.flash_attention(q, k, v, **kw)
    assert not np.isfinite(got[:, :, :200]).all(axis=-1).any()     # every real row sees key 250
    assert (got[:, :, 200:] == 0).all() and np.isneginf(lse[:, :, 200:]).all()
    np.testing.assert_array_equal(got[:, :, 200:], clean[:, :, 200:])


BANDS = [
    (dict(causal="top_left"), slice(0, 250), slice(250, 300)),
    (dict(window=(20, 20)), slice(0, 229), slice(230, 271)),
    (dict(causal="top_left", block_mask=np.tril(np.ones((3, 3), bool))[None, None]),
     slice(0, 250), slice(250, 300)),
]


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("kw, hidden, seeing", BANDS)
@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_a_non_finite_hidden_value_reaches_only_the_rows_that_see_it(kw, hidden, seeing, bad,
                                                                     api, monkeypatch):
    """V's non-finite entries are zeroed on chip and flagged (forward.guard_values): the rows
    that cannot see the value are bit-identical to a finite run, the rows that see it are NaN
    (as P V would make them). Through both namespaces."""
    monkeypatch.setenv(API_ENV_VAR, api)
    q, k, v = _qkv(300, 300, seed=2)
    clean = host.flash_attention(q, k, v, mixed_precision=False, **kw)
    v[0, 0, 250, 5] = bad
    got = host.flash_attention(q, k, v, mixed_precision=False, **kw)
    np.testing.assert_array_equal(got[:, :, hidden], clean[:, :, hidden])
    assert np.isnan(got[:, :, seeing]).all()


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("kw, hidden, seeing", BANDS)
def test_backward_keeps_a_hidden_non_finite_key_or_value_out_of_dq(kw, hidden, seeing, which):
    """The dP and dQ operands (V^T, natural K) have their non-finite entries zeroed; S uses the
    raw K^T. Rows that cannot see the key get the dQ of the finite run; rows that see it get
    NaN (through P or through D = rowsum(dO O))."""
    q, k, v = _qkv(300, 300, seed=3)
    do = np.random.default_rng(4).standard_normal(q.shape).astype(np.float32)

    def grads():
        o, lse = host.flash_attention(q, k, v, mixed_precision=False, return_lse=True, **kw)
        return host.flash_attention_backward(do, q, k, v, o, lse, mixed_precision=False, **kw)

    dq0 = grads()[0]
    (k if which == "k" else v)[0, 0, 250, 5] = np.nan
    dq = grads()[0]
    np.testing.assert_array_equal(dq[:, :, hidden], dq0[:, :, hidden])
    assert np.isnan(dq[:, :, seeing]).any(axis=-1).all()


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("tree", [False, True])
def test_decode_keeps_a_later_new_token_out_of_earlier_rows(which, tree):
    """A new token's key or value hidden from the earlier tokens (causal, or a tree mask) by
    selection and the value guard: earlier rows are unchanged, the rows that see it NaN."""
    rng = np.random.default_rng(5)
    B, Hq, Hkv, T, D, S = 1, 4, 2, 3, 32, 200
    q = rng.standard_normal((B, Hq, T, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, S, D)).astype(np.float32) for _ in range(2))
    lens = np.array([150])
    tree_mask = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], bool) if tree else None
    clean = host.flash_decode(q, k, v, cache_lens=lens, tree_mask=tree_mask,
                              mixed_precision=False)
    (k if which == "k" else v)[0, :, 149, 2] = np.nan       # new token 2, at L - 1
    got = host.flash_decode(q, k, v, cache_lens=lens, tree_mask=tree_mask,
                            mixed_precision=False)
    np.testing.assert_array_equal(got[:, :, 0:2], clean[:, :, 0:2])
    assert np.isnan(got[:, :, 2]).all()
