"""Block-sparse flash attention (FlashAttention section 3.3, appendix Algorithm 5): forward and
backward kernels through the NumPy API, against the float64 reference restricted to the same
pattern, with the traffic that proves inactive blocks are skipped.

The kernels are one source for both NKI namespaces (nki_kernels.port). These tests run them
through the legacy namespace (``NKI_FLASH_API=legacy``, autouse fixture), but for the program
size, checked flat in N under both. The section "nki.*" at the end runs a representative subset
through nki.* (NKI 0.7) against the legacy trace, bit for bit: the compile-time (sorted, dense)
and runtime (index form, padding slots) patterns, a query tile without blocks, lengths with a
band and GQA over several (batch, kv head) instances, and dropout with its mask -- the paths
where the two traces differ (flattened indirect rows, loop indices read as data) -- forward
and backward; plus the int32 row numbers past 2^24 (the bound lowered). Each is a few 128-row
tiles (~20 s in all).
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import host
from _attention_inputs import attention_inputs
import simulate
from host import block_sparse as bs
from host import reference as ref
from host._launch import launch, program_size
from nki_kernels import nki as binding
from nki_kernels import tiles as T
from nki_kernels.attention import block_sparse as BSK
from nki_kernels.attention.block_sparse import (block_sparse_attention_fwd, check_natural,
                                                check_shared, keeps_order, window_capacity)
from nki_kernels.attention.block_sparse_bwd import block_sparse_attention_bwd
from nki_kernels.nki import BACKEND
from nki_kernels.port import launch_grid

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)

pytestmark = pytest.mark.skipif(BACKEND != "simulate",
                                reason="exact byte counts and program sizes use the simulator")


@pytest.fixture(autouse=True)
def _legacy_namespace(monkeypatch):
    """The kernels trace through the legacy namespace unless a test says otherwise."""
    monkeypatch.setenv(binding.API_ENV_VAR, "legacy")


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


@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_fully_masked_rows_are_zero_not_nan(api, monkeypatch):
    """Rows whose active blocks are all hidden by causality, and key blocks no query sees.
    On NeuronCore-v3+ a group's LSE is stored as rows after a TensorE transpose
    (tiles.BSP_LSE_ROWS_MAX_SLOTS), -inf included; its one step's accumulator update is a
    copy (forward.fold_update first)."""
    monkeypatch.setenv(binding.API_ENV_VAR, api)
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
    K/V bytes read are exactly those of the active blocks of each kernel group of query tiles:
    tile 2 (two blocks) alone, tiles 0 and 1 (the class of one block) one group that shares
    key block 0 and reads it once."""
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
    want = Hq * (rows[0] + rows[2] + rows[0]) * D * 4
    per = m.per_tensor
    assert per["k"]["read"] == want and per["v"]["read"] == want
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 128:256] = 0.0
    v2[:, :, 128:256] = 0.0
    np.testing.assert_array_equal(o, host.flash_attention(q, k2, v2, block_mask=mask,
                                                          mixed_precision=False))


def _shared_mask():
    """Query tiles 0-2 of 4 key blocks: blocks 0 and 3 in every tile, plus block i in tiles 1
    and 2 (a group of two sharing two blocks, each with one of its own)."""
    mask = np.zeros((1, 1, 3, 4), bool)
    mask[..., [0, 3]] = True
    mask[0, 0, [1, 2], [1, 2]] = True
    return mask


def test_a_group_reads_its_common_key_blocks_once():
    """The forward's tables group each class's query tiles by their common key blocks, listed
    first; the kernel gathers those once per group: tiles 1, 2, 4 (blocks 0-6) one group, tiles
    0 and 3 (blocks 0-5) another -- 13 key blocks read per head instead of 33 -- with the
    reference's outputs (a step of 7 blocks: two score tiles)."""
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 640, 896, 16
    q, k, v, _ = attention_inputs(B, Hq, Hkv, Nq, Nk, D, seed=21)
    mask = np.zeros((1, 1, 5, 7), bool)
    mask[..., :6] = True
    mask[0, 0, [1, 2, 4], 6] = True
    t = bs.launch_tables(bs.check_block_mask(mask, B, Hq, Nq, Nk), group=2, backward=False).q
    assert [c[:3] for c in t.classes] == [(0, 3, 7), (3, 2, 6)] and t.shared == (7, 6)
    assert np.all(t.meta[..., 2:8] == 128 * np.arange(6))
    with simulate.measure() as m:
        o, lse = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                      mixed_precision=False)
    want = Hq * 13 * 128 * D * 4
    assert m.per_tensor["k"]["read"] == want and m.per_tensor["v"]["read"] == want
    ro, rl = ref.attention_forward(q, k, v, block_mask=mask)
    assert _err(o, ro) < 2e-6 and _err(lse, rl) < 2e-6


def test_nki_more_than_128_slots_with_padding(monkeypatch):
    """A class of more than 128 slots with a padding slot, K/V resident: the padding matmul
    contracts over the slots (one partition each), so past 128 the slots are masked the
    other way (it failed with a partition-count error); the result is the reference's."""
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    Nq, Nk, D = 256, 150 * 128, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, n, D)).astype(np.float32) for n in (Nq, Nk, Nk))
    mask = np.zeros((1, 1, 2, Nk // 128), dtype=bool)
    mask[0, 0, 0, :150] = True
    mask[0, 0, 1, 1:150] = True                       # one padding slot
    assert bs.dense_to_index(mask).max_blocks == 150
    o = host.flash_attention(q, k, v, block_mask=mask, mixed_precision=False)
    ro, _ = ref.attention_forward(q, k, v, block_mask=mask)
    assert _err(o, ro) < 2e-6


def test_shared_counts_are_checked_against_the_classes():
    assert check_shared(None, ((0, 2, 3, True),)) == (0,)
    with pytest.raises(ValueError, match=r"shared: expected one count in \[0, trip\] per class "
                                         r"of \(\(0, 2, 3, True\),\), got \(4,\)"):
        check_shared((4,), ((0, 2, 3, True),))


def test_natural_flags_are_checked_against_the_classes():
    assert check_natural(None, ((0, 2, 3, True),)) == (False,)
    with pytest.raises(ValueError, match=r"natural: expected one bool per class of "
                                         r"\(\(0, 2, 3, True\),\), got \(1,\)"):
        check_natural((1,), ((0, 2, 3, True),))


def test_tables_keep_their_order_only_for_nki_whole_tiles_and_resident_kv():
    """The forward's tables skip the grouping by common key blocks only where it saves
    nothing and natural order pays (nki.*, K/V resident, whole query tiles, no lengths)."""
    assert keeps_order("nki", 4096, 4096, 128, "bfloat16", 16, False)
    assert not keeps_order("legacy", 4096, 4096, 128, "bfloat16", 16, False)
    assert not keeps_order("nki", 4000, 4096, 128, "bfloat16", 16, False)
    assert not keeps_order("nki", 4096, 4096, 128, "bfloat16", 16, True)
    assert not keeps_order("nki", 65536, 65536, 128, "bfloat16", 32, False)   # K/V past SBUF


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


@pytest.mark.parametrize("mods", [False, True], ids=["plain", "score-mods"])
@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_program_size_does_not_grow_with_n(api, mods):
    """One compilation per class structure: a uniform pattern is one class at any N, under both
    namespaces (0.7 would unroll any Python loop over tiles or slots), with the score
    modifiers too. (The program depends on N only through the step widths, min(4, blocks per
    tile) and min(16, blocks a group shares), and through whether a group's first sweep is
    one step, then peeled, a smaller program: 16, 32 and 64 blocks here, all shared.) The
    backward in one chunk and in chunks of 8 query tiles (4 and 16 chunks; not at 8K), under
    nki.* with the query tiles reordered (even and odd tiles meet different blocks here)."""
    sizes = []
    grid = launch_grid((1, 1), api)
    for N in (4096, 8192, 16384):
        q, k, v, do = attention_inputs(1, 1, 1, N, N, 64, dtype=BF16)
        sp = bs.check_block_mask(bs.fixed_density(N // 128, N // 128, 0.5), 1, 1, N, N)
        t = bs.launch_tables(sp, group=1)
        kw = dict(scale=0.125, mm_dtype="bfloat16")
        if mods:
            kw.update(softcap=5.0, alibi_slopes=np.full(1, 0.1, np.float32),
                      sinks=np.zeros(1, np.float32))
        assert t.q.shared == t.q.classes[0][2:3]
        fwd = program_size(block_sparse_attention_fwd.on(api), grid, q, k, v, t.q.meta,
                           classes=t.q.classes, shared=t.q.shared, **kw)
        o = np.zeros_like(q)
        lse = np.zeros(q.shape[:3], np.float32)
        chunked = bs.launch_tables(sp, group=1, chunk_tiles=8, reorder=api == "nki",
                                   head_dim=64)
        assert (chunked.order_q is not None) == (api == "nki")
        bwd = [program_size(block_sparse_attention_bwd.on(api), grid, q, k, v, o, do, lse,
                            tk.k.meta, acc_k=tk.acc_k if api == "nki" else None,
                            order_q=tk.order_q, slots_k=tk.slots_k, classes_k=tk.k.classes,
                            chunk_tiles=ct, **kw)
               for ct, tk in ((N // 128, t), (8, chunked)) if N != 8192]
        sizes.append((fwd, *bwd))
    assert sizes[1][0] == sizes[2][0] and sizes[0][0] <= sizes[2][0]
    assert sizes[0][1:] == sizes[2][1:]
    assert max(sizes[0]) < 20000


@pytest.mark.parametrize("kw, match", [
    (dict(tiles=object()), "tiles: not used by the block-sparse kernel"),
    (dict(sbuf_budget=1000), "sbuf_budget: not used"),
    (dict(lnc=3), "lnc: expected None, 1 or 2"),
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


# -- nki.* (NKI 0.7) ------------------------------------------------------------------------


def _both(run, monkeypatch):
    """``run()`` traced through nki.* (on trn2) and through legacy: ``(nki outputs, legacy
    outputs)`` as lists of arrays, each trace asserted to have used its namespace."""
    outs = {}
    for api in ("nki", "legacy"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        with simulate.measure(target="trn2") as m:
            got = run()
        assert {kr.api for kr in m.kernels} == {api}
        outs[api] = [np.asarray(x) for x in got]
    return outs["nki"], outs["legacy"]


def _same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)


def _empty_tile_mask(b, h, Nq, Nk, density, seed):
    mask = _pattern(b, h, Nq, Nk, density, seed)
    mask[..., 1, :] = False                       # query tile 1 sees no block: its own class
    return mask


NKI_CASES = [
    # compile-time pattern (sorted classes, one of trip 0), band, GQA, 2 x 2 instances
    (dict(causal="bottom_right"), lambda: _empty_tile_mask(2, 2, 300, 390, 0.5, 11), 2, 2, 1),
    # runtime pattern: one class of max_blocks slots, padding slots masked and never read
    (dict(window=(100, 20)),
     lambda: tuple(bs.dense_to_index(_pattern(1, 1, 300, 390, 0.4, 12), max_blocks=3)), 1, 2,
     1),
    # lengths with the band (bottom_right alignment moves with them), several instances
    (dict(causal=True, kv_lens=[250, 3], q_lens=[200, 300]),
     lambda: _pattern(2, 2, 300, 390, 0.6, 13), 2, 2, 2),
    # key blocks shared by a group's tiles (loaded once), with a band, lengths and GQA
    (dict(window=(250, 100), kv_lens=[390, 300], q_lens=[300, 200]),
     _shared_mask, 2, 2, 1),
    # a runtime pattern per head of a GQA group: each member head's slot counts (the
    # backward's per-class count table, block_sparse_bwd._row_counts)
    (dict(), lambda: tuple(bs.dense_to_index(_pattern(1, 2, 300, 390, 0.5, 15), max_blocks=3)),
     1, 2, 1),
]


@pytest.mark.parametrize("kw, make_mask, B, Hq, Hkv", NKI_CASES,
                         ids=["sorted", "index", "lens", "shared", "gqa-index"])
def test_nki_namespace_matches_legacy(kw, make_mask, B, Hq, Hkv, monkeypatch):
    """Through nki.* the forward and the backward give the legacy trace's outputs bit for bit
    (the same instructions on the data; 0.7 adds the slices' first rows to the gather indices
    and reads the loop indices as data)."""
    q, k, v, do = attention_inputs(B, Hq, Hkv, 300, 390, 32, seed=14)
    mask = make_mask()

    def run():
        o, lse, grads = _fwd_bwd(q, k, v, do, mask, **kw)
        return [o, lse, *grads]

    got, want = _both(run, monkeypatch)
    _same(got, want)
    kw_ref = {**kw, "causal": "bottom_right" if kw.get("causal") is True else kw.get("causal")}
    dense = bs.check_block_mask(mask, B, Hq, 300, 390).dense
    assert _err(got[0], ref.attention_forward(q, k, v, block_mask=dense, **kw_ref)[0]) < 2e-6


def _few_blocks_index():
    """Index form of 5 query tiles x 12 key blocks with max_blocks 11 (two 4-slot steps and a
    3-slot tail): the first group of 4 tiles has at most 5 active blocks (one step and the
    tail skipped under nki.*), the remainder group (tile 4) none at all (no step runs)."""
    mask = np.zeros((1, 1, 5, 12), bool)
    for i, blocks in enumerate(([0, 3], [1, 5, 7, 8, 11], [2], [])):
        mask[0, 0, i, blocks] = True
    return tuple(bs.dense_to_index(mask, max_blocks=11))


def test_nki_index_form_skips_padding_steps_and_matches_legacy(monkeypatch):
    """Under nki.* the index form's forward sweep runs only the steps below the group's
    largest count (runtime trip counts, ``block_sparse._trip_counts``) and the backward's slot
    loops each row's count, legacy all ``max_blocks`` slots masked: the same outputs bit for bit, the empty tiles' rows zero,
    and a shorter scheduled estimate under nki.*."""
    Nq, Nk = 600, 1536
    q, k, v, do = attention_inputs(1, 1, 1, Nq, Nk, 16, seed=15)
    index = _few_blocks_index()
    outs, est = {}, {}
    for api in ("nki", "legacy"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        with simulate.measure(target="trn2") as m:
            o, lse = host.flash_attention(q, k, v, block_mask=index, return_lse=True,
                                          mixed_precision=False)
            grads = host.flash_attention_backward(do, q, k, v, o, lse, block_mask=index,
                                                  mixed_precision=False)
            outs[api] = [o, lse, *grads]
        assert {kr.api for kr in m.kernels} == {api}
        est[api] = m.estimated_seconds
    got, want = outs["nki"], outs["legacy"]
    _same(got, want)
    assert not got[0][0, 0, 3 * 128:].any()
    dense = bs.check_block_mask(index, 1, 1, Nq, Nk).dense
    assert _err(got[0], ref.attention_forward(q, k, v, block_mask=dense)[0]) < 2e-6
    assert est["nki"] < 0.8 * est["legacy"]


def test_nki_namespace_dropout_and_its_mask_match_legacy(monkeypatch):
    """Dropout through nki.* (unit numbers from the loop indices read as data, the seed set by
    nisa.set_rng_seed): the same keep mask, outputs and gradients as legacy, bit for bit."""
    q, k, v, do = attention_inputs(1, 2, 1, 300, 260, 32, seed=15)
    mask = _pattern(1, 2, 300, 260, 0.6, seed=16)
    kw = dict(causal=True, dropout_p=0.3, seed=777, mixed_precision=False)

    def run():
        o, lse, keep = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                            return_dropout_mask=True, **kw)
        return [o, lse, keep, *host.flash_attention_backward(do, q, k, v, o, lse,
                                                             block_mask=mask, **kw)]

    got, want = _both(run, monkeypatch)
    _same(got, want)
    assert got[2].any() and not got[2].all()


def test_nki_namespace_numbers_large_rows_in_int32(monkeypatch):
    """Flattened rows (and dropout units, the debug mask's rows) that may reach 2^24 -- the
    bound lowered here to 4 -- are numbered in int32 under nki.* (the slices' first rows from
    ``port.OffsetColumns(exact=True)``, added on GpSimd; fp32 would round them): ``auto`` on
    trn2 traces the forward and the backward through nki.*, with more GpSimd instructions than
    below the bound, and their outputs are the legacy trace's bit for bit (two batches, GQA,
    lengths, dropout with its mask)."""
    q, k, v, do = attention_inputs(2, 2, 1, 200, 160, 16, seed=15)
    mask = _pattern(2, 2, 200, 160, 0.7, seed=16)
    kw = dict(causal=True, dropout_p=0.3, seed=777, mixed_precision=False,
              kv_lens=np.array([150, 160], np.int32), q_lens=np.array([200, 70], np.int32))

    def run():
        o, lse, keep = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                            return_dropout_mask=True, **kw)
        return [o, lse, keep, *host.flash_attention_backward(do, q, k, v, o, lse,
                                                             block_mask=mask, **kw)]

    gpsimd, outs = {}, {}
    for api, bound in (("nki", T.FP32_EXACT_INT), ("legacy", 4), ("auto", 4)):
        monkeypatch.setattr(T, "FP32_EXACT_INT", bound)
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        with simulate.measure(target="trn2") as m:
            outs[api] = [np.asarray(x) for x in run()]
        assert {kr.api for kr in m.kernels} == {"legacy" if api == "legacy" else "nki"}
        gpsimd[api] = m.instructions["gpsimd"]
    _same(outs["auto"], outs["legacy"])
    assert outs["auto"][2].any() and gpsimd["auto"] > gpsimd["nki"]


@pytest.mark.parametrize("B, Hkv", [(2, 1), (1, 2), (1, 1)], ids=["batches", "heads", "odd"])
def test_lnc2_spreads_the_instances_over_two_cores(B, Hkv, monkeypatch):
    """``lnc=2`` (trn2): the (batch, kv head) instances spread over the two cores as the dense
    backward's (legacy ``nl.spmd_dim(n, nl.nc(2))``, nki.* ``kernel[2]`` sharing them by
    ``nl.program_id(0)``): the outputs and gradients (dsinks included) of ``lnc=1`` bit for
    bit under both namespaces, the modeled time well under one core's (at most 0.7x, not 0.5x:
    at this size an instance is latency-bound -- one forward instance is a chain of dependent
    loads and steps, ~16 us on trn2 through nki.* -- so two on one core already overlap; the
    heads case models 33.6 against 51.6 us through nki.*, 0.65x); an odd ``B Hkv`` stays on one
    core (the same launch as ``lnc=1``)."""
    q, k, v, do = attention_inputs(B, 2, Hkv, 300, 260, 32, seed=31)
    mask = _pattern(B, 2, 300, 260, 0.6, seed=32)
    kw = dict(causal=True, sinks=np.array([0.5, -1.0]))
    for api in ("legacy", "nki"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        runs = {}
        for lnc in (1, 2):
            with simulate.measure(target="trn2") as m:
                o, lse, grads = _fwd_bwd(q, k, v, do, mask, lnc=lnc, **kw)
            assert m.api == api
            runs[lnc] = ([np.asarray(x) for x in (o, lse, *grads)], m.estimated_seconds)
        _same(runs[2][0], runs[1][0])
        if B * Hkv % 2:
            assert runs[2][1] == runs[1][1]
        else:
            assert runs[2][1] < 0.7 * runs[1][1]


def test_nki_index_form_program_size_does_not_grow_with_n():
    """The index form's runtime trip counts (forward steps, backward slot loops) keep the nki.*
    program flat in N: a bound of 12 blocks (8 active per tile) at 4K and 16K, its query tiles
    in natural order."""
    sizes = []
    grid = launch_grid((1, 1), "nki")
    for N in (4096, 16384):
        q, k, v, _ = attention_inputs(1, 1, 1, N, N, 64, dtype=BF16)
        index = bs.dense_to_index(bs.fixed_density(N // 128, N // 128, 8 / (N // 128)),
                                  max_blocks=12)
        t = bs.launch_tables(bs.check_block_mask(tuple(index), 1, 1, N, N), group=1)
        kw = dict(scale=0.125, mm_dtype="bfloat16")
        assert t.q.natural == (True,)           # plain loads and stores, held outputs
        fwd = program_size(block_sparse_attention_fwd.on("nki"), grid, q, k, v, t.q.meta,
                           classes=t.q.classes, shared=t.q.shared, natural=t.q.natural, **kw)
        o = np.zeros_like(q)
        lse = np.zeros(q.shape[:3], np.float32)
        bwd = program_size(block_sparse_attention_bwd.on("nki"), grid, q, k, v, o, q, lse,
                           t.k.meta, classes_k=t.k.classes, chunk_tiles=N // 128, **kw)
        sizes.append((fwd, bwd))
    assert sizes[0] == sizes[1]


# -- nki.* resident K/V (issue 25, item 1) ---------------------------------------------------


@pytest.mark.parametrize("index", [False, True], ids=["bool", "index"])
def test_nki_forward_reads_k_and_v_once_per_instance(index, monkeypatch):
    """Through nki.* the forward loads K and V of each (batch, kv head) once and every query
    tile reads its blocks in SBUF (runtime offsets): K/V bytes read are exactly the dense
    kernel's, whatever the pattern reuses, with GQA, a partial last key block and padding
    slots (the index form's bound 3). An inactive block is then loaded but never used: its
    non-finite K and V reach no row (the outputs are those of zeros there, bit for bit)."""
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 384, 300, 32
    q, k, v, _ = attention_inputs(B, Hq, Hkv, Nq, Nk, D, seed=41)
    mask = np.zeros((1, 1, 3, 3), bool)
    mask[0, 0, :, 0] = True
    mask[0, 0, 2, 2] = True
    mask[0, 0, 0, 2] = True
    pattern = tuple(bs.dense_to_index(mask, max_blocks=3)) if index else mask
    k[:, :, 128:256] = np.nan                       # key block 1: inactive everywhere
    v[:, :, 128:256] = np.inf
    with simulate.measure(target="trn2") as m:
        o = host.flash_attention(q, k, v, block_mask=pattern, mixed_precision=False)
    assert [kr.api for kr in m.kernels] == ["nki"]
    want = B * Hkv * Nk * D * 4
    assert m.per_tensor["k"]["read"] == want and m.per_tensor["v"]["read"] == want
    assert np.all(np.isfinite(o))
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 128:256] = 0.0
    v2[:, :, 128:256] = 0.0
    o2 = host.flash_attention(q, k2, v2, block_mask=pattern, mixed_precision=False)
    np.testing.assert_array_equal(o, o2)
    ro, _ = ref.attention_forward(q, k2, v2, block_mask=mask)
    assert _err(o, ro) < 2e-6


def test_resident_kv_rule_and_dma_share():
    """K/V stay resident while they fit trn2's budget beside the work and the group's tables
    (else the steps gather, with 4-block own steps), and a class's P^T DMA share grows with
    its slots up to the device's."""
    assert T.bsp_fwd_kv_resident(16384, 128, 2, 128)
    assert not T.bsp_fwd_kv_resident(65536, 128, 2, 16)
    assert not T.bsp_fwd_kv_resident(24576, 128, 4, 16)         # fp32 matmuls: 4 bytes
    assert T.bsp_p_dma_share(0.75, 4) == 0.25 and T.bsp_p_dma_share(0.75, 32) == 0.75


# -- the backward's staged query side --------------------------------------------------------


def test_backward_reads_the_query_side_once():
    """The backward stages every query tile of a kv group in SBUF (``_Resident``) and sweeps
    the key blocks once, dQ accumulated on chip: q, dO, o and lse are read exactly once, K and
    V once per active key block (block 1 is inactive everywhere: never read), dQ, dK, dV
    written once -- the dense backward's traffic restricted to the pattern."""
    B, Hq, Hkv, N, D = 1, 2, 1, 384, 32
    q, k, v, do = attention_inputs(B, Hq, Hkv, N, N, D, seed=41)
    mask = np.zeros((1, Hq, 3, 3), bool)
    mask[0, 0, :, 0] = True
    mask[0, 1, [0, 2], [2, 0]] = True
    per = _backward_traffic(q, k, v, do, mask, mask)
    assert per["k"]["read"] == per["v"]["read"] == 2 * 128 * D * 4


def _backward_traffic(q, k, v, do, pattern, mask):
    """The backward's HBM bytes per tensor (``simulate.measure``) on ``pattern`` (the bool
    ``mask`` or its index form), fp32: the query side (q, dO, o, lse) asserted read exactly
    once, the gradients asserted against the reference."""
    o, lse = host.flash_attention(q, k, v, block_mask=pattern, return_lse=True,
                                  mixed_precision=False)
    with simulate.measure() as m:
        grads = host.flash_attention_backward(do, q, k, v, o, lse, block_mask=pattern,
                                              mixed_precision=False)
    per = m.per_tensor
    for name in ("q", "do", "o"):
        assert per[name]["read"] == q.size * 4
    assert per["lse"]["read"] == q.size // q.shape[-1] * 4
    for got, want in zip(grads, ref.attention_backward(do, q, k, v, block_mask=mask)):
        assert _err(got, want) < 1e-5 * max(1.0, np.abs(want).max())
    return per


def _chunk_budget(monkeypatch, G, D, extras, slots):
    """SBUF budget (both generations) that fits exactly ``slots`` tiles per head in a chunk
    of the backward (fp32 matmuls)."""
    budget = T.bsp_bwd_chunk_bytes(G, slots, D, 4, extras, True)
    monkeypatch.setattr(T, "BWD_SBUF_BUDGET_BYTES", {"trn1": budget, "trn2": budget})


def _reordering(monkeypatch, on: bool, real=bs.launch_tables):
    """The backward's tables with the query tiles reordered where cheaper (``launch_tables``
    ``reorder``; ``on``) or not, in both namespaces (the host reorders under nki.* only):
    both traces run the same tables."""
    monkeypatch.setattr(bs, "launch_tables", lambda *a, **kw: real(
        *a, **{**kw, "reorder": on and kw.get("chunk_tiles") is not None}))


def test_backward_chunks_the_query_side_past_sbuf(monkeypatch):
    """Past SBUF (the budget shrunk here: two 128-row tiles per head and chunk, two chunks)
    the backward stages the query tiles a chunk at a time, sweeps per chunk the key blocks
    the chunk meets and adds their dK, dV to an fp32 scratch (legacy: every chunk; nki.*:
    only the chunks that meet a block): the gradients match the reference (band, lengths,
    GQA, the partial last tile) and, through nki.*, the legacy trace bit for bit, also with
    the query tiles reordered (this pattern's chunk plan is cheaper so: tiles 0 and 2 first,
    gathered and stored at their rows; the partial last tile stays last)."""
    B, Hq, Hkv, Nq, Nk, D = 1, 2, 1, 500, 390, 32
    _chunk_budget(monkeypatch, Hq // Hkv, D, True, 2)
    assert T.bsp_bwd_chunks(Hq // Hkv, Nq, D, 4, "trn2", True) == (2, 2)
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, D, seed=42)
    mask = _pattern(B, Hq, Nq, Nk, 0.5, seed=43)
    kw = dict(causal=True, kv_lens=[250], q_lens=[280])
    order = bs.launch_tables(bs.check_block_mask(mask, B, Hq, Nq, Nk), group=2, forward=False,
                             chunk_tiles=2, reorder=True, head_dim=D, kv_itemsize=4).order_q
    assert order[0, 0].tolist() == [0, 256, 128, 384]

    def run():
        o, lse, grads = _fwd_bwd(q, k, v, do, mask, **kw)
        return list(grads)

    ref_grads = ref.attention_backward(do, q, k, v, block_mask=mask,
                                       **{**kw, "causal": "bottom_right"})
    for reordered in (False, True):
        _reordering(monkeypatch, reordered)
        got, want = _both(run, monkeypatch)
        _same(got, want)
        for g, w in zip(got, ref_grads):
            assert _err(g, w) < 1e-5 * max(1.0, np.abs(w).max())


@pytest.mark.parametrize("api, heads, index, kv_blocks, scratch", [
    ("legacy", 2, False, 4, 4), ("legacy", 2, True, 6, 8), ("legacy", 1, False, 4, 4),
    ("nki", 2, False, 3, 2), ("nki", 2, True, 5, 2), ("nki", 1, False, 3, 2)],
    ids=["legacy-dense", "legacy-index", "legacy-shared", "nki-dense", "nki-index",
         "nki-shared"])
def test_chunked_backward_traffic(api, heads, index, kv_blocks, scratch, monkeypatch):
    """Chunks of two query tiles (GQA 2:1; with ``heads`` 2 per-head patterns: head 0 meets
    key block 0 from every tile, head 1 block 2 from tile 1; with 1 one pattern of both),
    one order of key blocks for both chunks: q, dO, o, lse read once; dQ, dK, dV written
    once. K, V per chunk for the blocks it meets, except in the last chunk: legacy (natural
    order: the first chunk meets 0 and 2, the last 0) reads every block some chunk meets (0
    and 2; in the index form all four), nki.* too with per-head patterns, but with one
    shared pattern only those it meets. nki.* reorders the query tiles where that moves
    fewer bytes (per-head patterns: tiles 0 and 2 first, meeting block 0 only; the shared
    pattern's plan costs the same, kept natural; the index form always takes the reordered
    tables). The fp32 scratch (``scratch`` 128-key blocks of dK and dV, each written and
    read once): legacy writes every listed row in the first chunk and reads it in the last;
    nki.* only blocks that several chunks meet (0), in either form, plus ``acc_k``: four
    columns per listed row and chunk. Under nki.* K, V and the scratch are the host's plan
    (``backward_plan_bytes``)."""
    monkeypatch.setenv(binding.API_ENV_VAR, api)
    B, Hq, Hkv, N, D = 1, 2, 1, 512, 32
    _chunk_budget(monkeypatch, Hq // Hkv, D, False, 2)
    q, k, v, do = attention_inputs(B, Hq, Hkv, N, N, D, seed=44)
    mask = np.zeros((1, heads, 4, 4), bool)
    mask[0, 0, :, 0] = True
    mask[0, heads - 1, 1, 2] = True
    pattern = tuple(bs.dense_to_index(mask, 2)) if index else mask
    per = _backward_traffic(q, k, v, do, pattern, mask)
    block = 128 * D * 4
    assert per["k"]["read"] == per["v"]["read"] == kv_blocks * block
    outs = sum(r["written"] for n, r in per.items() if n.startswith("shared_hbm"))
    assert outs == (Hq + 2 * Hkv) * N * D * 4
    parts = [r for n, r in per.items() if n.startswith("hbm")]
    assert sum(r["read"] for r in parts) == sum(r["written"] for r in parts) == scratch * block
    listed = 4 if index else 2
    assert per.get("acc_k", {"read": 0})["read"] == (2 * 4 * listed * 4 if api == "nki"
                                                     else 0)
    if api == "nki":
        t = bs.launch_tables(bs.check_block_mask(pattern, B, Hq, N, N), group=2,
                             forward=False, chunk_tiles=2, reorder=True, head_dim=D,
                             kv_itemsize=4)
        assert ("order_q" in per) == (t.order_q is not None) == (heads == 2 or index)
        assert bs.backward_plan_bytes(t.k, group=2, chunks=2, head_dim=D, kv_itemsize=4) == (
            2 * kv_blocks + 2 * scratch) * block


@pytest.mark.parametrize("index", [False, True], ids=["bool", "index"])
def test_reordered_chunks_move_the_planned_bytes(index, monkeypatch):
    """The evenly spread pattern at s = 1/4 over 8 x 8 blocks gives tiles i and i + 4 the same
    key blocks (i, i + 4): in chunks of two consecutive tiles every block is met by two
    chunks, so natural order moves each block's dK, dV partial sums through HBM (written and
    read back once each) and reads K, V twice.
    nki.* reorders the tiles (0, 4, 1, 5, ...): each block is met by one chunk, so there is no
    scratch and K, V are read once (the dense kernel's floor), in both forms; the HBM bytes
    of K, V and the scratch are the host's plan (``backward_plan_bytes``), the gradients the
    reference's (each tile's Q, dO, O, lse gathered and dQ scattered at its rows)."""
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    N, D = 1024, 16
    _chunk_budget(monkeypatch, 1, D, False, 2)
    q, k, v, do = attention_inputs(1, 1, 1, N, N, D, seed=61)
    mask = bs.fixed_density(8, 8, 0.25)
    pattern = tuple(bs.dense_to_index(mask)) if index else mask
    sp = bs.check_block_mask(pattern, 1, 1, N, N)
    plan = {}
    for reorder in (False, True):
        t = bs.launch_tables(sp, group=1, forward=False, chunk_tiles=2, reorder=reorder,
                             head_dim=D, kv_itemsize=4)
        plan[reorder] = bs.backward_plan_bytes(t.k, group=1, chunks=4, head_dim=D,
                                               kv_itemsize=4)
    assert t.order_q[0, 0].tolist() == [128 * i for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    per = _backward_traffic(q, k, v, do, pattern, mask)
    moved = per["k"]["read"] + per["v"]["read"] + sum(
        r["read"] + r["written"] for n, r in per.items() if n.startswith("hbm"))
    assert moved == plan[True] == 2 * N * D * 4
    assert plan[False] == plan[True] + 8 * 4 * 128 * D * 4 + 2 * N * D * 4


@pytest.mark.parametrize("make_mask, B, kw", [
    (lambda: tuple(bs.dense_to_index(bs.local_global(6, 4, global_blocks=0))), 1,
     dict(kv_lens=[300], q_lens=[600], causal="bottom_right")),
    (lambda: _pattern(2, 2, 700, 500, 0.3, seed=63), 2, dict(window=(200, 50)))],
    ids=["band-index-lens", "random-gqa"])
def test_reordered_backward_matches_the_reference(make_mask, B, kw, monkeypatch):
    """nki.* with the query tiles reordered (chunks of two tiles, GQA 2:1, the partial last
    tile): a band in the index form (always the reordered tables: here in natural order,
    no worse a plan than the greedy one) with lengths (rows past q_len zero, gathered and
    scattered through the order), and random per-head patterns of two sequences given
    densely with a window (each sequence's kv group in its own greedy order) -- the
    gradients are the reference's."""
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    Hq, Hkv, Nq, Nk, D = 2, 1, 700, 500, 16
    _chunk_budget(monkeypatch, Hq // Hkv, D, True, 2)
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, D, seed=62)
    pattern = make_mask()
    sp = bs.check_block_mask(pattern, B, Hq, Nq, Nk)
    t = bs.launch_tables(sp, group=2, forward=False, chunk_tiles=2, reorder=True, head_dim=D,
                         kv_itemsize=4)
    natural = np.arange(6) * 128.0
    assert [np.array_equal(x, natural) for x in t.order_q[:, 0]] == (
        [True] if sp.runtime else [False, False])
    o, lse, grads = _fwd_bwd(q, k, v, do, pattern, **kw)
    want = ref.attention_backward(do, q, k, v, block_mask=sp.dense, **kw)
    for g, w in zip(grads, want):
        assert _err(g, w) < 1e-5 * max(1.0, np.abs(w).max())


def test_backward_refuses_groups_and_chunks_that_do_not_fit(monkeypatch):
    """A kv group whose query heads cannot stage one tile each is refused by the host; the
    kernel refuses a chunk size past SBUF, tables of another chunking, accumulator steps
    missing (nki.*, several chunks), of another shape or where none are read, and the
    reordered tiles' tables alone or of another shape."""
    q, k, v, do = attention_inputs(1, 64, 1, 256, 256, 256)
    lse = np.zeros(q.shape[:3], np.float32)
    with pytest.raises(ValueError, match=r"block_mask: the block-sparse backward stages one "
                                         r"query tile of each of the 64 query heads"):
        host.flash_attention_backward(do, q, k, v, q, lse, mixed_precision=False,
                                      block_mask=np.eye(2, dtype=bool)[None, None])
    q, k, v, do = attention_inputs(1, 1, 1, 512, 256, 128, dtype=BF16)
    lse = np.zeros(q.shape[:3], np.float32)
    t = bs.launch_tables(bs.check_block_mask(np.ones((1, 1, 4, 2), bool), 1, 1, 512, 256),
                         group=1, forward=False, chunk_tiles=2)
    grid = launch_grid((1, 1), "legacy")
    for ct, match in ((4, r"meta_k: expected 1 x 2 rows"), (0, r"chunk_tiles: expected an int"),
                      (2.0, r"chunk_tiles: expected an int in \[1, 4\]")):
        with pytest.raises(ValueError, match=match):
            program_size(block_sparse_attention_bwd.on("legacy"), grid, q, k, v, q, do, lse,
                         t.k.meta, classes_k=t.k.classes, chunk_tiles=ct)
    # the accumulator steps: needed by nki.* with several chunks, refused elsewhere
    for api, acc_k, match in (
            ("nki", None, r"acc_k: nki.\* with 2 chunks needs the accumulator steps "
                          r"\(B or 1, Hkv or 1, 4, 4\) \(LaunchTables.acc_k\), got None"),
            ("nki", t.acc_k[..., :2], r"acc_k: .* got \(1, 1, 4, 2\)"),
            ("legacy", t.acc_k, r"acc_k: read only by the nki.\* backward with several "
                                r"chunks; this is 2 chunk\(s\) through legacy: pass None")):
        with pytest.raises(ValueError, match=match):
            program_size(block_sparse_attention_bwd.on(api), launch_grid((1, 1), api), q, k,
                         v, q, do, lse, t.k.meta, acc_k=acc_k, classes_k=t.k.classes,
                         chunk_tiles=2)
    # the reordered tiles' tables: both or neither, of the launch's shapes
    r = bs.launch_tables(bs.check_block_mask(np.ones((1, 1, 4, 2), bool), 1, 1, 512, 256),
                         group=1, forward=False, chunk_tiles=2, reorder=True)
    for order_q, slots_k in ((np.zeros((1, 1, 4), np.float32), None),
                             (np.zeros((1, 1, 3), np.float32), r.k.meta[..., 2:])):
        with pytest.raises(ValueError, match=r"order_q, slots_k: both or neither, \(B or 1, "
                                             r"Hkv or 1, 4\) and \(1, 1, 4, 2\)"):
            program_size(block_sparse_attention_bwd.on("legacy"), grid, q, k, v, q, do, lse,
                         r.k.meta, order_q=order_q, slots_k=slots_k, classes_k=r.k.classes,
                         chunk_tiles=2)
    monkeypatch.setitem(T.BWD_SBUF_BUDGET_BYTES, "trn2", 1000)
    with pytest.raises(ValueError, match=r"chunk_tiles: 2 query tiles of 1 heads need \d+ "
                                         r"bytes per partition, more than trn2's budget"):
        with simulate.measure(target="trn2"):
            program_size(block_sparse_attention_bwd.on("legacy"), grid, q, k, v, q, do, lse,
                         t.k.meta, classes_k=t.k.classes, chunk_tiles=2)


def test_natural_order_tiles_store_their_rows_by_plain_dmas(monkeypatch):
    """Query tiles processed in their natural order (``KernelTables.natural``; whole 128-row
    tiles, no lengths) load Q and store O and LSE by plain DMAs at rows affine in the loop
    indices, each group storing the previous group's outputs (``block_sparse._Held``): the
    outputs are bit for bit those of the indirect gathers and scatters (the tables without
    the flags) under nki.* and in legacy, with the same HBM bytes, and the scheduled estimate
    is shorter (an indirect write covers its whole tensor, so a tensor's scatters wait for
    each other). 19 query tiles: a peeled group of 8, one loop iteration, a remainder of 3;
    two query heads of a kv head. (The index form is always in natural order, the host's
    tables test.)"""
    N, D = 19 * 128, 16
    q, k, v, _ = attention_inputs(1, 2, 1, N, N, D, seed=31)
    mask = bs.fixed_density(19, 19, 3 / 19)
    tables = bs.launch_tables(bs.check_block_mask(mask, 1, 2, N, N), group=2, backward=False)
    assert tables.q.natural == (True,)
    flagged = bs.launch_tables
    outs, runs = [], {}
    for api, flags in (("nki", True), ("nki", False), ("legacy", True)):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        monkeypatch.setattr(bs, "launch_tables", flagged if flags else (
            lambda *a, **kw: (lambda t: t._replace(q=t.q._replace(natural=None)))(
                flagged(*a, **kw))))
        with simulate.measure(target="trn2") as m:
            o, lse = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                          mixed_precision=False)
        outs.append([o, lse])
        runs[api, flags] = (m.hbm_bytes_read + m.hbm_bytes_written, m.estimated_seconds)
    _same(outs[0], outs[1])
    _same(outs[0], outs[2])
    assert runs["nki", True][0] == runs["nki", False][0]
    assert runs["nki", True][1] < 0.9 * runs["nki", False][1]
    assert _err(outs[0][0], ref.attention_forward(q, k, v, block_mask=mask)[0]) < 2e-6


# -- nki.* index form past SBUF (issue 25, items 1-2) -------------------------------------


def _past_sbuf(monkeypatch):
    """The block-sparse forward's K/V never resident in SBUF (as at N = 64K, D = 128)."""
    monkeypatch.setattr(T, "bsp_fwd_kv_resident", lambda *args: False)


def test_nki_index_form_past_sbuf_reads_a_groups_common_blocks_once(monkeypatch):
    """Past SBUF (forced here at N = 2048) the nki.* index form takes grouped tables of
    bounded shape (``host.block_sparse.shared_bound_tables``) as the bool form's: the evenly
    spread pattern at s = 1/2 gives the 8 even query tiles the 8 even key blocks and the odd
    ones the odd blocks, so each group reads its 8 common blocks once (under a bound of 10: 2
    padding slots in the common region, 10 in the own one). K/V bytes are the bool form's,
    K and V read once, and all bytes at most the streaming dense kernel's (8 query tiles per
    K/V pass: twice) plus the tables'; the outputs the reference's."""
    _past_sbuf(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    N, D = 2048, 32
    q, k, v, _ = attention_inputs(1, 1, 1, N, N, D, seed=51)
    mask = bs.fixed_density(16, 16, 0.5)
    read = {}
    for form, pattern in (("bool", mask), ("index", tuple(bs.dense_to_index(mask, 10)))):
        with simulate.measure(target="trn2") as m:
            o = host.flash_attention(q, k, v, block_mask=pattern, mixed_precision=False)
        assert [kr.api for kr in m.kernels] == ["nki"]
        per = m.per_tensor
        read[form] = (per["k"]["read"], per["v"]["read"], m.hbm_bytes_read, per["meta"]["read"])
        assert _err(o, ref.attention_forward(q, k, v, block_mask=mask)[0]) < 2e-6
    assert read["index"][:2] == read["bool"][:2] == (N * D * 4, N * D * 4)
    assert read["index"][2] - read["index"][3] == read["bool"][2] - read["bool"][3]
    dense = T.ForwardTiles(kv_resident=False, q_group=8, target="trn2")
    with simulate.measure(target="trn2") as m:
        host.flash_attention(q, k, v, tiles=dense, mixed_precision=False)
    assert m.per_tensor["k"]["read"] == 2 * N * D * 4
    assert read["index"][2] <= m.hbm_bytes_read + read["index"][3]


def test_nki_index_form_past_sbuf_matches_legacy_and_compiles_once_per_bound(monkeypatch):
    """The grouped tables of a pattern of bound 10 (10 query tiles: a group of 8 and a
    remainder of 2; GQA 2:1, a window): head 0's first group shares blocks 0-2 and has no own
    block, its remainder shares block 1, head 1's random first group shares none. Through nki.* (runtime trip counts of the common
    and own sweeps) the outputs are the legacy trace's bit for bit (every slot, padding
    masked) and the reference's. Two other random patterns of the bound have the same
    program (the simulator's program size traces a runtime loop's body only where it runs:
    in both, the first head's groups run one common step and some own steps, no tail)."""
    _past_sbuf(monkeypatch)
    B, Hq, Hkv, N, D = 1, 2, 1, 1280, 16
    q, k, v, _ = attention_inputs(B, Hq, Hkv, N, N, D, seed=52)
    kw = dict(scale=D ** -0.5, mm_dtype="float32", window=(300, 100))
    grid = {api: launch_grid((B, Hkv), api) for api in ("nki", "legacy")}

    def tables(seed, common, alone):
        mask = _pattern(B, Hq, N, N, 0.4, seed)
        if alone:
            mask[0, 0, :8] = False
        mask[0, 0, :8, :common] = True
        mask[0, 0, 8:, 0] = False
        mask[0, 0, 8:, 1] = True
        t = bs.shared_bound_tables(bs.dense_to_index(mask, 10), T.BSP_GROUP_TILES)
        return mask, t.meta, dict(classes=t.classes, shared=t.shared, natural=t.natural,
                                  shared_runtime=True, **kw)

    sizes = []
    for seed in (54, 55):
        _, meta, kw_t = tables(seed, 3, False)
        monkeypatch.setenv(binding.API_ENV_VAR, "nki")
        sizes.append(program_size(block_sparse_attention_fwd.on("nki"), grid["nki"], q, k, v,
                                  meta, **kw_t))
    assert sizes[0] == sizes[1]
    mask, meta, kw_t = tables(53, 3, True)
    outs = {}
    for api in grid:
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        outs[api] = launch(block_sparse_attention_fwd.on(api), grid[api], q, k, v, meta, **kw_t)
    _same(outs["nki"], outs["legacy"])
    want = ref.attention_forward(q, k, v, block_mask=mask, window=(300, 100))[0]
    assert _err(outs["nki"][0], want) < 2e-6


# -- nki.* key-block window past SBUF (issue 25, item 1) --------------------------------------


@pytest.mark.parametrize("form", ["bool", "index"])
@pytest.mark.parametrize("G", [2, 4])
def test_nki_window_past_sbuf_gathers_each_block_once_per_kv_head(monkeypatch, form, G):
    """Past SBUF (forced at N = 1536: 12 query tiles, a group of 8 and a remainder of 4;
    GQA G:1) the nki.* forward fills a key-block window group by group
    (``host.block_sparse.window_tables``). The band+strided pattern is broadcast over the
    heads, so the G member heads share the window (``window_shared``): each group gathers
    its new blocks once for all of them, and K and V are read once per kv head -- 1/G of
    the window run per query head (forced here, as where the heads' tables differ), which
    reads them once per query head, and of the grouping (several times per query head:
    ``grouped_block_loads``). The HBM bytes are exactly ``window_hbm_bytes``' in both window
    runs; the outputs and LSE are the reference's, and the same bits with or without the
    sharing."""
    _past_sbuf(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    plans = _spy_window_plan(monkeypatch)
    B, Hq, N, D = 1, G, 12 * 128, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, N, N, D, seed=61)
    mask = bs.band_strided(12, 12)
    pattern = mask if form == "bool" else tuple(bs.dense_to_index(mask))
    sparsity = bs.check_block_mask(pattern, B, Hq, N, N)
    grouped = bs.launch_tables(sparsity, group=Hq, backward=False,
                               share_runtime=form == "index").q
    o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask)[:2]
    block = 128 * D * 4
    runs = {}
    for plan in ("shared", "per head", "grouping"):
        if plan == "per head":
            monkeypatch.setattr(bs, "_kv_head_index", lambda *args: None)
        if plan == "grouping":
            # (without the window, sparse super-groups would gather less than the grouping)
            monkeypatch.setattr(bs, "window_plan", lambda *args: None)
            monkeypatch.setattr(host.api, "_supergroups", lambda *args: None)
        with simulate.measure(target="trn2") as m:
            o, lse = host.flash_attention(q, k, v, block_mask=pattern, return_lse=True,
                                          mixed_precision=False)
        assert ("window_loads" in m.per_tensor) == (plan != "grouping")
        assert _err(o, o_ref) < 2e-6 and _err(lse, lse_ref) < 2e-5
        per = m.per_tensor
        assert per["k"]["read"] == per["v"]["read"]
        runs[plan] = (o, lse, per["k"]["read"])
        if plan != "grouping":
            win = plans[-1]
            # every group size gathers each of the 12 key blocks once: groups of 8
            assert win.group == T.BSP_GROUP_TILES and win.block_loads == 12
            assert win.heads == (G if plan == "shared" else 1)
            assert per["k"]["read"] == Hq * win.head_loads * block
            assert m.hbm_bytes_read + m.hbm_bytes_written == bs.window_hbm_bytes(win, B, Hq,
                                                                                 N, N, D, 4)
    assert runs["shared"][2] == N * D * 4 and runs["per head"][2] == G * N * D * 4
    assert runs["grouping"][2] == bs.grouped_block_loads(grouped, T.BSP_GROUP_TILES) * Hq * block
    assert runs["grouping"][2] >= 2 * runs["per head"][2]
    for a, b in zip(runs["shared"][:2], runs["per head"][:2]):
        np.testing.assert_array_equal(a, b)


def test_nki_window_shared_by_heads_found_alike(monkeypatch):
    """A pattern given per query head (Hq = 4, Hkv = 2) whose two member heads of each kv
    head have the same block sets (random, different across the kv heads):
    the host plans the window once per kv head and repeats its tables for the member heads
    (``window_plan``'s ``heads``), which share it; K and V are read once per kv head, the
    bytes exactly ``window_hbm_bytes``', the outputs and LSE the reference's. Once one
    member head's sets differ (one block flipped), the window runs per query head (17
    key blocks gathered, then 35)."""
    _past_sbuf(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    plans = _spy_window_plan(monkeypatch)
    B, Hq, Hkv, N, D = 1, 4, 2, 9 * 128, 16
    q, k, v, _ = attention_inputs(B, Hq, Hkv, N, N, D, seed=71)
    mask = np.repeat(_pattern(B, Hkv, N, N, 0.3, seed=72), 2, axis=1)
    read = {}
    for alike in (True, False):
        if not alike:
            mask[0, 3, 5] = ~mask[0, 3, 5]
        with simulate.measure(target="trn2") as m:
            o, lse = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                          mixed_precision=False)
        win = plans[-1]
        assert win.heads == (2 if alike else 1) and win.slots.shape[1] == Hq
        # the tables' entries are the query heads': head_loads is the launch's blocks
        read[alike] = m.per_tensor["k"]["read"]
        assert read[alike] == win.head_loads * 128 * D * 4
        assert win.block_loads == win.heads * win.head_loads
        assert m.hbm_bytes_read + m.hbm_bytes_written == bs.window_hbm_bytes(win, B, Hq, N, N,
                                                                             D, 4)
        o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask)[:2]
        fin = np.isfinite(lse_ref)                # (a query tile may have no block)
        assert _err(o, o_ref) < 2e-6 and (np.isfinite(lse) == fin).all()
        assert _err(np.where(fin, lse, 0), np.where(fin, lse_ref, 0)) < 2e-5
    # 17 blocks once per kv head; per query head twice as many and the flipped block
    assert (read[True], read[False]) == (17 * 128 * D * 4, 35 * 128 * D * 4)


@pytest.mark.parametrize("form", ["bool", "index"])
def test_nki_window_past_sbuf_matches_the_reference_with_lengths_and_padding(monkeypatch, form):
    """The window path on a random pattern per (batch, head) (B = 2, GQA 2:1), partial last
    query and key tiles, valid lengths and a causal band: the outputs and LSE are the
    reference's (padding rows zeros and -inf), through the window (its tables read)."""
    _past_sbuf(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    B, Hq, Nq, Nk, D = 2, 2, 10 * 128 + 37, 11 * 128 - 50, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, seed=62)
    mask = _pattern(B, Hq, Nq, Nk, 0.2, seed=63)
    mask[0, 1, 3] = False                        # a query tile without blocks
    pattern = mask if form == "bool" else tuple(bs.dense_to_index(mask))
    kw = dict(causal="bottom_right", kv_lens=np.array([Nk - 300, Nk], np.int32),
              q_lens=np.array([Nq, Nq - 200], np.int32))
    with simulate.measure(target="trn2") as m:
        o, lse = host.flash_attention(q, k, v, block_mask=pattern, return_lse=True,
                                      mixed_precision=False, **kw)
    assert "window_loads" in m.per_tensor
    o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask, **kw)[:2]
    assert _err(o, o_ref) < 2e-6
    fin = np.isfinite(lse_ref)
    assert (np.isfinite(lse) == fin).all()
    assert _err(np.where(fin, lse, 0), np.where(fin, lse_ref, 0)) < 2e-5


@pytest.mark.parametrize("kw", [
    dict(causal="bottom_right", kv_lens=np.array([600, 846], np.int32),
         q_lens=np.array([805, 700], np.int32)),
    dict(softcap=5.0, alibi_slopes=np.array([0.25, 0.0625], np.float32),
         sinks=np.array([0.5, -1.0], np.float32)),
    dict(dropout_p=0.2, seed=5, return_dropout_mask=True)],
    ids=["lengths", "score-mods", "dropout"])
def test_nki_window_shared_by_heads_keeps_each_heads_masks_modifiers_and_dropout(
        monkeypatch, kw):
    """GQA 2:1 (B = 2) with a random pattern broadcast over the heads: the member heads
    share the window, and each keeps what is its own -- valid lengths with a causal band
    (partial last query and key tiles), its ALiBi slope and sink beside the softcap, its
    dropout units (the kernel's keep mask): the outputs and LSE are the reference's (with
    the kernel's mask), and the same bits (mask included) as the window run per query
    head (forced)."""
    _past_sbuf(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    plans = _spy_window_plan(monkeypatch)
    B, Hq, Nq, Nk, D = 2, 2, 6 * 128 + 37, 7 * 128 - 50, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, seed=73)
    mask = _pattern(1, 1, Nq, Nk, 0.3, seed=74)
    runs = []
    for heads in (2, 1):
        if heads == 1:
            monkeypatch.setattr(bs, "_kv_head_index", lambda *args: None)
        with simulate.measure(target="trn2") as m:
            outs = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                        mixed_precision=False, **kw)
        assert plans[-1].heads == heads and "window_loads" in m.per_tensor
        runs.append(outs)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    o, lse = runs[0][:2]
    rkw = {x: y for x, y in kw.items() if x not in ("seed", "return_dropout_mask")}
    if "dropout_p" in kw:
        rkw["dropout_mask"] = runs[0][2]
    o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask, **rkw)[:2]
    fin = np.isfinite(lse_ref)
    assert _err(o, o_ref) < 2e-6 and (np.isfinite(lse) == fin).all()
    assert _err(np.where(fin, lse, 0), np.where(fin, lse_ref, 0)) < 2e-5


def _spy_window_plan(monkeypatch):
    """``host.block_sparse.window_plan`` recording each plan the host takes (a list)."""
    plans, plan = [], bs.window_plan
    monkeypatch.setattr(bs, "window_plan", lambda *args: plans.append(plan(*args)) or plans[-1])
    return plans


@pytest.mark.parametrize("form,group", [("bool", 2), ("index", 1)])
def test_nki_window_in_smaller_groups_matches_the_reference_with_the_planned_bytes(
        monkeypatch, form, group):
    """The window in groups of 2 and of 1 query tiles (the host's only size here:
    ``tiles.BSP_WINDOW_GROUPS`` patched) on a random pattern per (batch, head) (B = 2, GQA
    2:1), partial last query and key tiles, a causal band, a window of 8 blocks (it evicts):
    the outputs and LSE are the reference's and the HBM bytes exactly ``window_hbm_bytes``'
    of the host's plan."""
    _past_sbuf(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    monkeypatch.setattr(T, "BSP_WINDOW_GROUPS", (group,))
    monkeypatch.setattr(BSK, "window_capacity", lambda *args: 8)
    plans = _spy_window_plan(monkeypatch)
    B, Hq, Nq, Nk, D = 2, 2, 10 * 128 + 37, 11 * 128 - 50, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, seed=66)
    mask = _pattern(B, Hq, Nq, Nk, 0.3, seed=67)
    mask[1, 0, 4] = False                        # a query tile without blocks
    pattern = mask if form == "bool" else tuple(bs.dense_to_index(mask))
    kw = dict(causal="bottom_right")
    with simulate.measure(target="trn2") as m:
        o, lse = host.flash_attention(q, k, v, block_mask=pattern, return_lse=True,
                                      mixed_precision=False, **kw)
    win, = plans
    assert win.group == group and "window_loads" in m.per_tensor
    # it evicts: more gathers than the pattern's key blocks of each (b, h)
    assert win.block_loads > int(mask.any(axis=2).sum())
    assert m.hbm_bytes_read + m.hbm_bytes_written == bs.window_hbm_bytes(win, B, Hq, Nq, Nk,
                                                                         D, 4)
    o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask, **kw)[:2]
    assert _err(o, o_ref) < 2e-6
    fin = np.isfinite(lse_ref)
    assert (np.isfinite(lse) == fin).all()
    assert _err(np.where(fin, lse, 0), np.where(fin, lse_ref, 0)) < 2e-5


@pytest.mark.parametrize("group", [2, 1])
def test_nki_window_in_smaller_groups_in_natural_order(monkeypatch, group):
    """The window in groups of 2 and 1 on band+strided over 9 whole query tiles (B = 2, GQA
    2:1), which the host keeps in natural order: the groups store their held outputs by
    plain DMAs (the last group of 2 a remainder of 1); outputs and LSE are the reference's
    and the HBM bytes exactly ``window_hbm_bytes``'."""
    _past_sbuf(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    monkeypatch.setattr(T, "BSP_WINDOW_GROUPS", (group,))
    monkeypatch.setattr(BSK, "window_capacity", lambda *args: 8)
    plans = _spy_window_plan(monkeypatch)
    B, Hq, N, D = 2, 2, 9 * 128, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, N, N, D, seed=69)
    mask = bs.band_strided(9, 9, stride=4)
    with simulate.measure(target="trn2") as m:
        o, lse = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                      mixed_precision=False)
    win, = plans
    # the pattern is broadcast over the heads: both member heads run each group in turn,
    # each storing the outputs held before it
    assert win.group == group and win.tables.natural == (True,) and win.heads == 2
    assert "window_loads" in m.per_tensor
    assert m.hbm_bytes_read + m.hbm_bytes_written == bs.window_hbm_bytes(win, B, Hq, N, N, D, 4)
    o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask)[:2]
    assert _err(o, o_ref) < 2e-6 and _err(lse, lse_ref) < 2e-5


def test_nki_window_group_is_the_largest_within_the_dense_forwards_traffic(monkeypatch):
    """The host's window group (``window_plan`` with the dense forward's K/V blocks,
    ``host.api._dense_kv_blocks``): a random pattern of 24 x 24 blocks in a window of 16
    gathers 26 / 25 / 23 key blocks in groups of 8 / 4 / 2, and the dense forward's tiling
    holds K/V resident (one pass: 24 blocks): the host takes groups of 2, which read K
    less than once, and the outputs are the reference's."""
    _past_sbuf(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    monkeypatch.setattr(BSK, "window_capacity", lambda *args: 16)
    plans = _spy_window_plan(monkeypatch)
    N, D = 24 * 128, 16
    q, k, v, _ = attention_inputs(1, 1, 1, N, N, D, seed=68)
    mask = np.random.default_rng(0).random((1, 1, 24, 24)) < 0.15
    index = bs.dense_to_index(mask)
    assert [bs.window_tables(index, 16, g).block_loads for g in (8, 4, 2)] == [26, 25, 23]
    with simulate.measure(target="trn2") as m:
        o = host.flash_attention(q, k, v, block_mask=mask, mixed_precision=False)
    win, = plans
    assert (win.group, win.block_loads) == (2, 23)
    assert m.per_tensor["k"]["read"] == 23 * 128 * D * 4
    assert _err(o, ref.attention_forward(q, k, v, block_mask=mask)[0]) < 2e-6


@pytest.mark.parametrize("G", [1, 2], ids=["mha", "shared-gqa"])
def test_nki_window_program_does_not_grow_with_n(monkeypatch, G):
    """The window path's program (groups, window loads, slots: compiled loops over table
    data) has the same size at 20 and 36 query tiles of the band+strided pattern in the index
    form (the tables' shapes grow, not the program); so has a window two member heads
    share (``window_shared``: the member-head loop a compiled loop inside the groups')."""
    _past_sbuf(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    sizes = []
    for nqt in (20, 36):
        N, D = nqt * 128, 16
        q, k, v, _ = attention_inputs(1, G, 1, N, N, D, seed=64)
        index = bs.dense_to_index(bs.band_strided(nqt, nqt), 4)
        win = bs.window_tables(index, T.bsp_fwd_window_blocks(D, 4, 4, True), T.BSP_GROUP_TILES)
        t = win.tables
        sizes.append(program_size(
            block_sparse_attention_fwd.on("nki"), launch_grid((1, 1), "nki"), q, k, v, t.meta,
            window_loads=win.loads, window_slots=win.slots, window_blocks=win.blocks,
            window_shared=G > 1, classes=t.classes, shared=t.shared, natural=t.natural,
            mm_dtype="float32"))
    assert sizes[0] == sizes[1]


def _trace(monkeypatch, api, q, k, v, meta, **kw):
    """Trace the forward on one (batch, kv head) through ``api`` (its program size): where
    its arguments are checked."""
    monkeypatch.setenv(binding.API_ENV_VAR, api)
    program_size(block_sparse_attention_fwd.on(api), launch_grid((1, 1), api), q, k, v, meta,
                 **kw)


def test_nki_window_arguments_are_checked(monkeypatch):
    """The window's arguments: refused without nki.* or with resident K/V, wider than SBUF
    holds, without its tables, with tables it would ignore, or over other classes."""
    N, D = 12 * 128, 16
    q, k, v, _ = attention_inputs(1, 1, 1, N, N, D, seed=65)
    index = bs.dense_to_index(bs.band_strided(12, 12), 4)
    most = T.bsp_fwd_window_blocks(D, 4, 4, plain=True)
    win = bs.window_tables(index, most, T.BSP_GROUP_TILES)
    t = win.tables
    base = dict(window_loads=win.loads, window_slots=win.slots, window_blocks=win.blocks,
                classes=t.classes, mm_dtype="float32")

    def run(api, **kw):
        _trace(monkeypatch, api, q, k, v, t.meta, **{**base, **kw})

    with pytest.raises(ValueError, match=r"window_blocks: a window of \d+ blocks needs nki\.\*, "
                                         r"K/V not resident .* got api='nki', resident=True"):
        run("nki")
    _past_sbuf(monkeypatch)
    with pytest.raises(ValueError, match="got api='legacy', resident=False"):
        run("legacy")
    with pytest.raises(ValueError, match=f"at most {most} blocks"):
        run("nki", window_blocks=most + 1)
    # a causal band keeps more tables per slot: a narrower window than a plain launch's
    banded = T.bsp_fwd_window_blocks(D, 4, 4)
    assert banded < most
    with pytest.raises(ValueError, match=f"at most {banded} blocks"):
        run("nki", window_blocks=banded + 1, causal="top_left")
    with pytest.raises(ValueError, match=r"window_blocks: expected an int >= 0, got -1"):
        run("nki", window_blocks=-1)
    with pytest.raises(ValueError, match="both needed with window_blocks > 0, got Tensor, "
                                         "NoneType"):
        run("nki", window_slots=None)
    with pytest.raises(ValueError, match="given with window_blocks=0"):
        run("nki", window_blocks=0)
    for bad in (0, T.BSP_GROUP_TILES + 1, True, 2.0):
        with pytest.raises(ValueError, match=re.escape(
                f"window_group: expected an int from 1 to {T.BSP_GROUP_TILES}, got {bad!r}")):
            run("nki", window_group=bad)
    with pytest.raises(ValueError, match=r"window_group: given \(2\) with window_blocks=0; "
                                         r"allowed: 8 \(the default: no window\)"):
        run("nki", window_blocks=0, window_loads=None, window_slots=None, window_group=2)
    with pytest.raises(ValueError, match=r"window_shared: expected a bool, got 1$"):
        run("nki", window_shared=1)
    with pytest.raises(ValueError, match=r"window_shared: given \(True\) with window_blocks=0; "
                                         r"allowed: False \(no window\)"):
        run("nki", window_blocks=0, window_loads=None, window_slots=None, window_shared=True)
    with pytest.raises(ValueError, match=r"classes: a window needs one class of the table's 4 "
                                         r"slots, got \(\(0, 8, 4, False\), \(8, 4, 4"):
        run("nki", classes=((0, 8, 4, False), (8, 4, 4, False)))
    with pytest.raises(ValueError, match=r"classes: a window needs one class of the table's 4 "
                                         r"slots, got \(\(0, 12, 3, False\),\)"):
        run("nki", classes=((0, 12, 3, False),))
    # a class from another position than 0: refused with the classes (check_classes)
    with pytest.raises(ValueError, match=r"classes: expected contiguous runs .* got "
                                         r"\(\(1, 11, 4, False\),\)"):
        run("nki", classes=((1, 11, 4, False),))
    with pytest.raises(ValueError, match=r"shared: a window's class shares no slots \(allowed: "
                                         r"None or \(0,\)\), got \(1,\)"):
        run("nki", shared=(1,))
    with pytest.raises(ValueError, match=r"shared_runtime: .* \(allowed: False\), got True"):
        run("nki", shared_runtime=True)
    with pytest.raises(ValueError, match=r"window_slots: expected shape \(1, 1, 12, 4\) .* "
                                         r"got \(1, 1, 11, 4\)"):
        run("nki", window_slots=win.slots[:, :, :11])
    # 12 rows: a group of 8 and a remainder of 4; L = 32 blocks (bound 4 x 8 tiles)
    assert win.loads.shape == (1, 1, 2, 2 + 2 * 32)
    for bad in (win.loads[:, :, :1], win.loads[..., :-1], win.loads[..., :-2],
                win.loads[..., :2], np.concatenate([win.loads] * 2), win.loads[0]):
        with pytest.raises(ValueError, match=re.escape(
                f"window_loads: expected shape (1, 1, 2) + (2 + 2 L,) (meta's leading dims, "
                f"one row per group of 8 of the 12 rows, L a positive multiple of "
                f"{T.BSP_WINDOW_LOAD_BLOCKS}), got {bad.shape}")):
            run("nki", window_loads=bad)
    # groups of 4: 3 rows of loads (a table planned for groups of 8 has 2)
    with pytest.raises(ValueError, match=re.escape(
            "window_loads: expected shape (1, 1, 3) + (2 + 2 L,) (meta's leading dims, one row "
            "per group of 4 of the 12 rows")):
        run("nki", window_group=4)


def test_window_capacity_is_wider_only_where_nothing_but_padding_is_masked():
    """A plain launch (no band, lengths, score modifier or dropout; whole key blocks) keeps
    fewer tables per slot, so its window holds more blocks: at 64K, D = 128, bf16 the 256
    slots of fixed_density s = 1/2 fit (a group's 256 blocks); any mask gives the narrower
    window, which they do not."""
    D, trip, Nk = 128, 256, 65536

    def cap(Nk=Nk, causal=None, window=None, lengths=False, mods=False, dropout=False):
        return window_capacity(D, "bfloat16", trip, Nk, causal, window, lengths, mods, dropout)

    masked = T.bsp_fwd_window_blocks(D, 2, trip)
    assert cap() == T.bsp_fwd_window_blocks(D, 2, trip, plain=True) >= trip > masked
    for kw in (dict(causal="top_left"), dict(window=(256, 0)), dict(lengths=True),
               dict(mods=True), dict(dropout=True), dict(Nk=Nk - 5)):
        assert cap(**kw) == masked, kw


@pytest.mark.parametrize("kw", [dict(dropout_p=0.2, seed=5),
                                dict(softcap=5.0, sinks=np.array([0.5, -1.0], np.float32))],
                         ids=["dropout", "softcap-sinks"])
def test_nki_window_past_sbuf_agrees_with_the_grouping_under_dropout_and_modifiers(
        monkeypatch, kw):
    """Through the window the forward draws the dropout units' bits and applies the score
    modifiers as the grouping does (GQA 2:1, a random pattern per head): the outputs and LSE
    agree to rounding."""
    _past_sbuf(monkeypatch)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    N, D = 12 * 128, 16
    q, k, v, _ = attention_inputs(1, 2, 1, N, N, D, seed=66)
    mask = _pattern(1, 2, N, N, 0.3, seed=67)
    outs = []
    for windowed in (True, False):
        if not windowed:
            monkeypatch.setattr(bs, "window_plan", lambda *args: None)
        with simulate.measure(target="trn2") as m:
            outs.append(host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                             mixed_precision=False, **kw))
        assert ("window_loads" in m.per_tensor) == windowed
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=0, atol=1e-6)
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=0, atol=4e-6)


def test_nki_window_at_capacity_stays_within_the_sbuf_budget(monkeypatch):
    """A window as wide as ``tiles.bsp_fwd_window_blocks`` allows a plain launch (Nk = 64K,
    D = 128, bf16, no mask but the pattern: one group of 8 query tiles of about 46 random key
    blocks each, 317 blocks in all) keeps
    the peak SBUF within trn2's budget (90 % of a partition) beside the rest of the kernel:
    the per-slot tables, the load row's tables and the padding selector."""
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    Nq, Nk, D = 1024, 65536, 128
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, Nq, D)).astype(BF16)
    k, v = (rng.standard_normal((1, 1, Nk, D)).astype(BF16) for _ in range(2))
    mask = np.random.default_rng(1).random((1, 1, Nq // 128, Nk // 128)) < 0.09
    index = bs.dense_to_index(mask)
    most = T.bsp_fwd_window_blocks(D, 2, index.max_blocks, plain=True)
    assert bs.window_tables(index, most, T.BSP_GROUP_TILES).blocks == most
    with simulate.measure(target="trn2") as m:
        host.flash_attention(q, k, v, block_mask=mask)
    assert "window_loads" in m.per_tensor
    assert m.peak_sbuf_bytes_per_partition <= T.FWD_SBUF_BUDGET_BYTES["trn2"]


def test_nki_fp32_window_at_capacity_stays_within_the_sbuf_budget(monkeypatch):
    """fp32 operands (``mixed_precision=False``) double the window's fixed working set: a
    window at its fp32 capacity (Nk = 32K, D = 128; 8 query tiles of 35 consecutive key
    blocks, each 14 past the previous: 133 blocks in all, what the window holds, none common
    to the group, so the window gathers fewer than the grouping) keeps the peak SBUF within
    trn2's budget (with the bf16-fitted working set it peaked at 229364 bytes per partition,
    22926 over)."""
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    Nq, Nk, D = 1024, 32768, 128
    most = T.bsp_fwd_window_blocks(D, 4, 35, plain=True)
    assert most == 7 * 14 + 35
    mask = np.zeros((1, 1, Nq // 128, Nk // 128), dtype=bool)
    for t in range(8):
        mask[0, 0, t, 14 * t:14 * t + 35] = True
    assert bs.window_tables(bs.dense_to_index(mask), most, T.BSP_GROUP_TILES).blocks == most
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, Nq, D)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, Nk, D)).astype(np.float32) for _ in range(2))
    with simulate.measure(target="trn2") as m:
        host.flash_attention(q, k, v, block_mask=mask, mixed_precision=False)
    assert "window_loads" in m.per_tensor
    assert m.peak_sbuf_bytes_per_partition <= T.FWD_SBUF_BUDGET_BYTES["trn2"]


# -- nki.* super-groups past SBUF (issue 25, items 1-2) ---------------------------------------


def _no_window(monkeypatch):
    """K/V past SBUF and no key-block window: the host chooses between the grouping and
    super-groups (``host.api._supergroups``)."""
    _past_sbuf(monkeypatch)
    monkeypatch.setattr(bs, "window_plan", lambda *args: None)
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")


@pytest.mark.parametrize("form", ["bool", "index"])
def test_nki_supergroups_read_each_union_once_with_the_planned_bytes(monkeypatch, form):
    """Past SBUF (forced at 10 query tiles, the last partial; a partial last key block; GQA
    2:1) every query tile of a pattern of one block set (5 of the 6 key blocks; the bool form
    of all 6 goes to the dense kernel) is in one super-group: each query head reads K and V
    once (the grouping's group of 8 and remainder of 2: twice), the HBM bytes are exactly
    ``supergroup_hbm_bytes``', the outputs and LSE the reference's."""
    _no_window(monkeypatch)
    B, Hq, Nq, Nk, D = 1, 2, 9 * 128 + 37, 6 * 128 - 50, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, seed=71)
    mask = np.ones((1, 1, 10, 6), dtype=bool)
    mask[..., 2] = False
    pattern = mask if form == "bool" else tuple(bs.dense_to_index(mask))
    sg = bs.supergroup_tables(bs.check_block_mask(pattern, B, Hq, Nq, Nk).index,
                              T.bsp_fwd_supergroup_tiles(D, 4, 4, bs.union_width(5)[1]))
    assert sg.meta.shape[2] == 1 and sg.rows.shape[3] == 10 and sg.idle == 0
    with simulate.measure(target="trn2") as m:
        o, lse = host.flash_attention(q, k, v, block_mask=pattern, return_lse=True,
                                      mixed_precision=False)
    assert "sg_rows" in m.per_tensor
    keys = Nk - 128                                           # block 2 not read
    assert m.per_tensor["k"]["read"] == m.per_tensor["v"]["read"] == Hq * keys * D * 4
    assert m.hbm_bytes_read + m.hbm_bytes_written == bs.supergroup_hbm_bytes(
        sg, B, Hq, Nq, Nk, D, 4)
    o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask)[:2]
    assert _err(o, o_ref) < 2e-6
    assert _err(lse, lse_ref) < 2e-5


def test_nki_supergroups_with_idle_slots_and_several_sets_match_the_reference(monkeypatch):
    """The kernel on super-group tables of 4 tiles (B = 2, one pattern per batch: tiles i
    and i + 3 have the same blocks, and a tile without any; partial last query tile): runs
    of identical sets cut into super-groups with idle slots, a batch needing fewer
    super-groups than the other (an empty one), unions of different counts, a padded
    step: outputs and LSE the reference's (the tile without blocks: zeros and -inf)."""
    _no_window(monkeypatch)
    B, Hq, Nq, Nk, D = 2, 1, 6 * 128 + 5, 20 * 128, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, seed=72)
    mask = np.zeros((B, 1, 7, 20), dtype=bool)
    for t in range(7):
        mask[0, 0, t, (t % 3)::3] = True                      # 7, 7 and 6 blocks
        mask[1, 0, t, :17 + (t % 2)] = True                   # 17 and 18: past one step
    mask[0, 0, 6] = False
    index = bs.dense_to_index(mask)
    sg = bs.supergroup_tables(index, 4)
    # batch 0: 4 sets (one empty), batch 1: 2 sets and one empty super-group
    assert sg.rows.shape[3] == 4 and sg.meta.shape[2] == 4 and sg.idle == 2 * 4 * 4 - 14
    kw = dict(classes=sg.classes, sg_rows=sg.rows, mm_dtype="float32", scale=D ** -0.5)
    o, lse = launch(block_sparse_attention_fwd.on("nki"), launch_grid((B, 1), "nki"), q, k, v,
                    sg.meta, **kw)
    o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask, scale=D ** -0.5)[:2]
    assert _err(o, o_ref) < 2e-6
    fin = np.isfinite(lse_ref)
    assert (np.isfinite(lse) == fin).all() and not fin[0, 0, 6 * 128:].any()
    assert _err(np.where(fin, lse, 0), np.where(fin, lse_ref, 0)) < 2e-5


def test_nki_supergroup_program_does_not_grow_with_n(monkeypatch):
    """The super-group path's program (super-groups, steps: compiled loops over table data)
    has the same size at 10 and 20 query tiles of a bound of 6 blocks."""
    _no_window(monkeypatch)
    sizes = []
    for nqt in (10, 20):
        N, D = nqt * 128, 16
        q, k, v, _ = attention_inputs(1, 1, 1, N, N, D, seed=73)
        mask = np.zeros((1, 1, nqt, nqt), dtype=bool)
        mask[..., :6] = True
        sg = bs.supergroup_tables(bs.dense_to_index(mask), 5)
        sizes.append(program_size(
            block_sparse_attention_fwd.on("nki"), launch_grid((1, 1), "nki"), q, k, v, sg.meta,
            classes=sg.classes, sg_rows=sg.rows, mm_dtype="float32"))
    assert sizes[0] == sizes[1]


def test_nki_supergroup_arguments_are_checked(monkeypatch):
    """Super-groups are refused without nki.*, with resident K/V, in a launch that returns
    its dropout mask (masked ones with a soft-cap or ALiBi), with a window or shared slots,
    over other classes or with rows of another shape; their key counts without rows, of
    another shape or over a partial last key block."""
    N, D = 4 * 128, 16
    q, k, v, _ = attention_inputs(1, 1, 1, N, N, D, seed=74)
    sg = bs.supergroup_tables(bs.dense_to_index(np.ones((1, 1, 4, 4), dtype=bool)), 4)
    base = dict(classes=sg.classes, sg_rows=sg.rows, mm_dtype="float32")

    def run(api, **kw):
        _trace(monkeypatch, api, q, k, v, sg.meta, **{**base, **kw})

    with pytest.raises(ValueError, match=r"sg_rows: super-groups need nki\.\*, K/V not "
                                         r".* got api='nki', resident=True, "
                                         r"dropout_mask=False"):
        run("nki")
    _past_sbuf(monkeypatch)
    with pytest.raises(ValueError, match="got api='legacy', resident=False, dropout_mask=False"):
        run("legacy")
    with pytest.raises(ValueError, match="resident=False, dropout_mask=True"):
        run("nki", dropout_p=0.1, dropout_mask=True, seed=np.zeros(1, np.int32))
    with pytest.raises(ValueError, match=re.escape(
            "sg_keys: masked super-groups take no soft-cap, ALiBi or dropout (the mask adds "
            "before the tanh; ALiBi's bias or a dropped unit can hide a guarded key's NaN); "
            "got softcap=5.0, alibi=False, dropout=False")):
        run("nki", softcap=5.0, sg_keys=np.zeros((1, 1, 8, 4), np.float32))
    with pytest.raises(ValueError, match="got softcap=None, alibi=True, dropout=False"):
        run("nki", alibi_slopes=np.full((1, 1), 0.5, np.float32),
            sg_keys=np.zeros((1, 1, 8, 4), np.float32))
    with pytest.raises(ValueError, match="got softcap=None, alibi=False, dropout=True"):
        run("nki", dropout_p=0.1, seed=np.zeros(1, np.int32),
            sg_keys=np.zeros((1, 1, 8, 4), np.float32))
    with pytest.raises(ValueError, match=r"sg_rows: super-groups take no window"):
        run("nki", shared=(1,))
    with pytest.raises(ValueError, match=re.escape(
            "classes: super-groups need ((0, 1, U, False),) with U a multiple of 4, got "
            "((0, 1, 8, True),)")):
        run("nki", classes=((0, 1, 8, True),))
    with pytest.raises(ValueError, match=re.escape(
            "sg_rows: expected shape (1, 1, 1) + (tiles,) (meta's leading dims, one row per "
            "super-group), got (1, 1, 2, 4)")):
        run("nki", sg_rows=np.concatenate([sg.rows] * 2, axis=2))
    with pytest.raises(ValueError, match=re.escape("sg_keys: given without sg_rows")):
        run("nki", sg_rows=None, sg_keys=np.zeros((1, 1, 8, 4), np.float32))
    with pytest.raises(ValueError, match=re.escape(
            "sg_keys: expected shape (1, 1, 8, 4) (sg_rows' leading dims, U rows per "
            "super-group, one column per tile), got (1, 1, 8, 3)")):
        run("nki", sg_keys=np.zeros((1, 1, 8, 3), np.float32))
    with pytest.raises(ValueError, match=re.escape(
            "sg_keys: masked super-groups need whole key blocks (Nk a multiple of 128)")):
        _trace(monkeypatch, "nki", q, k[:, :, :N - 5], v[:, :, :N - 5], sg.meta,
               **{**base, "sg_keys": np.zeros((1, 1, 8, 4), np.float32)})


@pytest.mark.parametrize("kind", ["exact", "masked", "sparse", "sparse-options"])
def test_nki_supergroup_at_capacity_stays_within_the_sbuf_budget(monkeypatch, kind):
    """A super-group as large as ``tiles.bsp_fwd_supergroup_tiles`` allows at D = 128, bf16,
    U = 528 slots (N = 64K: the index form's bound 512 at s = 1, or a masked union of all
    512 key blocks; here 151 query tiles of the same 16 key blocks, or 149 of random subsets
    of them at s = 0.85, the window off) keeps the peak SBUF within trn2's budget (90 % of a partition):
    measured 179202 and 176882 bytes per partition. Sparse super-groups (U = 576, steps of
    64 blocks): 138 query tiles of random subsets (s = 0.3) of 64 key blocks, one full step:
    171460; with a causal band, both lengths, the three score modifiers and dropout (each
    sub-step's slot columns) 172296. (With those options the exact and masked ones peaked
    lower, 171970 and 173918 without the soft-cap: their slot columns are per step, not
    the plain launch's whole-union padding columns.)"""
    _no_window(monkeypatch)
    D, Nk = 128, 65536
    options = kind == "sparse-options"
    kind = kind.split("-")[0]
    masked, sparse = kind == "masked", kind == "sparse"
    most = T.bsp_fwd_supergroup_tiles(D, 2, 2, bs.union_width(512, sparse)[1], masked=masked,
                                      own=sparse)
    assert most == {"exact": 151, "masked": 149, "sparse": 138}[kind]
    q, kv = np.ones((1, 1, most * 128, D), BF16), np.zeros((1, 1, Nk, D), BF16)
    mask = np.zeros((1, 1, most, Nk // 128), dtype=bool)
    rng = np.random.default_rng(0)
    if sparse:
        mask[..., :64] = rng.random((most, 64)) < 0.3
    else:
        mask[..., :16] = rng.random((most, 16)) < 0.85 if masked else True
    kw = {}
    if options:
        kw = dict(causal="bottom_right", kv_lens=np.array([Nk - 100], np.int32),
                  q_lens=np.array([most * 128 - 50], np.int32), softcap=5.0,
                  alibi_slopes=np.array([0.25], np.float32), sinks=np.array([0.5], np.float32),
                  dropout_p=0.1, seed=3)
    with simulate.measure(target="trn2") as m:
        host.flash_attention(q, kv, kv, block_mask=mask if kind != "exact" else tuple(
            bs.dense_to_index(mask, 512)), **kw)
    assert m.per_tensor["sg_rows"]["read"] == most * 4
    assert ("sg_keys" in m.per_tensor) == masked and ("sg_own" in m.per_tensor) == sparse
    assert m.peak_sbuf_bytes_per_partition <= T.FWD_SBUF_BUDGET_BYTES["trn2"]


def test_nki_masked_supergroups_read_each_union_once_and_match_the_reference(monkeypatch):
    """A random pattern at s = 0.9 past SBUF (10 query tiles, the last partial; GQA 2:1; a
    tile without blocks): no two tiles share a block set, the grouping would gather more
    blocks than the dense kernel's one pass, and a masked super-group of all 10 tiles
    computes at most ``tiles.BSP_SG_SPARSE_PAIR_COST`` times the active pairs, so the host
    takes it: each query head reads the union's K and V rows once, the
    HBM bytes are exactly ``supergroup_hbm_bytes``' (with the keep flags of each step),
    the outputs and LSE the reference's (the tile without blocks: zeros and -inf)."""
    _no_window(monkeypatch)
    B, Hq, Nq, Nk, D = 1, 2, 9 * 128 + 37, 20 * 128, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, seed=75)
    mask = _pattern(1, 1, Nq, Nk, 0.9, seed=76)
    mask[..., 3, :] = False
    index = bs.dense_to_index(mask)
    sg = bs.masked_supergroup_tables(index, T.bsp_fwd_supergroup_tiles(
        D, 4, 4, bs.union_width(20)[1], masked=True), Nk)
    assert sg.meta.shape[2] == 1 and sg.keys is not None and int(sg.meta[0, 0, 0, 1]) == 20
    with simulate.measure(target="trn2") as m:
        o, lse = host.flash_attention(q, k, v, block_mask=tuple(index), return_lse=True,
                                      mixed_precision=False)
    assert "sg_keys" in m.per_tensor
    assert m.per_tensor["k"]["read"] == Hq * Nk * D * 4
    assert m.hbm_bytes_read + m.hbm_bytes_written == bs.supergroup_hbm_bytes(
        sg, B, Hq, Nq, Nk, D, 4)
    o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask)[:2]
    assert _err(o, o_ref) < 2e-6
    fin = np.isfinite(lse_ref)
    assert (np.isfinite(lse) == fin).all() and not fin[0, :, 3 * 128:4 * 128].any()
    assert _err(np.where(fin, lse, 0), np.where(fin, lse_ref, 0)) < 2e-5


@pytest.mark.parametrize("plan", ["resident", "masked"])
def test_nki_fp16_masks_by_matmul_without_nan(monkeypatch, plan):
    """fp16 inputs where TensorE adds MASK_NEG to scores (the resident index form's padding
    slots; masked super-groups past SBUF): the mask's operands are bf16, not fp16, whose
    range would round -2^100 to -inf and make every score the matmul touches NaN (-inf x 0;
    it did, in every row). Outputs are the reference's. (10 of the 12 blocks active: masked
    super-groups compute 1.2x the active pairs, within ``tiles.BSP_SG_SPARSE_PAIR_COST``.)"""
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    if plan == "masked":
        _no_window(monkeypatch)
    Nq, Nk, D = 3 * 128, 4 * 128, 16
    q, k, v, _ = attention_inputs(1, 1, 1, Nq, Nk, D, seed=3)
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    mask = np.ones((1, 1, 3, 4), bool)
    mask[0, 0, 1, 0] = mask[0, 0, 2, 1] = False
    with simulate.measure(target="trn2") as m:
        o = host.flash_attention(q, k, v, block_mask=tuple(bs.dense_to_index(mask)))
    assert ("sg_keys" in m.per_tensor) == (plan == "masked")
    o_ref = ref.attention_forward(q, k, v, block_mask=mask)[0]
    assert not np.isnan(np.asarray(o, np.float64)).any() and _err(o, o_ref) < 2e-3


def test_nki_masked_supergroups_hide_other_tiles_blocks_whatever_they_hold(monkeypatch):
    """Masked super-groups of 3 tiles (B = 2, idle slots, unions past one step): a block one
    tile of a super-group uses and the others do not holds a NaN and an inf in K; the
    others' outputs are the reference's (K's non-finite values are guarded, so the added
    mask never meets them), the tile that sees them gets the reference's NaN rows."""
    _no_window(monkeypatch)
    B, Hq, Nq, Nk, D = 2, 1, 7 * 128, 20 * 128, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, seed=77)
    mask = _pattern(B, 1, Nq, Nk, 0.5, seed=78)
    mask[:, 0, :, 19] = False
    mask[:, 0, 1, 19] = True                                  # only tile 1 sees block 19
    k[:, 0, 19 * 128 + 5, 3] = np.nan
    k[:, 0, 19 * 128 + 9, 0] = np.inf
    sg = bs.masked_supergroup_tables(bs.dense_to_index(mask), 3, Nk)
    assert sg.rows.shape[3] == 3 and sg.meta.shape[2] == 3 and sg.idle == 2 * 2
    o, lse = launch(block_sparse_attention_fwd.on("nki"), launch_grid((B, 1), "nki"), q, k, v,
                    sg.meta, classes=sg.classes, sg_rows=sg.rows, sg_keys=sg.keys,
                    mm_dtype="float32", scale=D ** -0.5)
    o_ref = ref.attention_forward(q, k, v, block_mask=mask, scale=D ** -0.5)[0]
    seen = np.isnan(o_ref).any(axis=-1)
    assert seen[:, 0, 128:256].any() and not seen[:, 0, :128].any() and \
        not seen[:, 0, 256:].any()
    assert (np.isnan(o).any(axis=-1) == seen).all()
    assert _err(np.where(seen[..., None], 0, o), np.where(seen[..., None], 0, o_ref)) < 2e-6


@pytest.mark.parametrize("name, form, plan", [
    ("s=1", "index", "exact"), ("random 9/10", "bool", "masked"),
    ("random 1/2", "bool", "sparse"), ("random 1/4", "bool", "sparse"),
    ("random 1/8", "index", "sparse"),
    ("random 1/16", "bool", "window"), ("fixed 1/2", "index", "window")])
def test_the_host_takes_supergroups_where_they_gather_less_at_a_bounded_cost(monkeypatch, name,
                                                                           form, plan):
    """The forward's plan at N = 64K, D = 128 (host only: the launch is intercepted):
    every block in the index form takes exact super-groups (4 of 128 tiles: each block
    gathered 4 times, the dense forward's passes, not the grouping's 64); a random pattern
    at s = 9/10 masked ones (the other plan gathers more than the dense forward's 2048
    blocks; they compute 1.1x the active pairs); at s = 1/2, 1/4 and 1/8 sparse ones (the
    grouping gathers about 125k blocks, the window 11123 and 4259; masked super-groups
    would compute 2x, 4x and 8x the active pairs); at s = 1/16 the window stays (it gathers 1994 blocks, under the
    dense forward's); fixed_density s = 1/2 keeps its window (each set once: 512)."""
    mask = _plan_mask(name)
    got, seen = _host_plan(monkeypatch, mask if form == "bool" else tuple(
        bs.dense_to_index(mask)))
    assert got == plan
    if plan != "window":
        assert seen["sg_rows"].shape == (1, 1, 4, 128)


def _plan_mask(name: str, nqt: int = 512) -> np.ndarray:
    """The 64K plan tests' patterns: every block ("s=1"), "random a/b" (each block active
    with probability a/b, ``np.random.default_rng(1)``), fixed_density s = 1/2."""
    if name == "s=1":
        return np.ones((1, 1, nqt, nqt), bool)
    if name == "fixed 1/2":
        return bs.fixed_density(nqt, nqt, 0.5)
    num, den = name.split()[1].split("/")
    return (np.random.default_rng(1).random((nqt, nqt)) < int(num) / int(den))[None, None]


def _host_plan(monkeypatch, pattern, N: int = 65536, D: int = 128, **kw):
    """``(plan, kwargs)``: the forward plan the host takes for ``pattern`` on bf16 zeros of
    ``(1, 1, N, D)`` through nki.* ("exact", "masked" or "sparse" super-groups, "window",
    "grouping") and the kernel arguments, the launch intercepted."""
    import host.api as api

    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    x = np.zeros((1, 1, N, D), BF16)
    seen = {}

    def intercept(kernel, grid, *args, **kwargs):
        seen.update(kwargs)
        raise StopIteration

    monkeypatch.setattr(api, "launch", intercept)
    with pytest.raises(StopIteration):
        host.flash_attention(x, x, x, block_mask=pattern, **kw)
    got = ("masked" if seen.get("sg_keys") is not None else
           "sparse" if seen.get("sg_own") is not None else
           "exact" if seen.get("sg_rows") is not None else
           "window" if seen.get("window_blocks") else "grouping")
    return got, seen


# -- nki.* sparse super-groups past SBUF (issue 25, item 1 at medium density) -----------------


@pytest.mark.parametrize("form, dtype", [("index", BF16), ("bool", BF16),
                                         ("index", np.float16)], ids=["index-bf16",
                                                                      "bool-bf16",
                                                                      "index-fp16"])
def test_nki_sparse_supergroups_read_each_union_once_and_match_the_reference(monkeypatch,
                                                                              form, dtype):
    """A random pattern at s = 1/4 past SBUF (10 query tiles, the last partial; GQA 2:1; a
    tile without blocks): masked super-groups would compute 4x the active pairs, so the host
    takes sparse ones (``sg_own``): one super-group of the 10 tiles whose union (23 of the
    24 key blocks) each query head reads once, each tile computing only its own blocks in
    sub-steps of 8, 4, 2 and 1. HBM bytes exactly ``supergroup_hbm_bytes``'; outputs the
    reference's (float64 on the rounded inputs; max error below 3e-2 in bf16, 2e-3 in fp16,
    as this file's other bf16 and fp16 tests), the tile without blocks zeros and -inf."""
    _no_window(monkeypatch)
    B, Hq, Nq, Nk, D = 1, 2, 9 * 128 + 37, 24 * 128, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, dtype=dtype, seed=81)
    mask = _pattern(1, 1, Nq, Nk, 0.25, seed=82)
    mask[..., 3, :] = False
    index = bs.dense_to_index(mask)
    sg = bs.sparse_supergroup_tables(index, T.bsp_fwd_supergroup_tiles(
        D, 2, 2, bs.union_width(24, sparse=True)[1], own=True), Nk)
    union = int(mask[0, 0].any(axis=0).sum())
    assert sg.meta.shape[2] == 1 and int(sg.meta[0, 0, 0, 1]) == union
    assert sg.pairs == mask.sum() and sg.own.shape[2] == 2 * 10     # two steps of 24 slots
    pattern = mask if form == "bool" else tuple(index)
    with simulate.measure(target="trn2") as m:
        o, lse = host.flash_attention(q, k, v, block_mask=pattern, return_lse=True)
    assert "sg_own" in m.per_tensor and "sg_keys" not in m.per_tensor
    assert m.per_tensor["k"]["read"] == Hq * union * 128 * D * 2
    assert m.hbm_bytes_read + m.hbm_bytes_written == bs.supergroup_hbm_bytes(
        sg, B, Hq, Nq, Nk, D, 2)
    o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask)[:2]
    assert o.dtype == dtype and _err(o, o_ref) < (3e-2 if dtype == BF16 else 2e-3)
    fin = np.isfinite(lse_ref)
    assert (np.isfinite(lse) == fin).all() and not fin[0, :, 3 * 128:4 * 128].any()
    assert _err(np.where(fin, lse, 0), np.where(fin, lse_ref, 0)) < 2e-2
    assert not np.asarray(o, np.float64)[0, :, 3 * 128:4 * 128].any()


def test_nki_sparse_supergroups_never_read_other_tiles_blocks(monkeypatch):
    """Sparse super-groups of 3 tiles (B = 2, idle slots, unions past one step of 64): a block
    only tile 1 uses holds a NaN and an inf in K and an inf in V; every other tile's
    outputs are the reference's on K/V without those values (they never read the block),
    tile 1's rows are NaN where the reference's are. Sub-steps of every width run, and
    tiles with no block in a step."""
    _no_window(monkeypatch)
    B, Hq, Nq, Nk, D = 2, 1, 7 * 128, 80 * 128, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, seed=83)
    mask = _pattern(B, 1, Nq, Nk, 0.55, seed=84)
    mask[:, 0, :, 70] = False
    mask[:, 0, 1, 70] = True                                  # only tile 1 sees block 70
    clean_k, clean_v = k.copy(), v.copy()
    k[:, 0, 70 * 128 + 5, 3] = np.nan
    k[:, 0, 70 * 128 + 9, 0] = np.inf
    v[:, 0, 70 * 128 + 7, 2] = np.inf
    sg = bs.sparse_supergroup_tables(bs.dense_to_index(mask), 3, Nk)
    assert sg.rows.shape[3] == 3 and sg.meta.shape[2] == 3 and sg.idle == 2 * 2
    assert (sg.meta[..., 1] > 64).any()
    assert (sg.own[..., :len(T.BSP_SG_OWN_WIDTHS)] > 0).any(axis=(0, 1, 2)).all()
    o, lse = launch(block_sparse_attention_fwd.on("nki"), launch_grid((B, 1), "nki"), q, k, v,
                    sg.meta, classes=sg.classes, sg_rows=sg.rows, sg_own=sg.own,
                    mm_dtype="float32", scale=D ** -0.5)
    o_ref, lse_ref = ref.attention_forward(q, clean_k, clean_v, block_mask=mask,
                                           scale=D ** -0.5)[:2]
    seen = np.zeros(o_ref.shape[:-1], bool)
    seen[:, 0, 128:256] = True
    assert (np.isnan(o).any(axis=-1) == seen).all()
    assert _err(np.where(seen[..., None], 0, o), np.where(seen[..., None], 0, o_ref)) < 2e-6
    assert _err(np.where(seen, 0, lse), np.where(seen, 0, lse_ref)) < 2e-5


def test_nki_sparse_supergroups_with_an_empty_union_give_zeros(monkeypatch):
    """A query head without any active block under sparse super-groups (past SBUF, the
    window off; the other head at s = 1/4 takes them): its super-group's union is empty, so
    its step loop runs no iteration and its program text is traced on table rows never
    written; the head's outputs are zeros and LSE -inf, the other head's the reference's.
    (The simulator raised IndexError on the never-run body's runtime select before.)"""
    _no_window(monkeypatch)
    B, Hq, Nq, Nk, D = 1, 2, 6 * 128, 70 * 128, 32
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, seed=5)
    mask = np.random.default_rng(6).random((1, Hq, 6, 70)) < 0.25
    mask[0, 0] = False
    with simulate.measure(target="trn2") as m:
        o, lse = host.flash_attention(q, k, v, block_mask=mask, return_lse=True,
                                      mixed_precision=False)
    assert "sg_own" in m.per_tensor
    assert not np.asarray(o)[0, 0].any() and np.isneginf(lse[0, 0]).all()
    o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask)[:2]
    assert _err(o[0, 1], o_ref[0, 1]) < 2e-6 and _err(lse[0, 1], lse_ref[0, 1]) < 2e-5


def test_nki_sparse_supergroup_program_does_not_grow_with_n(monkeypatch):
    """The sparse super-group path's program (super-groups, steps, each tile's sub-steps:
    compiled loops over table data) has the same size at 10 and 20 query tiles of random
    patterns over 70 key blocks (two steps)."""
    _no_window(monkeypatch)
    sizes = []
    for nqt in (10, 20):
        Nq, Nk, D = nqt * 128, 70 * 128, 16
        q, k, v, _ = attention_inputs(1, 1, 1, Nq, Nk, D, seed=85)
        sg = bs.sparse_supergroup_tables(bs.dense_to_index(_pattern(1, 1, Nq, Nk, 0.2)), 5,
                                         Nk)
        sizes.append(program_size(
            block_sparse_attention_fwd.on("nki"), launch_grid((1, 1), "nki"), q, k, v, sg.meta,
            classes=sg.classes, sg_rows=sg.rows, sg_own=sg.own, mm_dtype="float32"))
    assert sizes[0] == sizes[1]


def test_nki_sparse_supergroup_arguments_are_checked(monkeypatch):
    """``sg_own`` is refused without ``sg_rows``, beside ``sg_keys``, in another shape, or
    over a partial last key block."""
    N, D = 4 * 128, 16
    q, k, v, _ = attention_inputs(1, 1, 1, N, N, D, seed=86)
    sg = bs.sparse_supergroup_tables(bs.dense_to_index(np.ones((1, 1, 4, 4), dtype=bool)), 4, N)
    assert sg.own.shape == (1, 1, 2 * 4, 10)            # steps of 4: widths 4, 2, 1
    assert T.bsp_sg_own_layout(4) == (((4, 3), (2, 7), (1, 9)), 10)
    base = dict(classes=sg.classes, sg_rows=sg.rows, sg_own=sg.own, mm_dtype="float32")
    _past_sbuf(monkeypatch)

    def run(**kw):
        _trace(monkeypatch, "nki", q, k, v, sg.meta, **{**base, **kw})

    run()
    with pytest.raises(ValueError, match=re.escape("sg_own: given without sg_rows")):
        run(sg_rows=None)
    with pytest.raises(ValueError, match=re.escape("sg_own: given with sg_keys")):
        run(sg_keys=np.zeros((1, 1, 8, 4), np.float32))
    with pytest.raises(ValueError, match=re.escape(
            "sg_own: expected shape (1, 1, 8, 10) (sg_rows' leading dims, one row per step of 4 "
            "blocks and tile of each super-group, the columns of tiles.bsp_sg_own_layout), "
            "got (1, 1, 8, 8)")):
        run(sg_own=sg.own[..., :8])
    with pytest.raises(ValueError, match=re.escape(
            "sg_own: sparse super-groups need whole key blocks (Nk a multiple of 128)")):
        _trace(monkeypatch, "nki", q, k[:, :, :N - 5], v[:, :, :N - 5], sg.meta, **base)


# -- nki.* super-groups of every launch: band, lengths, modifiers, dropout (issue 25, item 1) --


_SG_OPTIONS = {
    "causal-lengths": dict(causal="bottom_right", kv_lens=np.array([1100, 1230], np.int32),
                           q_lens=np.array([1000, 1180], np.int32)),
    "lengths": dict(kv_lens=np.array([1100, 1230], np.int32),
                    q_lens=np.array([1000, 1180], np.int32)),
    "window": dict(window=(300, 200)),
    "score-mods": dict(softcap=5.0, alibi_slopes=np.array([0.25, 0.0625], np.float32),
                       sinks=np.array([0.5, -1.0], np.float32)),
    "sinks": dict(sinks=np.array([0.5, -1.0], np.float32)),
    "dropout": dict(causal=True, dropout_p=0.2, seed=5),
}


def _sg_pattern(plan, Hq, nqt, nkt):
    """A pattern the host cuts into ``plan`` super-groups (with the pair-cost bound patched
    by the caller): one block set (exact), a dense random one (masked), a sparse one."""
    if plan == "exact":
        mask = np.ones((1, 1, nqt, nkt), dtype=bool)
        mask[..., 3] = False
        return mask
    rng = np.random.default_rng(91)
    return rng.random((1, Hq, nqt, nkt)) < (0.8 if plan == "masked" else 0.3)


@pytest.mark.parametrize("opts, plan", [
    (opts, plan) for opts in _SG_OPTIONS for plan in ("exact", "masked", "sparse")
    # masked super-groups take no soft-cap, ALiBi or dropout (the host takes sparse ones)
    if plan != "masked" or opts not in ("score-mods", "dropout")])
def test_nki_supergroups_serve_bands_lengths_modifiers_and_dropout(monkeypatch, opts, plan):
    """Past SBUF with the window off (B = 2, GQA 2:1, 10 query tiles, the last partial; 10
    key blocks), the host takes ``plan`` super-groups for a launch with valid lengths (with
    and without a causal band), a sliding window, the score modifiers (soft-cap, ALiBi and
    sinks; masked super-groups take no soft-cap or ALiBi: sinks alone there) or dropout: the
    outputs and LSE are the reference's (dropout: the grouping's, which draws the same
    units' bits: the super-groups return no mask to give the reference), rows that see no
    key zeros; a NaN and an inf in K make exactly the rows that see them non-finite (under
    ALiBi too, whose bias makes far keys' weights underflow)."""
    _no_window(monkeypatch)
    kw = _SG_OPTIONS[opts]
    monkeypatch.setattr(T, "BSP_SG_SPARSE_PAIR_COST", 100.0 if plan == "masked" else 0.0)
    B, Hq, Nq, Nk, D = 2, 2, 9 * 128 + 37, 10 * 128, 16
    q, k, v, _ = attention_inputs(B, Hq, 1, Nq, Nk, D, seed=92)
    # key block 1; a row that sees key 132 sees key 133 (masked super-groups guard K: a row
    # that sees an inf key outputs NaN, docs/semantics.md, where the reference may not)
    k[0, 0, 133, 2] = np.nan
    k[0, 0, 132, 1] = np.inf
    mask = _sg_pattern(plan, Hq, 10, 10)
    pattern = tuple(bs.dense_to_index(mask)) if plan == "exact" else mask
    with simulate.measure(target="trn2") as m:
        o, lse = host.flash_attention(q, k, v, block_mask=pattern, return_lse=True,
                                      mixed_precision=False, **kw)
    got = ("masked" if "sg_keys" in m.per_tensor else "sparse" if "sg_own" in m.per_tensor
           else "exact" if "sg_rows" in m.per_tensor else "none")
    assert got == plan
    if "dropout_p" in kw:
        monkeypatch.setattr(host.api, "_supergroups", lambda *args: None)
        o_ref, lse_ref = host.flash_attention(q, k, v, block_mask=pattern, return_lse=True,
                                              mixed_precision=False, **kw)
    else:
        o_ref, lse_ref = ref.attention_forward(q, k, v, block_mask=mask, **kw)[:2]
    seen = ~np.isfinite(o_ref).all(axis=-1)
    assert seen.any() and (~np.isfinite(o).all(axis=-1) == seen).all()
    fin = np.isfinite(lse_ref) & ~seen
    o, o_ref = (np.where(seen[..., None], 0, x) for x in (o, o_ref))
    assert _err(o, o_ref) < 2e-6 and (np.isfinite(lse)[~seen] == fin[~seen]).all()
    assert _err(np.where(fin, lse, 0), np.where(fin, lse_ref, 0)) < 2e-5


@pytest.mark.parametrize("name, kw, plan", [
    ("fixed 1/2", dict(softcap=30.0), "exact"),
    ("s=1", dict(causal=True), "exact"),
    ("random 1/4", dict(kv_lens=np.array([65000], np.int32)), "sparse"),
    ("random 9/10", dict(sinks=np.array([0.5], np.float32)), "masked"),
    ("random 9/10", dict(alibi_slopes=np.array([0.5], np.float32)), "sparse"),
    ("random 9/10", dict(softcap=30.0), "sparse"),
    ("random 9/10", dict(dropout_p=0.1, seed=1), "sparse"),
    ("random 1/4", dict(dropout_p=0.1, seed=1), "sparse"),
    ("random 1/4", dict(dropout_p=0.1, seed=1, return_dropout_mask=True), "window")])
def test_the_host_takes_supergroups_for_launches_with_options(monkeypatch, name, kw, plan):
    """The forward's plan at N = 64K, D = 128 with a band, lengths, a modifier or dropout
    (host only: the launch is intercepted): fixed_density s = 1/2 under a soft-cap takes
    exact super-groups (its window no longer fits beside the per-slot tables; the grouping
    gathered 8x the dense forward's blocks); random patterns take masked or sparse ones as
    plain launches do, sparse where a soft-cap, ALiBi or dropout would meet a masked one's
    added mask; a launch returning its dropout mask keeps the window."""
    got, _ = _host_plan(monkeypatch, tuple(bs.dense_to_index(_plan_mask(name))), **kw)
    assert got == plan
