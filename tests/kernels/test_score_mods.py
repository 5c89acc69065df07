"""Score modifiers in the kernels (nki_kernels/attention/score_mods.py): logit soft-capping,
ALiBi and attention sinks in the flash forward, backward and decode, against the float64
references of host/reference.py."""
import ml_dtypes
import numpy as np
import pytest

import host
from host import reference as ref
from nki_kernels.nki import API_ENV_VAR, BACKEND

from _attention_inputs import attention_inputs

pytestmark = pytest.mark.skipif(BACKEND != "simulate", reason="simulator runs")


@pytest.fixture(autouse=True)
def _legacy_namespace(monkeypatch):
    """These tests trace the kernels through the legacy namespace unless a test says otherwise
    (the forward is one source for both; tests/kernels/test_forward.py runs it through nki.*
    as well)."""
    monkeypatch.setenv(API_ENV_VAR, "legacy")


def _mods(Hq, softcap=None, alibi=False, sinks=False, B=None, seed=5):
    rng = np.random.default_rng(seed)
    out = {}
    if softcap is not None:
        out["softcap"] = softcap
    if alibi:
        out["alibi_slopes"] = rng.uniform(0.02, 0.4, (Hq,) if B is None else (B, Hq))
    if sinks:
        out["sinks"] = rng.uniform(-1.0, 3.0, Hq)
    return out


def _close(got, want, tol):
    got = np.asarray(got, dtype=np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=0)


FORWARD_CASES = [
    # (mods, masks, B, Hq, Hkv, Nq, Nk, D)
    (dict(softcap=4.0), {}, 1, 2, 1, 200, 600, 64),
    (dict(alibi=True), dict(causal=True), 1, 2, 2, 300, 700, 64),
    (dict(sinks=True), dict(window=(90, 30)), 1, 4, 2, 260, 260, 32),
    (dict(softcap=2.0, alibi=True, sinks=True), dict(causal="top_left"), 1, 2, 1, 300, 300, 128),
    (dict(alibi=True, sinks=True), dict(kv_lens=[500, 0], q_lens=[300, 120]), 2, 2, 1, 300,
     520, 64),
    (dict(softcap=3.0, alibi=True), dict(causal=True, kv_lens=[400, 131], q_lens=[200, 77]),
     2, 2, 1, 200, 420, 64),
]


@pytest.mark.parametrize("mods, masks, B, Hq, Hkv, Nq, Nk, D", FORWARD_CASES)
def test_forward_and_backward_match_the_reference(mods, masks, B, Hq, Hkv, Nq, Nk, D):
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, D, seed=Nq + Nk)
    kw = dict(masks, **_mods(Hq, B=B if "kv_lens" in masks else None, **mods))
    o, lse = host.flash_attention(q, k, v, return_lse=True, mixed_precision=False, lnc=1, **kw)
    ro, rl = ref.attention_forward(q, k, v, **kw)
    _close(o, ro, 2e-5)
    assert np.array_equal(np.isneginf(lse), np.isneginf(rl))
    _close(np.where(np.isfinite(rl), lse, 0.0), np.where(np.isfinite(rl), rl, 0.0), 2e-5)
    grads = host.flash_attention_backward(do, q, k, v, o, lse, mixed_precision=False, lnc=1,
                                          **kw)
    want = ref.attention_backward_from_lse(do, q, k, v, o, lse, **kw)
    assert len(grads) == len(want) == (4 if mods.get("sinks") else 3)
    for g, w in zip(grads, want):
        _close(g, w, 3e-5)


def test_bf16_inputs_with_every_modifier():
    q, k, v, do = attention_inputs(1, 4, 2, 257, 700, 64, dtype=ml_dtypes.bfloat16, seed=3)
    kw = dict(causal=True, **_mods(4, softcap=5.0, alibi=True, sinks=True))
    o, lse = host.flash_attention(q, k, v, return_lse=True, lnc=1, **kw)
    ro, rl = ref.attention_forward(q, k, v, **kw)
    _close(o, ro, 2e-2)
    _close(lse, rl, 2e-2)
    grads = host.flash_attention_backward(do, q, k, v, o, lse, lnc=1, **kw)
    for g, w in zip(grads, ref.attention_backward_from_lse(do, q, k, v, o, lse, **kw)):
        _close(g, w, 4e-2)


def test_sinks_give_rows_without_keys_the_sink_and_padding_rows_minus_inf():
    q, k, v, do = attention_inputs(2, 2, 1, 140, 150, 32, seed=9)
    sinks = np.array([0.75, -2.0])
    o, lse = host.flash_attention(q, k, v, kv_lens=[0, 150], q_lens=[140, 100], sinks=sinks,
                                  return_lse=True, mixed_precision=False, lnc=1)
    # sequence 0 has no key: every row is a real row without one (o = 0, lse = sink)
    assert np.all(o[0] == 0)
    np.testing.assert_allclose(lse[0], np.broadcast_to(sinks[:, None], (2, 140)), rtol=1e-6)
    # sequence 1: rows past q_len are padding (o = 0, lse = -inf)
    assert np.all(o[1, :, 100:] == 0) and np.all(np.isneginf(lse[1, :, 100:]))
    assert np.isfinite(lse[1, :, :100]).all()
    dq, dk, dv, dsinks = host.flash_attention_backward(
        do, q, k, v, o, lse, kv_lens=[0, 150], q_lens=[140, 100], sinks=sinks,
        mixed_precision=False, lnc=1)
    assert np.isfinite(dsinks).all() and np.all(dq[0] == 0) and np.all(dq[1, :, 100:] == 0)
    want = ref.attention_backward_from_lse(do, q, k, v, o, lse, kv_lens=[0, 150],
                                           q_lens=[140, 100], sinks=sinks)
    _close(dsinks, want[3], 3e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_hidden_key_stays_hidden_with_modifiers(bad):
    """The masks select after the modifiers: a NaN/inf in a causally hidden key reaches no row
    that cannot see it, through the tanh and the ALiBi bias, forward and backward."""
    q, k, v, do = attention_inputs(1, 2, 1, 300, 300, 32, seed=1)
    kw = dict(causal="top_left", lnc=1, mixed_precision=False,
              **_mods(2, softcap=3.0, alibi=True, sinks=True))
    o0, l0 = host.flash_attention(q, k, v, return_lse=True, **kw)
    k[0, 0, 250] = bad
    o1, l1 = host.flash_attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_array_equal(o1[:, :, :250], o0[:, :, :250])
    np.testing.assert_array_equal(l1[:, :, :250], l0[:, :, :250])


def test_alibi_lengths_rotate_like_a_band():
    """Non-causal ALiBi aligns the query at ``i + kv_len - q_len``: runtime lengths, so the
    kernel rotates the sequences (MaskSpec.alibi) and one compilation serves every length."""
    q, k, v, _ = attention_inputs(3, 2, 1, 140, 300, 32, seed=4)
    kw = _mods(2, alibi=True, B=3)
    for kv, ql in (([300, 129, 1], [140, 140, 140]), ([17, 300, 250], [1, 77, 140])):
        o = host.flash_attention(q, k, v, kv_lens=kv, q_lens=ql, mixed_precision=False, lnc=1,
                                 **kw)
        want, _ = ref.attention_forward(q, k, v, kv_lens=kv, q_lens=ql, **kw)
        _close(o, want, 2e-5)


def test_key_length_rows_longer_than_one_piece(monkeypatch):
    """With ALiBi and runtime lengths the padding keys are masked by a [1, n] key row
    (masks.key_length_row), built in pieces of ``FWD_ROW_FMAX`` keys: the full pieces in an
    NKI loop, the rest after it. With 96-key pieces a 512-key score tile's row is 5 full pieces
    and a 32-key tail (the forward), and the backward's key spans likewise."""
    from nki_kernels import tiles
    monkeypatch.setattr(tiles, "FWD_ROW_FMAX", 96)
    q, k, v, do = attention_inputs(2, 2, 1, 200, 420, 64, seed=8)
    kw = dict(causal=True, kv_lens=[400, 131], q_lens=[200, 77], **_mods(2, alibi=True, B=2))
    o, lse = host.flash_attention(q, k, v, return_lse=True, mixed_precision=False, lnc=1, **kw)
    _close(o, ref.attention_forward(q, k, v, **kw)[0], 2e-5)
    grads = host.flash_attention_backward(do, q, k, v, o, lse, mixed_precision=False, lnc=1,
                                          **kw)
    for g, w in zip(grads, ref.attention_backward_from_lse(do, q, k, v, o, lse, **kw)):
        _close(g, w, 3e-5)


def test_key_length_row_pieces_through_nki(monkeypatch):
    """Through nki.* the key row's pieces of a compiled loop start at loop-index keys read
    from the distance table (masks.key_length_row; 128-key pieces, the table's step, so a
    512-key score tile's row is four of them): the legacy trace's outputs bit for bit, ALiBi
    with lengths, per-sequence slopes."""
    from nki_kernels import tiles
    monkeypatch.setattr(tiles, "FWD_ROW_FMAX", 128)
    q, k, v, _ = attention_inputs(2, 2, 1, 200, 700, 64, seed=8)
    kw = dict(causal=True, kv_lens=[650, 131], q_lens=[200, 77], **_mods(2, alibi=True, B=2))
    outs = []
    for api in ("legacy", "nki"):
        monkeypatch.setenv(API_ENV_VAR, api)
        outs.append(host.flash_attention(q, k, v, return_lse=True, mixed_precision=False, lnc=1,
                                         **kw))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    _close(outs[1][0], ref.attention_forward(q, k, v, **kw)[0], 2e-5)


DECODE_CASES = [
    # (mods, T, tree, paged)
    (dict(softcap=3.0), 1, False, False),
    (dict(sinks=True), 2, False, True),
    (dict(alibi=True), 1, False, False),
    (dict(softcap=2.0, alibi=True, sinks=True), 3, False, False),
    (dict(alibi=True, softcap=4.0), 3, True, True),
]


@pytest.mark.parametrize("mods, T, tree, paged", DECODE_CASES)
def test_decode_matches_the_reference(mods, T, tree, paged):
    B, Hq, Hkv, D, S = 2, 8, 2, 64, 1024
    rng = np.random.default_rng(T)
    q = rng.standard_normal((B, Hq, T, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    lens = np.array([1000, 77])
    tree_mask = None
    if tree:
        tree_mask = np.tril(np.ones((T, T), bool))
        tree_mask[0, T - 1] = True        # a token that sees a later one: two-sided ALiBi
    kw = dict(tree_mask=tree_mask, **_mods(Hq, B=B if mods.get("alibi") else None, **mods))
    want_o, want_l = ref.decode(q, k, v, cache_lens=lens, **kw)
    if paged:
        (kp, vp), table = ref.contiguous_to_paged([k, v], lens, 64, rng, spare=2)
        o, lse = host.flash_decode(q, kp, vp, cache_lens=lens, block_table=table,
                                   return_lse=True, mixed_precision=False, num_splits=3, **kw)
    else:
        o, lse = host.flash_decode(q, k, v, cache_lens=lens, return_lse=True,
                                   mixed_precision=False, num_splits=3, **kw)
    _close(o, want_o, 5e-5)
    _close(lse, want_l, 5e-5)


def test_program_size_with_modifiers_does_not_grow_with_n():
    """Every modifier instruction sits in the kernels' NKI loop bodies: forward (causal) and
    backward (no band: its causal span plan has its own small-N steps, test_forward) programs
    are the same size at two key lengths with the same tails."""
    import simulate

    sizes = []
    for Nk in (4096 + 1024, 16384 + 1024):      # the same tails and spans (test_forward)
        q, k, v, do = attention_inputs(1, 2, 1, 1024, Nk, 64, dtype=ml_dtypes.bfloat16,
                                       seed=Nk)
        kw = dict(lnc=1, **_mods(2, softcap=5.0, alibi=True, sinks=True))
        with simulate.measure(target="trn2") as m:
            host.flash_attention(q, k, v, causal=True, **kw)
        o, lse = host.flash_attention(q, k, v, return_lse=True, **kw)
        with simulate.measure(target="trn2") as mb:
            host.flash_attention_backward(do, q, k, v, o, lse, **kw)
        sizes.append((m.program_instructions, mb.program_instructions))
    assert sizes[0] == sizes[1]
    assert max(sizes[0]) < 20_000


@pytest.mark.parametrize("kw, match", [
    (dict(softcap=2.0 ** 30), "softcap"),
    (dict(sinks=np.full(2, 2.0 ** 40)), "sinks"),
    (dict(alibi_slopes=np.full(2, -2.0 ** 33)), "alibi_slopes"),
    (dict(alibi_slopes=np.ones(3)), "alibi_slopes"),
    (dict(sinks=np.array([1.0, np.nan])), "sinks"),
    (dict(sinks=np.ones(3), block_mask=np.ones((1, 1, 2, 2), bool)
          & np.tri(2, dtype=bool)[None, None]), "sinks"),
])
def test_refusals_name_the_argument(kw, match):
    q, k, v, _ = attention_inputs(1, 2, 1, 200, 200, 32)
    with pytest.raises(ValueError, match=match):
        host.flash_attention(q, k, v, lnc=1, **kw)


# -- block-sparse kernels (nki_kernels/attention/block_sparse*.py) ----------------------------


def _block_pattern(B, Hq, Nq, Nk, density, seed):
    """A random compile-time pattern whose query tile 1 has no active block (its own class:
    o = 0, lse = sink with sinks)."""
    from host import block_sparse as bs
    nqt, nkt = bs.block_grid(Nq, Nk)
    mask = np.random.default_rng(seed).random((B, Hq, nqt, nkt)) < density
    mask[..., 1, :] = False
    return mask


BLOCK_SPARSE_CASES = [
    # (mods, masks, B, Hq, Hkv, index form)
    (dict(softcap=4.0, sinks=True), dict(window=(100, 20)), 1, 2, 1, True),
    (dict(alibi=True), dict(causal=True), 1, 2, 2, False),
    (dict(softcap=2.0, alibi=True, sinks=True), dict(causal=True, kv_lens=[250, 3],
                                                     q_lens=[200, 300]), 2, 2, 1, False),
    (dict(alibi=True, sinks=True), dict(kv_lens=[250, 300], q_lens=[200, 17]), 2, 2, 1, False),
]


@pytest.mark.parametrize("mods, masks, B, Hq, Hkv, index", BLOCK_SPARSE_CASES)
def test_block_sparse_forward_and_backward_match_the_reference(mods, masks, B, Hq, Hkv, index):
    """The block-sparse kernels with score modifiers against the float64 reference on the
    pattern's active blocks (tolerances as the dense kernels': fp32 inputs and matmuls, 2e-5
    forward and 3e-5 backward relative to max(1, max |want|)); the index form's padding
    slots and an empty query tile (lse = sink) included."""
    from host import block_sparse as bs
    Nq, Nk = 300, 390
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, 32, seed=21)
    dense = _block_pattern(B, Hq, Nq, Nk, 0.5, seed=22)
    mask = tuple(bs.dense_to_index(dense, max_blocks=3)) if index else dense
    dense = bs.check_block_mask(mask, B, Hq, Nq, Nk).dense
    kw = dict(masks, **_mods(Hq, B=B if "kv_lens" in masks else None, **mods))
    o, lse = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                  mixed_precision=False, **kw)
    ro, rl = ref.attention_forward(q, k, v, block_mask=dense, **kw)
    _close(o, ro, 2e-5)
    assert np.array_equal(np.isneginf(lse), np.isneginf(rl))
    _close(np.where(np.isfinite(rl), lse, 0.0), np.where(np.isfinite(rl), rl, 0.0), 2e-5)
    grads = host.flash_attention_backward(do, q, k, v, o, lse, block_mask=mask,
                                          mixed_precision=False, **kw)
    want = ref.attention_backward_from_lse(do, q, k, v, o, lse, block_mask=dense, **kw)
    assert len(grads) == len(want) == (4 if mods.get("sinks") else 3)
    for g, w in zip(grads, want):
        _close(g, w, 3e-5)


def test_block_sparse_nki_namespace_matches_legacy_with_every_modifier(monkeypatch):
    """Through nki.* the block-sparse forward and backward with every modifier give the legacy
    trace's outputs bit for bit (the same instructions on the data); bf16 inputs and matmuls
    within the bf16 tolerance of the reference."""
    import simulate
    q, k, v, do = attention_inputs(2, 2, 1, 300, 390, 32, dtype=ml_dtypes.bfloat16, seed=23)
    mask = _block_pattern(2, 2, 300, 390, 0.6, seed=24)
    kw = dict(causal=True, kv_lens=[250, 390], q_lens=[200, 300],
              **_mods(2, softcap=3.0, alibi=True, sinks=True, B=2))
    outs = {}
    for api in ("nki", "legacy"):
        monkeypatch.setenv(API_ENV_VAR, api)
        with simulate.measure(target="trn2") as m:
            o, lse = host.flash_attention(q, k, v, block_mask=mask, return_lse=True, **kw)
            grads = host.flash_attention_backward(do, q, k, v, o, lse, block_mask=mask, **kw)
        assert {kr.api for kr in m.kernels} == {api}
        outs[api] = [np.asarray(x) for x in (o, lse, *grads)]
    for a, b in zip(outs["nki"], outs["legacy"]):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    o, lse = outs["nki"][:2]
    ro, rl = ref.attention_forward(q, k, v, block_mask=mask, **kw)
    _close(o, ro, 2e-2)
    _close(np.where(np.isfinite(rl), lse, 0.0), np.where(np.isfinite(rl), rl, 0.0), 2e-2)


def test_block_sparse_hidden_non_finite_key_stays_hidden_with_modifiers():
    """A NaN in a key of an inactive block, and in a causally hidden key of an active one,
    reaches no row through the tanh and the ALiBi bias, forward and backward."""
    q, k, v, do = attention_inputs(1, 2, 1, 300, 300, 32, seed=25)
    mask = np.ones((1, 1, 3, 3), bool) & np.tri(3, dtype=bool)[None, None]
    mask[0, 0, 2, 1] = False
    kw = dict(causal="top_left", mixed_precision=False,
              **_mods(2, softcap=3.0, alibi=True, sinks=True))
    o0, l0 = host.flash_attention(q, k, v, block_mask=mask, return_lse=True, **kw)
    g0 = host.flash_attention_backward(do, q, k, v, o0, l0, block_mask=mask, **kw)
    k[0, 0, 250] = np.nan          # causally hidden from rows < 250
    k[0, 0, 200] = np.nan          # block (2, 1) is inactive: rows >= 256 never see it
    o1, l1 = host.flash_attention(q, k, v, block_mask=mask, return_lse=True, **kw)
    np.testing.assert_array_equal(o1[:, :, :200], o0[:, :, :200])
    np.testing.assert_array_equal(o1[:, :, 256:], o0[:, :, 256:])
    np.testing.assert_array_equal(l1[:, :, 256:], l0[:, :, 256:])
    g1 = host.flash_attention_backward(do, q, k, v, o1, l1, block_mask=mask, **kw)
    np.testing.assert_array_equal(g1[0][:, :, :200], g0[0][:, :, :200])
