"""Split-KV flash decoding over a *paged* KV cache (``block_table``): the kernels of
nki_kernels/attention/decode.py through the active backend's simulator (legacy grid; one case
through nki.* against it, bit for bit).

The same data is run twice: as a contiguous cache ``(B, Hkv, S_max, D)`` and scattered into a
shuffled page pool ``(num_blocks, Hkv, page_size, D)`` with a block table. Every case is built
so that both calls get the same tiling (the key row ``min(page_size, 32)`` equals the
contiguous one), so the paged result must equal the contiguous one *bit for bit* (only the
addresses of the gathers differ); it must also obey the tolerance rule against the float64
reference (``reference.decode(..., block_table=...)``: o error <= 2 * baseline error + floor,
floor 1e-3 for bf16/fp16 matmul operands and 1e-5 for fp32, as in test_decode.py).

Pools are poisoned: every page no sequence uses, and every position at or past a sequence's
length inside a used page, holds NaN; block-table entries past a sequence's blocks hold -1 or
garbage. A kernel that read any of them would return NaN or fail the exact IO count.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_decode import (BF16, F16, F32, SEED_TREE_MASK, check_against_reference, decode,
                         make_inputs, mm_dtype, needs_measure, run_merge, split_kernel,
                         tree_from_parents)

from host import reference
from host.api import decode_work_list, flash_decode_hbm_bytes
from nki_kernels import tiles


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def to_pages(cache, lens, page_size, rng, *, spare=3, shared=None):
    """Scatter ``cache (B, Hkv, S_max, D)`` (S_max a multiple of page_size) into a shuffled,
    poisoned page pool; returns ``(pool, block_table)``.

    ``shared``: number of leading blocks every sequence takes from sequence 0 (prefix sharing:
    those blocks of the other sequences must already equal sequence 0's). ``spare`` unused
    pages (all NaN) are mixed in.
    """
    B, Hkv, S_max, D = cache.shape
    assert S_max % page_size == 0
    max_blocks = S_max // page_size
    used = [-(-int(n) // page_size) for n in lens]
    own = [used[0]] + [u - min(shared or 0, u) for u in used[1:]]
    num_blocks = sum(own) + spare
    perm = rng.permutation(num_blocks)
    pool = np.full((num_blocks, Hkv, page_size, D), np.nan, dtype=cache.dtype)
    table = np.full((B, max_blocks), -1, dtype=np.int32)
    table[:, ::2] = 2 ** 30                       # garbage in unused entries, never read
    j = 0
    for b in range(B):
        for i in range(used[b]):
            if b > 0 and shared and i < shared:
                table[b, i] = table[0, i]
                continue
            page = perm[j]
            j += 1
            table[b, i] = page
            valid = min(page_size, int(lens[b]) - i * page_size)
            pool[page, :, :valid] = cache[b, :, i * page_size:i * page_size + valid]
    return pool, table


def decode_paged(q, k_pool, v_pool, table, lens, *, scale=None, tree=None, num_splits=None,
                 mixed_precision=True):
    """The two kernels as host.flash_decode launches them on a paged cache: (o, lse, tiles)."""
    B, Hq, T, D = q.shape
    Hkv, page_size = k_pool.shape[1], k_pool.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    mm = mm_dtype(q.dtype, mixed_precision)
    n = tiles.decode_paged_key_row(page_size)
    need = int(np.max((lens.astype(np.int64) - T) // n))
    t = tiles.decode_tiles(Hq // Hkv * T, D, table.shape[1] * page_size, mm.itemsize, need,
                           num_splits, batch=B, key_row=n)
    work, per_program, splits = decode_work_list(lens, T, t)
    per_head = tiles.decode_heads_per_program(Hkv, per_program, t.max_steps)
    W = 0 if work is None else len(work)
    tm = None if tree is None else np.asarray(tree, dtype=np.uint8)
    o_part, lse_part = split_kernel(
        Hkv // per_head, W // per_program + B, q, k_pool, v_pool, lens, work, tm, table,
        scale=scale, mm_dtype=mm.name, key_row=t.key_row, split_rows=t.split_rows,
        num_splits=t.num_splits, row_tile=t.row_tile, pack=t.pack,
        items_per_program=per_program, heads_per_program=per_head)
    o, lse = run_merge(o_part, lse_part, np.repeat(splits, Hq * T), q.dtype)
    return o.reshape(B, Hq, T, D), lse.reshape(B, Hq, T), t


def check_paged(q, k, v, lens, page_size, *, seed=0, tree=None, num_splits=None,
                mixed_precision=True, shared=None):
    """Paged == contiguous (bit for bit, same tiling) and within the tolerance rule."""
    rng = np.random.default_rng(seed)
    k_pool, table = to_pages(k, lens, page_size, rng, shared=shared)
    v_pool, _ = to_pages(v, lens, page_size, np.random.default_rng(seed), shared=shared)
    o_p, lse_p, t_p = decode_paged(q, k_pool, v_pool, table, lens, tree=tree,
                                   num_splits=num_splits, mixed_precision=mixed_precision)
    o_c, lse_c, t_c = decode(q, k, v, lens, tree=tree, num_splits=num_splits,
                             mixed_precision=mixed_precision)
    assert t_p == t_c, "the case must give the paged and contiguous calls the same tiling"
    np.testing.assert_array_equal(o_p, o_c)
    np.testing.assert_array_equal(lse_p, lse_c)
    mm = mm_dtype(q.dtype, mixed_precision)
    ref_o, ref_lse = reference.decode(q, k_pool, v_pool, cache_lens=lens, tree_mask=tree,
                                      block_table=table)
    base_o = reference.decode_baseline_lowp(q, k_pool, v_pool, cache_lens=lens, dtype=mm,
                                            out_dtype=q.dtype, tree_mask=tree, block_table=table)
    tol = reference.tolerance(ref_o, base_o, floor=reference.atol_floor(mm))
    assert reference.max_abs_err(o_p, ref_o) <= tol
    check_against_reference(q, k, v, lens, o_p, lse_p, tree=tree,
                            mixed_precision=mixed_precision)
    return t_p, (k_pool, v_pool, table)


# --------------------------------------------------------------------------------------------
# paged == contiguous
# --------------------------------------------------------------------------------------------
CASES = [
    # B, Hq, Hkv, T, S_max, D, cache_lens, dtype, page_size, num_splits
    (1, 4, 1, 1, 80, 32, [40], BF16, 16, None),           # GQA 4:1, page 16 (key row 16)
    (2, 8, 2, 3, 256, 64, [3, 256], BF16, 32, None),       # len = T and = capacity
    (1, 4, 4, 5, 1024, 128, [999], F32, 64, None),         # MHA, fp32 -> bf16 operands
    (1, 2, 1, 1, 4096, 256, [4000], BF16, 256, None),      # D=256
    (1, 8, 1, 17, 512, 64, [300], BF16, 128, None),        # MQA, T=17
    (3, 6, 3, 2, 112, 16, [2, 50, 112], BF16, 16, 3),      # ragged, forced splits, page 16
    (1, 4, 2, 4, 2048, 64, [2048], F16, 512, 7),           # more splits than needed, fp16
    (1, 1, 1, 1, 16, 16, [1], BF16, 16, 4),                # cache_len 1, a single page
    (2, 4, 1, 128, 1024, 128, [128, 1000], BF16, 1024, None),  # T=128 spans pages; big page
    (1, 16, 1, 9, 160, 64, [150], BF16, 32, None),         # G*T = 144 > 128 rows
    (2, 32, 8, 1, 3072, 128, [1, 3072], BF16, 256, None),  # Llama-like heads, ragged
    (4, 8, 2, 1, 2048, 64, [1, 2048, 33, 1500], BF16, 2048, None),  # one page per sequence
]


@pytest.mark.parametrize("B,Hq,Hkv,T,S_max,D,lens,dtype,page_size,num_splits", CASES)
def test_paged_equals_contiguous(B, Hq, Hkv, T, S_max, D, lens, dtype, page_size, num_splits):
    rng = np.random.default_rng(B * 1000 + Hq * 100 + T * 10 + D)
    q, k, v, lens = make_inputs(rng, B, Hq, Hkv, T, S_max, D, dtype, lens)
    check_paged(q, k, v, lens, page_size, seed=D + page_size, num_splits=num_splits)


@pytest.mark.parametrize("page_size", [16, 32, 64, 256])
def test_paged_across_page_sizes_and_split_counts(page_size):
    """One ragged batch under every page size, with automatic and forced split counts (splits
    that start and end inside a page, and pages larger than a split). The capacity is an odd
    number of 16-position pages for page 16, so the contiguous key row is 16 too."""
    rng = np.random.default_rng(page_size)
    S_max = 65 * 16 if page_size == 16 else 1024
    q, k, v, lens = make_inputs(rng, 3, 8, 2, 2, S_max, 64, BF16, [2, 513, 1000])
    for ns in (None, 2, 5):
        check_paged(q, k, v, lens, page_size, seed=ns or 0, num_splits=ns)


@needs_measure
@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_paged_multi_tile_splits_on_both_generations(target):
    """Splits of several K/V tiles (a block-table gather per tile; trn2 zero-fills by copying,
    trn1 by memsets), the boundary tile and a tile past the second sequence's end."""
    import simulate

    rng = np.random.default_rng(29)
    q, k, v, lens = make_inputs(rng, 2, 8, 2, 2, 8192, 64, BF16, [8192, 3000])
    with simulate.measure(target=target):
        t, _ = check_paged(q, k, v, lens, 128, num_splits=1)
    assert t.split_rows >= 2 * tiles.PMAX


def test_paged_full_precision():
    """fp32 operands: paged == contiguous and ~1e-6 from the float64 reference."""
    rng = np.random.default_rng(7)
    q, k, v, lens = make_inputs(rng, 2, 8, 2, 4, 384, 64, F32, [200, 384])
    check_paged(q, k, v, lens, 128, mixed_precision=False)


def test_paged_tree_masks():
    """Seed 003's 9-token tree and a random 40-token tree (new tokens spanning two pages)."""
    rng = np.random.default_rng(9)
    q, k, v, lens = make_inputs(rng, 2, 8, 2, 9, 320, 64, BF16, [9, 300])
    check_paged(q, k, v, lens, 64, tree=SEED_TREE_MASK)
    T = 40
    parents = [-1] + [int(rng.integers(0, t)) for t in range(1, T)]
    tree = tree_from_parents(parents)
    q, k, v, lens = make_inputs(rng, 2, 8, 2, T, 224, 32, BF16, [T, 180])
    check_paged(q, k, v, lens, 32, tree=tree)


def test_prefix_sharing():
    """Sequences 1 and 2 share sequence 0's first three pages (a common prompt) and then
    diverge; each sees exactly its own logical cache."""
    rng = np.random.default_rng(31)
    B, Hq, Hkv, T, S_max, D, ps = 3, 8, 2, 2, 256, 64, 32
    q, k, v, lens = make_inputs(rng, B, Hq, Hkv, T, S_max, D, BF16, [200, 150, 97])
    k[1:, :, :3 * ps] = k[0, :, :3 * ps]
    v[1:, :, :3 * ps] = v[0, :, :3 * ps]
    _, (_, _, table) = check_paged(q, k, v, lens, ps, shared=3)
    assert np.all(table[1:, :3] == table[0, :3])
    assert len(set(table[:, 3:].ravel()) - {-1, 2 ** 30}) == 4 + 2 + 1


# --------------------------------------------------------------------------------------------
# IO: every valid KV byte exactly once, nothing past cache_lens, the block-table entries
# --------------------------------------------------------------------------------------------
@needs_measure
def test_paged_nki_matches_legacy(monkeypatch):
    """host.flash_decode over a page pool through nki.* (the page lookups' table gathers and
    pool-row arithmetic of the splits and tails, with the program indices read from a table)
    gives the legacy grid's o and LSE bit for bit and the same HBM bytes (with a tree mask and
    partial last key rows: page 64, key row 32)."""
    import host
    import simulate
    from nki_kernels import nki as binding

    rng = np.random.default_rng(5)
    B, Hq, Hkv, T, S_max, D = 2, 8, 2, 3, 1024, 64
    q, k, v, lens = make_inputs(rng, B, Hq, Hkv, T, S_max, D, BF16, [333, 1000])
    k_pool, table = to_pages(k, lens, 64, np.random.default_rng(6))
    v_pool, _ = to_pages(v, lens, 64, np.random.default_rng(6))
    tree = np.tril(np.ones((T, T), bool)) & ~np.eye(T, k=-2, dtype=bool)
    runs = {}
    for api in ("legacy", "nki"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        with simulate.measure(target="trn2") as m:
            runs[api] = host.flash_decode(q, k_pool, v_pool, cache_lens=lens, block_table=table,
                                          tree_mask=tree, return_lse=True, lnc=1), m
        assert m.api == api
    (o0, lse0), m0 = runs["legacy"]
    (o1, lse1), m1 = runs["nki"]
    assert np.all(np.isfinite(np.asarray(o1, np.float32)))
    assert np.array_equal(np.asarray(o0, np.float32), np.asarray(o1, np.float32))
    assert np.array_equal(lse0, lse1)
    assert (m0.hbm_bytes_read, m0.hbm_bytes_written) == (m1.hbm_bytes_read, m1.hbm_bytes_written)


@needs_measure
@pytest.mark.parametrize("lens,S_max,T,page_size,tree,num_splits", [
    ([1, 777, 1024], 1024, 1, 64, False, None),   # full rows, a partial row, an empty prefix
    ([5, 1000], 1024, 5, 16, False, None),        # key row 16
    ([300], 512, 9, 256, True, None),             # tree mask, new tokens in one page
    ([4000, 2500], 4096, 1, 32, False, 8),        # 11 full splits -> padding work items
])
def test_paged_io_exact(lens, S_max, T, page_size, tree, num_splits):
    import simulate

    rng = np.random.default_rng(23)
    B, Hq, Hkv, D = len(lens), 8, 2, 64
    q, k, v, lens = make_inputs(rng, B, Hq, Hkv, T, S_max, D, BF16, lens)
    k_pool, table = to_pages(k, lens, page_size, np.random.default_rng(1))
    v_pool, _ = to_pages(v, lens, page_size, np.random.default_rng(1))
    tree_mask = SEED_TREE_MASK if tree else None
    with simulate.measure(target="trn2") as m:
        o, lse, t = decode_paged(q, k_pool, v_pool, table, lens, tree=tree_mask,
                                 num_splits=num_splits)
    work, per_program, splits = decode_work_list(lens, T, t)
    if num_splits == 8:
        assert len(work) > int(np.sum(splits))           # the case has padding items
    kv_bytes = Hkv * D * BF16.itemsize * int(lens.sum())
    per = m.per_tensor
    assert per["k_cache"]["read"] == kv_bytes and per["v_cache"]["read"] == kv_bytes
    lp = lens.astype(np.int64) - T
    n = t.key_row
    # a key row's page once per head group, a tail position's per kv head
    groups = Hkv // tiles.decode_heads_per_program(Hkv, per_program, t.max_steps)
    assert per["block_table"]["read"] == 4 * (groups * int(np.sum(lp // n))
                                              + Hkv * int(np.sum(lp % n + T)))
    read, written = flash_decode_hbm_bytes(B, Hq, T, D, Hkv, lens, BF16.itemsize, t,
                                           tree_mask=tree, paged=True)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)
    assert np.all(np.isfinite(o.astype(np.float32))) and np.all(np.isfinite(lse))
