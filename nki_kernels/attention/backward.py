"""Flash attention backward: dQ, dK, dV recomputed from O and LSE, in one pass over K/V.

Math (docs/semantics.md; FlashAttention, appendix B.4, Algorithm 4; seed 001 for the masking).
For one query head with rows i and keys j, ``S = scale * Q K^T`` and the forward kept only
``O = softmax(S) V`` and ``LSE_i = log sum_j exp(S_ij)``. Then

    D_i   = rowsum(dO_i * O_i)                       (pre-pass, O(N d); = rowsum(P_i * dP_i))
    P_ij  = exp(scale * q_i . k_j - LSE_i)           (recomputed per tile; 0 for masked keys)
    dV_j += sum_i P_ij dO_i                          dV = P^T dO
    dP_ij = dO_i . v_j                               dP = dO V^T
    dS_ij = P_ij (dP_ij - D_i)                       the softmax backward
    dQ_i += scale * sum_j dS_ij k_j                  dQ = scale dS K
    dK_j += scale * sum_i dS_ij q_i                  dK = scale dS^T Q

GQA: query head ``h`` reads kv head ``h // G``; dK and dV of a kv head are summed over its G
query heads (they simply accumulate into the same dK_j, dV_j).

Design: one kernel, one pass, no atomics
----------------------------------------
GPUs either run one kernel whose dQ is accumulated with atomics in HBM (10 N^2 d FLOPs) or two
kernels, one for dK/dV and one for dQ, that recompute P and dP twice (14 N^2 d FLOPs by the
matmul count: S, dP, dV, dK in the first and S, dP, dQ in the second). A NeuronCore has 24-28 MiB
of SBUF, enough to keep a whole head's query-side state on chip: Q, Q^T, dO, dO^T, D, LSE and
the fp32 dQ accumulator. So the kernel streams K/V once, in tiles of ``Bk`` keys (the outer
loop), and for each K/V tile visits every query tile of every head of the group (the inner loop):

* dK_j and dV_j accumulate in PSUM across the whole inner loop (free on TensorE) and are
  written once;
* dQ_i for all query tiles stays in SBUF (fp32) and gains ``dS_ij K_j`` per visit (one small
  VectorE add of [128, d] per 128 x Bk scores);
* Q, dO, O, LSE, K, V are each read from HBM once, dQ, dK, dV written once: the minimum
  traffic, ``itemsize * (4 Nq d + 2 Nk d) + 4 Nq`` in and ``itemsize * (Nq d + 2 Nk d)`` out
  per (query head, kv head) pair.

That is 5 matmuls per score, 10 N^2 d FLOPs. dQ contracts over keys, so it needs dS^T (keys on
the partitions); every other product contracts over the partition dim of a tile we already
have. On trn2 the transpose is one SBUF -> SBUF DMA transpose per visit (the DMA queues are
otherwise idle), so TensorE does exactly the 5 matmul passes; on trn1 (no DMA-transpose
hardware) it is a 6th TensorE pass (128 x 128 transposes), the PSUM copies split between
ScalarE and VectorE. ``dP - D`` is formed by ScalarE while it copies dP out of PSUM, so VectorE
does one bf16 multiply per score for dS.

Measured (``python benchmarks/backward.py``; one head, N = 4096, D = 128, bf16; modeled µs =
max over engines; the limits of hardware-and-limits.md §5 in brackets, strict / engine-aware):

=====================  ===============================  ===============================
variant                trn2 non-causal (273 / 382)      trn2 causal (137 / 191)
=====================  ===============================  ===============================
this design            280  (TensorE; 8.40 MB = min)    152  (DMA; TensorE 148)
dQ in HBM ("atomics")  399  (DMA; 46.2 MB)              243
two kernels (14N^2d)   477  (ScalarE; 13.7 MB)          283
dS^T on TensorE        335  (TensorE)                   176
=====================  ===============================  ===============================

trn1: 287 µs non-causal (strict 234, engine-aware 328), 151 µs causal (117 / 164), TensorE-bound
with the 6th pass. The single pass wins on every engine: the two-kernel split recomputes S, P
and dP (2 more matmuls, a second exp and dP - D per score), and dQ in HBM moves 5.5x the bytes.

Limits. One pass holds ``tiles.bwd_slot_bytes`` per 128 query rows (bf16, D = 128: 1544 bytes
per partition) next to a fixed working set, so it covers ``G * Nq`` up to
``tiles.bwd_rows_per_pass`` query rows per kv head: 16128 on trn2 and 13440 on trn1 for D = 128
(24448 / 20352 for D = 64, 8064 / 6656 for D = 256; fp32 operands roughly halve them).
Beyond that (long sequences, wide GQA groups) the query tiles are split into *passes* that
each fit; every pass streams K/V again and adds its dK/dV partial sums into an fp32 scratch in
HBM (read-add-write, deterministic, no atomics). Each extra pass costs one more read of K/V and
``16 Nk d`` bytes of fp32 partial sums; forcing 1024-row passes at N = 4096 costs 36 % on trn2.

Layouts (all on chip, from the standard ``(B, H, N, D)`` layout in HBM):

* "natural" tiles ``[128 rows (partitions), D]``: Q, dO (moving operands of dK, dV), K (moving
  operand of dQ), O (for D);
* "transposed" tiles ``[D (partitions), rows]``: Q^T, dO^T, K^T, V^T (operands of S and dP,
  which contract over D), made on chip with TensorE transposes (once per input tile);
* S, P, dP, dS are ``[128 query rows, Bk keys]``: the per-row LSE and D are per-partition
  scalars (ScalarE bias, VectorE scalar operand).

Masks. The lengths (``q_lens``, ``kv_lens``) are compile-time tuples: keys past ``kv_len`` and
queries past ``q_len`` are never loaded or computed (partial tiles are simply narrower), so no
padded key ever reaches the exponential (seed 001's NaN hazard) and padding costs nothing; the
price is one compilation per set of lengths on a device (the forward takes them at run time).
Causal and window masks follow the forward's :class:`masks.MaskSpec` (band, key range, tile
classes): tiles entirely outside the band are skipped, tiles entirely inside it run unmasked,
and on the boundary tiles the scaled scores are masked *before* the exp by GpSimd
``affine_select`` (masked entries become ``fp32.min``, whose exp is 0) -- not by the forward's
TensorE mask-add, because TensorE is the backward's busiest engine. Rows whose LSE is ``-inf``
(no visible key) get an exp bias of ``-1e30`` instead of ``+inf``, so their P is exactly 0 and
they contribute nothing.

Precision: matmul operands in the input dtype for bf16/fp16, bf16 for fp32 inputs with
``mixed_precision`` (fp32 otherwise); PSUM, D, LSE, the dQ accumulator and the dS arithmetic
are fp32; P and dS are rounded to the operand dtype before their matmuls; outputs are written
in the input dtype.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import numpy as np

from nki_kernels.attention import masks as M
from nki_kernels.nki import nisa, nki, nl
from nki_kernels.tiles import (
    BWD_ACT_EVAC_BLOCKS,
    BWD_DQ_ACCUMULATE_MODES,
    BWD_DS_TRANSPOSE,
    BWD_EXP_BIAS_NO_KEY,
    BWD_LSE_NO_KEY,
    BWD_MASK_FILL,
    PMAX,
    bwd_key_tile,
    bwd_rows_per_pass,
)

# ---------------------------------------------------------------------------------------------
# Compile-time plan (pure Python on ints: which tiles exist, which are skipped or masked)
# ---------------------------------------------------------------------------------------------


class QTile(NamedTuple):
    """A tile of ``rows`` valid query rows starting at row ``r0`` of query head ``h``; ``slot``
    is its place in the resident query-side state of its pass."""

    h: int
    r0: int
    rows: int
    slot: int


class KTile(NamedTuple):
    """Keys ``[c0, c0 + cols)`` (valid keys only), split in blocks of at most 128 keys:
    ``blocks[b] = (offset within the tile, keys)``."""

    c0: int
    cols: int
    blocks: Tuple[Tuple[int, int], ...]


class Visit(NamedTuple):
    """One (query tile, key tile) pair to compute: keys ``[c0 + a, c0 + a + w)`` (whole blocks
    ``b_lo .. b_hi - 1`` of the key tile), and which edges of the visibility band cut through
    it (``mask_hi``: ``j <= i + off + hi``; ``mask_lo``: ``j >= i + off + lo``)."""

    qt: QTile
    a: int
    w: int
    b_lo: int
    b_hi: int
    mask_hi: bool
    mask_lo: bool


def mask_spec(nq: int, nk: int, causal: Optional[str], window) -> M.MaskSpec:
    """The visibility band of docs/semantics.md for one sequence, as the forward's
    :class:`masks.MaskSpec` (its ``static_offset`` is the alignment offset of the valid lengths:
    0 for top_left, ``nk - nq`` otherwise). The lengths are compile-time here, so they enter as
    the sequence's own ``nq, nk`` and never as runtime masks."""
    return M.MaskSpec(nq, nk, causal, window)


def plan_q_tiles(G: int, nq: int, rows_per_pass: int):
    """Query tiles of the G heads of a group, grouped into passes of at most ``rows_per_pass``
    rows each (a multiple of 128). Returns a tuple of passes, each a tuple of QTile."""
    tiles_per_pass = max(1, rows_per_pass // PMAX)
    passes, cur = [], []
    for h in range(G):
        for r0 in range(0, nq, PMAX):
            if len(cur) == tiles_per_pass:
                passes.append(tuple(cur))
                cur = []
            cur.append(QTile(h, r0, min(PMAX, nq - r0), len(cur)))
    if cur:
        passes.append(tuple(cur))
    return tuple(passes)


def plan_k_tiles(nk: int, key_tile: int):
    """Key tiles over the valid keys ``[0, nk)``."""
    tiles = []
    for c0 in range(0, nk, key_tile):
        cols = min(key_tile, nk - c0)
        blocks = tuple((b, min(PMAX, cols - b)) for b in range(0, cols, PMAX))
        tiles.append(KTile(c0, cols, blocks))
    return tuple(tiles)


def plan_visit(spec: M.MaskSpec, qt: QTile, kt: KTile) -> Optional[Visit]:
    """Classify a (query tile, key tile) pair with the forward's mask plan: None when no row
    sees any of its keys, else the whole 128-key blocks holding visible keys
    (``spec.key_range``) and whether the band's edges cut through them (``spec.classify``)."""
    k_lo, k_hi = spec.key_range(qt.r0, qt.rows)
    lo, hi = max(k_lo, kt.c0), min(k_hi, kt.c0 + kt.cols)
    if lo >= hi:
        return None
    b_lo = (lo - kt.c0) // PMAX
    b_hi = (hi - 1 - kt.c0) // PMAX + 1
    a = kt.blocks[b_lo][0]
    w = kt.blocks[b_hi - 1][0] + kt.blocks[b_hi - 1][1] - a
    kind = spec.classify(qt.r0, qt.rows, kt.c0 + a, w)
    if kind is None:
        return None
    off = spec.static_offset
    first_col, last_col = kt.c0 + a, kt.c0 + a + w - 1
    mask_hi = kind != M.FULL and spec.hi is not None and last_col - qt.r0 - off > spec.hi
    mask_lo = (kind != M.FULL and spec.lo is not None
               and first_col - (qt.r0 + qt.rows - 1) - off < spec.lo)
    return Visit(qt, a, w, b_lo, b_hi, mask_hi, mask_lo)


# ---------------------------------------------------------------------------------------------
# Phase 1: query-side state of a pass (Q, Q^T, dO, dO^T, D = rowsum(dO * O), exp bias)
# ---------------------------------------------------------------------------------------------


def _accumulate(psum, first, product):
    """``psum = product`` for the first partial product of a PSUM accumulation group, then
    ``psum += product`` (a matmul's first write into a bank overwrites it)."""
    if first:
        psum[...] = product
    else:
        psum[...] += product


def _transpose_into(dst, src, tp_dtype, engine="scalar"):
    """``dst[D, rows] = src[rows, D]^T`` through a TensorE transpose and a PSUM -> SBUF copy on
    ScalarE (default) or VectorE."""
    rows, cols = src.shape
    t_psum = nl.ndarray((cols, rows), dtype=tp_dtype, buffer=nl.psum)
    t_psum[...] = nisa.nc_transpose(src)
    if engine == "scalar":
        dst[...] = nisa.activation(nl.copy, t_psum, dtype=dst.dtype)
    else:
        dst[...] = nisa.tensor_copy(t_psum, dtype=dst.dtype)


def _blocks_view(t, rows, nblocks):
    """A ``[rows, nblocks * 128]`` tile seen as ``[rows, nblocks, 128]`` (a free-dim access
    pattern, no copy)."""
    ip = nl.arange(rows)[:, None, None]
    ib = nl.arange(nblocks)[None, :, None]
    ik = nl.arange(PMAX)[None, None, :]
    return t[ip, ib * PMAX + ik]


def load_query_side(q, do, o, lse, b, h0, qtiles, d_chunks, q_nat, q_T, do_nat, do_T,
                    neg_delta, exp_bias, op_dtype, tp_dtype):
    """Load every query tile of a pass and derive what the inner loop needs.

    Per tile (rows r0 .. r0 + rows - 1 of query head h0 + h):

    * ``q_nat``, ``do_nat`` ``[rows, D]`` in the operand dtype, and their transposes
      ``q_T``, ``do_T`` ``[D chunk, rows]``;
    * ``neg_delta = -D = -rowsum(dO * O)`` in fp32 (from the loaded values, before any
      rounding; negated because it is used as the ScalarE bias of ``dP - D``);
    * ``exp_bias = -LSE``, or ``BWD_EXP_BIAS_NO_KEY`` where LSE = -inf (a row with no visible
      key), computed as ``m * BIAS_NO_KEY - max(LSE, LSE_NO_KEY)`` with ``m = [LSE < LSE_NO_KEY]``
      so every intermediate is finite.
    """
    for qt in qtiles:
        hh, r0, rows, s = h0 + qt.h, qt.r0, qt.rows, qt.slot
        rsl = nl.ds(r0, rows)
        do_in = nl.load(do[b, hh, rsl, :])
        o_in = nl.load(o[b, hh, rsl, :])
        prod = nisa.tensor_tensor(do_in, o_in, np.multiply, dtype=nl.float32)
        neg_delta[0:rows, s:s + 1] = nisa.tensor_reduce(np.add, prod, axis=(1,), negate=True,
                                                        dtype=nl.float32, keepdims=True)
        if do_in.dtype == op_dtype:
            do_nat[0:rows, s, :] = do_in
        else:
            do_nat[0:rows, s, :] = nisa.tensor_copy(do_in, dtype=op_dtype)
        q_nat[0:rows, s, :] = nl.load(q[b, hh, rsl, :], dtype=op_dtype)

        lse_t = nl.load(lse[b, hh, rsl])
        lse_floor = nisa.tensor_scalar(lse_t, np.maximum, BWD_LSE_NO_KEY, dtype=nl.float32)
        no_key = nisa.tensor_scalar(lse_t, np.less, BWD_LSE_NO_KEY, dtype=nl.float32)
        exp_bias[0:rows, s:s + 1] = nisa.scalar_tensor_tensor(
            data=no_key, op0=np.multiply, operand0=BWD_EXP_BIAS_NO_KEY,
            op1=np.subtract, operand1=lse_floor, dtype=nl.float32)

        for c, (d0, dsz) in enumerate(d_chunks):
            cols = nl.ds(s * PMAX, rows)
            _transpose_into(q_T[0:dsz, c, cols], q_nat[0:rows, s, d0:d0 + dsz], tp_dtype)
            _transpose_into(do_T[0:dsz, c, cols], do_nat[0:rows, s, d0:d0 + dsz], tp_dtype)


# ---------------------------------------------------------------------------------------------
# Phase 2: one K/V tile (K natural for dQ, K^T and V^T for S and dP)
# ---------------------------------------------------------------------------------------------


def load_kv_tile(k, v, b, g, kt, d_chunks, k_nat, k_T, v_T, op_dtype, tp_dtype):
    """Keys ``kt.c0 ..`` of kv head g: ``k_nat[keys, blk, D]``, ``k_T[D chunk, c, keys]``,
    ``v_T[D chunk, c, keys]`` (V itself is only needed transposed)."""
    for bi, (off, n) in enumerate(kt.blocks):
        ksl = nl.ds(kt.c0 + off, n)
        k_nat[0:n, bi, :] = nl.load(k[b, g, ksl, :], dtype=op_dtype)
        v_in = nl.load(v[b, g, ksl, :], dtype=op_dtype)
        for c, (d0, dsz) in enumerate(d_chunks):
            _transpose_into(k_T[0:dsz, c, nl.ds(off, n)], k_nat[0:n, bi, d0:d0 + dsz], tp_dtype)
            _transpose_into(v_T[0:dsz, c, nl.ds(off, n)], v_in[0:n, d0:d0 + dsz], tp_dtype)


# ---------------------------------------------------------------------------------------------
# Phase 3: the per-visit math (recompute P, softmax backward, accumulate dV, dK, dQ)
# ---------------------------------------------------------------------------------------------


def recompute_p(vis, kt, spec, scale, d_chunks, q_T, k_T, exp_bias, op_dtype):
    """``P = exp(scale * Q K^T - LSE)`` for the visit's rows and keys, ``[rows, w]`` in the
    operand dtype. Masked keys get ``fp32.min`` before the exp (P = 0 exactly)."""
    qt = vis.qt
    rows, s, w = qt.rows, qt.slot, vis.w
    s_psum = nl.ndarray((rows, w), dtype=nl.float32, buffer=nl.psum)
    for c, (d0, dsz) in enumerate(d_chunks):
        _accumulate(s_psum, c == 0, nisa.nc_matmul(q_T[0:dsz, c, nl.ds(s * PMAX, rows)],
                                                   k_T[0:dsz, c, nl.ds(vis.a, w)]))
    bias = exp_bias[0:rows, s:s + 1]
    if not (vis.mask_hi or vis.mask_lo):
        return nisa.activation(np.exp, s_psum, bias=bias, scale=scale, dtype=op_dtype)

    # Row i = qt.r0 + iq, key j = kt.c0 + vis.a + ik; keep i + off + lo <= j <= i + off + hi.
    # GpSimd selects on the diagonal tiles only: TensorE, where the forward adds its masks, is
    # the backward's busiest engine.
    scores = nisa.activation(nl.copy, s_psum, scale=scale, dtype=nl.float32)
    iq, ik = nl.mgrid[0:rows, 0:w]
    row = qt.r0 + iq
    key = kt.c0 + vis.a + ik
    off = spec.static_offset
    if vis.mask_hi:
        scores = nisa.affine_select(row + (off + spec.hi) >= key, scores, BWD_MASK_FILL,
                                    dtype=nl.float32)
    if vis.mask_lo:
        scores = nisa.affine_select(key >= row + (off + spec.lo), scores, BWD_MASK_FILL,
                                    dtype=nl.float32)
    return nisa.activation(np.exp, scores, bias=bias, scale=1.0, dtype=op_dtype)


def softmax_backward(vis, d_chunks, do_T, v_T, neg_delta, p, op_dtype):
    """``dS = P * (dP - D)`` with ``dP = dO V^T``, ``[rows, w]`` in the operand dtype.

    ``dP - D`` is formed by ScalarE while it evacuates PSUM (identity with a per-row bias), so
    VectorE does a single bf16 multiply per score."""
    qt = vis.qt
    rows, s, w = qt.rows, qt.slot, vis.w
    dp_psum = nl.ndarray((rows, w), dtype=nl.float32, buffer=nl.psum)
    for c, (d0, dsz) in enumerate(d_chunks):
        _accumulate(dp_psum, c == 0, nisa.nc_matmul(do_T[0:dsz, c, nl.ds(s * PMAX, rows)],
                                                    v_T[0:dsz, c, nl.ds(vis.a, w)]))
    dp_minus_d = nisa.activation(nl.copy, dp_psum, bias=neg_delta[0:rows, s:s + 1], scale=1.0,
                                 dtype=op_dtype)
    return nisa.tensor_tensor(dp_minus_d, p, np.multiply, dtype=op_dtype)


def accumulate_dv_dk(vis, kt, p, ds, q_nat, do_nat, dv_psum, dk_psum, D):
    """``dV_j += P^T dO_i`` and ``dK_j += dS^T Q_i`` (scale applied at write-out), per 128-key
    block of the visit: stationary ``P[:, block]`` / ``dS[:, block]`` ``[rows, keys]``, moving
    ``dO_i`` / ``Q_i`` ``[rows, D]``, result ``[keys, D]`` accumulating in PSUM."""
    rows, s = vis.qt.rows, vis.qt.slot
    for bi in range(vis.b_lo, vis.b_hi):
        off, n = kt.blocks[bi]
        cols = nl.ds(off - vis.a, n)
        acc = nl.ds(bi * D, D)
        dv_psum[0:n, acc] += nisa.nc_matmul(p[0:rows, cols], do_nat[0:rows, s, :])
        dk_psum[0:n, acc] += nisa.nc_matmul(ds[0:rows, cols], q_nat[0:rows, s, :])


def accumulate_dq(vis, kt, ds, k_nat, dq_psum, op_dtype, tp_dtype, ds_transpose,
                  act_evac_blocks):
    """``dQ_i += dS K_j`` (scale applied at write-out). dQ contracts over keys, so dS goes
    through a transpose to ``[keys, rows]`` per 128-key block, the stationary operand against
    ``K[keys, D]``:

    * ``ds_transpose="dma"`` (whole 128-key blocks only): one DMA transpose of the visit's
      ``[rows, blocks, 128]`` dS into ``[128, blocks, rows]``, no TensorE or PSUM time;
    * ``"pe"``: a TensorE transpose per block into PSUM, copied to SBUF by ScalarE for the first
      ``act_evac_blocks`` blocks and by VectorE for the rest.
    """
    rows = vis.qt.rows
    blocks = range(vis.b_lo, vis.b_hi)
    if ds_transpose == "dma" and all(kt.blocks[bi][1] == PMAX for bi in blocks):
        nb = vis.b_hi - vis.b_lo
        ds_T = nl.ndarray((PMAX, nb, rows), dtype=op_dtype, buffer=nl.sbuf)
        ds_T[...] = nisa.dma_transpose(_blocks_view(ds, rows, nb))
        for j, bi in enumerate(blocks):
            _accumulate(dq_psum, j == 0, nisa.nc_matmul(ds_T[:, j, :], k_nat[:, bi, :]))
        return
    for j, bi in enumerate(blocks):
        off, n = kt.blocks[bi]
        ds_T = nl.ndarray((n, rows), dtype=op_dtype, buffer=nl.sbuf)
        engine = "scalar" if j < act_evac_blocks else "vector"
        _transpose_into(ds_T, ds[0:rows, nl.ds(off - vis.a, n)], tp_dtype, engine)
        _accumulate(dq_psum, j == 0, nisa.nc_matmul(ds_T, k_nat[0:n, bi, :]))


# ---------------------------------------------------------------------------------------------
# Phase 4: write-out
# ---------------------------------------------------------------------------------------------


def write_dk_dv(dk, dv, b, g, kt, dk_psum, dv_psum, D, scale, out_dtype, scratch, first, last):
    """Store ``dK_j = scale * dK_psum`` and ``dV_j = dV_psum`` for the valid keys of tile kt.

    With several passes the partial sums go through fp32 ``scratch = (dk_acc, dv_acc)`` in HBM:
    the first pass writes them, later passes add theirs, the last one writes the outputs."""
    for bi, (off, n) in enumerate(kt.blocks):
        ksl = nl.ds(kt.c0 + off, n)
        acc = nl.ds(bi * D, D)
        for out, psum, factor, part in ((dk, dk_psum, scale, 0), (dv, dv_psum, 1.0, 1)):
            if first and last:
                tile = nisa.activation(nl.copy, psum[0:n, acc], scale=factor, dtype=out_dtype)
                nl.store(out[b, g, ksl, :], value=tile)
                continue
            total = nisa.activation(nl.copy, psum[0:n, acc], scale=factor, dtype=nl.float32)
            if not first:
                prev = nl.load(scratch[part][ksl, :])
                total = nisa.tensor_tensor(total, prev, np.add, dtype=nl.float32)
            if last:
                nl.store(out[b, g, ksl, :], value=nisa.tensor_copy(total, dtype=out_dtype))
            else:
                nl.store(scratch[part][ksl, :], value=total)


def write_dq(dq, b, h0, qtiles, dq_acc, scale, out_dtype):
    """Store ``dQ_i = scale * dq_acc_i`` for every query tile of a pass."""
    for qt in qtiles:
        tile = nisa.activation(nl.copy, dq_acc[0:qt.rows, qt.slot, :], scale=scale,
                               dtype=out_dtype)
        nl.store(dq[b, h0 + qt.h, nl.ds(qt.r0, qt.rows), :], value=tile)


def zero_dq_scratch(dq_scratch, qtiles, D):
    """``dq_acc_i = 0`` in the fp32 HBM scratch of the ``dq_accumulate="hbm"`` variant."""
    for qt in qtiles:
        nl.store(dq_scratch[qt.h, nl.ds(qt.r0, qt.rows), :],
                 value=nl.zeros((qt.rows, D), dtype=nl.float32))


def accumulate_dq_in_hbm(dq_scratch, qt, dq_psum):
    """``dq_acc_i += dS K_j`` read-add-written in HBM (what a GPU does with atomics)."""
    rsl = nl.ds(qt.r0, qt.rows)
    prev = nl.load(dq_scratch[qt.h, rsl, :])
    nl.store(dq_scratch[qt.h, rsl, :],
             value=nisa.tensor_tensor(prev, dq_psum, np.add, dtype=nl.float32))


def write_dq_from_scratch(dq, b, h0, qtiles, dq_scratch, scale, out_dtype):
    """Store ``dQ_i = scale * dq_acc_i`` from the HBM scratch."""
    for qt in qtiles:
        rsl = nl.ds(qt.r0, qt.rows)
        acc = nl.load(dq_scratch[qt.h, rsl, :])
        tile = nisa.activation(nl.copy, acc, scale=scale, dtype=out_dtype)
        nl.store(dq[b, h0 + qt.h, rsl, :], value=tile)


def write_zero_rows(out, b, head, r0, r1, D, out_dtype):
    """Rows ``[r0, r1)`` of ``out[b, head]`` are zero (padding past q_len / kv_len)."""
    for z0 in range(r0, r1, PMAX):
        n = min(PMAX, r1 - z0)
        nl.store(out[b, head, nl.ds(z0, n), :], value=nl.zeros((n, D), dtype=out_dtype))


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------


class _Config(NamedTuple):
    """Compile-time choices shared by every sequence of a launch."""

    scale: float
    causal: Optional[str]
    window: Optional[Tuple[int, int]]
    G: int
    D: int
    d_chunks: Tuple[Tuple[int, int], ...]
    key_tile: int
    rows_per_pass: int
    op_dtype: object
    tp_dtype: object
    out_dtype: object
    dq_accumulate: str
    ds_transpose: str
    act_evac_blocks: int
    grads: Tuple[str, ...]


def backward_one_sequence(cfg, q, k, v, o, do, lse, dq, dk, dv, b, g, nq, nk, scratch,
                          dq_scratch):
    """All gradients of kv head g of sequence b (valid lengths nq, nk): passes over the query
    tiles of the group, each streaming K/V once (see the module docstring)."""
    G, D, d_chunks = cfg.G, cfg.D, cfg.d_chunks
    op_dtype, tp_dtype = cfg.op_dtype, cfg.tp_dtype
    n_dc, d_part = len(d_chunks), min(D, PMAX)
    n_kblk = cfg.key_tile // PMAX
    Nq, Nk = q.shape[2], k.shape[2]
    spec = mask_spec(nq, nk, cfg.causal, cfg.window)
    passes = plan_q_tiles(G, nq, cfg.rows_per_pass)
    ktiles = plan_k_tiles(nk, cfg.key_tile)
    h0 = g * G

    for p_idx, qtiles in enumerate(passes):
        n_slots = len(qtiles)
        q_nat = nl.ndarray((PMAX, n_slots, D), dtype=op_dtype, buffer=nl.sbuf)
        do_nat = nl.ndarray((PMAX, n_slots, D), dtype=op_dtype, buffer=nl.sbuf)
        q_T = nl.ndarray((d_part, n_dc, n_slots * PMAX), dtype=op_dtype, buffer=nl.sbuf)
        do_T = nl.ndarray((d_part, n_dc, n_slots * PMAX), dtype=op_dtype, buffer=nl.sbuf)
        neg_delta = nl.ndarray((PMAX, n_slots), dtype=nl.float32, buffer=nl.sbuf)
        exp_bias = nl.ndarray((PMAX, n_slots), dtype=nl.float32, buffer=nl.sbuf)
        load_query_side(q, do, o, lse, b, h0, qtiles, d_chunks, q_nat, q_T, do_nat, do_T,
                        neg_delta, exp_bias, op_dtype, tp_dtype)
        if cfg.dq_accumulate == "sbuf":
            dq_acc = nl.zeros((PMAX, n_slots, D), dtype=nl.float32, buffer=nl.sbuf)
        else:
            zero_dq_scratch(dq_scratch, qtiles, D)

        for kt in ktiles:
            k_nat = nl.ndarray((PMAX, n_kblk, D), dtype=op_dtype, buffer=nl.sbuf)
            k_T = nl.ndarray((d_part, n_dc, cfg.key_tile), dtype=op_dtype, buffer=nl.sbuf)
            v_T = nl.ndarray((d_part, n_dc, cfg.key_tile), dtype=op_dtype, buffer=nl.sbuf)
            load_kv_tile(k, v, b, g, kt, d_chunks, k_nat, k_T, v_T, op_dtype, tp_dtype)
            dk_psum = nl.zeros((PMAX, n_kblk * D), dtype=nl.float32, buffer=nl.psum)
            dv_psum = nl.zeros((PMAX, n_kblk * D), dtype=nl.float32, buffer=nl.psum)

            for qt in qtiles:
                vis = plan_visit(spec, qt, kt)
                if vis is None:
                    continue
                p = recompute_p(vis, kt, spec, cfg.scale, d_chunks, q_T, k_T, exp_bias,
                                op_dtype)
                ds = softmax_backward(vis, d_chunks, do_T, v_T, neg_delta, p, op_dtype)
                if "dk" in cfg.grads:
                    accumulate_dv_dk(vis, kt, p, ds, q_nat, do_nat, dv_psum, dk_psum, D)
                if "dq" not in cfg.grads:
                    continue
                dq_psum = nl.ndarray((qt.rows, D), dtype=nl.float32, buffer=nl.psum)
                accumulate_dq(vis, kt, ds, k_nat, dq_psum, op_dtype, tp_dtype,
                              cfg.ds_transpose, cfg.act_evac_blocks)
                if cfg.dq_accumulate == "sbuf":
                    dq_acc[0:qt.rows, qt.slot, :] = nisa.tensor_tensor(
                        dq_acc[0:qt.rows, qt.slot, :], dq_psum, np.add, dtype=nl.float32)
                else:
                    accumulate_dq_in_hbm(dq_scratch, qt, dq_psum)

            if "dk" in cfg.grads:
                write_dk_dv(dk, dv, b, g, kt, dk_psum, dv_psum, D, cfg.scale, cfg.out_dtype,
                            scratch, first=(p_idx == 0), last=(p_idx == len(passes) - 1))

        if "dq" not in cfg.grads:
            pass
        elif cfg.dq_accumulate == "sbuf":
            write_dq(dq, b, h0, qtiles, dq_acc, cfg.scale, cfg.out_dtype)
        else:
            write_dq_from_scratch(dq, b, h0, qtiles, dq_scratch, cfg.scale, cfg.out_dtype)

    # Padding rows: queries past q_len and keys past kv_len have zero gradients (all keys when
    # no query row is valid: then no pass ran).
    if "dq" in cfg.grads:
        for h in range(G):
            write_zero_rows(dq, b, h0 + h, nq, Nq, D, cfg.out_dtype)
    if "dk" in cfg.grads:
        k_zero_from = nk if passes else 0
        write_zero_rows(dk, b, g, k_zero_from, Nk, D, cfg.out_dtype)
        write_zero_rows(dv, b, g, k_zero_from, Nk, D, cfg.out_dtype)


@nki.jit
def flash_attn_bwd(q, k, v, o, do, lse, scale=1.0, causal=None, window=None, q_lens=None,
                   kv_lens=None, mixed_precision=True, rows_per_pass=None, key_tile=None,
                   dq_accumulate="sbuf", ds_transpose=None, act_evac_blocks=None,
                   grads=("dq", "dk", "dv")):
    """Flash attention backward; one program per kv head (and per sequence without lengths).

    Parameters
    ----------
    q, o, do : HBM (B, Hq, Nq, D), one float dtype (fp32, bf16 or fp16)
    k, v : HBM (B, Hkv, Nk, D), same dtype; ``Hq % Hkv == 0``, ``1 <= D <= 256``
    lse : HBM (B, Hq, Nq) float32, natural log, ``-inf`` for rows without a visible key
    scale : float (compile-time)
    causal : None, "top_left" or "bottom_right" (compile-time)
    window : None or (left, right) ints, -1 = unbounded (compile-time)
    q_lens, kv_lens : tuple of B ints, or None (compile-time)
        Valid lengths per sequence (None = all Nq / Nk). Without them the grid is
        ``[B, Hkv]`` (sequence ``program_id(0)``); with them it is ``[1, Hkv]`` and each
        program walks the B sequences in turn, so every tile shape is a compile-time constant:
        padding rows and keys are never loaded, computed or masked (their gradients are
        written as zeros).
    mixed_precision : bool
        fp32 inputs: bf16 matmul operands (True) or fp32 (False).
    rows_per_pass : int, optional
        Query rows (all heads of the group) resident per pass; None = as many as fit SBUF.
    key_tile : int, optional
        Keys per K/V tile (a multiple of 128, at most 512 and one PSUM bank of dK per row);
        None = the largest that fits.
    dq_accumulate : "sbuf" (default) or "hbm"
        Where dQ accumulates across K/V tiles: on chip, or (the atomics analogue, for
        measurement) read-add-written to an fp32 HBM scratch after every visit.
    ds_transpose : "pe", "dma" or None
        How dS is transposed for dQ (see :func:`accumulate_dq`); None = ``BWD_DS_TRANSPOSE``
        of the target generation.
    act_evac_blocks : int, optional
        With PE transposes, dS^T blocks per visit copied out of PSUM by ScalarE; None =
        ``BWD_ACT_EVAC_BLOCKS`` of the target.
    grads : ("dq", "dk", "dv") (default), ("dk", "dv") or ("dq",)
        Which gradients to compute. The subsets exist to measure the two-kernel design of
        GPU backwards (one kernel for dK/dV, one for dQ, each recomputing P and dP) against the
        single pass; see benchmarks/backward.py.

    Returns
    -------
    The requested gradients in the order dq (B, Hq, Nq, D), dk, dv (B, Hkv, Nk, D), in the
    input dtype.
    """
    grads = tuple(grads)
    if grads not in (("dq", "dk", "dv"), ("dk", "dv"), ("dq",)):
        raise ValueError(f"grads: expected ('dq', 'dk', 'dv'), ('dk', 'dv') or ('dq',), got "
                         f"{grads!r}")
    if dq_accumulate not in BWD_DQ_ACCUMULATE_MODES:
        raise ValueError(f"dq_accumulate: expected one of {BWD_DQ_ACCUMULATE_MODES}, got "
                         f"{dq_accumulate!r}")
    B, Hq, Nq, D = q.shape
    _, Hkv, Nk, _ = k.shape
    in_dtype = q.dtype
    if in_dtype == nl.float32 and not mixed_precision:
        op_dtype = nl.float32
    elif in_dtype == nl.float32:
        op_dtype = nl.bfloat16
    else:
        op_dtype = in_dtype
    gen3 = nisa.get_nc_version() >= nisa.nc_version.gen3
    target = "trn2" if gen3 else "trn1"
    op_itemsize = 4 if op_dtype == nl.float32 else 2
    if rows_per_pass is None:
        rows_per_pass = bwd_rows_per_pass(D, op_itemsize, target,
                                          dq_on_chip=(dq_accumulate == "sbuf"))
    cfg = _Config(
        scale=scale, causal=causal, window=window, G=Hq // Hkv, D=D,
        d_chunks=tuple((d0, min(PMAX, D - d0)) for d0 in range(0, D, PMAX)),
        key_tile=bwd_key_tile(D) if key_tile is None else key_tile,
        rows_per_pass=rows_per_pass, op_dtype=op_dtype,
        tp_dtype=op_dtype if (gen3 and op_dtype != nl.float32) else nl.float32,
        out_dtype=in_dtype, dq_accumulate=dq_accumulate,
        ds_transpose=BWD_DS_TRANSPOSE[target] if ds_transpose is None else ds_transpose,
        act_evac_blocks=(BWD_ACT_EVAC_BLOCKS[target] if act_evac_blocks is None
                         else act_evac_blocks), grads=grads)

    if q_lens is None and kv_lens is None:
        sequences = ((nl.program_id(0), Nq, Nk),)
    else:
        sequences = tuple((bi, Nq if q_lens is None else int(q_lens[bi]),
                           Nk if kv_lens is None else int(kv_lens[bi])) for bi in range(B))
    multi_pass = "dk" in grads and any(len(plan_q_tiles(cfg.G, nq, rows_per_pass)) > 1
                                       for _, nq, _ in sequences)

    dq = dk = dv = None
    if "dq" in grads:
        dq = nl.ndarray((B, Hq, Nq, D), dtype=in_dtype, buffer=nl.shared_hbm)
    if "dk" in grads:
        dk = nl.ndarray((B, Hkv, Nk, D), dtype=in_dtype, buffer=nl.shared_hbm)
        dv = nl.ndarray((B, Hkv, Nk, D), dtype=in_dtype, buffer=nl.shared_hbm)
    scratch = None
    if multi_pass:
        scratch = (nl.ndarray((Nk, D), dtype=nl.float32, buffer=nl.hbm),
                   nl.ndarray((Nk, D), dtype=nl.float32, buffer=nl.hbm))
    dq_scratch = None
    if dq_accumulate == "hbm":
        dq_scratch = nl.ndarray((cfg.G, Nq, D), dtype=nl.float32, buffer=nl.hbm)

    g = nl.program_id(1)
    for b, nq, nk in sequences:
        backward_one_sequence(cfg, q, k, v, o, do, lse, dq, dk, dv, b, g, nq, nk, scratch,
                              dq_scratch)
    if grads == ("dk", "dv"):
        return dk, dv
    if grads == ("dq",):
        return dq
    return dq, dk, dv
