"""Split-KV flash decoding kernels (nki_kernels/attention/decode.py, decode_merge.py) through the
active backend's simulator, against the float64 references of host/reference.py.

Both kernels are one source through nki.* and legacy. The cases against the reference run the
legacy namespace (the grid the legacy estimates were made with); the nki.* section runs a
representative subset through both namespaces and asserts the same outputs bit for bit and
the same HBM bytes (the instruction streams differ only where 0.7 needs it: program walks,
iota offsets read from a table, predicated copies): one call per feature that changes the
instruction stream -- packed GQA rows with several splits, a ragged batch with forced splits
and a 1-position key row, a tree mask with T > 1, every score modifier, D = 256, fp32 inputs,
a paged cache (test_decode_paged.py) and LNC=2 (tests/host/test_api_decode.py runs those
through nki.* on trn2, the default) -- and the program size flat in the cache length under
both.

Tolerance (docs/semantics.md, FlashAttention's rule): the max abs error of o against
``reference.decode`` is at most ``2 * err(decode_baseline_lowp) + floor`` (floor 1e-5 for fp32
matmul operands, 1e-3 for bf16/fp16); the LSE error at most
``2 * err(baseline LSE) + floor``.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from host import reference
from host.api import decode_work_list, flash_decode_hbm_bytes
from nki_kernels import tiles
from host._launch import launch
from nki_kernels.attention import decode as dk
from nki_kernels.attention import decode_merge as merge
from nki_kernels.nki import BACKEND

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

#: Seed 003's speculative tree: token i's parent (A..I = 0..8) and the mask printed there.
SEED_TREE_PARENTS = (-1, 0, 1, 1, 2, 2, 3, 3, 4)
SEED_TREE_MASK = np.array([
    [1, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0, 0, 0],
    [1, 1, 1, 0, 1, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 1, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 1, 0, 0],
    [1, 1, 0, 1, 0, 0, 0, 1, 0],
    [1, 1, 1, 0, 1, 0, 0, 0, 1],
], dtype=bool)

needs_measure = pytest.mark.skipif(BACKEND != "simulate",
                                   reason="simulate.measure needs the bundled simulator")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def mm_dtype(dtype, mixed_precision=True):
    dtype = np.dtype(dtype)
    return BF16 if (dtype == F32 and mixed_precision) else dtype


def make_inputs(rng, B, Hq, Hkv, T, S_max, D, dtype, lens):
    """q, caches and int32 lengths."""
    q = rng.standard_normal((B, Hq, T, D)).astype(np.float32).astype(dtype)
    k = rng.standard_normal((B, Hkv, S_max, D)).astype(np.float32).astype(dtype)
    v = rng.standard_normal((B, Hkv, S_max, D)).astype(np.float32).astype(dtype)
    return q, k, v, np.asarray(lens, dtype=np.int32)


def poisoned(cache, lens):
    """A copy of ``cache`` with NaN at every position at or past the length: a kernel that
    read one would return NaN (the references get the clean cache: 0 * NaN is NaN there)."""
    out = cache.copy()
    for b, n in enumerate(lens):
        out[b, :, n:] = np.nan
    return out


def plan(q, k, lens, mm, num_splits=None):
    B, Hq, T, D = q.shape
    Hkv, S_max = k.shape[1], k.shape[2]
    n = tiles.decode_key_row(S_max)
    need = int(np.max((lens.astype(np.int64) - T) // n))
    return tiles.decode_tiles(Hq // Hkv * T, D, S_max, mm.itemsize, need, num_splits, batch=B)


def split_kernel(groups, programs, *args, api="legacy", **kwargs):
    """The split kernel through ``api``: legacy on its grid ``(groups, programs)`` (head
    groups, chunk and tail programs), nki.* as ``kernel[1]`` (it walks them itself)."""
    grid = (groups, programs) if api == "legacy" else (1,)
    q, k, work = args[0], args[1], args[4]
    if (work is not None and "zero_row" not in kwargs
            and tiles.decode_zero_by_dma(kwargs["split_rows"])):  # the K/V zero fills' source
        cols = tiles.decode_zero_row_cols(kwargs["split_rows"], kwargs["key_row"], q.shape[3])
        kwargs["zero_row"] = np.zeros((1, cols), dtype=k.dtype)
    part = launch(dk.flash_decode_split_kernel.on(api), grid, *args, **kwargs)
    return part[..., :-1], part[..., -1]          # (o, lse): stored together as o | lse


def run_phase1(q, k, v, lens, t, scale, mm, tree=None, work=None, per_program=1,
               api="legacy"):
    """The split kernel on its grid (Hkv, W / per_program + B) through ``api``: every partial
    (o, lse). ``work`` defaults to the host's work list (the splits that hold committed
    rows)."""
    B, Hkv = q.shape[0], k.shape[1]
    per_head = 1
    if work is None:
        work, per_program, _ = decode_work_list(lens, q.shape[2], t)
        per_head = tiles.decode_heads_per_program(Hkv, per_program, t.max_steps)
    W = 0 if work is None else len(work)
    tm = None if tree is None else np.asarray(tree, dtype=np.uint8)
    return split_kernel(
        Hkv // per_head, W // per_program + B, q, k, v, lens, work, tm, api=api, scale=scale,
        mm_dtype=mm.name, key_row=t.key_row, split_rows=t.split_rows, num_splits=t.num_splits,
        row_tile=t.row_tile, pack=t.pack, items_per_program=per_program,
        heads_per_program=per_head)


def packed(o_part, lse_part):
    """The merge kernel's partials ``o | lse`` (the split kernel's layout)."""
    return np.concatenate([o_part, lse_part[..., None]], axis=-1)


def run_merge(o_part, lse_part, row_splits, out_dtype, api="legacy"):
    """The merge kernel through ``api``: legacy on its grid of row tiles, nki.* as
    ``kernel[1]``."""
    N = o_part.shape[0] if row_splits is None else row_splits.shape[0]
    grid = (tiles.ceil_div(N, tiles.DECODE_MERGE_ROWS),) if api == "legacy" else (1,)
    return launch(merge.flash_decode_merge_kernel.on(api), grid, packed(o_part, lse_part),
                  row_splits, out_dtype=np.dtype(out_dtype).name,
                  rows_per_program=tiles.DECODE_MERGE_ROWS)


def decode(q, k, v, lens, *, scale=None, tree=None, num_splits=None, mixed_precision=True,
           api="legacy"):
    """The two kernels as host.flash_decode launches them (LNC=1), through ``api``; returns
    (o, lse, tiles)."""
    B, Hq, T, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    mm = mm_dtype(q.dtype, mixed_precision)
    t = plan(q, k, lens, mm, num_splits)
    o_part, lse_part = run_phase1(q, k, v, lens, t, scale, mm, tree, api=api)
    _, _, splits = decode_work_list(lens, T, t)
    o, lse = run_merge(o_part, lse_part, np.repeat(splits, Hq * T), q.dtype, api=api)
    return o.reshape(B, Hq, T, D), lse.reshape(B, Hq, T), t


def check_against_reference(q, k, v, lens, o, lse, *, scale=None, tree=None,
                            mixed_precision=True):
    mm = mm_dtype(q.dtype, mixed_precision)
    ref_o, ref_lse = reference.decode(q, k, v, cache_lens=lens, scale=scale, tree_mask=tree)
    base_o, base_lse = reference.decode_baseline_lowp(
        q, k, v, cache_lens=lens, dtype=mm, out_dtype=q.dtype, scale=scale, tree_mask=tree,
        return_lse=True)
    floor = reference.atol_floor(mm)
    err_o = reference.max_abs_err(o, ref_o)
    tol_o = reference.tolerance(ref_o, base_o, floor=floor)
    err_lse = reference.max_abs_err(lse, ref_lse)
    tol_lse = reference.tolerance(ref_lse, base_lse, floor=floor)
    assert o.dtype == q.dtype and lse.dtype == F32
    assert np.all(np.isfinite(ref_o)) and np.all(np.isfinite(base_o))
    assert err_o <= tol_o, f"o error {err_o:.3g} > tolerance {tol_o:.3g}"
    assert err_lse <= tol_lse, f"lse error {err_lse:.3g} > tolerance {tol_lse:.3g}"
    return err_o, err_lse


def tree_from_parents(parents):
    """Ancestor-or-self mask of a token tree given each token's parent (-1 = root)."""
    T = len(parents)
    mask = np.zeros((T, T), dtype=bool)
    for t in range(T):
        u = t
        while u >= 0:
            mask[t, u] = True
            u = parents[u]
    return mask


# --------------------------------------------------------------------------------------------
# correctness against the reference
# --------------------------------------------------------------------------------------------
CASES = [
    # B, Hq, Hkv, T, S_max, D, cache_lens, dtype, num_splits
    (1, 4, 1, 1, 64, 32, [40], BF16, None),                 # GQA 4:1, T=1
    (2, 8, 2, 3, 256, 64, [3, 256], BF16, None),            # GQA 8:2; len = T and = S_max
    (2, 8, 2, 3, 257, 80, [100, 257], F16, None),           # odd S_max -> key row 1
    (1, 4, 4, 5, 1000, 128, [999], F32, None),              # MHA, fp32 -> bf16 operands
    (1, 2, 1, 1, 4096, 256, [4000], BF16, None),            # D=256 (two head-dim tiles)
    (1, 8, 1, 17, 512, 64, [300], BF16, None),              # MQA, T=17
    (3, 6, 3, 2, 96, 16, [2, 50, 96], BF16, 3),             # ragged batch, forced splits
    (1, 4, 2, 4, 2048, 64, [2048], BF16, 7),                # more splits than needed
    (1, 1, 1, 1, 64, 16, [1], BF16, 4),                     # cache_len 1: splits all empty
    (1, 3, 1, 1, 1, 8, [1], BF16, None),                    # S_max = 1
    (2, 4, 1, 128, 1024, 128, [128, 1000], BF16, None),     # T=128: 4 row tiles per kv head
    (1, 16, 1, 9, 160, 64, [150], BF16, None),              # G*T = 144 > 128 rows
    (2, 32, 8, 1, 3072, 128, [1, 3072], BF16, None),        # Llama-like heads, ragged
]


@pytest.mark.parametrize("B,Hq,Hkv,T,S_max,D,lens,dtype,num_splits", CASES)
def test_decode_matches_reference(B, Hq, Hkv, T, S_max, D, lens, dtype, num_splits):
    rng = np.random.default_rng(B * 1000 + Hq * 100 + T * 10 + D)
    q, k, v, lens = make_inputs(rng, B, Hq, Hkv, T, S_max, D, dtype, lens)
    o, lse, _ = decode(q, poisoned(k, lens), poisoned(v, lens), lens, num_splits=num_splits)
    check_against_reference(q, k, v, lens, o, lse)


@needs_measure
@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_decode_multi_tile_splits_on_both_generations(target):
    """Splits of several K/V tiles (trn2 zeroes them by copying a zero tile, trn1 by memsets):
    full tiles, a boundary tile and a tile past the second sequence's end, on each
    generation's code path."""
    import simulate

    rng = np.random.default_rng(29)
    q, k, v, lens = make_inputs(rng, 2, 8, 2, 2, 8192, 64, BF16, [8192, 3000])
    with simulate.measure(target=target):
        o, lse, t = decode(q, poisoned(k, lens), poisoned(v, lens), lens, num_splits=1)
    assert t.split_rows >= 2 * tiles.PMAX
    check_against_reference(q, k, v, lens, o, lse)


@pytest.mark.parametrize("items,heads", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (6, 4)])
def test_every_program_shape_gives_the_reference(items, heads):
    """A split-kernel program streams ``items`` work items for ``heads`` kv heads through two
    buffers (a software pipeline with two dead gathers at the end). Every shape -- single
    steps, pairs of heads, pairs of items, padding items between real ones -- gives the
    reference, with NaN past every length (a stale or dead buffer row that reached a score or
    a P V product would show)."""
    rng = np.random.default_rng(31)
    B, Hq, Hkv, T, S_max, D = 2, 8, 4, 2, 512, 32
    q, k, v, lens = make_inputs(rng, B, Hq, Hkv, T, S_max, D, BF16, [500, 70])
    scale = 1.0 / math.sqrt(D)
    t = plan(q, k, lens, BF16, num_splits=3)
    _, _, splits = decode_work_list(lens, T, t)
    real = [(b, s) for b in range(B) for s in range(splits[b])]
    pad = -len(real) % items
    work = np.array(real + [(B, 0)] * pad, dtype=np.int32)
    o_part, lse_part = split_kernel(
        Hkv // heads, len(work) // items + B, q, poisoned(k, lens), poisoned(v, lens), lens,
        work, None, scale=scale, mm_dtype="bfloat16", key_row=t.key_row,
        split_rows=t.split_rows, num_splits=t.num_splits, row_tile=t.row_tile, pack=t.pack,
        items_per_program=items, heads_per_program=heads)
    o, lse = run_merge(o_part, lse_part, np.repeat(splits, Hq * T), q.dtype)
    check_against_reference(q, k, v, lens, o.reshape(B, Hq, T, D), lse.reshape(B, Hq, T))


@pytest.mark.parametrize("items,heads", [(3, 1), (3, 2), (1, 3), (5, 4)])
def test_unpaired_program_shapes_are_refused(items, heads):
    rng = np.random.default_rng(1)
    q, k, v, lens = make_inputs(rng, 1, 12, 12, 1, 256, 16, BF16, [200])
    work = np.zeros((15, 2), dtype=np.int32)
    with pytest.raises(ValueError, match="steps come in pairs"):
        split_kernel(12 // heads, 15 // items + 1, q, k, v, lens, work, None, key_row=32,
                     split_rows=1, num_splits=1, items_per_program=items,
                     heads_per_program=heads)


def test_missing_zero_row_is_refused():
    rng = np.random.default_rng(1)
    q, k, v, lens = make_inputs(rng, 1, 4, 4, 1, 256, 16, BF16, [200])
    work = np.zeros((2, 2), dtype=np.int32)
    msg = r"zero_row: a \(1, ceil\(split_rows / 128\) \* key_row \* D\) = \(1, 512\)"
    # splits of 1 and 128 key rows: zeroed by DMA (zero_row required) and on the engines (None)
    for rows, bad in ((1, None), (1, np.zeros((1, 16), BF16)), (128, np.zeros((1, 512), BF16))):
        with pytest.raises(ValueError, match=msg):
            split_kernel(1, 3, q, k, v, lens, work, None, key_row=32, split_rows=rows,
                         num_splits=1, items_per_program=2, zero_row=bad)


def test_program_shape_choice():
    """Items per program: 1 or even, at most DECODE_ITEMS_PER_PROGRAM and the step budget,
    spread evenly; heads per program: a divisor of Hkv within the step budget (even with an
    odd item count)."""
    assert tiles.decode_work_items(1) == (1, 1)
    assert tiles.decode_work_items(8) == (8, 8)
    assert tiles.decode_work_items(7) == (8, 8)                 # steps come in pairs
    total, per = tiles.decode_work_items(40)                   # 40 items: 2 programs of 20
    assert (total, per) == (40, 20)
    assert tiles.decode_work_items(70) == (84, 28)             # bucket 80: 3 programs of 28
    assert tiles.decode_work_items(40, max_steps=5) == (40, 4)
    assert tiles.decode_heads_per_program(8, 8, 64) == 8
    assert tiles.decode_heads_per_program(8, 16, 64) == 4
    assert tiles.decode_heads_per_program(3, 1, 64) == 1        # odd items need even heads
    assert tiles.decode_heads_per_program(6, 1, 64) == 6
    assert tiles.decode_heads_per_program(8, 1, 64) == 8
    assert tiles.decode_max_steps(rows=4, row_tile=4, D=128) == 128
    assert tiles.decode_max_steps(rows=1024, row_tile=128, D=128) == 16
    # tails run beside a chunk program's steps (nki.*): B // chunks, at most the items of a
    # head; a single sequence's run first
    assert tiles.decode_tails_per_program(64, 4, 16) == 16
    assert tiles.decode_tails_per_program(8, 2, 16) == 4
    assert tiles.decode_tails_per_program(3, 1, 4) == 3
    assert tiles.decode_tails_per_program(3, 2, 4) == 1
    assert tiles.decode_tails_per_program(1, 1, 16) == 0
    assert tiles.decode_tails_per_program(40, 2, 16) == 16
    assert tiles.decode_tails_per_program(5, 2, 1) == 1
    assert tiles.decode_tails_per_program(5, 0, 1) == 0


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_decode_full_precision_and_dtypes(dtype):
    """fp32 with mixed_precision=False is exact to ~1e-6; every dtype obeys the rule."""
    rng = np.random.default_rng(7)
    q, k, v, lens = make_inputs(rng, 2, 8, 2, 4, 384, 64, dtype, [200, 384])
    mixed = dtype != F32
    o, lse, _ = decode(q, k, v, lens, mixed_precision=mixed)
    err_o, err_lse = check_against_reference(q, k, v, lens, o, lse, mixed_precision=mixed)
    if dtype == F32:
        assert err_o < 1e-5 and err_lse < 1e-5


@pytest.mark.parametrize("scale", [0.0, -0.3, 2.0])
def test_decode_any_scale(scale):
    """The scale is folded into q, so masks stay valid for zero and negative scales."""
    rng = np.random.default_rng(3)
    q, k, v, lens = make_inputs(rng, 1, 4, 2, 3, 128, 32, F32, [77])
    o, lse, _ = decode(q, k, v, lens, scale=scale, mixed_precision=False)
    check_against_reference(q, k, v, lens, o, lse, scale=scale, mixed_precision=False)


def test_every_split_count_gives_the_same_answer():
    """Merge associativity: any split of the keys (1 split ... more splits than key rows) merges
    to the same result, within fp32 rounding (fp32 operands)."""
    rng = np.random.default_rng(11)
    q, k, v, lens = make_inputs(rng, 2, 4, 2, 2, 512, 32, F32, [500, 130])
    results = []
    for ns in (None, 1, 2, 3, 5, 16, 20):
        o, lse, t = decode(q, k, v, lens, num_splits=ns, mixed_precision=False)
        if ns is not None:
            assert t.num_splits == ns
        results.append((o, lse))
    ref_o, ref_lse = reference.decode(q, k, v, cache_lens=lens)
    for o, lse in results:
        assert reference.max_abs_err(o, results[0][0]) < 2e-6
        assert reference.max_abs_err(lse, results[0][1]) < 2e-6
        assert reference.max_abs_err(o, ref_o) < 2e-6


def test_split_partials_are_attention_over_their_keys():
    """Each split's partial (o, lse) is attention over exactly its key rows (a split with no
    committed row writes o = 0 and lse = -inf); the tail partial covers the rest of the
    committed prefix and the new tokens under the causal mask."""
    rng = np.random.default_rng(5)
    B, Hq, Hkv, T, S_max, D = 2, 4, 2, 2, 256, 32
    q, k, v, lens = make_inputs(rng, B, Hq, Hkv, T, S_max, D, F32, [200, 41])
    scale = 1.0 / math.sqrt(D)
    t = plan(q, k, lens, F32, num_splits=4)
    # each split s of every sequence as a work item (zero-filled, masked), including splits
    # past a sequence's end (which the host would not schedule): one launch per s
    o_part = np.zeros((B * Hq * T, t.num_splits + 1, D), np.float32)
    lse_part = np.zeros((B * Hq * T, t.num_splits + 1), np.float32)
    for s in range(t.num_splits):
        work = np.array([(b, s) for b in range(B)], dtype=np.int32)
        o_s, lse_s = run_phase1(q, k, v, lens, t, scale, F32, work=work, per_program=B)
        o_s, lse_s = o_s[:B * Hq * T], lse_s[:B * Hq * T]
        o_part[:, s], lse_part[:, s] = o_s[:, s], lse_s[:, s]
        o_part[:, -1], lse_part[:, -1] = o_s[:, -1], lse_s[:, -1]
    o_part = o_part.reshape(B, Hq, T, t.num_splits + 1, D)
    lse_part = lse_part.reshape(B, Hq, T, t.num_splits + 1)
    G = Hq // Hkv
    kx, vx = np.repeat(k, G, axis=1).astype(np.float64), np.repeat(v, G, axis=1).astype(
        np.float64)
    for b in range(B):
        full = (int(lens[b]) - T) // t.key_row * t.key_row    # positions in full key rows
        for s in range(t.num_splits):
            lo = s * t.split_keys
            hi = min(full, lo + t.split_keys)
            if hi <= lo:
                assert np.all(lse_part[b, :, :, s] == -np.inf)
                assert np.all(o_part[b, :, :, s] == 0)
                continue
            sc = scale * np.einsum("htd,hjd->htj", q[b].astype(np.float64), kx[b, :, lo:hi])
            m = sc.max(-1, keepdims=True)
            e = np.exp(sc - m)
            ref_o = np.einsum("htj,hjd->htd", e, vx[b, :, lo:hi]) / e.sum(-1, keepdims=True)
            ref_lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
            assert reference.max_abs_err(o_part[b, :, :, s], ref_o) < 1e-5
            assert reference.max_abs_err(lse_part[b, :, :, s], ref_lse) < 1e-5
        L = int(lens[b])
        sc = scale * np.einsum("htd,hjd->htj", q[b].astype(np.float64), kx[b, :, full:L])
        visible = np.ones((T, L - full), dtype=bool)
        visible[:, L - full - T:] = np.tril(np.ones((T, T), dtype=bool))
        sc = np.where(visible, sc, -np.inf)
        m = sc.max(-1, keepdims=True)
        e = np.exp(sc - m)
        ref_o = np.einsum("htj,hjd->htd", e, vx[b, :, full:L]) / e.sum(-1, keepdims=True)
        ref_lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
        assert reference.max_abs_err(o_part[b, :, :, -1], ref_o) < 1e-5
        assert reference.max_abs_err(lse_part[b, :, :, -1], ref_lse) < 1e-5


# --------------------------------------------------------------------------------------------
# masks among the new tokens
# --------------------------------------------------------------------------------------------
def test_seed_tree_reproduces_its_mask():
    assert np.array_equal(tree_from_parents(SEED_TREE_PARENTS), SEED_TREE_MASK)


@pytest.mark.parametrize("lens,S_max", [([9, 300], 300), ([9], 9), ([200], 257)])
def test_seed_tree_decode(lens, S_max):
    """Seed 003's 9-token tree: the kernel applies exactly that mask (and it differs from the
    causal result, so the mask is really used)."""
    rng = np.random.default_rng(9)
    q, k, v, lens = make_inputs(rng, len(lens), 8, 2, 9, S_max, 64, BF16, lens)
    o, lse, _ = decode(q, k, v, lens, tree=SEED_TREE_MASK)
    check_against_reference(q, k, v, lens, o, lse, tree=SEED_TREE_MASK)
    o_causal, _, _ = decode(q, k, v, lens)
    assert reference.max_abs_err(o, o_causal) > 1e-2


def test_random_tree_with_many_tokens():
    rng = np.random.default_rng(21)
    T = 40
    parents = [-1] + [int(rng.integers(0, t)) for t in range(1, T)]
    tree = tree_from_parents(parents)
    q, k, v, lens = make_inputs(rng, 2, 8, 2, T, 200, 32, BF16, [T, 180])
    o, lse, _ = decode(q, k, v, lens, tree=tree)
    check_against_reference(q, k, v, lens, o, lse, tree=tree)


# --------------------------------------------------------------------------------------------
# the merge kernel alone
# --------------------------------------------------------------------------------------------
def test_merge_kernel_matches_reference_merge():
    """Random partials, some splits empty (lse = -inf), one row with every split empty."""
    rng = np.random.default_rng(13)
    N, S, D = 200, 5, 48
    o_parts = rng.standard_normal((N, S, D)).astype(np.float32)
    lse_parts = (rng.standard_normal((N, S)) * 5).astype(np.float32)
    lse_parts[rng.random((N, S)) < 0.3] = -np.inf
    lse_parts[7] = -np.inf
    o_parts[lse_parts == -np.inf] = 0.0
    o, lse = run_merge(o_parts, lse_parts, None, F32)
    ref_o, ref_lse = reference.merge_partials(np.moveaxis(o_parts, 1, 0), lse_parts.T)
    assert reference.max_abs_err(o, ref_o) < 1e-5
    assert reference.max_abs_err(lse[:, 0], ref_lse) < 1e-5
    assert np.all(o[7] == 0) and lse[7, 0] == -np.inf


def test_merge_kernel_ignores_unused_split_slots():
    """Slots ``row_splits[r] .. S - 2`` were never written (garbage, here NaN and +inf); the
    last slot (the tail) always counts."""
    rng = np.random.default_rng(19)
    N, S, D = 130, 4, 16
    o_parts = rng.standard_normal((N, S, D)).astype(np.float32)
    lse_parts = rng.standard_normal((N, S)).astype(np.float32)
    used = rng.integers(0, S, size=N).astype(np.int32)
    for r in range(N):
        o_parts[r, used[r]:S - 1] = np.nan
        lse_parts[r, used[r]:S - 1] = np.inf
    o, lse = run_merge(o_parts, lse_parts, used, F32)
    clean_lse = lse_parts.copy()
    for r in range(N):
        clean_lse[r, used[r]:S - 1] = -np.inf
    ref_o, ref_lse = reference.merge_partials(np.moveaxis(np.nan_to_num(o_parts), 1, 0),
                                              clean_lse.T)
    assert reference.max_abs_err(o, ref_o) < 1e-5
    assert reference.max_abs_err(lse[:, 0], ref_lse) < 1e-5


def test_merge_kernel_single_partial():
    rng = np.random.default_rng(17)
    o_tail = rng.standard_normal((3, 1, 8)).astype(np.float32)
    lse_tail = rng.standard_normal((3, 1)).astype(np.float32)
    o, lse = run_merge(o_tail, lse_tail, None, BF16)
    assert o.dtype == BF16
    assert reference.max_abs_err(o, o_tail[:, 0]) < 1e-2
    assert reference.max_abs_err(lse, lse_tail) < 1e-6


def _merge_inputs(rng, N, S, D, used=False):
    """Random partials, some empty (lse = -inf); with ``used``, per-row split counts and
    garbage (NaN o, +inf lse) in the slots past them."""
    o_parts = rng.standard_normal((N, S, D)).astype(np.float32)
    lse_parts = (rng.standard_normal((N, S)) * 5).astype(np.float32)
    lse_parts[rng.random((N, S)) < 0.3] = -np.inf
    o_parts[lse_parts == -np.inf] = 0.0
    splits = None
    if used:
        splits = rng.integers(0, S, size=N).astype(np.int32)
        for r in range(N):
            o_parts[r, splits[r]:S - 1] = np.nan
            lse_parts[r, splits[r]:S - 1] = np.inf
    return o_parts, lse_parts, splits


@needs_measure
@pytest.mark.parametrize("N,S,D,used,out", [(200, 5, 48, True, BF16), (128, 1, 16, False, F32),
                                            (300, 3, 128, False, F16)])
def test_merge_kernel_nki_matches_legacy(N, S, D, used, out):
    """Through nki.* (kernel[1]: one program looping over the row tiles) the merge gives the
    legacy grid's outputs bit for bit (the same instructions per row tile; the masking of
    unused slots is a predicated copy instead of nl.where) and reads and writes the same HBM
    bytes."""
    import simulate

    o_parts, lse_parts, splits = _merge_inputs(np.random.default_rng(N + S), N, S, D, used)
    runs = {}
    for api in ("legacy", "nki"):
        with simulate.measure(target="trn2") as m:
            runs[api] = run_merge(o_parts, lse_parts, splits, out, api=api), m
        assert m.api == api
    (o0, lse0), m0 = runs["legacy"]
    (o1, lse1), m1 = runs["nki"]
    assert o1.dtype == out
    assert np.array_equal(np.asarray(o0, np.float32), np.asarray(o1, np.float32))
    assert np.array_equal(lse0, lse1)
    assert (m0.hbm_bytes_read, m0.hbm_bytes_written) == (m1.hbm_bytes_read, m1.hbm_bytes_written)


@needs_measure
@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_merge_kernel_program_flat_in_splits(api):
    """The sum over the partials is a compiled loop (their count grows with the cache length)
    and under nki.* so is the walk over the row tiles: the same program at 3 and 40 slots
    (a decode cache about 13x longer) and at 2 and 9 row tiles."""
    from host._launch import program_size

    sizes = set()
    for N, S in ((200, 3), (1100, 40)):
        o_parts, lse_parts, splits = _merge_inputs(np.random.default_rng(S), N, S, 64, True)
        grid = (tiles.ceil_div(N, tiles.DECODE_MERGE_ROWS),) if api == "legacy" else (1,)
        sizes.add(program_size(merge.flash_decode_merge_kernel.on(api), grid,
                               packed(o_parts, lse_parts), splits, out_dtype="bfloat16",
                               rows_per_program=tiles.DECODE_MERGE_ROWS))
    assert len(sizes) == 1, sizes


NKI_CASES = [
    # B, Hq, Hkv, T, S_max, D, cache_lens, dtype, options
    (1, 8, 2, 1, 2048, 64, [2000], BF16, {}),                          # packed GQA, 2 splits
    (3, 6, 3, 3, 301, 80, [3, 150, 301], F16, dict(num_splits=3)),     # ragged, key row 1
    (2, 4, 1, 4, 512, 64, [100, 512], BF16, dict(tree=True)),           # tree mask, T = 4
    (2, 8, 2, 2, 1024, 64, [700, 1024], BF16, dict(mods=True)),          # softcap, ALiBi, sinks
    (1, 2, 1, 1, 4096, 256, [4000], BF16, {}),                          # D = 256
    (1, 4, 4, 5, 1000, 128, [999], F32, {}),                            # fp32 -> bf16 operands
    (3, 16, 4, 3, 256, 64, [200, 256, 31], BF16, {}),                   # 144 rows: 2 merge tiles
    (6, 8, 2, 1, 512, 64, [512, 300, 77, 1, 480, 33], BF16, {}),      # tails beside splits
]


@needs_measure
@pytest.mark.parametrize("B,Hq,Hkv,T,S_max,D,lens,dtype,opts", NKI_CASES)
def test_decode_nki_matches_legacy(B, Hq, Hkv, T, S_max, D, lens, dtype, opts, monkeypatch):
    """host.flash_decode through nki.* (the split kernel as kernel[1], walking its chunk and
    tail programs in compiled loops) gives the legacy grid's o and LSE bit for bit and reads
    and writes the same HBM bytes."""
    import host
    import simulate
    from nki_kernels import nki as binding

    rng = np.random.default_rng(S_max + T)
    q, k, v, lens = make_inputs(rng, B, Hq, Hkv, T, S_max, D, dtype, lens)
    kw = {}
    if opts.get("num_splits"):
        kw["num_splits"] = opts["num_splits"]
    if opts.get("tree"):
        kw["tree_mask"] = np.tril(np.ones((T, T), bool)) & ~np.eye(T, k=-2, dtype=bool)
    if opts.get("mods"):
        kw.update(softcap=20.0, alibi_slopes=rng.uniform(0.01, 0.5, (Hq,)).astype(np.float32),
                  sinks=rng.standard_normal((Hq,)).astype(np.float32))
    runs = {}
    for api in ("legacy", "nki"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        with simulate.measure(target="trn2") as m:
            runs[api] = host.flash_decode(q, poisoned(k, lens), poisoned(v, lens),
                                          cache_lens=lens, return_lse=True, lnc=1, **kw), m
        assert m.api == api
    (o0, lse0), m0 = runs["legacy"]
    (o1, lse1), m1 = runs["nki"]
    assert o1.dtype == dtype and np.all(np.isfinite(np.asarray(o1, np.float32)))
    assert np.array_equal(np.asarray(o0, np.float32), np.asarray(o1, np.float32))
    assert np.array_equal(lse0, lse1)
    assert (m0.hbm_bytes_read, m0.hbm_bytes_written) == (m1.hbm_bytes_read, m1.hbm_bytes_written)


@needs_measure
@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_decode_program_flat_in_cache_length(api, monkeypatch):
    """The same programs for a 16K and a 32K cache (more splits and work items, the same
    compiled loops; both at least two splits of DECODE_MIN_SPLIT_KEYS, as a single work item
    is a program of one step): under nki.* the walks over the chunk and tail programs are
    compiled loops too."""
    import host
    import simulate
    from nki_kernels import nki as binding

    monkeypatch.setenv(binding.API_ENV_VAR, api)
    sizes = []
    for S in (16384, 32768):
        rng = np.random.default_rng(S)
        q = rng.standard_normal((1, 1, 1, 64)).astype(BF16)
        cache = rng.standard_normal((1, 1, S, 64)).astype(BF16)
        with simulate.measure(target="trn2") as m:
            host.flash_decode(q, cache, cache, cache_lens=np.array([S]), lnc=1)
        assert m.api == api
        sizes.append(m.program_instructions_per_kernel)
    assert sizes[0] == sizes[1], sizes


# --------------------------------------------------------------------------------------------
# IO: every valid KV byte exactly once, nothing past cache_lens
# --------------------------------------------------------------------------------------------
@needs_measure
@pytest.mark.parametrize("lens,S_max,T,tree", [
    ([1, 777, 1024], 1024, 1, False),     # n = 32: full rows, a partial row, an empty prefix
    ([5, 1000], 1000, 5, False),          # n = 8
    ([300], 301, 9, True),                # n = 1, tree mask
])
def test_io_exact(lens, S_max, T, tree):
    import simulate

    rng = np.random.default_rng(23)
    B, Hq, Hkv, D = len(lens), 8, 2, 64
    q, k, v, lens = make_inputs(rng, B, Hq, Hkv, T, S_max, D, BF16, lens)
    tree_mask = SEED_TREE_MASK if tree else None
    with simulate.measure(target="trn2") as m:
        o, lse, t = decode(q, poisoned(k, lens), poisoned(v, lens), lens, tree=tree_mask)
    kv_bytes = Hkv * D * BF16.itemsize * int(lens.sum())
    per = m.per_tensor
    assert per["k_cache"]["read"] == kv_bytes and per["v_cache"]["read"] == kv_bytes
    read, written = flash_decode_hbm_bytes(B, Hq, T, D, Hkv, lens, BF16.itemsize, t,
                                           tree_mask=tree)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)
    assert np.all(np.isfinite(o.astype(np.float32)))


@needs_measure
@pytest.mark.parametrize("n", [1, 3, 7, 128, 257, 2048])
def test_int_mod_is_exact_without_nl_mod(n):
    """masks.int_mod (the kernels' replacement of nl.mod): exact for x n < 2^22."""
    import simulate
    import simulate.language as snl
    from nki_kernels.attention import masks as M
    hi = (1 << 22) // n
    x = np.random.default_rng(n).integers(0, hi, (128, 64)).astype(np.float32)
    x[0, :3] = [0, hi - 1, n * (hi // n)]

    @simulate.jit
    def k(a):
        out = snl.ndarray((128, 64), dtype=snl.float32, buffer=snl.shared_hbm)
        snl.store(out, M.int_mod(snl.load(a), n))
        return out
    np.testing.assert_array_equal(k(x), np.mod(x, n))
