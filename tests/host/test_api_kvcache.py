"""host.flash_attention_with_kvcache (chunked prefill and prefix caching over a KV cache) and
flash_decode's window: results against the float64 references with awkward shapes (a sequence
of length 1, a chunk equal to its cache, pages shared between sequences), both kernels and
their boundary, both namespaces over a page pool, and the documented errors. Tolerance rule
as in test_api_decode.py: o's error <= 2 x the plain low-precision baseline's + floor
(docs/semantics.md).
"""
from __future__ import annotations

import numpy as np
import pytest

import host
from host import reference
from nki_kernels import tiles
from nki_kernels.nki import BACKEND

from _decode_helpers import BF16, inputs

#: the first T the prefill kernel runs at 4 query heads per kv head (the tests' group)
PREFILL_T = tiles.kvcache_decode_max_tokens(4) + 1


def _paged(k, v, lens, page_size, seed=1):
    (kp, vp), table = reference.contiguous_to_paged((k, v), lens, page_size,
                                                    np.random.default_rng(seed), spare=2)
    return kp, vp, table


def _forward_ref(q, k, v, lens, causal=True, window=None, **mods):
    """float64 reference and low-precision baseline: the forward over the cache with
    ``kv_lens = cache_lens`` (bottom-right alignment cache_lens - T)."""
    c = "bottom_right" if causal else None
    ref, lse = reference.attention_forward(q, k, v, causal=c, window=window, kv_lens=lens,
                                           **mods)
    base = reference.attention_baseline_lowp(q, k, v, dtype=BF16, out_dtype=q.dtype, causal=c,
                                             window=window, kv_lens=lens, **mods)
    return ref, lse, reference.tolerance(ref, base, floor=reference.atol_floor(BF16))


def _check(o, lse, q, k, v, lens, **options):
    ref, ref_lse, tol = _forward_ref(q, k, v, lens, **options)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:3]
    assert reference.max_abs_err(o, ref) <= tol
    assert np.max(np.abs(lse - ref_lse)) < 2e-2


# --------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------
def test_chunk_paged_equals_contiguous_with_length_1_and_a_chunk_equal_to_its_cache():
    """The prefill kernel over a page pool: sequence 0 is the chunk alone (cache_lens = T),
    sequence 1 a chunk after a 181-position prefix ending in a partial page; paged and
    contiguous give the same bits, within the rule of the float64 reference."""
    T = PREFILL_T
    q, k, v = inputs(B=2, Hq=8, Hkv=2, T=T, S_max=256, D=32)
    lens = np.array([T, 181 + T])
    kp, vp, table = _paged(k, v, lens, 32)
    o, lse = host.flash_attention_with_kvcache(q, kp, vp, cache_lens=lens, block_table=table,
                                               return_lse=True)
    oc, lsec = host.flash_attention_with_kvcache(q, k, v, cache_lens=lens, return_lse=True)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(oc, np.float32))
    np.testing.assert_array_equal(lse, lsec)
    _check(o, lse, q, k, v, lens)


def test_decode_of_one_token_over_a_length_1_cache():
    q, k, v = inputs(B=2, Hq=4, Hkv=1, T=1, S_max=64, D=16)
    lens = np.array([1, 40])
    kp, vp, table = _paged(k, v, lens, 16)
    o, lse = host.flash_attention_with_kvcache(q, kp, vp, cache_lens=lens, block_table=table,
                                               return_lse=True)
    _check(o, lse, q, k, v, lens)


def test_pages_shared_between_sequences():
    """Prefix caching: both sequences' first two pages are the same pages of the pool (a
    shared prompt); each then has its own chunk."""
    T, ps = PREFILL_T, 32
    q, k, v = inputs(B=2, Hq=4, Hkv=1, T=T, S_max=192, D=32, seed=3)
    k[1, :, :2 * ps], v[1, :, :2 * ps] = k[0, :, :2 * ps], v[0, :, :2 * ps]
    lens = np.array([2 * ps + T, 2 * ps + T + 20])
    kp, vp, table = _paged(k, v, lens, ps)
    table[1, :2] = table[0, :2]
    o, lse = host.flash_attention_with_kvcache(q, kp, vp, cache_lens=lens, block_table=table,
                                               return_lse=True)
    _check(o, lse, q, k, v, lens)


@pytest.mark.parametrize("causal,window,mods", [
    (False, None, {}),
    (True, (40, 0), dict(softcap=20.0)),
    (False, (30, 10), dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 1.0], np.float32))),
    (True, None, dict(sinks=np.array([1.0, -0.5, 0.0, 2.0], np.float32))),
])
def test_prefill_masks_and_score_modifiers(causal, window, mods):
    T = PREFILL_T
    q, k, v = inputs(B=2, Hq=4, Hkv=1, T=T, S_max=256, D=32, seed=5)
    lens = np.array([T + 3, 250])
    kp, vp, table = _paged(k, v, lens, 64)
    o, lse = host.flash_attention_with_kvcache(q, kp, vp, cache_lens=lens, block_table=table,
                                               causal=causal, window=window, return_lse=True,
                                               **mods)
    _check(o, lse, q, k, v, lens, causal=causal, window=window, **mods)


@pytest.mark.parametrize("causal", [True, False])
def test_both_kernels_agree_at_the_threshold(monkeypatch, causal):
    """The same call run by the decode kernels (T at the threshold) and by the prefill kernel
    (threshold lowered by one): both within the rule, and within rounding of each other."""
    T = tiles.kvcache_decode_max_tokens(4)
    q, k, v = inputs(B=2, Hq=4, Hkv=1, T=T, S_max=256, D=32, seed=7)
    lens = np.array([T, 200])
    kp, vp, table = _paged(k, v, lens, 32)
    outs = []
    for limit in (T, T - 1):
        monkeypatch.setattr(tiles, "kvcache_decode_max_tokens", lambda group, n=limit: n)
        outs.append(host.flash_attention_with_kvcache(q, kp, vp, cache_lens=lens,
                                                      block_table=table, causal=causal,
                                                      return_lse=True))
        _check(*outs[-1], q, k, v, lens, causal=causal)
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-2)


@pytest.mark.parametrize("Hq,T,window,prefill", [
    (4, 64, None, False), (4, 65, None, True),          # G = 4: T <= 64
    (1, 128, None, False), (2, 96, None, False),         # G <= 2: G T <= 192 rows
    (2, 97, None, True), (8, 1, (4, 0), True),           # a window: always the prefill kernel
])
def test_kernel_choice(Hq, T, window, prefill):
    from host import api

    q, k, v = inputs(B=1, Hq=Hq, Hkv=1, T=T, S_max=128, D=16)
    call = api._kvcache_call(q, k, v, cache_lens=[128], window=window)
    assert call.prefill is prefill


def test_flash_decode_window():
    q, k, v = inputs(B=2, Hq=4, Hkv=2, T=3, S_max=128, D=32)
    lens = np.array([3, 120])
    o, lse = host.flash_decode(q, k, v, cache_lens=lens, window=(16, 0), return_lse=True)
    _check(o, lse, q, k, v, lens, window=(16, 0))


@pytest.mark.skipif(BACKEND != "simulate", reason="simulate.measure needs the bundled simulator")
def test_paged_prefill_io_is_the_contiguous_one_plus_one_table_entry_per_key():
    """HBM bytes (exact, simulate.measure): the paged chunk reads K, V, q and the lengths as the
    contiguous one does (each valid key once, nothing past cache_lens; one edge key per
    program) plus one int32 block-table entry per valid key and one for the edge key, per kv
    head; writes the same."""
    import simulate

    T, Hkv = PREFILL_T, 2
    q, k, v = inputs(B=2, Hq=8, Hkv=Hkv, T=T, S_max=256, D=32, seed=11)
    lens = np.array([T, 231])
    kp, vp, table = _paged(k, v, lens, 32)
    runs = []
    for kk, vv, extra in ((k, v, {}), (kp, vp, dict(block_table=table))):
        with simulate.measure(target="trn2") as m:
            host.flash_attention_with_kvcache(q, kk, vv, cache_lens=lens, **extra)
        runs.append(m)
    contiguous, paged = runs
    assert paged.hbm_bytes_written == contiguous.hbm_bytes_written
    assert paged.per_tensor["block_table"]["read"] == 4 * Hkv * int(np.sum(lens + 1))
    for name in ("q", "k", "v", "kv_lens"):
        assert paged.per_tensor[name] == contiguous.per_tensor[name]
    assert contiguous.per_tensor["v"]["read"] == Hkv * 32 * 2 * int(np.sum(lens))
    assert paged.hbm_bytes_read == (contiguous.hbm_bytes_read
                                    + paged.per_tensor["block_table"]["read"])


@pytest.mark.skipif(BACKEND != "simulate", reason="simulate.measure needs the bundled simulator")
def test_paging_adds_a_program_size_independent_of_the_cache():
    """The table lookups are a compiled loop: paging adds the same instructions to the program
    whatever the cache length."""
    import simulate

    added = []
    for S in (256, 1024):
        q, k, v = inputs(B=1, Hq=4, Hkv=1, T=PREFILL_T, S_max=S, D=16)
        lens = np.array([S])
        kp, vp, table = _paged(k, v, lens, 32)
        sizes = []
        for kk, vv, extra in ((k, v, {}), (kp, vp, dict(block_table=table))):
            with simulate.measure(target="trn2") as m:
                host.flash_attention_with_kvcache(q, kk, vv, cache_lens=lens, **extra)
            sizes.append(m.program_instructions)
        added.append(sizes[1] - sizes[0])
    assert added[0] == added[1] > 0


def test_paged_prefill_nki_matches_legacy_in_strict_mode(monkeypatch, strict_sim):
    """The paged gathers (table lookups in a compiled loop, pool-row arithmetic) trace through
    both namespaces under strict simulation and give the same bits."""
    from nki_kernels import nki as binding

    T = PREFILL_T
    q, k, v = inputs(B=2, Hq=8, Hkv=2, T=T, S_max=256, D=32, seed=9)
    lens = np.array([T, 230])
    kp, vp, table = _paged(k, v, lens, 16)
    runs = []
    for api in ("legacy", "nki"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        runs.append(host.flash_attention_with_kvcache(q, kp, vp, cache_lens=lens,
                                                      block_table=table, return_lse=True))
    np.testing.assert_array_equal(np.asarray(runs[0][0], np.float32),
                                  np.asarray(runs[1][0], np.float32))
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    _check(*runs[1], q, k, v, lens)


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------
def _call(T=2, S_max=64, lens=(2, 64), **kw):
    q, k, v = inputs(B=2, Hq=2, Hkv=1, T=T, S_max=S_max, D=16)
    return host.flash_attention_with_kvcache(q, k, v, cache_lens=np.array(lens), **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(causal="top_left"), r"causal: .*bottom-right.*got 'top_left'"),
    (dict(lens=(1, 64)), r"cache_lens: each value must be in \[T=2, S_max=64\].*got 1 at index 0"),
    (dict(T=130, S_max=256, lens=(130, 256), tree_mask=np.ones((130, 130), bool)),
     r"tree_mask: an option of the split-KV decode kernels .*T=130"),
    (dict(num_splits=2, window=(8, 0)), r"num_splits: an option of the split-KV decode.*window"),
    (dict(tree_mask=np.eye(2, dtype=bool), causal=False), r"tree_mask: .*needs causal=True"),
    (dict(window=(-2, 0)), r"window: left must be >= -1"),
])
def test_errors_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        _call(**kw)


def test_paged_prefill_index_limit():
    q, k, v = inputs(B=1, Hq=4, Hkv=1, T=PREFILL_T, S_max=128, D=16)
    kp, vp, table = _paged(k, v, [128], 16)
    big = np.full((1, (1 << 21) // 16), -1, dtype=np.int32)
    big[0, :table.shape[1]] = table[0]
    with pytest.raises(ValueError, match=r"block_table: the prefill kernel over a paged cache "
                                         r"indexes .* below 2\^22"):
        host.flash_attention_with_kvcache(q, kp, vp, cache_lens=[128], block_table=big)


def test_block_table_out_of_range():
    q, k, v = inputs(B=2, Hq=4, Hkv=1, T=PREFILL_T, S_max=128, D=16)
    lens = np.array([PREFILL_T, 128])
    kp, vp, table = _paged(k, v, lens, 16)
    table[1, 7] = kp.shape[0]
    with pytest.raises(ValueError, match=r"block_table: entry \[1, 7\] = .* is not a page"):
        host.flash_attention_with_kvcache(q, kp, vp, cache_lens=lens, block_table=table)
