"""Block-sparse attention patterns: validation, the two layouts, and the standard patterns.

A block-sparse pattern says which 128 x 128 blocks of the score matrix exist (FlashAttention
section 3.3: Br x Bc blocks; here one partition tile of queries by :data:`BLOCK` keys). A block
that is absent is skipped entirely by the kernels: no K/V load, no matmul, no exponential.
Inside an active block the usual masks (causal, window, lengths) still apply.

Two layouts describe the same pattern:

- **dense**: a boolean array ``(B or 1, H or 1, ceil(Nq/128), ceil(Nk/128))``; entry
  ``[b, h, i, j]`` is True when query tile i attends to key block j.
- **index** (FlexAttention's BlockMask form): ``num_blocks`` int32 ``(B or 1, H or 1, nqt)``,
  the number of active key blocks of each query tile, and ``indices`` int32
  ``(B or 1, H or 1, nqt, max_blocks)``, their key-block indices in increasing order in the
  first ``num_blocks`` slots (the rest is ignored). ``max_blocks`` is the compile-time bound on
  the count: one compilation serves every pattern with at most that many blocks per tile.

Everything here is host-side bookkeeping on small integer arrays; no attention is computed.
"""
from __future__ import annotations

import heapq
from fractions import Fraction
from typing import NamedTuple, Optional, Tuple

import numpy as np

from host.validation import _is_array, _shape, check_int, describe, dtype_name
from nki_kernels import tiles as _tiles

#: Edge of a block (queries x keys), the kernels' natural tile.
BLOCK = _tiles.BLOCK_SPARSE_TILE

_INT_NAMES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


class BlockIndex(NamedTuple):
    """The index layout of a block-sparse pattern (see the module docstring)."""

    num_blocks: np.ndarray
    indices: np.ndarray

    @property
    def max_blocks(self) -> int:
        """The compile-time bound on active key blocks per query tile."""
        return int(self.indices.shape[-1])


class BlockSparsity(NamedTuple):
    """A validated pattern in both layouts, broadcast-ready to ``(B, H)``."""

    dense: np.ndarray  # bool (B or 1, H or 1, nqt, nkt)
    index: BlockIndex  # int32 layout of the same pattern
    runtime: bool = False  # given in the index form (a runtime pattern of a bound)

    @property
    def density(self) -> float:
        """Fraction of the (nqt x nkt) blocks that are active, averaged over batch and heads."""
        return float(self.dense.mean())


def block_grid(nq: int, nk: int) -> Tuple[int, int]:
    """``(ceil(nq / 128), ceil(nk / 128))``: the block grid of an Nq x Nk score matrix."""
    nq = check_int("nq", nq, minimum=1)
    nk = check_int("nk", nk, minimum=1)
    return _tiles.ceil_div(nq, BLOCK), _tiles.ceil_div(nk, BLOCK)


def _to_numpy(x):
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _check_lead_dims(name: str, shape, B: int, H: int, H_name: str) -> None:
    b, h = shape[0], shape[1]
    if b not in (1, B) or h not in (1, H):
        raise ValueError(
            f"{name}: leading dims must be (B or 1, {H_name} or 1) = ({B} or 1, {H} or 1), "
            f"got shape {shape}"
        )


def dense_to_index(dense, max_blocks: Optional[int] = None) -> BlockIndex:
    """Index layout of a dense boolean block mask ``(b, h, nqt, nkt)``.

    ``max_blocks`` defaults to the largest count in the pattern (at least 1); a smaller bound
    than the pattern needs is an error.
    """
    dense = np.asarray(dense, dtype=bool)
    counts = dense.sum(axis=-1)
    need = int(counts.max()) if counts.size else 0
    if max_blocks is None:
        max_blocks = max(need, 1)
    max_blocks = check_int("max_blocks", max_blocks, minimum=1)
    if need > max_blocks:
        raise ValueError(
            f"max_blocks: the pattern has up to {need} active key blocks per query tile, "
            f"got max_blocks={max_blocks}"
        )
    nkt = dense.shape[-1]
    # Stable argsort of "not active" puts active blocks first, in increasing key order.
    order = np.argsort(~dense, axis=-1, kind="stable")[..., :max_blocks]
    if order.shape[-1] < max_blocks:
        pad = np.zeros(order.shape[:-1] + (max_blocks - order.shape[-1],), order.dtype)
        order = np.concatenate([order, pad], axis=-1)
    slot = np.arange(max_blocks)
    indices = np.where(slot < counts[..., None], order, 0)
    assert indices.max(initial=0) < nkt
    return BlockIndex(counts.astype(np.int32), indices.astype(np.int32))


def index_to_dense(index: BlockIndex, nkt: int) -> np.ndarray:
    """Dense boolean layout ``(b, h, nqt, nkt)`` of a validated index layout."""
    num, idx = np.asarray(index.num_blocks), np.asarray(index.indices)
    dense = np.zeros(num.shape + (nkt,), dtype=bool)
    slot = np.arange(idx.shape[-1])
    live = slot < num[..., None]
    b, h, i, s = np.nonzero(live)
    dense[b, h, i, idx[b, h, i, s]] = True
    return dense


def _check_dense(block_mask, B, H, nqt, nkt, H_name) -> np.ndarray:
    name = "block_mask"
    dname = dtype_name(block_mask)
    if dname != "bool":
        raise TypeError(f"{name}: expected a boolean array, got dtype {dname}")
    shape = _shape(block_mask)
    if len(shape) != 4:
        raise ValueError(
            f"{name}: expected a 4-D array of shape (B or 1, {H_name} or 1, ceil(Nq/{BLOCK}), "
            f"ceil(Nk/{BLOCK})), got a {len(shape)}-D array of shape {shape}"
        )
    _check_lead_dims(name, shape, B, H, H_name)
    if shape[2:] != (nqt, nkt):
        raise ValueError(
            f"{name}: expected {BLOCK} x {BLOCK} blocks, i.e. trailing dims (ceil(Nq/{BLOCK}), "
            f"ceil(Nk/{BLOCK})) = ({nqt}, {nkt}), got {shape[2:]} (shape {shape})"
        )
    return np.array(_to_numpy(block_mask), dtype=bool, copy=True)


def _check_index(block_mask, B, H, nqt, nkt, H_name) -> BlockIndex:
    num, idx = block_mask
    for name, x, nd in (("block_mask.num_blocks", num, 3), ("block_mask.indices", idx, 4)):
        if not _is_array(x):
            raise TypeError(f"{name}: expected an integer array, got {describe(x)}")
        if dtype_name(x) not in _INT_NAMES:
            raise TypeError(f"{name}: expected an integer array, got dtype {dtype_name(x)}")
        if len(_shape(x)) != nd:
            raise ValueError(f"{name}: expected a {nd}-D array, got shape {_shape(x)}")
        _check_lead_dims(name, _shape(x), B, H, H_name)
    num, idx = _to_numpy(num).astype(np.int64), _to_numpy(idx).astype(np.int64)
    if num.shape[2] != nqt or idx.shape[2] != nqt:
        raise ValueError(
            f"block_mask: expected one entry per query tile, ceil(Nq/{BLOCK}) = {nqt}; got "
            f"num_blocks {num.shape} and indices {idx.shape}"
        )
    if num.shape[:2] != idx.shape[:2]:
        raise ValueError(
            f"block_mask: num_blocks {num.shape} and indices {idx.shape} must share their "
            f"leading (batch, head) dims"
        )
    max_blocks = idx.shape[3]
    if max_blocks < 1:
        raise ValueError("block_mask.indices: the last dim (max_blocks) must be >= 1")
    bad = np.argwhere((num < 0) | (num > min(max_blocks, nkt)))
    if bad.size:
        at = tuple(int(x) for x in bad[0])
        raise ValueError(
            f"block_mask.num_blocks: values must be in [0, min(max_blocks={max_blocks}, "
            f"nkt={nkt})], got {int(num[at])} at index {at}"
        )
    live = np.arange(max_blocks) < num[..., None]
    bad = np.argwhere(live & ((idx < 0) | (idx >= nkt)))
    if bad.size:
        at = tuple(int(x) for x in bad[0])
        raise ValueError(
            f"block_mask.indices: key-block index out of range [0, {nkt}) at {at}: {int(idx[at])}"
        )
    # Active indices must be strictly increasing (each block once, in key order).
    step_ok = np.diff(idx, axis=-1) > 0
    bad = np.argwhere(live[..., 1:] & ~step_ok)
    if bad.size:
        at = tuple(int(x) for x in bad[0])
        raise ValueError(
            f"block_mask.indices: the active key blocks of a query tile must be strictly "
            f"increasing; not so at {at[:3]}: {idx[at[:3]][: int(num[at[:3]])].tolist()}"
        )
    return BlockIndex(num.astype(np.int32), np.where(live, idx, 0).astype(np.int32))


def check_block_mask(block_mask, B: int, H: int, Nq: int, Nk: int, *,
                     H_name: str = "Hq") -> Optional[BlockSparsity]:
    """Validate a block-sparse pattern given densely or as ``(num_blocks, indices)``.

    Parameters
    ----------
    block_mask : None, bool array, or a ``(num_blocks, indices)`` pair (e.g. :class:`BlockIndex`)
        See the module docstring. NumPy arrays or torch tensors.
    B, H : int
        Batch size and head count the pattern must broadcast to.
    Nq, Nk : int
        Query and key lengths (the grid is ``ceil(N / 128)`` each way).
    H_name : str
        Name of ``H`` in messages.

    Returns
    -------
    BlockSparsity or None
        Both layouts of the pattern (None when ``block_mask`` is None).
    """
    if block_mask is None:
        return None
    nqt, nkt = block_grid(Nq, Nk)
    limit = _tiles.BSP_PAD_FIRST - 2 * BLOCK
    if max(Nq, Nk) > limit:
        raise ValueError(f"block_mask: block-sparse attention supports sequences of at most "
                         f"{limit} positions (fp32 position tables); got Nq={Nq}, Nk={Nk}")
    if isinstance(block_mask, tuple) and len(block_mask) == 2:
        index = _check_index(block_mask, B, H, nqt, nkt, H_name)
        return BlockSparsity(index_to_dense(index, nkt), index, True)
    if not _is_array(block_mask):
        raise TypeError(
            "block_mask: expected None, a boolean array (B or 1, H or 1, nqt, nkt) or a "
            f"(num_blocks, indices) pair, got {describe(block_mask)}"
        )
    dense = _check_dense(block_mask, B, H, nqt, nkt, H_name)
    return BlockSparsity(dense, dense_to_index(dense))


def expand(dense, Nq: int, Nk: int) -> np.ndarray:
    """Element mask ``(b, h, Nq, Nk)`` of a dense block mask (True = the block is active)."""
    dense = np.asarray(dense, dtype=bool)
    full = np.repeat(np.repeat(dense, BLOCK, axis=-2), BLOCK, axis=-1)
    return full[..., :Nq, :Nk]


# --------------------------------------------------------------------------------------------
# Standard patterns (dense, shape (1, 1, nqt, nkt))
# --------------------------------------------------------------------------------------------


def butterfly(nqt: int, nkt: int) -> np.ndarray:
    """The flat butterfly pattern: block (i, j) is active when ``i == j`` or ``i XOR j`` is a
    power of two (the union of the butterfly factors' supports, as in the block-sparse
    experiments of the FlashAttention paper). About ``(1 + log2 n) / n`` dense."""
    nqt = check_int("nqt", nqt, minimum=1)
    nkt = check_int("nkt", nkt, minimum=1)
    x = np.bitwise_xor(np.arange(nqt)[:, None], np.arange(nkt)[None, :])
    active = (x == 0) | ((x & (x - 1)) == 0)
    return active[None, None]


def local_global(nqt: int, nkt: int, *, window_blocks: int = 1,
                 global_blocks: int = 1) -> np.ndarray:
    """Sliding window plus global tokens (Longformer/BigBird style): query tile i sees key
    blocks within ``window_blocks`` of the diagonal, the first ``global_blocks`` key blocks,
    and the first ``global_blocks`` query tiles see every key block."""
    nqt = check_int("nqt", nqt, minimum=1)
    nkt = check_int("nkt", nkt, minimum=1)
    window_blocks = check_int("window_blocks", window_blocks, minimum=0)
    global_blocks = check_int("global_blocks", global_blocks, minimum=0)
    i = np.arange(nqt)[:, None]
    j = np.arange(nkt)[None, :]
    active = (np.abs(i - j) <= window_blocks) | (j < global_blocks) | (i < global_blocks)
    return active[None, None]


def fixed_density(nqt: int, nkt: int, density: float) -> np.ndarray:
    """A pattern with exactly ``max(1, round(density * nkt))`` active key blocks per query tile,
    spread evenly and rotated by the tile index so every key block is used about equally
    (the sweep pattern of ``benchmarks/block_sparse.py``)."""
    nqt = check_int("nqt", nqt, minimum=1)
    nkt = check_int("nkt", nkt, minimum=1)
    if not isinstance(density, (int, float, np.floating)) or not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density: expected a number in (0, 1], got {describe(density)}")
    per_row = max(1, int(round(float(density) * nkt)))
    stride = nkt / per_row
    cols = (np.floor(np.arange(per_row) * stride).astype(np.int64)[None, :]
            + np.arange(nqt)[:, None]) % nkt
    active = np.zeros((nqt, nkt), dtype=bool)
    active[np.arange(nqt)[:, None], cols] = True
    return active[None, None]


def band_strided(nqt: int, nkt: int, *, stride: int = 8) -> np.ndarray:
    """A local band plus strided global blocks: query tile i sees key blocks ``i - 1 .. i +
    1`` and key block ``stride floor(i / stride)`` (every ``stride``-th key block is global for
    the ``stride`` query tiles from it): at most 4 key blocks per query tile, fewer where
    the band holds the strided block or meets an edge (square, ``stride`` 8: 0.115 dense at
    32 x 32 blocks, N = 4K; 0.029 at 16K). The band+strided rows of
    ``benchmarks/block_sparse.py``."""
    nqt = check_int("nqt", nqt, minimum=1)
    nkt = check_int("nkt", nkt, minimum=1)
    stride = check_int("stride", stride, minimum=1)
    i = np.arange(nqt)[:, None]
    j = np.arange(nkt)[None, :]
    active = (np.abs(i - j) <= 1) | (j == stride * (i // stride))
    return active[None, None]


# --------------------------------------------------------------------------------------------
# The kernels' tables
# --------------------------------------------------------------------------------------------


class KernelTables(NamedTuple):
    """What a block-sparse kernel reads: its rows (query tiles in the forward, key blocks in
    the backward's dK/dV sweep) in processing order, with their active blocks.

    ``meta`` float32 ``(b, h, n, 2 + trip_max)``: at order position r, ``[first, count,
    first_0, ..., first_{trip_max - 1}]`` -- the row's first position (``128 x`` its tile
    index), its count of active blocks and the first positions of those blocks; slots past
    ``count`` hold :data:`nki_kernels.tiles.BSP_PAD_FIRST`, beyond every sequence, so the
    kernels skip and mask them with the length comparisons. Positions are exact in fp32 (the
    kernels broadcast the row to every partition with a matmul).
    ``classes``: ``((first position, positions, trip, exact), ...)``, at most
    :data:`nki_kernels.tiles.BSP_MAX_CLASSES`: a loop over positions whose inner loop runs
    ``trip`` slots; ``exact`` when every row of the class has exactly ``trip`` blocks (no slot
    is masked). Compile-time: the kernel's program depends on ``classes`` and the shapes only.
    ``shared`` (forward, compile-time patterns; zeros otherwise): per class, how many leading
    slots list the same key blocks, in the same order, in every query tile of each kernel group
    (:func:`kernel_tables`' ``share``): the kernel loads those blocks once per group.
    ``natural``: per class, whether its order position p holds row p in every ``(b, h)``
    (the forward then loads and stores a query tile's rows at positions affine in its loop
    indices, not through indirect DMAs). ``shared_runtime``: ``shared`` is a bound, each group's
    first ``shared`` slots its common blocks then padding (:func:`shared_bound_tables`).
    """

    meta: np.ndarray
    classes: Tuple[Tuple[int, int, int, bool], ...]
    shared: Tuple[int, ...]
    natural: Optional[Tuple[bool, ...]] = None
    shared_runtime: bool = False


def _cut(profile: np.ndarray, max_classes: int):
    """Cut a non-increasing count profile into at most ``max_classes`` runs of positions,
    merging greedily the adjacent runs whose merge adds the fewest padding slots."""
    runs = []
    for pos, c in enumerate(profile.tolist()):
        if runs and runs[-1][2] == c:
            runs[-1][1] += 1
        else:
            runs.append([pos, 1, c])
    while len(runs) > max_classes:
        # merging run i + 1 into run i pads run i + 1 up to run i's trip
        costs = [runs[i + 1][1] * (runs[i][2] - runs[i + 1][2]) for i in range(len(runs) - 1)]
        i = int(np.argmin(costs))
        runs[i][1] += runs[i + 1][1]
        del runs[i + 1]
    return [(a, n, t) for a, n, t in runs]


def _grouped(sets, a: int, m: int, g: int, greedy: bool):
    """The forward kernel's groups of the rows ``a .. a + m - 1`` of a run, ``g`` at a time
    (and a remainder group), in every ``(b, h)`` of ``sets`` (``(b, h, rows, blocks)`` bool:
    each row's active blocks): ``[(b, h, first position, rows, common blocks), ...]``.
    ``greedy``: each group takes the rows whose blocks overlap most with it, else the rows in
    their order."""
    b, h = sets.shape[:2]
    groups = []
    for x in range(b):
        for y in range(h):
            rest = list(range(a, a + m))
            pos = a
            while rest:
                grp = [rest.pop(0)]
                inter = sets[x, y, grp[0]].copy()
                for _ in range(min(g, len(rest) + 1) - 1):
                    k = int(np.argmax((sets[x, y, rest] & inter).sum(axis=1))) if greedy else 0
                    grp.append(rest.pop(k))
                    inter &= sets[x, y, grp[-1]]
                groups.append((x, y, pos, grp, np.flatnonzero(inter)))
                pos += len(grp)
    return groups


def _share_blocks(order, num_o, idx_o, runs, size: int):
    """Group the rows of every run (class) as the forward kernel does -- consecutive groups of
    ``min(size, rows)`` and a remainder group -- choosing greedily, for each group, the rows
    whose active blocks overlap most with the group's (FlashAttention's K/V reuse across the
    query tiles of a group, applied to the pattern's structure), unless the rows in their
    order share as many (a run then keeps its order), and list each group's common blocks
    first in its rows. Returns ``(order, num_o, idx_o, shared)``: the new processing
    order, counts and slot lists of every ``(b, h)``, and per run the count of leading slots
    every group shares (the least over the groups and heads)."""
    b, h, n = num_o.shape
    trip = idx_o.shape[-1]
    live = np.arange(trip) < num_o[..., None]
    width = int(idx_o[live].max()) + 1 if live.any() else 1
    sets = np.zeros((b, h, n, width), dtype=bool)
    bi, hi, ri, si = np.nonzero(live)
    sets[bi, hi, ri, idx_o[bi, hi, ri, si]] = True
    perm = np.empty((b, h, n), dtype=np.int64)
    new_idx = np.zeros_like(idx_o)
    shared = []
    for a, m, _t in runs:
        g = min(size, m)
        # the greedy grouping, unless the rows in their order share as many slots: the forward
        # then keeps the order (natural order: plain loads and stores of a tile's rows)
        kept, greedy = _grouped(sets, a, m, g, False), _grouped(sets, a, m, g, True)
        sh_kept, sh = (min(len(c) for *_, c in grp) for grp in (kept, greedy))
        groups = kept if sh_kept >= sh else greedy
        sh = max(sh_kept, sh)
        shared.append(sh)
        for x, y, pos, members, _ in groups:
            perm[x, y, pos:pos + len(members)] = members
        for x, y, pos, members, blocks in groups:
            sz = len(members)
            for r in range(pos, pos + sz):
                src = perm[x, y, r]
                own = idx_o[x, y, src, :num_o[x, y, src]]
                own = own[~np.isin(own, blocks[:sh])]
                new_idx[x, y, r, :num_o[x, y, src]] = np.concatenate([blocks[:sh], own])
    num_new = np.take_along_axis(num_o, perm, axis=-1)
    return np.take_along_axis(order, perm, axis=-1), num_new, new_idx, tuple(shared)


def kernel_tables(index: BlockIndex, *, sort: bool, group: int = 1,
                  max_classes: Optional[int] = None, share: int = 1) -> KernelTables:
    """Tables of a validated index layout ``(b, h, rows, max_blocks)`` for a block-sparse
    kernel.

    ``sort=True`` (a compile-time pattern) orders the rows of every ``(b, h)`` by decreasing
    count and cuts them into classes with tight trip counts; ``sort=False`` (a runtime pattern:
    one compilation for every pattern of the bound) keeps the natural order in one class whose
    trip is ``max_blocks``. ``group``: rows must be processed in the same order by ``group``
    consecutive heads (the query heads of a kv group, whose dK/dV one loop accumulates), so
    the order of a group follows the largest count among its heads. ``share > 1`` (the
    forward's compile-time tables: ``tiles.BSP_GROUP_TILES``) groups the rows of each class
    ``share`` at a time by the blocks they have in common and lists those first
    (``KernelTables.shared``).
    """
    num = np.asarray(index.num_blocks, dtype=np.int64)
    idx = np.asarray(index.indices, dtype=np.int64)
    b, h, n = num.shape
    max_classes = _tiles.BSP_MAX_CLASSES if max_classes is None else max_classes
    if h % group:
        raise ValueError(f"group: {group} must divide the head count {h} of the pattern")
    if share > 1 and group > 1:
        raise ValueError(f"share: grouping rows by shared blocks ({share}) needs group=1, got "
                         f"group={group}")
    if sort:
        key = num.reshape(b, h // group, group, n).max(axis=2)          # (b, h/group, n)
        order_g = np.argsort(-key, axis=-1, kind="stable")
        order = np.repeat(order_g, group, axis=1)                     # (b, h, n)
        profile = np.take_along_axis(key, order_g, axis=-1).max(axis=(0, 1))
        runs = _cut(profile, max_classes)
    else:
        order = np.broadcast_to(np.arange(n), (b, h, n))
        runs = [(0, n, int(idx.shape[-1]))]
    trip_max = max(1, max(t for _, _, t in runs))
    num_o = np.take_along_axis(num, order, axis=-1)
    idx_o = np.take_along_axis(idx, order[..., None], axis=2)[..., :trip_max]
    if idx_o.shape[-1] < trip_max:
        idx_o = np.concatenate(
            [idx_o, np.zeros(idx_o.shape[:-1] + (trip_max - idx_o.shape[-1],), np.int64)], -1)
    shared = (0,) * len(runs)
    if sort and share > 1:
        order, num_o, idx_o, shared = _share_blocks(order, num_o, idx_o, runs, share)
    live = np.arange(trip_max) < num_o[..., None]
    block = _tiles.BLOCK_SPARSE_TILE
    firsts = np.where(live, idx_o * block, _tiles.BSP_PAD_FIRST)
    meta = np.concatenate([order[..., None] * block, num_o[..., None], firsts], -1)
    classes, natural = [], []
    for a, m, t in runs:
        counts = num_o[..., a:a + m]
        classes.append((a, m, t, bool((counts == t).all())))
        natural.append(bool((order[..., a:a + m] == np.arange(a, a + m)).all()))
    return KernelTables(np.ascontiguousarray(meta, dtype=np.float32), tuple(classes), shared,
                        tuple(natural))


def shared_bound_tables(index: BlockIndex, size: int) -> KernelTables:
    """Tables of a runtime pattern (the index form, one compilation per ``max_blocks`` bound
    M) whose query tiles are grouped ``size`` at a time by the key blocks they have in
    common, as :func:`kernel_tables`' ``share`` does for a compile-time pattern, but with
    every group's common blocks kept (not the least count over the groups): each row has
    ``2 M`` slots, the first M its group's common blocks (then padding), the last M its own
    other blocks (then padding), and its count column is ``M +`` its own count (every slot
    past it is padding). One class ``(0, rows, 2 M, False)`` whose ``shared`` is M: the
    program depends on the bound only, the contents on the pattern (the forward's
    ``shared_runtime``: under nki.* the group's common and own sweeps run only their steps
    below the table's counts). Groups as the forward's: consecutive ``min(size, rows)`` and a
    remainder; rows taken greedily by overlap unless the natural order shares as many
    blocks in all (either way the class is not ``natural``: its rows are gathered)."""
    num = np.asarray(index.num_blocks, dtype=np.int64)
    idx = np.asarray(index.indices, dtype=np.int64)
    b, h, n = num.shape
    m = idx.shape[-1]
    live = np.arange(m) < num[..., None]
    sets = np.zeros((b, h, n, int(idx[live].max()) + 1 if live.any() else 1), dtype=bool)
    bi, hi, ri, si = np.nonzero(live)
    sets[bi, hi, ri, idx[bi, hi, ri, si]] = True
    g = min(size, n)
    kept, greedy = _grouped(sets, 0, n, g, False), _grouped(sets, 0, n, g, True)
    total = [sum(len(c) for *_, c in grp) for grp in (kept, greedy)]
    groups = kept if total[0] >= total[1] else greedy
    order = np.empty((b, h, n), dtype=np.int64)
    slots = np.full((b, h, n, 2 * m), -1, dtype=np.int64)
    count = np.empty((b, h, n), dtype=np.int64)
    for x, y, pos, members, common in groups:
        for r, src in enumerate(members, pos):
            own = idx[x, y, src, :num[x, y, src]]
            own = own[~np.isin(own, common)]
            order[x, y, r] = src
            slots[x, y, r, :len(common)] = common
            slots[x, y, r, m:m + len(own)] = own
            count[x, y, r] = m + len(own)
    block = _tiles.BLOCK_SPARSE_TILE
    firsts = np.where(slots >= 0, slots * block, _tiles.BSP_PAD_FIRST)
    meta = np.concatenate([order[..., None] * block, count[..., None], firsts], -1)
    # never natural, even where the rows keep their order: that would make the program
    # depend on the pattern (plain loads and stores instead of gathers and scatters)
    return KernelTables(np.ascontiguousarray(meta, dtype=np.float32), ((0, n, 2 * m, False),),
                        (m,), (False,), True)


class LaunchTables(NamedTuple):
    """The tables of one block-sparse launch: the forward's (query tiles) and the backward's
    key-major ones (key blocks, one order per kv group and chunk of query tiles), and with
    several chunks ``acc_k``, what the nki.* backward does with each key block's dK, dV
    partial sums per chunk (:func:`_accumulator_steps`), and with the backward's query tiles
    reordered (``launch_tables`` ``reorder``) ``order_q`` and ``slots_k`` (:func:`_ordered`),
    else None."""

    q: KernelTables
    k: KernelTables
    runtime: bool
    acc_k: Optional[np.ndarray] = None
    order_q: Optional[np.ndarray] = None
    slots_k: Optional[np.ndarray] = None


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _chunk_columns(dense_t: np.ndarray, chunk_tiles: int,
                   position: Optional[np.ndarray] = None) -> np.ndarray:
    """``(b, h, chunks, nkt, nqt)``: the transposed pattern ``(b, h, nkt, nqt)`` restricted,
    per chunk c, to its query tiles: those at processing positions ``c chunk_tiles .. (c + 1)
    chunk_tiles - 1``, ``position`` ``(b or 1, h or 1, nqt)`` giving each tile's (None: its
    index, the natural order)."""
    nqt = dense_t.shape[-1]
    chunks = _tiles.ceil_div(nqt, chunk_tiles)
    if position is None:
        position = np.arange(nqt)[None, None]
    chunk_of = position // chunk_tiles                                  # (b, h, nqt)
    keep = chunk_of[:, :, None, :] == np.arange(chunks)[None, None, :, None]
    return dense_t[:, :, None] & keep[:, :, :, None, :]


def _forward_tables(sparsity: BlockSparsity, keep_order: bool,
                    share_runtime: bool) -> KernelTables:
    """The forward's tables (:func:`launch_tables`, ``keep_order``, ``share_runtime``)."""
    if share_runtime and sparsity.runtime and sparsity.index.max_blocks:
        return shared_bound_tables(sparsity.index, _tiles.BSP_GROUP_TILES)
    num = np.asarray(sparsity.index.num_blocks, dtype=np.int64)
    pads = num.size * sparsity.index.max_blocks - int(num.sum())
    natural = sparsity.runtime or (keep_order
                                   and pads <= _tiles.BSP_NATURAL_MAX_PADDING * num.sum())
    return kernel_tables(sparsity.index, sort=not natural,
                         share=1 if keep_order else _tiles.BSP_GROUP_TILES)


def launch_tables(sparsity: BlockSparsity, *, group: int, backward: bool = True,
                  forward: bool = True, keep_order: bool = False,
                  share_runtime: bool = False,
                  chunk_tiles: Optional[int] = None, reorder: bool = False,
                  head_dim: int = 128, kv_itemsize: int = 2) -> LaunchTables:
    """Tables for the kernels of a validated pattern.

    A pattern given densely is a compile-time pattern: rows are sorted into tight classes.
    One given in the index form (``sparsity.runtime``) keeps one class with the pattern's own
    ``max_blocks`` bound, so the forward compiles once per bound. The backward's key-major
    sweep then bounds each key block's query tiles by the next power of two of the pattern's
    largest column count in a chunk (few recompilations, at most 2x padding). ``group``: query
    heads per kv head (the key-major order is shared within a kv group). ``chunk_tiles``: the
    backward's query tiles per chunk (``tiles.bsp_bwd_chunks``; None: one chunk of all): its
    table lists, per chunk, each key block's query tiles of that chunk -- rows ``c nkt ..`` of
    ``k.meta`` are chunk c's -- in one order per kv group common to every chunk (the kernel
    keeps a block's partial dK, dV at its order position), under classes common to every
    chunk and kv group. ``forward`` / ``backward`` False: that kernel's tables are None (the
    backward reads only its own). ``keep_order``
    (``nki_kernels.attention.block_sparse.keeps_order``): the forward's query tiles are not
    grouped by common key blocks, and a dense pattern's stay in natural order too, in one
    class of the largest count, unless that pads more than
    ``tiles.BSP_NATURAL_MAX_PADDING`` of its blocks (sorted classes then). ``share_runtime``
    (``nki_kernels.attention.block_sparse.shares_at_runtime``): a pattern in the index form
    takes grouped tables of bounded shape (:func:`shared_bound_tables`), so the forward
    gathers a group's common blocks once and still compiles once per bound. ``reorder`` (the
    nki.* backward with several chunks): process each kv group's query tiles in
    :func:`chunk_order` where that plan moves fewer HBM bytes (:func:`backward_plan_bytes`
    at ``head_dim`` and K/V elements of ``kv_itemsize`` bytes, plus the tables'), in the
    index form always in the reordered tables (:func:`_reordered`).
    """
    nqt = sparsity.dense.shape[-2]
    if not (forward or backward):
        raise ValueError("forward, backward: both False asks for no tables; allowed: at least "
                         "one True")
    if keep_order and not forward:
        raise ValueError("keep_order: orders the forward's tables, but forward=False")
    if share_runtime and (keep_order or not forward):
        raise ValueError(f"share_runtime: groups the forward's tables, but keep_order="
                         f"{keep_order}, forward={forward}; allowed: keep_order=False, "
                         f"forward=True")
    if chunk_tiles is not None:
        if not backward:
            raise ValueError("chunk_tiles: chunks the backward's tables, but backward=False")
        _tiles.check_chunk_tiles(chunk_tiles, nqt)
    heads, runtime = sparsity.dense.shape[1], sparsity.runtime
    q = _forward_tables(sparsity, keep_order, share_runtime) if forward else None
    if not backward:
        return LaunchTables(q, None, runtime)
    g = group if heads > 1 else 1
    ct = nqt if chunk_tiles is None else chunk_tiles
    k, acc_k = _key_tables(sparsity, g, ct)
    tables = LaunchTables(q, k, runtime, acc_k)
    if reorder and ct < nqt:
        return _reordered(tables, sparsity, g, ct, head_dim, kv_itemsize)
    return tables


def _key_tables(sparsity: BlockSparsity, g: int, chunk_tiles: int,
                position: Optional[np.ndarray] = None):
    """``(k, acc_k)`` of :class:`LaunchTables` for the backward (:func:`launch_tables`; ``g``
    query heads per table group) in chunks of ``chunk_tiles`` query tiles at processing
    positions ``position`` (``(b, heads, nqt)``; None: natural order)."""
    heads, runtime = sparsity.dense.shape[1], sparsity.runtime
    nqt = sparsity.dense.shape[-2]
    dense_t = np.swapaxes(sparsity.dense, -1, -2)
    b, _, nkt, _ = dense_t.shape
    per = _chunk_columns(dense_t, chunk_tiles, position)
    chunks = per.shape[2]
    # (b, kv groups, chunks, members, nkt, nqt) -> heads: each kv group's chunks and members
    # one table group (one order)
    folded = per.reshape(b, heads // g, g, chunks, nkt, nqt).transpose(0, 1, 3, 2, 4, 5)
    folded = folded.reshape(b, heads * chunks, nkt, nqt)
    if runtime:
        need = int(folded.sum(axis=-1).max()) if folded.size else 0
        bound = min(nqt, _pow2_at_least(max(need, 1)))
        k = kernel_tables(dense_to_index(folded, bound), sort=False)
    else:
        k = kernel_tables(dense_to_index(folded), sort=True, group=g * chunks)
    w = k.meta.shape[-1]
    meta = k.meta.reshape(b, heads // g, chunks, g, nkt, w)
    # a key block no query head of the group meets in a chunk before the last (a row the
    # common order still lists) is pushed past every sequence: the kernel reads nothing for
    # it (the last chunk writes every listed block's dK, dV)
    met = meta[..., 1].max(axis=3) > 0                      # (b, kv groups, chunks, nkt)
    acc_k = _accumulator_steps(met) if chunks > 1 else None
    empty = meta[:, :, :-1, :, :, 1].max(axis=3, keepdims=True) == 0
    meta[:, :, :-1, :, :, 0] = np.where(empty, _tiles.BSP_PAD_FIRST, meta[:, :, :-1, :, :, 0])
    meta = meta.transpose(0, 1, 3, 2, 4, 5).reshape(b, heads, chunks * nkt, w)
    return k._replace(meta=np.ascontiguousarray(meta)), acc_k


def _accumulator_steps(met: np.ndarray) -> np.ndarray:
    """fp32 0/1 ``(b, kv groups, chunks nkt, 4)``: per chunk and order position (``met``:
    whether some query head of the group meets the key block in the chunk, ``(b, kv groups,
    chunks, nkt)``) what the nki.* backward (``block_sparse_bwd``) does with the block's fp32
    dK, dV sums. The block's last meeting chunk finishes it (stores dK, dV), the last chunk
    any block no chunk meets (zeros); an earlier meeting chunk writes its sums (column 0) or,
    after another, adds to them (1); the finishing chunk reads them back (column 2: another
    met the block before) or not (3). A block met by one chunk never leaves it."""
    later = np.flip(np.cumsum(np.flip(met, 2), axis=2), 2) - met > 0     # met after
    seen = np.cumsum(met, axis=2) - met > 0                               # met before
    finish = met & ~later
    finish[:, :, -1] |= ~met.any(axis=2)
    steps = [met & ~seen & ~finish, met & seen & ~finish, finish & seen, finish & ~seen]
    out = np.stack(steps, -1).reshape(met.shape[0], met.shape[1], -1, 4)
    return np.ascontiguousarray(out, dtype=np.float32)


# --------------------------------------------------------------------------------------------
# The backward's chunk order (nki.*, several chunks)
# --------------------------------------------------------------------------------------------


def backward_plan_bytes(k: KernelTables, *, group: int, chunks: int, head_dim: int,
                        kv_itemsize: int) -> int:
    """HBM bytes of the nki.* block-sparse backward (``block_sparse_bwd``) in ``chunks`` > 1
    chunks that depend on how its query tiles fall into chunks, summed over the slices
    ``(b, kv group)`` of its key-major tables ``k`` (:func:`launch_tables`; ``group``: query
    heads per kv head), whole 128-key blocks (no lengths): K and V gathered once per key
    block a chunk meets -- in the last chunk, with per-head tables of a GQA group, every
    block of a class with slots -- and the fp32 dK, dV partial sums, ``2 (2 m - 2)`` ``[128,
    head_dim]`` transfers per block that ``m >= 2`` chunks meet (each written once, read and
    written ``m - 2`` times, read once)."""
    b, heads, rows, _ = k.meta.shape
    group = group if heads > 1 else 1
    nkt = rows // chunks
    counts = k.meta[..., 1].reshape(b, heads // group, group, chunks, nkt)
    met = (counts > 0).any(axis=2)                              # (b, kv groups, chunks, nkt)
    if heads > 1 and group > 1:
        last = met.shape[0] * met.shape[1] * sum(m for _, m, t, _ in k.classes if t)
    else:
        last = int(met[:, :, -1].sum())
    m = met.sum(axis=2)
    scratch = int((2 * (2 * m - 2) * (m >= 2)).sum())
    kv = int(met[:, :, :-1].sum()) + last
    return (2 * kv * kv_itemsize + 4 * scratch) * BLOCK * head_dim


def chunk_order(sets: np.ndarray, chunk_tiles: int) -> np.ndarray:
    """A processing order of the query tiles (``sets``: ``(nqt, nkt)`` bool, each tile's key
    blocks, the union over a kv group's heads) whose consecutive chunks of ``chunk_tiles``
    meet few key blocks, and few of them several chunks: each chunk is filled greedily with
    the tile that shares most blocks with the chunk's so far (then: that adds fewest, then
    the lowest index). The last tile (the partial one, if any) stays last: the kernel
    stages and stores it at static rows. ``(nqt,)`` int, a permutation."""
    nqt, nkt = sets.shape
    s = sets.astype(np.float32)
    size = s.sum(axis=1)
    last = nqt - 1
    left = np.ones(nqt, dtype=bool)
    left[last] = False
    order = []
    for c0 in range(0, nqt, chunk_tiles):
        n = min(chunk_tiles, nqt - c0)
        final = c0 + n == nqt
        union = s[last].copy() if final else np.zeros(nkt, dtype=np.float32)
        for _ in range(n - final):
            rest = np.flatnonzero(left)
            shared = s[rest] @ union
            pick = int(rest[np.argmax(shared * (nkt + 1) - (size[rest] - shared))])
            order.append(pick)
            left[pick] = False
            union = np.maximum(union, s[pick])
    return np.asarray(order + [last], dtype=np.int64)


def _reordered(tables: LaunchTables, sparsity: BlockSparsity, g: int, chunk_tiles: int,
               head_dim: int, kv_itemsize: int) -> LaunchTables:
    """``tables`` (natural order, several chunks) or, where it moves fewer HBM bytes
    (:func:`backward_plan_bytes` plus the tables'), the backward's tables with the query tiles
    of each ``(b, kv group)`` in :func:`chunk_order`: ``order_q`` and ``slots_k`` set
    (:func:`launch_tables`' ``reorder``). A pattern in the index form always takes the
    reordered form (the program must not depend on the pattern), in natural order where
    that is no worse."""
    dense = sparsity.dense
    b, heads, nqt, nkt = dense.shape
    sets = dense.reshape(b, heads // g, g, nqt, nkt).any(axis=2)       # (b, kv groups, ...)
    greedy = np.stack([np.stack([chunk_order(sets[x, y], chunk_tiles)
                                 for y in range(sets.shape[1])]) for x in range(b)])
    chunks = _tiles.ceil_div(nqt, chunk_tiles)

    def cost(t: LaunchTables) -> int:
        data = backward_plan_bytes(t.k, group=g, chunks=chunks, head_dim=head_dim,
                                   kv_itemsize=kv_itemsize)
        return data + sum(x.nbytes for x in (t.k.meta, t.order_q, t.slots_k) if x is not None)

    options = [_ordered(tables, sparsity, g, chunk_tiles, greedy)]
    natural = np.broadcast_to(np.arange(nqt), greedy.shape)
    options.append(_ordered(tables, sparsity, g, chunk_tiles, natural) if sparsity.runtime
                   else tables)
    # the natural option last: kept on a tie
    return min(reversed(options), key=cost)


def _ordered(tables: LaunchTables, sparsity: BlockSparsity, g: int, chunk_tiles: int,
             order: np.ndarray) -> LaunchTables:
    """``tables`` with the backward's query tiles of each ``(b, kv group)`` processed in
    ``order`` (``(b, kv groups, nqt)``, a permutation each): ``order_q`` float32 ``(b, kv
    groups, nqt)``, the tiles' first rows in that order (chunk c: positions ``c chunk_tiles
    ..``), and ``slots_k`` float32 ``(b, heads, chunks nkt, trip)`` beside ``k.meta``: each
    entry's place in its chunk (padding slots: ``chunk_tiles``, the kernel's zero tile)."""
    heads = sparsity.dense.shape[1]
    position = np.argsort(order, axis=-1)
    per_head = np.repeat(position, g, axis=1)                       # (b, heads, nqt)
    k, acc_k = _key_tables(sparsity, g, chunk_tiles, per_head)
    firsts = k.meta[..., 2:]
    live = firsts < _tiles.BSP_PAD_FIRST
    tile = np.where(live, firsts // BLOCK, 0).astype(np.int64)
    b, _, rows, trip = tile.shape
    local = np.take_along_axis(np.broadcast_to(per_head, (b, heads, per_head.shape[-1])),
                               tile.reshape(b, heads, rows * trip), axis=-1)
    slots = np.where(live, local.reshape(tile.shape) % chunk_tiles, chunk_tiles)
    return tables._replace(k=k, acc_k=acc_k,
                           order_q=np.ascontiguousarray(order * BLOCK, dtype=np.float32),
                           slots_k=np.ascontiguousarray(slots, dtype=np.float32))


# --------------------------------------------------------------------------------------------
# Key-block windows: the forward past SBUF (nki.*)
# --------------------------------------------------------------------------------------------


class WindowTables(NamedTuple):
    """The forward's tables for a key-block window (nki.*, K/V not resident): its query
    tiles in one class of ``trip`` slots (``tables``, as :func:`kernel_tables`' with the
    tiles ordered so that nearby ones share blocks; natural where that order is the
    tiles' own in every ``(b, h)``), and what the window
    holds: ``slots`` float32 ``(b, h, rows, trip)``, each slot's position in the window
    (``blocks``, the window's block of zeros, for a padding slot); ``loads`` float32 ``(b, h,
    groups, 2 + 2 L)``, per kernel group (``group`` rows at a time, then a remainder group)
    ``[steps, 0, first key_0, ..., first key_{L-1}, position_0, ..., position_{L-1}]``: the
    blocks it gathers into the window before its tiles run, in ``steps`` of
    :data:`nki_kernels.tiles.BSP_WINDOW_LOAD_BLOCKS` (the first ``2 + L`` columns a
    :class:`KernelTables` ``meta`` row; past the blocks padding entries, ``BSP_PAD_FIRST`` at
    ``blocks``, the block of zeros: nothing read, zeros written there).
    ``block_loads``: the key blocks the tables gather, over every ``(b, h)`` (each entry
    counted as if its query heads gathered their own); ``group``: the kernel group's query
    tiles (the forward's ``window_group``); ``heads``: the query heads that share each
    gather -- the ``Hq / Hkv`` member heads of a kv head where their tables are the same
    (the forward's ``window_shared``, :func:`window_plan`), else 1."""

    tables: KernelTables
    slots: np.ndarray
    loads: np.ndarray
    blocks: int
    block_loads: int
    group: int
    heads: int = 1

    @property
    def head_loads(self) -> Fraction:
        """The key blocks gathered per query head, over every ``(b, h)``: ``block_loads /
        heads``, exact. The units :func:`window_plan` and the host compare plans in
        (:func:`grouped_block_loads`, ``SuperGroupTables.block_loads``,
        ``host.api._dense_kv_blocks``)."""
        return Fraction(self.block_loads, self.heads)


def _window_order(sets: np.ndarray, recent: int) -> np.ndarray:
    """A processing order of the rows of one ``(b, h)`` (``sets``: ``(rows, blocks)`` bool)
    in which nearby rows share blocks: from row 0, each next row the unplaced one with the
    most blocks in common with the union of the last ``recent`` rows placed (what the window
    likely still holds; ties and no overlap: the lowest)."""
    n = sets.shape[0]
    s = sets.astype(np.int32)
    placed = np.zeros(n, dtype=bool)
    order = [0]
    placed[0] = True
    for _ in range(n - 1):
        common = s @ sets[order[-recent:]].any(axis=0).astype(np.int32)
        common[placed] = -1
        nxt = int(np.argmax(common))
        order.append(nxt)
        placed[nxt] = True
    return np.asarray(order, dtype=np.int64)


def _window_loads(needs, blocks: int):
    """The window's contents group by group of one ``(b, h)`` (``needs``: each group's
    blocks, sorted arrays): ``[(loads, positions), ...]``, the ``(position, block)`` pairs a
    group gathers (blocks it needs and the window does not hold) and the position of each of
    its blocks. A held block no later group needs frees its position; a gathered block takes
    the lowest free position, else evicts the held one next needed furthest ahead (Belady's
    choice: the fewest gathers for this order; on a tie the one gathered first), so the
    positions in use stay few where the pattern's working set is small. None when a group
    needs more than ``blocks``.

    O(log n) per access: each block's sorted list of uses with a pointer to its next one,
    and a lazy max-heap of ``(next use, when gathered)`` over the held blocks, whose entries
    go stale when their block is used again or leaves the window."""
    uses = {}
    for gi, need in enumerate(needs):
        for j in need.tolist():
            uses.setdefault(j, []).append(gi)
    nxt = dict.fromkeys(uses, 0)                 # index in uses[j] of j's next use
    held, since = {}, {}                         # block -> position, -> when it was gathered
    heap, free, out, done, count = [], list(range(blocks)), [], [], 0
    for gi, need in enumerate(needs):
        if len(need) > blocks:
            return None
        for x in done:                           # held blocks no later group needs
            heapq.heappush(free, held.pop(x))
        need = need.tolist()
        loads = []
        for j in need:
            if j in held:
                continue
            if not free:
                # the victim: a held block this group does not need (its next use is past
                # gi; the entries of this group's blocks say gi, or are stale)
                while True:
                    key, when, x = heapq.heappop(heap)
                    if since.get(x) == when and uses[x][nxt[x]] == -key > gi:
                        break
                heapq.heappush(free, held.pop(x))
                del since[x]
            held[j] = heapq.heappop(free)
            since[j] = count
            count += 1
            loads.append((held[j], j))
        out.append((loads, {j: held[j] for j in need}))
        done = []
        for j in need:
            nxt[j] += 1
            if nxt[j] == len(uses[j]):
                done.append(j)
                del since[j]
            else:
                heapq.heappush(heap, (-uses[j][nxt[j]], since[j], j))
    return out


def _block_sets(idx: np.ndarray, live: np.ndarray, x: int, y: int, nkt: int) -> np.ndarray:
    """``(n, nkt)`` bool: the key blocks of each query tile of ``(b, h) = (x, y)``."""
    sets = np.zeros((live.shape[2], nkt), dtype=bool)
    ri, si = np.nonzero(live[x, y])
    sets[ri, idx[x, y, ri, si]] = True
    return sets


def window_orders(index: BlockIndex, blocks: int) -> np.ndarray:
    """``(b, h, n)`` int64: the order of the query tiles of every ``(b, h)`` for a window of
    ``blocks`` blocks (:func:`_window_order` over the last rows whose blocks would fill the
    window twice), whatever the group size: :func:`window_tables` of several group sizes
    share it (:func:`window_plan`)."""
    num = np.asarray(index.num_blocks, dtype=np.int64)
    idx = np.asarray(index.indices, dtype=np.int64)
    b, h, n = num.shape
    live = np.arange(idx.shape[-1]) < num[..., None]
    nkt = int(idx[live].max()) + 1 if live.any() else 1
    # the rows placed last whose blocks would fill the window twice: their union stands for
    # what the window holds (64K, D = 128, s = 1/16 random: the last row alone 2626 gathered
    # blocks, the last 19 by this rule 2300; butterfly 740 and 512; fixed_density and
    # band+strided 512 either way)
    recent = max(1, 2 * blocks * b * h * n // max(1, int(num.sum())))
    order = np.empty((b, h, n), dtype=np.int64)
    for x in range(b):
        for y in range(h):
            order[x, y] = _window_order(_block_sets(idx, live, x, y, nkt), recent)
    return order


def window_tables(index: BlockIndex, blocks: int, group: int,
                  order: Optional[np.ndarray] = None) -> Optional[WindowTables]:
    """Tables of a validated index layout for the forward's key-block window of at most
    ``blocks`` blocks (:func:`nki_kernels.tiles.bsp_fwd_window_blocks`; the window the tables
    give, ``WindowTables.blocks``, holds the positions the plan uses, rounded up to a power of
    two, so its SBUF follows the pattern's working set): the query tiles of every ``(b,
    h)`` ordered so that nearby ones share key blocks (:func:`_window_order`: over the last
    rows whose blocks would fill the window twice, by the mean count), cut into
    the kernel's groups of ``min(group, rows)`` and a remainder group; each group gathers
    into the window the blocks of its tiles it does not hold (:func:`_window_loads`) and its
    tiles read every block in place. One class whose trip is ``max_blocks`` (the index
    form's bound), so the kernel's program depends on the bound and the window's size only
    (the loads table's width ``2 + 2 L``, ``L`` = ``min(group max_blocks, blocks)`` rounded up
    to a multiple of ``tiles.BSP_WINDOW_LOAD_BLOCKS``). ``order``: :func:`window_orders` of
    the same ``index`` and ``blocks`` (None: computed here). None when a group's tiles need
    more than ``blocks`` blocks."""
    num = np.asarray(index.num_blocks, dtype=np.int64)
    idx = np.asarray(index.indices, dtype=np.int64)
    b, h, n = num.shape
    m = idx.shape[-1]
    g = min(group, n)
    starts = list(range(0, n - n % g, g)) + ([n - n % g] if n % g else [])
    step = _tiles.BSP_WINDOW_LOAD_BLOCKS
    width = _tiles.ceil_div(min(g * m, blocks), step) * step
    if order is None:
        order = window_orders(index, blocks)
    slots = np.full((b, h, n, m), blocks, dtype=np.int64)
    loads = np.zeros((b, h, len(starts), 2 + 2 * width), dtype=np.float64)
    loads[..., 2:2 + width] = _tiles.BSP_PAD_FIRST
    loads[..., 2 + width:] = blocks
    total = top = 0
    live = np.arange(m) < num[..., None]
    nkt = int(idx[live].max()) + 1 if live.any() else 1
    block = _tiles.BLOCK_SPARSE_TILE
    for x in range(b):
        for y in range(h):
            sets = _block_sets(idx, live, x, y, nkt)
            needs = [np.flatnonzero(sets[order[x, y, a:a + g]].any(axis=0)) for a in starts]
            plan = _window_loads(needs, blocks)
            if plan is None:
                return None
            for gi, (a, (got, pos)) in enumerate(zip(starts, plan)):
                loads[x, y, gi, 0] = _tiles.ceil_div(len(got), step)
                for e, (p, j) in enumerate(got):
                    loads[x, y, gi, 2 + e] = j * block
                    loads[x, y, gi, 2 + width + e] = p
                    top = max(top, p + 1)
                total += len(got)
                for r in range(a, min(a + g, n)):
                    src = order[x, y, r]
                    slots[x, y, r, :num[x, y, src]] = [pos[j] for j in
                                                       idx[x, y, src, :num[x, y, src]]]
    num_o = np.take_along_axis(num, order, axis=-1)
    idx_o = np.take_along_axis(idx, order[..., None], axis=2)
    firsts = np.where(np.arange(m) < num_o[..., None], idx_o * block, _tiles.BSP_PAD_FIRST)
    meta = np.concatenate([order[..., None] * block, num_o[..., None], firsts], -1)
    natural = bool((order == np.arange(n)).all())
    tables = KernelTables(np.ascontiguousarray(meta, dtype=np.float32),
                          ((0, n, m, bool((num_o == m).all())),), (0,), (natural,))
    # the block of zeros follows the positions in use
    size = min(blocks, _pow2_at_least(max(top, 1)))
    slots[slots == blocks] = size
    loads[..., 2 + width:][loads[..., 2 + width:] == blocks] = size
    return WindowTables(tables, np.ascontiguousarray(slots, dtype=np.float32),
                        np.ascontiguousarray(loads, dtype=np.float32), size, total, group)


class SuperGroupTables(NamedTuple):
    """The forward's super-group tables (nki.*, K/V not resident, a plain launch; the kernel's
    ``sg_rows``): query tiles cut into super-groups of ``tiles`` query tiles each, whose
    union of key blocks the kernel streams once.

    ``meta`` float32 ``(b, h, groups, 2 + U)``: per super-group ``[0, count, first key of
    block 0, ...]``, slots past ``count`` :data:`nki_kernels.tiles.BSP_PAD_FIRST`; ``U = (M //
    W + 1) W`` for the bound M of a union and the kernel's step ``W = min(tiles.
    BSP_SHARED_STEP_BLOCKS, M)`` (``U // 2 >= W``, so the kernel finds W again). ``rows``
    float32 ``(b, h, groups, tiles)``: the first query row of each tile, ``BSP_PAD_FIRST`` in
    an idle slot. ``keys`` (masked super-groups; None: every tile uses every block of its
    union) float32 ``(b, h, groups U, tiles)``: at row ``c U + k``, column t, 1.0 where slot k
    of super-group c's union is one of tile t's blocks, else 0 (a padding slot: 0).
    ``classes``: ``((0, groups, U, False),)``. ``block_loads``: key blocks gathered over every
    ``(b, h)``; ``idle``: idle tile slots over every ``(b, h)``; ``pairs``: (tile, block)
    pairs computed, each super-group's tiles times its union, idle slots included (sparse
    super-groups: the active pairs). ``own`` (sparse super-groups, :func:`
    sparse_supergroup_tables`; None: none) float32 ``(b, h, groups S tiles, C)`` with ``S =
    U / W`` steps of ``W = min(tiles.BSP_SG_OWN_STEP_BLOCKS, M)`` blocks: at row ``(c S + s)
    tiles + t`` tile t's blocks of step s of super-group c as the trip count of each sub-step
    width of ``tiles.BSP_SG_OWN_WIDTHS``, then each width's section of the blocks' positions
    in the step (0 .. W - 1; ``tiles.bsp_sg_own_layout``, unused entries 0)."""

    meta: np.ndarray
    rows: np.ndarray
    classes: Tuple[Tuple[int, int, int, bool], ...]
    block_loads: int
    idle: int
    pairs: int
    keys: Optional[np.ndarray] = None
    own: Optional[np.ndarray] = None


def union_width(bound: int, sparse: bool = False) -> Tuple[int, int]:
    """``(W, U)`` of :class:`SuperGroupTables` for unions of at most ``bound`` blocks: ``U =
    (bound // W + 1) W`` -- the padded step's loop starts at ``count // W``, in the table even
    where no padded step runs (its body is still program text). ``W`` is
    ``tiles.BSP_SHARED_STEP_BLOCKS`` (``sparse``: ``tiles.BSP_SG_OWN_STEP_BLOCKS``) or
    ``bound`` if smaller."""
    most = _tiles.BSP_SG_OWN_STEP_BLOCKS if sparse else _tiles.BSP_SHARED_STEP_BLOCKS
    step = min(most, bound)
    return step, (bound // step + 1) * step


def supergroup_size(rows: int, most: int) -> int:
    """Query tiles per super-group of ``rows`` query tiles with up to ``most`` each: ``ceil(rows
    / ceil(rows / most))`` (a shape's, not the pattern's: every super-group full where one
    set covers all rows, as the index form at s = 1)."""
    return _tiles.ceil_div(rows, _tiles.ceil_div(rows, max(1, most)))


def _supergroup_arrays(index: BlockIndex, plans, size: int, bound: int,
                       masked: bool, sparse: bool = False) -> SuperGroupTables:
    """The tables of ``plans`` (per ``(x, y)``: a list of super-groups ``(union, members)``);
    ``masked``: the ``keys`` table too; ``sparse``: the ``own`` table instead."""
    num = np.asarray(index.num_blocks, dtype=np.int64)
    idx = np.asarray(index.indices, dtype=np.int64)
    b, h, n = num.shape
    step, width = union_width(bound, sparse)
    groups = max(len(p) for p in plans.values())
    block = _tiles.BLOCK_SPARSE_TILE
    pad = _tiles.BSP_PAD_FIRST
    meta = np.full((b, h, groups, 2 + width), pad, dtype=np.float32)
    meta[..., :2] = 0
    rows = np.full((b, h, groups, size), pad, dtype=np.float32)
    keys = (np.zeros((b, h, groups, width, size), dtype=np.float32) if masked or sparse
            else None)
    loads = pairs = 0
    for (x, y), plan in plans.items():
        for c, (union, members) in enumerate(plan):
            meta[x, y, c, 1] = len(union)
            meta[x, y, c, 2:2 + len(union)] = np.asarray(union, dtype=np.int64) * block
            rows[x, y, c, :len(members)] = np.asarray(members) * block
            loads += len(union)
            pairs += size * len(union) if not sparse else int(num[x, y, members].sum())
            if keys is None:
                continue
            # each member's blocks at their positions in the (ascending) union
            mem = np.asarray(members, dtype=np.int64)
            t_i, s_i = np.nonzero(np.arange(idx.shape[-1]) < num[x, y, mem][:, None])
            pos = np.searchsorted(np.asarray(union, dtype=np.int64), idx[x, y, mem[t_i], s_i])
            keys[x, y, c, pos, t_i] = 1.0
    own = None
    if sparse:
        own, keys = _own_rows(keys, step), None
    if keys is not None:
        keys = keys.reshape(b, h, groups * width, size)
    return SuperGroupTables(meta, rows, ((0, groups, width, False),), loads,
                            b * h * groups * size - b * h * n, pairs, keys, own)


def _own_rows(keys: np.ndarray, step: int) -> np.ndarray:
    """The ``own`` table of :class:`SuperGroupTables` from the keep flags ``keys`` ``(b, h,
    groups, U, tiles)`` (1.0 where union slot k is one of tile t's blocks) in steps of
    ``step`` blocks: per (super-group, step, tile) the positions of the tile's blocks in the
    step, ascending, split greedily over the sub-step widths (``tiles.bsp_sg_own_layout``)."""
    b, h, groups, width, size = keys.shape
    steps = width // step
    sections, cols = _tiles.bsp_sg_own_layout(step)
    own = np.zeros((b, h, groups, steps, size, cols), dtype=np.float32)
    flags = keys.reshape(b, h, groups, steps, step, size) > 0
    for lead in zip(*np.nonzero(flags.any(axis=4))):
        pos = np.flatnonzero(flags[lead[:4] + (slice(None), lead[4])])
        row = own[lead]
        at = 0
        for i, (w, col) in enumerate(sections):
            trips = (len(pos) - at) // w
            row[i] = trips
            row[col:col + trips * w] = pos[at:at + trips * w]
            at += trips * w
    return own.reshape(b, h, groups * steps * size, cols)


def supergroup_tables(index: BlockIndex, most: int) -> Optional[SuperGroupTables]:
    """Exact super-group tables of a pattern (:class:`SuperGroupTables`, no ``keys``) with up
    to ``most`` query tiles per super-group (``tiles.bsp_fwd_supergroup_tiles``): the query
    tiles of each ``(b, h)`` sorted by block set, each run of identical sets cut into
    super-groups of :func:`supergroup_size`, every ``(b, h)`` padded to the most
    super-groups any needs (``idle`` counts the idle slots: each costs a tile's sweep). None
    where the pattern has no active block."""
    num = np.asarray(index.num_blocks, dtype=np.int64)
    idx = np.asarray(index.indices, dtype=np.int64)
    b, h, n = num.shape
    m = idx.shape[-1]
    if m == 0 or not num.any():
        return None
    size = supergroup_size(n, most)
    plans = {}
    for x in range(b):
        for y in range(h):
            runs = {}
            for r in range(n):
                runs.setdefault(tuple(sorted(idx[x, y, r, :num[x, y, r]])), []).append(r)
            plans[x, y] = [(key, members[i:i + size]) for key, members in sorted(runs.items())
                           for i in range(0, len(members), size)]
    return _supergroup_arrays(index, plans, size, m, False)


def masked_supergroup_tables(index: BlockIndex, most: int, Nk: int) -> Optional[
        SuperGroupTables]:
    """Masked super-group tables of a pattern over ``Nk`` keys (:class:`SuperGroupTables`
    with ``keys``): the query tiles of each ``(b, h)`` in their order, cut into super-groups
    of :func:`supergroup_size` with up to ``most`` each, each streaming the union of its
    tiles' blocks (in ascending order) and masking per tile the blocks not its own. Unions
    are bounded by the ``Nk / 128`` key blocks (the table's width depends on the shape only).
    None where the pattern has no active block or the last key block is partial (the kernel
    masks whole blocks)."""
    return _consecutive(index, most, Nk, "masked")


def _consecutive(index: BlockIndex, most: int, Nk: int, kind: str) -> Optional[
        SuperGroupTables]:
    """The tables (``kind`` "masked" or "sparse") of super-groups of consecutive query tiles,
    :func:`supergroup_size` with up to ``most`` each, each with the union of its tiles'
    blocks in ascending order; None where the pattern has no active block or the last key
    block is partial (nothing would mask its keys past Nk)."""
    num = np.asarray(index.num_blocks, dtype=np.int64)
    idx = np.asarray(index.indices, dtype=np.int64)
    b, h, n = num.shape
    if idx.shape[-1] == 0 or not num.any() or Nk % _tiles.BLOCK_SPARSE_TILE:
        return None
    size = supergroup_size(n, most)
    plans = {}
    for x in range(b):
        for y in range(h):
            plans[x, y] = []
            live = np.arange(idx.shape[-1]) < num[x, y][:, None]
            for r0 in range(0, n, size):
                r1 = min(r0 + size, n)
                union = np.unique(idx[x, y, r0:r1][live[r0:r1]])
                plans[x, y].append((tuple(int(j) for j in union), list(range(r0, r1))))
    return _supergroup_arrays(index, plans, size, Nk // _tiles.BLOCK_SPARSE_TILE,
                              kind == "masked", sparse=kind == "sparse")


def sparse_supergroup_tables(index: BlockIndex, most: int, Nk: int) -> Optional[
        SuperGroupTables]:
    """Sparse super-group tables of a pattern over ``Nk`` keys (:class:`SuperGroupTables`
    with ``own``): the super-groups of :func:`masked_supergroup_tables` (consecutive query
    tiles, each streaming its union once, here in steps of ``tiles.BSP_SG_OWN_STEP_BLOCKS``),
    but each tile computes only its own blocks of a step (``pairs``: the active pairs), read
    at the positions ``own`` lists. None where the pattern has no active block or the last
    key block is partial (nothing masks its keys past Nk)."""
    return _consecutive(index, most, Nk, "sparse")


def supergroup_hbm_bytes(sg: SuperGroupTables, B: int, Hq: int, Nq: int, Nk: int, D: int,
                         itemsize: int) -> int:
    """The HBM bytes (read and written) of the forward with the super-group tables ``sg``
    over ``(B, Hq)`` query heads (the tables broadcast to them), q/k/v/o of ``itemsize``
    bytes: Q read and O, LSE written once; each super-group's union blocks' K and V rows
    below Nk; per super-group its union row and its tiles' first rows, and where masked
    (``keys``) the keep flags of each step run (``ceil(count / W)`` steps), where sparse
    (``own``) each step run's rows of ``own``, one per tile."""
    meta = np.broadcast_to(sg.meta, (B, Hq) + sg.meta.shape[2:])
    firsts = meta[..., 2:]
    firsts = firsts[firsts < _tiles.BSP_PAD_FIRST].astype(np.int64)
    kv_rows = int(np.minimum(_tiles.BLOCK_SPARSE_TILE, Nk - firsts).sum())
    per_group = (meta.shape[-1] + sg.rows.shape[-1]) * 4
    flags = 0
    if sg.keys is not None or sg.own is not None:
        # each step that runs reads its keep flags (masked) or its tiles' own rows (sparse)
        step = _tiles.bsp_sg_step(meta.shape[-1] - 2, sg.own is not None)
        steps = int((-(-meta[..., 1].astype(np.int64) // step)).sum())
        per_step = step if sg.own is None else sg.own.shape[-1]
        flags = steps * per_step * sg.rows.shape[-1] * 4
    return (B * Hq * (2 * Nq * D * itemsize + Nq * 4 + meta.shape[2] * per_group)
            + flags + 2 * kv_rows * D * itemsize)


def grouped_block_loads(tables: KernelTables, group: int) -> int:
    """The key blocks the forward gathers with ``tables`` (:func:`kernel_tables` with
    ``share``, or :func:`shared_bound_tables`) where K/V are not resident, over every ``(b,
    h)``: per kernel group (``min(group, rows)`` of a class at a time, then a remainder) its
    common blocks once (the class's ``shared`` count, or with ``shared_runtime`` the group's
    own count of them) and each tile's other blocks (padding slots gather nothing)."""
    meta = tables.meta
    total = 0
    for (a, m, _t, _e), sh in zip(tables.classes, tables.shared):
        g = min(group, m)
        for p in range(a, a + m, g):
            rows = meta[:, :, p:min(p + g, a + m)]
            count = rows[..., 1].astype(np.int64)
            if tables.shared_runtime:
                common = (rows[:, :, 0, 2:2 + sh] < _tiles.BSP_PAD_FIRST).sum(axis=-1)
                total += int((common + (count - sh).sum(axis=-1)).sum())
            else:
                total += int((sh + (count - sh).sum(axis=-1)).sum())
    return total


def _kv_head_index(sparsity: BlockSparsity, heads: int) -> Optional[Tuple[BlockIndex, int]]:
    """``(index, rep)``: the pattern of one query head per kv head where each kv head's
    ``heads`` member heads (consecutive query heads, GQA) have the same block sets -- the
    index itself where it is broadcast over heads (head dim 1; ``rep`` 1), else its first
    member heads (``rep`` = ``heads``: the tables planned on it repeat ``heads`` times along
    the head dim); None where the member heads' sets differ."""
    dense = sparsity.dense
    if dense.shape[1] == 1:
        return sparsity.index, 1
    d = dense.reshape((dense.shape[0], dense.shape[1] // heads, heads) + dense.shape[2:])
    if not (d == d[:, :, :1]).all():
        return None
    num, idx = sparsity.index
    return BlockIndex(num[:, ::heads], idx[:, ::heads]), heads


def window_plan(sparsity: BlockSparsity, grouped: KernelTables, blocks: int,
                dense, heads: int = 1) -> Optional[WindowTables]:
    """The forward's key-block window tables (:func:`window_tables`, a window of ``blocks``
    blocks) when they gather fewer key blocks than ``grouped``, the tables the forward would
    take otherwise (:func:`grouped_block_loads`); else None (also when ``blocks`` is 0 or
    every group size's groups need more than ``blocks``). The kernel's group size is the
    first of :data:`nki_kernels.tiles.BSP_WINDOW_GROUPS` (the largest first: more tiles per
    group share the gathers' waits) whose plan gathers at most ``dense`` key blocks (the
    dense forward's K/V traffic in key blocks per query head, over the same ``(b, h)``:
    ``host.api._dense_kv_blocks``, an int or a Fraction), else the one gathering the fewest
    (on a tie the larger). ``heads``: the query heads per kv head (GQA's ``Hq / Hkv``);
    where they have the same block sets (:func:`_kv_head_index`) the plan is made once per
    kv head and its tables serve every member head (``WindowTables.heads``: the kernel
    gathers once for them), so its key blocks per query head (``head_loads``) are
    ``1 / heads`` of a plan per query head. The counts are exact, so this keeps the smaller
    HBM traffic; it plans from the largest group down, in one order of the query tiles
    (:func:`window_orders`), and stops at the first that qualifies."""
    if blocks < 1:
        return None
    index, rep, share = sparsity.index, 1, 1
    kv = _kv_head_index(sparsity, heads) if heads > 1 else None
    if kv is not None:
        (index, rep), share = kv, heads

    def per_head(win: WindowTables) -> Fraction:
        return Fraction(win.block_loads * rep, share)

    best = None
    order = window_orders(index, blocks)
    for group in _tiles.BSP_WINDOW_GROUPS:
        win = window_tables(index, blocks, group, order)
        if win is not None and (best is None or win.block_loads < best.block_loads):
            best = win
        if best is not None and per_head(best) <= dense:
            break
    if best is None or per_head(best) >= grouped_block_loads(grouped, _tiles.BSP_GROUP_TILES):
        return None
    if rep > 1:
        best = best._replace(
            tables=best.tables._replace(meta=np.repeat(best.tables.meta, rep, axis=1)),
            slots=np.repeat(best.slots, rep, axis=1), loads=np.repeat(best.loads, rep, axis=1),
            block_loads=best.block_loads * rep)
    return best._replace(heads=share)


def window_hbm_bytes(win: WindowTables, B: int, Hq: int, Nq: int, Nk: int, D: int,
                     itemsize: int) -> int:
    """The HBM bytes (read and written) of the forward with the window tables ``win`` over
    ``(B, Hq)`` query heads (the tables broadcast to them), without lengths, dropout or score
    modifiers, q/k/v/o of ``itemsize`` bytes: Q read and O, LSE written once; each gathered
    key block's K and V rows below Nk and per kernel group its ``loads`` row, once per query
    head or, where ``win.heads`` member heads share the window, once per kv head (the first
    member head's tables); per query head and group its tiles' table and ``slots`` rows,
    and, where padding slots are masked by TensorE (not every tile has ``trip`` blocks,
    whole key blocks: ``block_sparse._padding_rows``), the rows again."""
    tables = win.tables
    (_, n, trip, exact), = tables.classes
    loads = np.broadcast_to(win.loads, (B, Hq) + win.loads.shape[2:])[:, ::win.heads]
    width = (loads.shape[-1] - 2) // 2
    block = _tiles.BLOCK_SPARSE_TILE
    per_tile = (2 + trip) * 4 + trip * 4
    if not exact and Nk % block == 0:
        per_tile += trip * 4
    firsts = loads[..., 2:2 + width]
    firsts = firsts[firsts < _tiles.BSP_PAD_FIRST].astype(np.int64)
    kv_rows = int(np.minimum(block, Nk - firsts).sum())
    return (B * Hq * (2 * Nq * D * itemsize + Nq * 4 + n * per_tile) + loads.size * 4
            + 2 * kv_rows * D * itemsize)
