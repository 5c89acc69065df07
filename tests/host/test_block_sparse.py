"""Block-sparse pattern layouts, validation and standard patterns (host/block_sparse.py), and the
block-sparse / dropout forms of the float64 references."""
import heapq
from fractions import Fraction

import numpy as np
import pytest

from host import block_sparse as bs
from host import reference as ref
from host.validation import check_dropout
from nki_kernels import tiles as T


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


# -- layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nq,nk,grid", [(1, 1, (1, 1)), (128, 129, (1, 2)), (1000, 300, (8, 3))])
def test_block_grid(nq, nk, grid):
    assert bs.block_grid(nq, nk) == grid


def test_dense_index_round_trip():
    rng = np.random.default_rng(3)
    dense = rng.random((2, 3, 5, 7)) < 0.4
    index = bs.dense_to_index(dense)
    assert index.num_blocks.dtype == np.int32 and index.indices.dtype == np.int32
    assert index.max_blocks == int(dense.sum(-1).max())
    np.testing.assert_array_equal(bs.index_to_dense(index, 7), dense)


def test_dense_to_index_orders_blocks_and_pads_with_zero():
    dense = np.zeros((1, 1, 2, 6), bool)
    dense[0, 0, 0, [4, 1]] = True
    index = bs.dense_to_index(dense, max_blocks=3)
    assert index.num_blocks.tolist() == [[[2, 0]]]
    assert index.indices[0, 0].tolist() == [[1, 4, 0], [0, 0, 0]]


def test_dense_to_index_bound_too_small():
    dense = np.ones((1, 1, 1, 4), bool)
    with pytest.raises(ValueError, match="max_blocks: the pattern has up to 4"):
        bs.dense_to_index(dense, max_blocks=2)


def test_check_block_mask_both_forms_agree():
    dense = bs.local_global(4, 4, window_blocks=1, global_blocks=1)
    a = bs.check_block_mask(dense, 2, 8, 500, 512)
    b = bs.check_block_mask(tuple(bs.dense_to_index(dense)), 2, 8, 500, 512)
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.index.indices, b.index.indices)
    assert bs.check_block_mask(None, 1, 1, 1, 1) is None


@pytest.mark.parametrize("mask,match", [
    (np.ones((1, 1, 2, 2), np.int32), "expected a boolean array, got dtype int32"),
    (np.ones((2, 2), bool), "expected a 4-D array"),
    (np.ones((1, 1, 2, 3), bool), r"trailing dims \(ceil\(Nq/128\), ceil\(Nk/128\)\) = \(2, 2\)"),
    (np.ones((3, 1, 2, 2), bool), r"leading dims must be \(B or 1, Hq or 1\)"),
    ([[True]], "expected None, a boolean array"),
])
def test_check_block_mask_dense_errors(mask, match):
    with pytest.raises((TypeError, ValueError), match=match):
        bs.check_block_mask(mask, 2, 4, 256, 200)


def test_check_block_mask_index_errors():
    num = np.array([[[1, 2]]], np.int32)
    good = np.array([[[[0, 0], [0, 1]]]], np.int32)
    bs.check_block_mask((num, good), 1, 1, 256, 256)
    out_of_range = np.array([[[[2, 0], [0, 1]]]], np.int32)
    with pytest.raises(ValueError, match=r"key-block index out of range \[0, 2\)"):
        bs.check_block_mask((num, out_of_range), 1, 1, 256, 256)
    repeated = np.array([[[[0, 0], [1, 1]]]], np.int32)
    with pytest.raises(ValueError, match="strictly increasing"):
        bs.check_block_mask((num, repeated), 1, 1, 256, 256)
    with pytest.raises(ValueError, match=r"num_blocks: values must be in \[0, min"):
        bs.check_block_mask((np.array([[[3, 0]]], np.int32), good), 1, 1, 256, 256)
    with pytest.raises(TypeError, match="num_blocks: expected an integer array, got dtype"):
        bs.check_block_mask((num.astype(np.float32), good), 1, 1, 256, 256)
    with pytest.raises(ValueError, match="one entry per query tile"):
        bs.check_block_mask((num, good), 1, 1, 384, 256)


# -- patterns --------------------------------------------------------------------------------


def test_butterfly_pattern():
    pat = bs.butterfly(8, 8)[0, 0]
    assert pat.shape == (8, 8) and np.array_equal(pat, pat.T)
    # i == j or i ^ j a power of two: 1 + log2(8) = 4 blocks per row.
    assert pat.sum(axis=1).tolist() == [4] * 8
    assert pat[0, 1] and pat[0, 4] and not pat[0, 3]


def test_local_global_pattern():
    pat = bs.local_global(6, 6, window_blocks=1, global_blocks=1)[0, 0]
    assert pat[0].all() and pat[:, 0].all()
    assert pat[3].tolist() == [True, False, True, True, True, False]


def test_band_strided_pattern():
    pat = bs.band_strided(10, 12, stride=4)[0, 0]
    assert [np.flatnonzero(r).tolist() for r in pat[[0, 3, 5, 9]]] == [
        [0, 1], [0, 2, 3, 4], [4, 5, 6], [8, 9, 10]]
    assert bs.band_strided(32, 32).mean() == 118 / 1024
    for kw, match in ((dict(nqt=0), r"nqt"), (dict(nkt=2.5), r"nkt"), (dict(stride=0), r"stride")):
        with pytest.raises((TypeError, ValueError), match=match):
            bs.band_strided(**{**dict(nqt=4, nkt=4), **kw})


@pytest.mark.parametrize("density,per_row", [(1.0, 64), (1 / 16, 4), (1 / 64, 1), (1e-6, 1)])
def test_fixed_density(density, per_row):
    pat = bs.fixed_density(16, 64, density)[0, 0]
    assert pat.sum(axis=1).tolist() == [per_row] * 16
    with pytest.raises(ValueError, match=r"density: expected a number in \(0, 1\]"):
        bs.fixed_density(4, 4, 0.0)


# -- references ------------------------------------------------------------------------------


def test_reference_block_mask_equals_dense_mask():
    q, k, v = _rand((1, 2, 300, 16), 1), _rand((1, 1, 260, 16), 2), _rand((1, 1, 260, 16), 3)
    dense = np.array([[True, False, True], [False, True, True], [True, True, False]])
    o, lse = ref.attention_forward(q, k, v, block_mask=dense[None, None])
    keep = bs.expand(dense[None, None], 300, 260)[0, 0]
    s = (q[0] @ k[0, 0].T) / np.sqrt(16)
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(o[0], (p / p.sum(-1, keepdims=True)) @ v[0, 0], atol=1e-12)
    np.testing.assert_allclose(lse[0], np.log(np.exp(s).sum(-1)), atol=1e-12)


def test_reference_block_row_without_blocks_gives_zeros():
    q, k, v = (_rand((1, 1, 256, 8), s) for s in range(3))
    dense = np.array([[[[True, True], [False, False]]]])
    o, lse = ref.attention_forward(q, k, v, block_mask=dense)
    assert np.all(o[0, 0, 128:] == 0) and np.all(np.isneginf(lse[0, 0, 128:]))
    dq, dk, dv = ref.attention_backward(_rand((1, 1, 256, 8), 9), q, k, v, block_mask=dense)
    assert np.all(dq[0, 0, 128:] == 0) and np.isfinite(dk).all() and np.isfinite(dv).all()


def test_reference_dropout_forward_and_gradients():
    B, H, N, D, p = 1, 2, 70, 8, 0.25
    q, k, v, do = (_rand((B, H, N, D), s) for s in range(4))
    keep = np.random.default_rng(7).random((B, H, N, N)) >= p
    o, lse = ref.attention_forward(q, k, v, causal=True, dropout_p=p, dropout_mask=keep)
    o0, lse0 = ref.attention_forward(q, k, v, causal=True)
    np.testing.assert_array_equal(lse, lse0)  # statistics of the undropped softmax
    assert not np.allclose(o, o0)
    dq, dk, dv = ref.attention_backward(do, q, k, v, causal=True, dropout_p=p, dropout_mask=keep)

    def loss(q_, k_, v_):
        out, _ = ref.attention_forward(q_, k_, v_, causal=True, dropout_p=p, dropout_mask=keep)
        return float(np.sum(out * do))

    eps = 1e-6
    for grad, idx, which in ((dq, (0, 1, 5, 3), 0), (dk, (0, 0, 7, 2), 1), (dv, (0, 1, 60, 4), 2)):
        args = [q, k, v]
        plus, minus = [a.copy() for a in args], [a.copy() for a in args]
        plus[which][idx] += eps
        minus[which][idx] -= eps
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert abs(fd - grad[idx]) < 1e-6 * max(1.0, abs(fd))
    from_lse = ref.attention_backward_from_lse(do, q, k, v, o, lse, causal=True, dropout_p=p,
                                               dropout_mask=keep)
    for a, b in zip(from_lse, (dq, dk, dv)):
        np.testing.assert_allclose(a, b, atol=1e-12)


def test_reference_dropout_all_kept_is_plain_attention_rescaled():
    q, k, v = (_rand((1, 1, 20, 4), s) for s in range(3))
    keep = np.ones((1, 1, 20, 20), bool)
    o, _ = ref.attention_forward(q, k, v, dropout_p=0.5, dropout_mask=keep)
    o0, _ = ref.attention_forward(q, k, v)
    np.testing.assert_allclose(o, 2.0 * o0, atol=1e-12)


def test_reference_dropout_errors():
    q, k, v = (_rand((1, 1, 4, 4), s) for s in range(3))
    with pytest.raises(ValueError, match="dropout_mask: required when dropout_p > 0"):
        ref.attention_forward(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_mask: expected shape \(B, Hq, Nq, Nk\)"):
        ref.attention_forward(q, k, v, dropout_p=0.1, dropout_mask=np.ones((1, 1, 4, 5), bool))


@pytest.mark.parametrize("p,seed,exc,match", [
    (1.0, 1, ValueError, r"dropout_p: expected a probability in \[0, 1\), got 1.0"),
    (-0.1, 1, ValueError, "expected a probability"),
    (True, 1, TypeError, "dropout_p: expected a real number"),
    ("0.1", 1, TypeError, "dropout_p: expected a real number"),
    (0.1, None, ValueError, "seed: required when dropout_p > 0"),
    (0.1, -1, ValueError, r"seed: expected an int in \[0, 2147483647\]"),
    (0.1, 2**31, ValueError, "seed: expected an int"),
    (0.1, 1.5, TypeError, "seed: expected an int"),
])
def test_check_dropout_errors(p, seed, exc, match):
    with pytest.raises(exc, match=match):
        check_dropout(p, seed)


def test_check_dropout_accepts():
    assert check_dropout(0, None) == (0.0, None)
    assert check_dropout(0.0, 5) == (0.0, 5)
    assert check_dropout(np.float32(0.5), np.int64(7)) == (0.5, 7)


def test_kernel_tables_share_needs_one_head_per_order():
    index = bs.dense_to_index(np.ones((1, 2, 2, 2), bool))
    with pytest.raises(ValueError, match=r"share: grouping rows by shared blocks \(4\) needs "
                                         r"group=1, got group=2"):
        bs.kernel_tables(index, sort=True, group=2, share=4)


@pytest.mark.parametrize("index", [False, True], ids=["dense", "index"])
def test_backward_tables_per_chunk(index):
    """The backward's key-major tables in chunks of two query tiles (GQA group of two, per-head
    pattern): rows ``c nkt ..`` list each key block's query tiles of chunk c only, in one
    order per kv group common to its heads and chunks, under classes common to all; before
    the last chunk a row no head of the group meets in the chunk is pushed past every
    sequence."""
    from nki_kernels import tiles as T

    rng = np.random.default_rng(7)
    dense = rng.random((1, 4, 5, 3)) < 0.4
    dense[:, :, 4, :] = False                             # chunk 2 (tile 4) meets nothing
    dense[:, :2, :2, 2] = False                           # kv group 0 meets key block 2 in
    dense[:, 0, 2, 2] = True                              # chunk 1 only: pushed in chunk 0
    sp = bs.BlockSparsity(dense, bs.dense_to_index(dense), index)
    t = bs.launch_tables(sp, group=2, forward=False, chunk_tiles=2)
    assert t.q is None
    meta, nkt = t.k.meta, 3
    assert meta.shape[:3] == (1, 4, 3 * nkt)
    pushed = 0
    for h in range(4):
        order = meta[0, h - h % 2, 2 * nkt:, 0]           # the group's last chunk: none pushed
        assert sorted(order.tolist()) == [0, 128, 256]
        for c in range(3):
            rows = meta[0, h, c * nkt:(c + 1) * nkt]
            partner = meta[0, h ^ 1, c * nkt:(c + 1) * nkt]
            seen = set()
            for r, (first, count, *entries) in enumerate(rows):
                tiles = [int(e) // 128 for e in entries[:int(count)]]
                assert all(e >= T.BSP_PAD_FIRST for e in entries[int(count):])
                if first >= T.BSP_PAD_FIRST:
                    assert c < 2 and count == 0 and partner[r, 1] == 0
                    pushed += 1
                    continue
                assert first == order[r] == partner[r, 0]
                j = int(first) // 128
                seen.add(j)
                assert tiles == [i for i in range(2 * c, min(5, 2 * c + 2)) if dense[0, h, i, j]]
            # every key block a head meets in the chunk is listed
            assert {j for j in range(nkt) if dense[0, h, 2 * c:2 * c + 2, j].any()} <= seen
    assert pushed >= 2                                    # block 2 of heads 0 and 1, chunk 0
    # the nki.* steps of each block's dK/dV sums, per kv group and chunk: the block's last
    # meeting chunk finishes it (with the sums of earlier ones read back, column 2, or not,
    # 3), the last chunk a block none meets; an earlier meeting chunk writes them (0) or,
    # after another, adds to them (1)
    acc = t.acc_k
    assert acc.shape == (1, 2, 3 * nkt, 4) and acc.dtype == np.float32
    for grp in range(2):
        order = meta[0, 2 * grp, 2 * nkt:, 0]
        for r, first in enumerate(order):
            j = int(first) // 128
            met = [dense[0, 2 * grp:2 * grp + 2, 2 * c:2 * c + 2, j].any() for c in range(3)]
            done = max([c for c in range(3) if met[c]], default=2)
            for c in range(3):
                earlier = any(met[:c])
                want = [met[c] and c < done and not earlier, met[c] and c < done and earlier,
                        c == done and earlier, c == done and not earlier]
                assert acc[0, grp, c * nkt + r].tolist() == [float(w) for w in want]
    assert bs.launch_tables(sp, group=2, forward=False).acc_k is None


def test_backward_reorders_query_tiles_where_the_chunk_plan_is_cheaper():
    """``launch_tables(reorder=True)`` (the nki.* backward past SBUF): the evenly spread
    pattern at s = 1/4 gives tiles i and i + 4 the same key blocks, so ``chunk_order`` pairs
    them (the last tile stays last) and the plan (``backward_plan_bytes``: K, V per chunk
    and block met, fp32 sums of blocks several chunks meet) drops to K and V once; the tables
    list each entry's place in its chunk (``slots_k``; padding: the zero tile, 2). A band
    given densely keeps its natural order (no cheaper plan: no ``order_q``); in the index
    form the reordered tables are always taken (the program must not depend on the
    pattern), here in natural order; one chunk is never reordered. A random pattern gains
    a few per cent (every chunk meets almost every block)."""
    spread = bs.check_block_mask(bs.fixed_density(8, 8, 0.25), 1, 1, 1024, 1024)
    kw = dict(group=1, forward=False, chunk_tiles=2, head_dim=16, kv_itemsize=4)
    t = bs.launch_tables(spread, reorder=True, **kw)
    assert t.order_q[0, 0].tolist() == [128 * i for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    plan = [bs.backward_plan_bytes(x.k, group=1, chunks=4, head_dim=16, kv_itemsize=4)
            for x in (bs.launch_tables(spread, **kw), t)]
    block = 128 * 16 * 4
    assert plan == [(2 * 16 + 8 * 4) * block, 2 * 8 * block]
    meta, slots = t.k.meta[0, 0], t.slots_k[0, 0]
    for r in range(4 * 8):
        count = int(meta[r, 1])
        chunk = r // 8
        tiles = [int(e) // 128 for e in meta[r, 2:2 + count]]
        assert [t.order_q[0, 0, 2 * chunk + int(p)] // 128 for p in slots[r, :count]] == tiles
        assert (slots[r, count:] == 2).all()
    band = bs.local_global(8, 8, global_blocks=0)
    assert bs.launch_tables(bs.check_block_mask(band, 1, 1, 1024, 1024), reorder=True,
                            **kw).order_q is None
    index = bs.check_block_mask(tuple(bs.dense_to_index(band)), 1, 1, 1024, 1024)
    assert bs.launch_tables(index, reorder=True, **kw).order_q[0, 0].tolist() == [
        128 * i for i in range(8)]
    assert bs.launch_tables(spread, reorder=True, **{**kw, "chunk_tiles": 8}).order_q is None
    rand = bs.check_block_mask(np.random.default_rng(3).random((1, 1, 64, 64)) < 0.125, 1, 1,
                               8192, 8192)
    kw.update(chunk_tiles=22)
    cost = [bs.backward_plan_bytes(bs.launch_tables(rand, reorder=r, **kw).k, group=1,
                                   chunks=3, head_dim=16, kv_itemsize=4) for r in (0, 1)]
    assert 0.95 * cost[0] <= cost[1] <= cost[0]


def test_kernel_tables_keep_the_natural_order_unless_grouping_shares_more():
    """A class keeps its rows in their order when grouping them by common blocks would share
    no more slots (``natural``: the forward then stores its tiles' rows by plain DMAs); the
    index form is always in natural order."""
    even = bs.dense_to_index(bs.fixed_density(32, 32, 0.125))
    t = bs.kernel_tables(even, sort=True, share=8)
    assert t.shared == (0,) and t.natural == (True,)
    assert np.array_equal(t.meta[0, 0, :, 0], 128 * np.arange(32))
    assert bs.kernel_tables(even, sort=False).natural == (True,)
    # rows 0 and 2 have blocks 0 and 1, rows 1 and 3 blocks 2 and 3: in pairs, rows in their
    # order share nothing, regrouped every slot
    mask = np.zeros((1, 1, 4, 4), bool)
    mask[0, 0, [0, 2], :2] = True
    mask[0, 0, [1, 3], 2:] = True
    t = bs.kernel_tables(bs.dense_to_index(mask), sort=True, share=2)
    assert t.shared == (2,) and t.natural == (False,)
    assert list(t.meta[0, 0, :, 0] // 128) == [0, 2, 1, 3]


def test_launch_tables_keep_order_keeps_natural_order_while_it_pads_little():
    """``keep_order`` (nki.*, resident K/V): no grouping by common blocks, and a bool mask's
    query tiles stay in natural order in one class of the largest count while the padding
    slots that adds are at most ``tiles.BSP_NATURAL_MAX_PADDING`` of its blocks."""
    i = np.arange(16)
    band = (np.abs(i[:, None] - i[None, :]) <= 1)[None, None]       # 2 of 46 slots padding
    sp = bs.check_block_mask(band, 1, 1, 2048, 2048)
    kept = bs.launch_tables(sp, group=1, backward=False, keep_order=True).q
    assert kept.classes == ((0, 16, 3, False),) and kept.natural == (True,)
    assert np.array_equal(kept.meta[0, 0, :, 0], 128 * i)
    # without keep_order the tiles are sorted into tight classes (tiles 0 and 15: 2 blocks)
    assert len(bs.launch_tables(sp, group=1, backward=False).q.classes) == 2
    causal = (i[None, :] <= i[:, None])[None, None]                  # 120 of 136 padding
    sp = bs.check_block_mask(causal, 1, 1, 2048, 2048)
    kept = bs.launch_tables(sp, group=1, backward=False, keep_order=True).q
    assert len(kept.classes) > 1 and kept.shared == (0,) * len(kept.classes)


def test_launch_tables_refuse_arguments_they_would_ignore():
    """``launch_tables`` names an argument that the tables asked for would not use, and a
    chunk size outside ``[1, query tiles]``."""
    sp = bs.check_block_mask(np.ones((1, 1, 4, 4), bool), 1, 1, 512, 512)
    for kw, match in (({"forward": False, "backward": False}, r"forward, backward: both False"),
                      ({"forward": False, "keep_order": True}, r"keep_order: orders the forward"),
                      ({"backward": False, "chunk_tiles": 2}, r"chunk_tiles: chunks the backward"),
                      ({"keep_order": True, "share_runtime": True},
                       r"share_runtime: groups the forward's tables, but keep_order=True"),
                      ({"chunk_tiles": 0}, r"chunk_tiles: expected an int in \[1, 4\].*got 0"),
                      ({"chunk_tiles": 2.5}, r"chunk_tiles: expected an int.*got 2.5"),
                      ({"chunk_tiles": 5}, r"chunk_tiles: expected an int in \[1, 4\].*got 5")):
        with pytest.raises(ValueError, match=match):
            bs.launch_tables(sp, group=1, **kw)
    assert bs.launch_tables(sp, group=1, chunk_tiles=4).k.meta.shape[2] == 4


def test_shared_bound_tables_list_each_groups_common_blocks_first_in_a_bounded_shape():
    """The index form's grouped tables (``share_runtime``): every row has ``2 max_blocks``
    slots, its group's common blocks first (then padding), its own blocks from slot
    ``max_blocks`` (then padding), its count column ``max_blocks +`` its own count; the
    class, ``shared`` and ``natural`` depend on the bound and the rows only. Rows 0 and 2
    share blocks 0 and 1 (a group of two, regrouped), rows 1 and 3 block 2; row 3 also has
    block 3."""
    mask = np.zeros((1, 1, 4, 4), bool)
    mask[0, 0, [0, 2], :2] = True
    mask[0, 0, [1, 3], 2] = True
    mask[0, 0, 3, 3] = True
    index = bs.dense_to_index(mask, max_blocks=3)
    t = bs.shared_bound_tables(index, 2)
    assert t.classes == ((0, 4, 6, False),) and t.shared == (3,) and t.natural == (False,)
    assert t.shared_runtime
    pad = T.BSP_PAD_FIRST
    want = [[0, 3, 0, 128, pad, pad, pad, pad],
            [256, 3, 0, 128, pad, pad, pad, pad],
            [128, 3, 256, pad, pad, pad, pad, pad],
            [384, 4, 256, pad, pad, 384, pad, pad]]
    assert t.meta.tolist() == [[want]]
    sp = bs.check_block_mask(tuple(index), 1, 1, 512, 512)
    got = bs.launch_tables(sp, group=1, backward=False, share_runtime=True).q
    assert np.array_equal(got.meta, bs.shared_bound_tables(index, T.BSP_GROUP_TILES).meta)
    # a bool mask (a compile-time pattern) keeps its sorted, tight classes
    sp = bs.check_block_mask(mask, 1, 1, 512, 512)
    assert not bs.launch_tables(sp, group=1, backward=False, share_runtime=True).q.shared_runtime


# -- the forward's key-block window past SBUF (issue 25, item 1) ---------------------------


def _replay(win, index):
    """Replay ``win``'s loads group by group (a window of ``win.blocks`` blocks, -1 empty)
    and check that every slot of every tile names the position holding its block (padding:
    the block of zeros); returns the blocks gathered per (b, h)."""
    meta, slots, loads = win.tables.meta, win.slots, win.loads
    b, h, n, _ = meta.shape
    width = (loads.shape[-1] - 2) // 2
    g = min(win.group, n)
    gathered = np.zeros((b, h), dtype=np.int64)
    for x in range(b):
        for y in range(h):
            held = np.full(win.blocks + 1, -1)
            for gi, a in enumerate(range(0, n, g)):
                live = loads[x, y, gi, 2:2 + width] < T.BSP_PAD_FIRST
                count = int(live.sum())
                # whole steps of loads, the blocks first, then padding entries (zero block)
                assert int(loads[x, y, gi, 0]) == -(-count // T.BSP_WINDOW_LOAD_BLOCKS)
                assert live[:count].all() and width % T.BSP_WINDOW_LOAD_BLOCKS == 0
                assert (loads[x, y, gi, 2 + width + count:] == win.blocks).all()
                firsts = loads[x, y, gi, 2:2 + count].astype(np.int64)
                held[loads[x, y, gi, 2 + width:2 + width + count].astype(np.int64)] = (
                    firsts // bs.BLOCK)
                gathered[x, y] += count
                for r in range(a, min(a + g, n)):
                    tile = int(meta[x, y, r, 0]) // bs.BLOCK
                    num = int(index.num_blocks[x, y, tile])
                    assert int(meta[x, y, r, 1]) == num
                    pos = slots[x, y, r].astype(np.int64)
                    assert (held[pos[:num]] == index.indices[x, y, tile, :num]).all()
                    assert (pos[num:] == win.blocks).all()
                    assert (meta[x, y, r, 2 + num:] == T.BSP_PAD_FIRST).all()
            assert sorted(meta[x, y, :, 0] // bs.BLOCK) == list(range(n))
    return gathered


@pytest.mark.parametrize("name", ["band", "fixed", "random"])
def test_window_tables_hold_every_slots_block_and_gather_fewer(name):
    """The window's tables (``window_tables``): replaying each group's loads, every slot of
    every tile names the window position holding its key block. The band+strided pattern
    and the rotated fixed-density one gather each key block once (the grouping: several
    times, ``grouped_block_loads``); a random pattern in a small window gathers no more
    than the grouping whenever ``window_plan`` takes it (here it does: 166 against 674)."""
    nqt = 40
    mask = {"band": bs.band_strided(nqt, nqt), "fixed": bs.fixed_density(nqt, nqt, 0.1),
            "random": np.random.default_rng(5).random((2, 2, nqt, nqt)) < 0.1}[name]
    index = bs.dense_to_index(mask)
    # the random pattern's window holds fewer blocks than the pattern uses: it evicts
    blocks = 32 if name == "random" else 64
    win = bs.window_tables(index, blocks, T.BSP_GROUP_TILES)
    gathered = _replay(win, index)
    assert win.block_loads == gathered.sum()
    grouped = bs.kernel_tables(index, sort=True, share=T.BSP_GROUP_TILES)
    runtime = bs.shared_bound_tables(index, T.BSP_GROUP_TILES)
    if name != "random":
        assert (gathered == nqt).all()
        for t in (grouped, runtime):
            assert bs.grouped_block_loads(t, T.BSP_GROUP_TILES) >= 2 * nqt
    sparsity = bs.check_block_mask(mask, mask.shape[0], mask.shape[1], nqt * 128, nqt * 128)
    # no more than the dense forward's blocks (here as many as the group of 8 gathers): 8
    plan = bs.window_plan(sparsity, grouped, blocks, win.block_loads)
    assert plan.group == T.BSP_GROUP_TILES and plan.block_loads == win.block_loads
    assert plan.block_loads < bs.grouped_block_loads(grouped, T.BSP_GROUP_TILES)


def _belady_by_scan(needs, blocks):
    """The window plan of ``bs._window_loads`` by its first algorithm, kept here as the
    oracle: the victim by a scan of every held block's list of uses (first the held one
    gathered first among those next needed furthest ahead)."""
    uses = {}
    for gi, need in enumerate(needs):
        for j in need.tolist():
            uses.setdefault(j, []).append(gi)
    held, free, out = {}, list(range(blocks)), []
    for gi, need in enumerate(needs):
        if len(need) > blocks:
            return None
        for x in [x for x in held if uses[x][-1] < gi]:
            heapq.heappush(free, held.pop(x))
        wanted = set(need.tolist())
        loads = []
        for j in need.tolist():
            if j in held:
                continue
            if not free:
                def next_use(x):
                    return next(u for u in uses[x] if u > gi)
                victim = max((x for x in held if x not in wanted), key=next_use)
                heapq.heappush(free, held.pop(victim))
            held[j] = heapq.heappop(free)
            loads.append((held[j], j))
        out.append((loads, {j: held[j] for j in need.tolist()}))
    return out


@pytest.mark.parametrize("name", ["band", "fixed", "random"])
def test_window_plan_equals_the_scanning_belady(monkeypatch, name):
    """``_window_loads`` (a lazy heap of next uses) plans exactly what the scan over every
    held block planned, ties included: on the pattern's groups in shuffled orders, in
    windows from the widest group's count up (they evict), and end to end (every table of
    ``window_tables``; the random pattern's window of 32 evicts)."""
    nqt = 40
    mask = {"band": bs.band_strided(nqt, nqt), "fixed": bs.fixed_density(nqt, nqt, 0.1),
            "random": np.random.default_rng(5).random((2, 2, nqt, nqt)) < 0.1}[name]
    rng = np.random.default_rng(7)
    gathers = 0
    for _ in range(4):
        order = rng.permutation(nqt)
        needs = [np.flatnonzero(mask[0, 0, order[a:a + 8]].any(axis=0))
                 for a in range(0, nqt, 8)]
        widest = max(len(n) for n in needs)
        for blocks in (widest, widest + 4):
            plan = bs._window_loads(needs, blocks)
            assert plan == _belady_by_scan(needs, blocks)
            gathers += sum(len(loads) for loads, _ in plan)
    assert gathers > 8 * int(mask[0, 0].any(axis=0).sum())      # they evict
    index = bs.dense_to_index(mask)
    fast = bs.window_tables(index, 32, T.BSP_GROUP_TILES)
    monkeypatch.setattr(bs, "_window_loads", _belady_by_scan)
    slow = bs.window_tables(index, 32, T.BSP_GROUP_TILES)
    assert (fast.blocks, fast.block_loads) == (slow.blocks, slow.block_loads)
    for x, y in ((fast.slots, slow.slots), (fast.loads, slow.loads),
                 (fast.tables.meta, slow.tables.meta)):
        np.testing.assert_array_equal(x, y)
    assert fast.tables._replace(meta=None) == slow.tables._replace(meta=None)


def test_window_loads_equal_the_scanning_belady_on_many_ties():
    """Groups drawing from few blocks (next uses tie often), windows from the widest group's
    count up: the same plan as the scan; a group wider than the window: None."""
    rng = np.random.default_rng(11)
    for trial in range(200):
        nb = int(rng.integers(2, 12))
        needs = [np.flatnonzero(rng.random(nb) < rng.uniform(0.1, 0.7))
                 for _ in range(int(rng.integers(1, 30)))]
        widest = max(len(n) for n in needs)
        for blocks in (max(widest, 1), widest + 1, widest + 3):
            assert bs._window_loads(needs, blocks) == _belady_by_scan(needs, blocks), trial
    assert bs._window_loads([np.arange(4)], 3) is None


def test_window_tables_refuse_a_group_wider_than_the_window():
    """A group whose tiles need more key blocks than the window holds: no window tables
    (the forward keeps the grouping)."""
    mask = np.zeros((1, 1, 8, 16), dtype=bool)
    mask[0, 0, :, :] = np.arange(16)[None, :] % 8 == np.arange(8)[:, None]   # 2 each, 16 in all
    index = bs.dense_to_index(mask)
    assert bs.window_tables(index, 15, T.BSP_GROUP_TILES) is None
    assert bs.window_tables(index, 16, T.BSP_GROUP_TILES).block_loads == 16
    sparsity = bs.check_block_mask(mask, 1, 1, 8 * 128, 16 * 128)
    grouped = bs.kernel_tables(index, sort=True, share=T.BSP_GROUP_TILES)
    assert bs.window_plan(sparsity, grouped, 0, 16) is None
    # groups of 4 fit in 15 blocks and gather 16, as many as the grouping (each tile's 2)
    assert bs.window_tables(index, 15, 4).block_loads == 16
    assert bs.window_plan(sparsity, grouped, 15, 16) is None
    assert bs.window_plan(sparsity, grouped, 16, 16) is None


@pytest.mark.parametrize("Hq,Hkv", [(1, 1), (4, 1)])
def test_dense_kv_blocks_are_the_dense_forwards_kv_bytes(Hq, Hkv):
    """``api._dense_kv_blocks`` (what ``window_plan`` compares the window's gathers to): at
    64K, D = 128, bf16 the dense forward's K/V bytes of ``tiles.forward_hbm_bytes``, in
    blocks per ``(b, h)`` of a pattern broadcast to the query heads: 2048 with one query
    head per kv head (4 passes over K and V), 1920 where 4 share one (15 passes for the
    4)."""
    from host import api, validation
    import ml_dtypes

    N, D = 65536, 128
    q = np.broadcast_to(np.zeros((), ml_dtypes.bfloat16), (1, Hq, N, D))
    k = np.broadcast_to(np.zeros((), ml_dtypes.bfloat16), (1, Hkv, N, D))
    mask = np.eye(N // 128, dtype=bool)[None, None]
    call = api._attention_call(validation.check_attention_inputs(q, k, k), "bfloat16",
                               bs.check_block_mask(mask, 1, Hq, N, N))
    tiles = T.choose_forward_tiles(N, N, D, Hq // Hkv, 2, 2, target="trn2", api="nki")
    read = T.forward_hbm_bytes(1, Hq, Hkv, N, N, D, 2, tiles)[0]
    kv = read - Hq * N * D * 2                   # Q read once
    blocks = api._dense_kv_blocks(call)
    assert blocks == {1: 2048, 4: 1920}[Hq]
    assert blocks * Hq * 2 * 128 * D * 2 == kv


def test_window_plan_takes_the_largest_group_within_the_dense_traffic():
    """``window_plan``'s group size: the largest of ``tiles.BSP_WINDOW_GROUPS`` whose plan
    gathers at most the dense forward's key blocks, else the one gathering the fewest. The
    random pattern in a window of 32 blocks (it evicts) gathers 166 / 163 / 161 / 160 blocks
    in groups of 8 / 4 / 2 / 1 (the grouping: 674); in a window of 16 groups of 8 and 4 do
    not fit, 2 gathers 240. Every plan's tables hold every slot's block
    (:func:`_replay`)."""
    nqt = 40
    mask = np.random.default_rng(5).random((2, 2, nqt, nqt)) < 0.1
    index = bs.dense_to_index(mask)
    sparsity = bs.check_block_mask(mask, 2, 2, nqt * 128, nqt * 128)
    grouped = bs.kernel_tables(index, sort=True, share=T.BSP_GROUP_TILES)
    loads = {g: bs.window_tables(index, 32, g).block_loads for g in T.BSP_WINDOW_GROUPS}
    assert T.BSP_WINDOW_GROUPS == (8, 4, 2, 1)
    assert [loads[g] for g in T.BSP_WINDOW_GROUPS] == [166, 163, 161, 160]
    for dense, group in ((10 ** 6, 8), (166, 8), (165, 4), (163, 4), (162, 2), (161, 2),
                         (160, 1), (159, 1), (0, 1)):
        plan = bs.window_plan(sparsity, grouped, 32, dense)
        assert (plan.group, plan.block_loads) == (group, loads[group]), dense
        assert _replay(plan, index).sum() == plan.block_loads
    assert bs.window_tables(index, 16, 4) is None
    plan = bs.window_plan(sparsity, grouped, 16, 10 ** 6)
    assert (plan.group, plan.block_loads) == (2, 240)
    assert _replay(plan, index).sum() == 240


def test_window_plan_shares_the_window_between_alike_member_heads():
    """``window_plan`` with the query heads per kv head (``heads``, GQA): the random pattern
    of 2 x 2 (b, kv head) entries given per query head, each kv head's 2 member heads alike,
    is planned once per kv head and its tables repeated for the member heads
    (``WindowTables.heads`` 2: they share each gather), so its key blocks per query head
    (``head_loads``) are those of the pattern of kv heads: groups of 8 gather 166 and fit a
    dense forward of 166, where the plan per query head (twice as many) takes groups of 1.
    Every member head's tables hold its slots' blocks (:func:`_replay`); the byte model
    counts the window's gathers and loads rows once per kv head. A pattern broadcast over
    heads shares its tables as they are; member heads that differ do not share."""
    nqt = 40
    kv = np.random.default_rng(5).random((2, 2, nqt, nqt)) < 0.1
    mask = np.repeat(kv, 2, axis=1)
    index = bs.dense_to_index(mask)
    sparsity = bs.check_block_mask(mask, 2, 4, nqt * 128, nqt * 128)
    grouped = bs.kernel_tables(index, sort=True, share=T.BSP_GROUP_TILES)
    shared = bs.window_plan(sparsity, grouped, 32, 166, 2)
    assert (shared.group, shared.heads, shared.head_loads, shared.block_loads) == (8, 2, 166, 332)
    assert shared.slots.shape[1] == shared.loads.shape[1] == shared.tables.meta.shape[1] == 4
    assert _replay(shared, index).sum() == shared.block_loads
    alone = bs.window_plan(sparsity, grouped, 32, 166)
    assert (alone.group, alone.heads, alone.head_loads) == (1, 1, 320)
    # bytes: K/V of 166 gathered blocks and the loads rows once per kv head, not per query
    # head; the same Q, O, LSE and per-tile tables
    B, Hq, N, D = 2, 4, nqt * 128, 64
    per_head = shared._replace(heads=1)
    kv_bytes = 2 * 166 * 128 * D * 2 + shared.loads[:, ::2].size * 4
    assert (bs.window_hbm_bytes(per_head, B, Hq, N, N, D, 2)
            - bs.window_hbm_bytes(shared, B, Hq, N, N, D, 2)) == kv_bytes
    # broadcast over the heads: the same tables, shared by the 4 query heads of a kv head
    one = bs.check_block_mask(kv[:1, :1], 1, 4, nqt * 128, nqt * 128)
    plan = bs.window_plan(one, bs.kernel_tables(one.index, sort=True, share=8), 32, 10 ** 6,
                          4)
    assert plan.heads == 4 and plan.tables.meta.shape[1] == 1
    assert plan.head_loads == Fraction(plan.block_loads, 4)
    mask[1, 3, 0, 0] = ~mask[1, 3, 0, 0]
    differ = bs.check_block_mask(mask, 2, 4, nqt * 128, nqt * 128)
    assert bs._kv_head_index(differ, 2) is None
    assert bs.window_plan(differ, grouped, 32, 166, 2).heads == 1


# -- super-groups (the forward past SBUF, nki.*) ----------------------------------------------


def test_supergroup_tables_cut_runs_of_identical_sets_and_mask_unions():
    """Exact super-groups: tiles sorted by block set, each run cut into super-groups of the
    shape's size (3 of 7 rows: ``ceil(7 / ceil(7 / 3))``), idle slots past a run; the union
    row lists the set. Masked ones: consecutive tiles, the union in ascending order, each
    tile's keep flag of each slot at row ``c U + slot``, column tile; none with a partial
    last key block."""
    dense = np.zeros((1, 1, 7, 5), bool)
    dense[0, 0, [0, 2, 4, 6], 1] = True
    dense[0, 0, [1, 3, 5], 4] = True
    dense[0, 0, 5, 0] = True
    index = bs.dense_to_index(dense)
    sg = bs.supergroup_tables(index, 3)
    assert bs.union_width(2) == (2, 4) and sg.classes == ((0, 4, 4, False),)
    assert sg.rows.shape == (1, 1, 4, 3) and sg.idle == 4 * 3 - 7
    counts = sg.meta[0, 0, :, 1].tolist()
    firsts = [tuple(sg.meta[0, 0, c, 2:2 + int(n)] // 128) for c, n in enumerate(counts)]
    tiles = [tuple(r // 128 for r in sg.rows[0, 0, c] if r < T.BSP_PAD_FIRST)
             for c in range(4)]
    assert sorted(zip(firsts, tiles)) == [((0, 4), (5,)), ((1,), (0, 2, 4)), ((1,), (6,)),
                                          ((4,), (1, 3))]
    assert sg.block_loads == 5 and sg.keys is None
    assert bs.masked_supergroup_tables(index, 4, 5 * 128 - 28) is None
    masked = bs.masked_supergroup_tables(index, 4, 5 * 128)
    assert masked.rows.shape == (1, 1, 2, 4) and masked.idle == 1
    W, U = bs.union_width(5)
    assert (W, U) == (5, 10) and masked.keys.shape == (1, 1, 2 * U, 4)
    assert masked.meta[0, 0, 0, 1] == 2 and masked.meta[0, 0, 1, 1] == 3
    # super-group 1: tiles 4, 5, 6 over the union (0, 1, 4); tile 5 (t = 1) has 0 and 4
    assert masked.keys[0, 0, U:U + 3, :3].tolist() == [[0, 1, 0], [1, 0, 1], [0, 1, 0]]
    assert not masked.keys[0, 0, U:, 3].any() and not masked.keys[0, 0, U + 3:].any()
    assert masked.pairs == 4 * 2 + 4 * 3 and masked.block_loads == 5


def test_sparse_supergroup_tables_list_each_tiles_blocks_per_step_and_width():
    """Sparse super-groups: the masked ones' super-groups and unions (consecutive tiles), in
    steps of ``min(BSP_SG_OWN_STEP_BLOCKS, nkt)`` blocks; per (super-group, step, tile) the
    trip count of each sub-step width (8, 4, 2, 1) and the positions of the tile's blocks in
    the step, greedily: 7 blocks are one sub-step of 4, one of 2 and one of 1. ``pairs`` is
    the active pairs; none with a partial last key block."""
    nkt = 12
    dense = np.zeros((1, 1, 3, nkt), bool)
    dense[0, 0, 0, [0, 2, 3, 5, 7, 9, 11]] = True            # 7 blocks
    dense[0, 0, 1, [2, 3]] = True
    dense[0, 0, 2, 6] = True
    index = bs.dense_to_index(dense)
    assert bs.sparse_supergroup_tables(index, 4, nkt * 128 - 1) is None
    sg = bs.sparse_supergroup_tables(index, 2, nkt * 128)
    assert T.BSP_SG_OWN_WIDTHS == (8, 4, 2, 1)
    W, U = bs.union_width(nkt, sparse=True)
    assert (W, U) == (min(T.BSP_SG_OWN_STEP_BLOCKS, nkt), 2 * nkt)
    sections, cols = T.bsp_sg_own_layout(W)
    assert sections == ((8, 4), (4, 12), (2, 16), (1, 18)) and cols == 19
    assert sg.rows.shape == (1, 1, 2, 2) and sg.keys is None and sg.idle == 1
    assert sg.own.shape == (1, 1, 2 * 2 * 2, cols)
    assert sg.pairs == 10 and sg.block_loads == 7 + 1
    # super-group 0: tiles 0 and 1 over the union (0, 2, 3, 5, 7, 9, 11), one step
    assert sg.meta[0, 0, 0, 1] == 7
    row = sg.own[0, 0, 0]
    assert row[:4].tolist() == [0, 1, 1, 1]
    assert row[12:16].tolist() == [0, 1, 2, 3] and row[16:18].tolist() == [4, 5]
    assert row[18] == 6 and not row[4:12].any()
    row = sg.own[0, 0, 1]                                     # tile 1: union slots 1 and 2
    assert row[:4].tolist() == [0, 0, 1, 0] and row[16:18].tolist() == [1, 2]
    assert not sg.own[0, 0, 2:4].any()                        # step 1: no block
    # super-group 1: tile 2 alone (the other slot idle), union (6,)
    assert sg.own[0, 0, 4, :4].tolist() == [0, 0, 0, 1] and sg.own[0, 0, 4, 18] == 0
    assert not sg.own[0, 0, 5:].any()
