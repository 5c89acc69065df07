"""host.flash_decode with a paged KV cache (``block_table``): results, planning, compile-time
arguments, IO and validation; and the paged float64 reference. Kernel-level coverage (page
sizes, ragged lengths, T > 1, tree masks, GQA/MQA, D, num_splits, prefix sharing, exact IO) is in
tests/kernels/test_decode_paged.py. Tolerance rule as in test_api_decode.py (o error <=
2 * baseline error + floor, docs/semantics.md).
"""
from __future__ import annotations

import numpy as np
import pytest

import host
from host import api, reference
from nki_kernels import tiles
from nki_kernels.nki import BACKEND

from _decode_helpers import BF16, F32, assert_within_rule, inputs


def to_pages(cache, lens, page_size, seed=1, spare=2):
    """``cache (B, Hkv, S_max, D)`` scattered over a shuffled pool with ``spare`` unused
    pages; unused table entries are -1."""
    pools, table = reference.contiguous_to_paged((cache,), lens, page_size,
                                                 np.random.default_rng(seed), spare=spare)
    return pools[0], table


# --------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------
def test_paged_flash_decode_equals_contiguous_and_returns_lse():
    q, k, v = inputs(S_max=128)
    lens = np.array([3, 101])
    kp, table = to_pages(k, lens, 32)
    vp, _ = to_pages(v, lens, 32)
    o, lse = host.flash_decode(q, kp, vp, cache_lens=lens, block_table=table, return_lse=True)
    o_c, lse_c = host.flash_decode(q, k, v, cache_lens=lens, return_lse=True)
    assert o.shape == q.shape and o.dtype == BF16 and lse.shape == (2, 8, 3)
    np.testing.assert_array_equal(o, o_c)
    np.testing.assert_array_equal(lse, lse_c)
    assert_within_rule(q, kp, vp, lens, o, table=table)


def test_paged_accepts_int64_tables_lists_and_tree_masks():
    q, k, v = inputs(T=4, S_max=64, dtype=F32)
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]], dtype=bool)
    kp, table = to_pages(k, [4, 64], 16)
    vp, _ = to_pages(v, [4, 64], 16)
    o = host.flash_decode(q, kp, vp, cache_lens=[4, 64], block_table=table.astype(np.int64),
                          tree_mask=tree, mixed_precision=False, scale=0.3)
    ref = reference.decode(q, k, v, cache_lens=[4, 64], tree_mask=tree, scale=0.3)[0]
    assert reference.max_abs_err(o, ref) < 1e-5


def test_table_may_change_every_step_without_new_compile_time_arguments(monkeypatch):
    """block_table and cache_lens are device data: two steps with different tables (a
    reshuffled pool) and lengths in one bucket launch the kernels with identical grids,
    compile-time options and argument shapes and dtypes."""
    calls = []
    real = api.launch

    def record(kernel, grid, *args, **kwargs):
        def shape(a):
            return (a.shape, a.dtype) if isinstance(a, np.ndarray) else a

        calls.append((kernel.__name__ if hasattr(kernel, "__name__") else str(kernel), grid,
                      [shape(a) for a in args], {k: shape(v) for k, v in kwargs.items()}))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(api, "launch", record)
    q, k, v = inputs(B=2, S_max=512, T=1, seed=4)
    outs = []
    for step, (lens, seed) in enumerate((([300, 500], 1), ([301, 501], 7))):
        kp, table = to_pages(k, lens, 64, seed=seed)
        vp, _ = to_pages(v, lens, 64, seed=seed)
        outs.append((host.flash_decode(q, kp, vp, cache_lens=lens, block_table=table), lens))
        assert_within_rule(q, kp, vp, lens, outs[-1][0], table=table)
    first, second = calls[:2], calls[2:]
    assert len(first) == len(second) == 2
    for a, b in zip(first, second):
        assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[3] == b[3]


def test_pages_shared_between_sequences():
    """Prefix sharing: both sequences' first two blocks are the same pages."""
    q, k, v = inputs(B=2, S_max=128, T=2, seed=5)
    k[1, :, :64] = k[0, :, :64]
    v[1, :, :64] = v[0, :, :64]
    lens = [120, 90]
    kp, table = to_pages(k, lens, 32, spare=0)
    vp, _ = to_pages(v, lens, 32, spare=0)
    table[1, :2] = table[0, :2]                     # sequence 1's own copies go unused
    o = host.flash_decode(q, kp, vp, cache_lens=lens, block_table=table)
    np.testing.assert_array_equal(o, host.flash_decode(q, k, v, cache_lens=lens))


# --------------------------------------------------------------------------------------------
# planning
# --------------------------------------------------------------------------------------------
def test_paged_plan_uses_the_logical_capacity_and_the_page_key_row():
    q = np.zeros((1, 32, 1, 128), BF16)
    pool = np.zeros((128, 8, 256, 128), BF16)
    table = np.arange(128, dtype=np.int32)[None]
    paged = host.plan_flash_decode(q, pool, pool, cache_lens=[32768], block_table=table)
    cont = np.zeros((1, 8, 32768, 128), BF16)
    assert paged == host.plan_flash_decode(q, cont, cont, cache_lens=[32768])
    pool16 = np.zeros((2048, 8, 16, 128), BF16)
    table16 = np.arange(2048, dtype=np.int32)[None]
    p16 = host.plan_flash_decode(q, pool16, pool16, cache_lens=[32768], block_table=table16)
    assert p16.key_row == 16 == tiles.decode_paged_key_row(16)


# --------------------------------------------------------------------------------------------
# IO
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(BACKEND != "simulate", reason="simulate.measure needs the bundled simulator")
def test_paged_hbm_bytes_formula_is_exact():
    import simulate

    q, k, v = inputs(B=3, Hq=8, Hkv=2, T=2, S_max=512, D=64)
    lens = [2, 300, 512]
    kp, table = to_pages(k, lens, 64)
    vp, _ = to_pages(v, lens, 64)
    p = host.plan_flash_decode(q, kp, vp, cache_lens=lens, block_table=table)
    with simulate.measure(target="trn1") as m:
        host.flash_decode(q, kp, vp, cache_lens=lens, block_table=table)
    read, written = host.flash_decode_hbm_bytes(3, 8, 2, 64, 2, lens, 2, p, paged=True)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)
    assert m.per_tensor["k_cache"]["read"] == 2 * 64 * 2 * sum(lens)
    contiguous = host.flash_decode_hbm_bytes(3, 8, 2, 64, 2, lens, 2, p)
    lp = np.array(lens) - 2
    # one program runs both kv heads: a key row's page is read once, a tail position's per head
    _, per_program, _ = api.decode_work_list(lens, 2, p)
    assert tiles.decode_heads_per_program(2, per_program, p.max_steps) == 2
    assert read - contiguous[0] == 4 * (int(np.sum(lp // 32)) + 2 * int(np.sum(lp % 32 + 2)))
    assert written == contiguous[1]


# --------------------------------------------------------------------------------------------
# validation: every error path names the argument
# --------------------------------------------------------------------------------------------
def _bad_calls():
    q, k, v = inputs(T=3, S_max=64)
    lens = [10, 64]
    kp, table = to_pages(k, lens, 16)           # 1 + 4 pages used, 2 spare: 7 pages
    vp, _ = to_pages(v, lens, 16)
    big = np.broadcast_to(np.zeros((), BF16), (api.DECODE_MAX_CACHE_POSITIONS // 16 + 1, 1, 16,
                                               32))
    out_of_range = table.copy()
    out_of_range[1, 2] = 7
    negative = table.copy()
    negative[0, 0] = -1
    return [
        # (kwargs overrides, exception, message fragment)
        (dict(block_table=table.astype(np.float32)), TypeError,
         "block_table: expected an integer dtype (int32 or int64), got dtype float32"),
        (dict(block_table=table.astype(bool)), TypeError, "block_table: expected an integer"),
        (dict(block_table=table.tolist()), TypeError,
         "block_table: expected a (B, max_blocks_per_seq) = (2, ...) integer numpy.ndarray"),
        (dict(block_table=table[0]), ValueError,
         "block_table: expected shape (B, max_blocks_per_seq) with B=2 matching q"),
        (dict(block_table=table[:1]), ValueError, "got (1, 4)"),
        (dict(block_table=out_of_range), ValueError,
         "block_table: entry [1, 2] = 7 is not a page of k_cache; sequence 1 uses blocks 0..3 "
         "(cache_lens[1]=64, page_size=16), each must be in [0, num_blocks=7)"),
        (dict(block_table=negative), ValueError, "block_table: entry [0, 0] = -1"),
        (dict(k_cache=kp[:, :, :, :16]), ValueError,
         "k_cache: expected page pool shape (num_blocks, Hkv, page_size, D) with D=32"),
        (dict(k_cache=kp[0]), ValueError,
         "k_cache: expected a 4-D array of shape (num_blocks, Hkv, page_size, D)"),
        (dict(v_cache=vp[:6]), ValueError, "v_cache: expected the same shape as k_cache"),
        (dict(k_cache=np.zeros((7, 2, 48, 32), BF16), v_cache=np.zeros((7, 2, 48, 32), BF16)),
         ValueError, "k_cache: page_size (dim 2) must be a power of two >= 16, got 48"),
        (dict(k_cache=np.zeros((7, 2, 8, 32), BF16), v_cache=np.zeros((7, 2, 8, 32), BF16)),
         ValueError, "page_size (dim 2) must be a power of two >= 16, got 8"),
        (dict(k_cache=kp.astype(np.float16)), TypeError, "k_cache"),
        (dict(k_cache=np.zeros((7, 3, 16, 32), BF16), v_cache=np.zeros((7, 3, 16, 32), BF16)),
         ValueError, "must divide q's Hq=8"),
        (dict(cache_lens=[10, 65]), ValueError,
         "cache_lens: values must be in [0, max_blocks_per_seq * page_size=64]"),
        (dict(cache_lens=[2, 64]), ValueError,
         "cache_lens: each value must be in [T=3, max_blocks_per_seq * page_size=64]"),
        (dict(cache_lens=None), TypeError, "cache_lens: required"),
        (dict(k_cache=big, v_cache=big), ValueError, "k_cache: num_blocks * Hkv * page_size"),
    ], (q, kp, vp, lens, table)


@pytest.mark.parametrize("index", range(len(_bad_calls()[0])))
def test_paged_validation_errors(index):
    cases, (q, k, v, lens, table) = _bad_calls()
    overrides, exc, fragment = cases[index]
    kw = dict(q=q, k_cache=k, v_cache=v, cache_lens=lens, block_table=table)
    kw.update(overrides)
    args = (kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"))
    with pytest.raises(exc) as info:
        host.flash_decode(*args, **kw)
    assert fragment in str(info.value)


def test_unused_table_entries_are_not_validated():
    q, k, v = inputs(T=1, S_max=64)
    kp, table = to_pages(k, [10, 20], 16)
    vp, _ = to_pages(v, [10, 20], 16)
    table[0, 1:] = 10 ** 6                      # past sequence 0's single block
    assert np.isfinite(host.flash_decode(q, kp, vp, cache_lens=[10, 20], block_table=table)
                       .astype(np.float32)).all()


# --------------------------------------------------------------------------------------------
# the float64 reference
# --------------------------------------------------------------------------------------------
def test_reference_paged_equals_contiguous_exactly():
    """reference.decode / decode_baseline_lowp with a block table are the contiguous
    references on the gathered cache (the same float64 arithmetic, bit for bit)."""
    q, k, v = inputs(B=3, T=2, S_max=96, D=16, dtype=F32, seed=2)
    lens = [2, 40, 96]
    tree = np.array([[1, 0], [1, 1]], dtype=bool)
    for ps in (1, 2, 32):
        kp, table = to_pages(k, lens, ps)
        vp, _ = to_pages(v, lens, ps)
        gathered = reference.paged_to_contiguous(kp, table, lens)
        for b, n in enumerate(lens):
            np.testing.assert_array_equal(gathered[b, :, :n], k[b, :, :n])
        o_p, lse_p = reference.decode(q, kp, vp, cache_lens=lens, block_table=table,
                                      tree_mask=tree)
        o_c, lse_c = reference.decode(q, k, v, cache_lens=lens, tree_mask=tree)
        np.testing.assert_array_equal(o_p, o_c)
        np.testing.assert_array_equal(lse_p, lse_c)
        b_p = reference.decode_baseline_lowp(q, kp, vp, cache_lens=lens, dtype=BF16,
                                             block_table=table, return_lse=True)
        b_c = reference.decode_baseline_lowp(q, k, v, cache_lens=lens, dtype=BF16,
                                             return_lse=True)
        np.testing.assert_array_equal(b_p[0], b_c[0])
        np.testing.assert_array_equal(b_p[1], b_c[1])


def test_reference_validates_the_table():
    q, k, v = inputs(T=1, S_max=64)
    kp, table = to_pages(k, [10, 64], 16)
    table[1, 3] = 99
    with pytest.raises(ValueError, match=r"block_table: entry \[1, 3\] = 99"):
        reference.decode(q, kp, kp, cache_lens=[10, 64], block_table=table)
