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

Measured (``python benchmarks/backward.py``, simulator with the DMA chunk model; one head,
N = 4096, D = 128, bf16; modeled µs = max over engines; the limits of hardware-and-limits.md
§5 in brackets, strict / engine-aware):

=====================  ===============================  ===============================
variant                trn2 non-causal (273 / 382)      trn2 causal (137 / 191)
=====================  ===============================  ===============================
this design            280  (TensorE; 8.40 MB = min)    148  (TensorE; DMA 147)
dQ in HBM ("atomics")  454  (DMA; 46.2 MB)              278
two kernels (14N^2d)   475  (ScalarE; 13.7 MB)          280
dS^T on TensorE        335  (TensorE)                   176
=====================  ===============================  ===============================

trn1: 287 µs non-causal (strict 234, engine-aware 328), 151 µs causal (117 / 164), TensorE-bound
with the 6th pass. The single pass wins on every engine: the two-kernel split recomputes S, P
and dP (2 more matmuls, a second exp and dP - D per score), and dQ in HBM moves 5.5x the bytes.

DMA layout (the simulator's descriptor model, docs/simulator.md: every DMA pays 81.25 ns and
every chunk -- a run contiguous in HBM and SBUF within one partition -- 256 bytes of transfer
time). Tiles stay in their natural row order, which causal tile skipping at 128-row/128-key
granularity needs, so a row of Q, dO, O, K, dQ, dK, dV is one chunk; what the kernel saves is
instructions and the narrow chunks: Q, dO, O, LSE and dQ move runs of whole query tiles
(``tiles.BWD_GROUP_BYTES`` per partition, 8 tiles for bf16 D = 128) in one DMA each, K, dK, dV
a whole key tile; V, used only transposed, comes in wide rows (partition p holds keys
``4p .. 4p + 3`` of a 512-key tile, one 1 KiB chunk; its transposes put the columns back in
key order); LSE is one trn2 DMA transpose of its contiguous ``[tiles, 128]`` rows instead of
4-byte elements; and up to four visits of a key tile share one dS DMA transpose
(``tiles.BWD_DS_GROUP_BYTES``). At N = 4096, D = 128 on trn2 that took the causal backward from
177.6 µs (DMA-bound: 352 loads/stores at 256 B or 4 B per chunk and 144 dS transposes) to
147.6 µs (TensorE; DMA 146.6) and D = 64 from 166.2 to 139.9 (ScalarE); HBM bytes unchanged.

With runtime lengths (``--variants lens=full lens=N/2 q_lens=N/2``, same N and D, trn2): 335
µs non-causal (TensorE: the rank-1 key mask is a 6th pass) and 176 causal (TensorE; DMA 171),
trn1 334 / 175 (TensorE); ``q_lens`` alone costs nothing on TensorE (DMA 151 causal, 1 row
per gather); D = 64 within 2 % of no lengths on trn1, trn2 causal 160 (DMA) against 140. Rows
and keys are gathered one per partition by design (each with its own index, padding skipped),
so these keep the 256 B chunks. Half-padded sequences cost the same as full ones (only the
8-byte length reads and the skipped padding reads differ).

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

Masks. Causal and window masks follow the forward's :class:`masks.MaskSpec` (band, key range,
tile classes) of the padded shapes: tiles entirely outside the band are skipped at compile time,
tiles entirely inside it run unmasked, and on the boundary tiles the scaled scores are masked
*before* the exp by GpSimd ``affine_select`` (masked entries become ``fp32.min``, whose exp is
0) -- not by the forward's TensorE mask-add, because TensorE is the backward's busiest engine.
Rows whose LSE is ``-inf`` (no visible key) get an exp bias of ``-1e30`` instead of ``+inf``,
so their P is exactly 0 and they contribute nothing.

Lengths. ``kv_lens``/``q_lens`` are runtime ``(B,)`` int32 tensors, as in the forward: the
compiled kernel depends on shapes and static options only, so padded training does not
recompile every step (:class:`RuntimeMasks` has the details). Padding is never read -- the
loads are indirect DMAs that skip rows past the lengths (decode.py's ``oob_mode.skip``
mechanism) into zero-filled tiles -- so a NaN in padding cannot leak, and a padding query row
has zero inputs and the no-key exp bias (P = 0, dQ row 0). Keys past ``kv_len`` are masked
before the exp by the forward's rank-1 TensorE add (``MASK_NEG * 1 (x) key_row``), so their P,
dS, dK and dV are exactly 0. The bottom_right alignment would move the band with the lengths;
instead the gathers rotate each sequence so that its valid rows and keys end at Nq and Nk,
where the band is static again (scatter stores undo the rotation), so static tile skipping
holds with lengths too. What runtime lengths cannot do is skip work by value: every tile the
static band allows is computed, padding included -- a padded batch costs its padded shape
(the lengths only save the HBM reads of padding). ``kv_lens`` adds one rank-1 matmul per score
tile when D is a multiple of 128 (``w`` TensorE cycles per 128 x w scores: a 6th pass next to
the 5 at D = 128, +20 % TensorE); otherwise the mask rides in a spare contraction row of the S
matmul for free. ``q_lens`` costs only O(N d) work (index tables, zero fills).

Not fully confirmed APIs (reference/nki-api-spec.md): ``nisa.dma_copy`` casting between dtypes
(documented in §7.5; [RE] lists a same-dtype rule for some DMA paths) -- the gathers of fp32
inputs into bf16 operand tiles and the key row into fp32 operands rely on it, as decode.py does.

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
    BWD_DS_GROUP_BYTES,
    BWD_GROUP_BYTES,
    BWD_LSE_NO_KEY,
    BWD_MASK_FILL,
    FWD_FOLD_SCALE_RANGE,
    FWD_MASK_NEG,
    PMAX,
    bwd_key_tile,
    bwd_rows_per_pass,
)

# ---------------------------------------------------------------------------------------------
# Compile-time plan (pure Python on ints: which tiles exist, which are skipped or masked)
# ---------------------------------------------------------------------------------------------


class QTile(NamedTuple):
    """A tile of ``rows`` query rows starting at row ``r0`` of query head ``h`` (of the padded
    length Nq); ``slot`` is its place in the resident query-side state of its pass."""

    h: int
    r0: int
    rows: int
    slot: int


class KTile(NamedTuple):
    """Keys ``[c0, c0 + cols)`` of the padded length Nk, split in blocks of at most 128 keys:
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


def band_spec(Nq: int, Nk: int, causal: Optional[str], window) -> M.MaskSpec:
    """The visibility band of docs/semantics.md as the forward's :class:`masks.MaskSpec` of the
    padded shapes, always static: its ``static_offset`` is 0 for top_left and ``Nk - Nq``
    otherwise. With lengths the kernel makes that true on chip: top_left needs nothing (the
    valid rows and keys start at 0), and for the length-dependent bottom_right alignment
    (``off_b = kv_len - q_len``) the gathers rotate each sequence so that its valid rows and
    keys end at Nq and Nk (:class:`RuntimeMasks`)."""
    return M.MaskSpec(Nq, Nk, causal, window)


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
    """Key tiles over the keys ``[0, nk)``."""
    tiles = []
    for c0 in range(0, nk, key_tile):
        cols = min(key_tile, nk - c0)
        blocks = tuple((b, min(PMAX, cols - b)) for b in range(0, cols, PMAX))
        tiles.append(KTile(c0, cols, blocks))
    return tuple(tiles)


def plan_visit(spec: M.MaskSpec, qt: QTile, kt: KTile) -> Optional[Visit]:
    """Classify a (query tile, key tile) pair with the forward's mask plan: None when no row
    sees any of its keys, else the whole 128-key blocks holding visible keys
    (``spec.key_range``) and whether the band's edges cut through them (``spec.classify``).
    ``spec`` is the static band of the padded shapes (:func:`band_spec`)."""
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
# Runtime lengths: gathers that skip padding, and the masks built from the lengths (the shared
# pieces live in masks.py: RuntimeLengths, position_table, gather_rows, store_rows)
# ---------------------------------------------------------------------------------------------


class RuntimeMasks(M.RuntimeLengths):
    """What the runtime ``kv_lens``/``q_lens`` of this program's sequence b mean on chip:
    :class:`masks.RuntimeLengths` (shared with the forward), plus the backward's way of masking
    keys.

    * **Padding never enters SBUF.** Rows of q, do, o, lse past q_len and rows of k, v past
      kv_len are skipped by indirect DMAs (:meth:`index_table`, index pushed out of bounds,
      ``oob_mode.skip``: decode.py's mechanism) and keep the zeros (lse: ``-inf``) their tiles
      were filled with. A padding query row thus has q = do = o = 0, D = 0 and the no-key exp
      bias (P = 0 exactly): it contributes nothing and its dQ row comes out 0. A padding key
      has k = v = 0, finite whatever HBM holds there.
    * **Keys past kv_len are masked before the exp** like the forward's: ``MASK_NEG * 1 (x)
      key_row`` (``masks.neg_row``, ``masks.key_length_row``) accumulated into S in PSUM by a
      rank-1 TensorE matmul, so their P and dS are exactly 0, and so are their dK, dV rows.
      When D % 128 != 0 the two rows instead fill the spare contraction partition
      ``mask_row`` of Q^T and K^T's last head-dim chunk (SBUF -> SBUF DMAs, exempt from the
      start-partition rule), and the S matmul adds the mask at no TensorE cost.
    * **The band stays static.** With bottom_right alignment (and a window without causal) the
      gathers rotate the sequence by its lengths (``rotate_q``/``rotate_k``; see
      :class:`masks.RuntimeLengths`), so the band is the static bottom_right band of the padded
      shapes (:func:`band_spec`): static tile skipping and boundary masks as without lengths.
      Padding is then at the start (rows ``i' < Nq - q_len`` skipped by the loads, keys
      ``j' < Nk - kv_len`` masked), and the stores scatter dQ, dK, dV back through the same
      bijection, zero rows included.
    """

    def __init__(self, spec: M.MaskSpec, kv_lens, q_lens, b, Nq: int, Nk: int, D: int,
                 op_dtype):
        super().__init__(spec, kv_lens, q_lens, b, Nq, Nk)
        # With a spare partition in the last head-dim chunk (D % 128 != 0) the rank-1 key mask
        # rides in the S matmul itself: Q^T gets a MASK_NEG row there and K^T the key row
        # (free on TensorE). fp16 operands cannot hold MASK_NEG: separate bf16 matmul.
        self.mask_row = D % PMAX if (self.has_k and D % PMAX and op_dtype != nl.float16) \
            else None
        self.neg_row = None
        if self.has_k and self.mask_row is None:
            self.neg_row = M.neg_row(PMAX)

    def key_row(self, kt: "KTile"):
        """bf16 ``[1, cols]``: 1.0 at the tile's padding keys (None without kv_lens)."""
        return self.key_mask_row(kt.c0, kt.cols)


def query_runs(b, Hq: int, Nq: int, h0, qtiles):
    """:func:`masks.position_table` runs of a pass's query tiles (consecutive tiles of one head)."""
    runs = []
    for qt in qtiles:
        if runs and runs[-1][4] == qt.h:
            c0, count, first, pos0, h = runs[-1]
            runs[-1] = (c0, count + 1, first, pos0, h)
        else:
            runs.append((qt.slot, 1, (b * Hq + h0 + qt.h) * Nq + qt.r0, qt.r0, qt.h))
    return [r[:4] for r in runs]


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


def _transpose_into(dst, src, tp_dtype, engine="scalar", scale=1.0):
    """``dst[D, rows] = scale * src[rows, D]^T`` through a TensorE transpose and a PSUM -> SBUF
    copy on ScalarE (default; it applies ``scale``) or VectorE."""
    rows, cols = src.shape
    t_psum = nl.ndarray((cols, rows), dtype=tp_dtype, buffer=nl.psum)
    t_psum[...] = nisa.nc_transpose(src)
    if engine == "scalar":
        dst[...] = nisa.activation(nl.copy, t_psum, scale=scale, dtype=dst.dtype)
    else:
        dst[...] = nisa.tensor_copy(t_psum, dtype=dst.dtype)


def _blocks_view(t, rows, nblocks):
    """A ``[rows, nblocks * 128]`` tile seen as ``[rows, nblocks, 128]`` (a free-dim access
    pattern, no copy)."""
    ip = nl.arange(rows)[:, None, None]
    ib = nl.arange(nblocks)[None, :, None]
    ik = nl.arange(PMAX)[None, None, :]
    return t[ip, ib * PMAX + ik]


def _row_view(t, b, hh, r0: int, n: int, width=None, rows: int = PMAX):
    """HBM rows ``r0 + 128 j + p`` of ``t[b, hh]`` as ``[rows (p), n (j), width]`` (a 2-D
    ``[rows, n]`` view for ``width=None``: lse): n query tiles in one DMA, each row in its
    tile's natural place (partition p of slot j)."""
    if width is None:
        return t[b, hh, r0 + PMAX * nl.arange(n)[None, :] + nl.arange(rows)[:, None]]
    ip = nl.arange(rows)[:, None, None]
    ij = nl.arange(n)[None, :, None]
    return t[b, hh, r0 + PMAX * ij + ip, nl.arange(width)[None, None, :]]


def query_groups(qtiles, D: int, itemsize: int):
    """Runs of at most ``tiles.BWD_GROUP_BYTES // (D * itemsize)`` consecutive whole
    (128-row) query tiles of one head: each run is loaded (and dQ stored) by one DMA per tensor,
    which saves the fixed cost per DMA (see ``BWD_GROUP_BYTES``). A partial tile is a run of
    its own."""
    cap = max(1, BWD_GROUP_BYTES // (D * itemsize))
    groups = []
    for qt in qtiles:
        g = groups[-1] if groups else None
        if (g and qt.rows == PMAX and g[-1].rows == PMAX and g[-1].h == qt.h
                and g[-1].r0 + PMAX == qt.r0 and len(g) < cap):
            g.append(qt)
        else:
            groups.append([qt])
    return [tuple(g) for g in groups]


def _load_query_rows(cfg, rt, q, do, o, lse, b, hh, group, q_nat, q_load, gen3):
    """do, o ``[rows, n, D]`` (input dtype) and lse ``[rows, n]`` (fp32) of a run of n query
    tiles of head hh (:func:`query_groups`), and q into ``q_nat`` (operand dtype).

    Without ``q_lens`` each is one DMA of the run's rows (lse on trn2: a DMA transpose of its
    ``[n, 128]`` rows, contiguous, instead of 4-byte elements). With ``q_lens`` (single tiles)
    they are gathered through column ``slot`` of ``q_load`` (:meth:`RuntimeMasks.index_table`):
    padding rows are never read and stay 0 (lse: -inf)."""
    D, rows, n, s = cfg.D, group[0].rows, len(group), group[0].slot
    if q_load is None:
        r0 = group[0].r0
        q_nat[0:rows, s:s + n, :] = nl.load(_row_view(q, b, hh, r0, n, D, rows),
                                             dtype=cfg.op_dtype)
        do_in = nl.load(_row_view(do, b, hh, r0, n, D, rows))
        o_in = nl.load(_row_view(o, b, hh, r0, n, D, rows))
        if gen3:
            ij = nl.arange(n)[:, None]
            lse_t = nisa.dma_transpose(lse[b, hh, r0 + PMAX * ij + nl.arange(rows)[None, :]])
        else:
            lse_t = nl.load(_row_view(lse, b, hh, r0, n, rows=rows))
        return do_in, o_in, lse_t
    n_rows = q.shape[0] * q.shape[1] * q.shape[2]
    do_in = nisa.memset((rows, 1, D), 0.0, dtype=do.dtype, engine=nisa.gpsimd_engine)
    M.gather_rows(do_in[:, 0, :], do.reshape((n_rows, D)), q_load, s, rows, D)
    o_in = nisa.memset((rows, 1, D), 0.0, dtype=o.dtype, engine=nisa.gpsimd_engine)
    M.gather_rows(o_in[:, 0, :], o.reshape((n_rows, D)), q_load, s, rows, D)
    q_nat[0:rows, s, :] = nisa.memset((rows, D), 0.0, dtype=cfg.op_dtype,
                                      engine=nisa.gpsimd_engine)
    M.gather_rows(q_nat[0:rows, s, :], q.reshape((n_rows, D)), q_load, s, rows, D)
    lse_t = nisa.memset((rows, 1), -np.inf, dtype=nl.float32, engine=nisa.gpsimd_engine)
    M.gather_rows(lse_t, lse.reshape((n_rows, 1)), q_load, s, rows, 1)
    return do_in, o_in, lse_t


def load_query_side(cfg, rt, q, do, o, lse, b, h0, qtiles, q_nat, q_T, do_nat, do_T,
                    neg_delta, exp_bias):
    """Load every query tile of a pass and derive what the inner loop needs.

    Per tile (rows r0 .. r0 + rows - 1 of query head h0 + h):

    * ``q_nat``, ``do_nat`` ``[rows, D]`` in the operand dtype, and their transposes
      ``q_T`` (times ``cfg.q_scale``), ``do_T`` ``[D chunk, rows]``;
    * ``neg_delta = -D = -rowsum(dO * O)`` in fp32 (from the loaded values, before any
      rounding; negated because it is used as the ScalarE bias of ``dP - D``);
    * ``exp_bias = -LSE``, or ``BWD_EXP_BIAS_NO_KEY`` where LSE = -inf (a row with no visible
      key, or a padding row past q_len), computed as ``m * BIAS_NO_KEY - max(LSE, LSE_NO_KEY)``
      with ``m = [LSE < LSE_NO_KEY]`` so every intermediate is finite.

    With the key mask in the S matmul, Q^T's row ``rt.mask_row`` of the last head-dim chunk is
    ``MASK_NEG``. Returns the dQ scatter indices ``[128, slots]`` (None unless the rows are
    rotated).
    """
    op_dtype, tp_dtype = cfg.op_dtype, cfg.tp_dtype
    gen3 = nisa.get_nc_version() >= nisa.nc_version.gen3
    q_load = q_store = None
    if rt is not None and rt.has_q:
        B, Hq, Nq, _ = q.shape
        rows_i, pos = M.position_table(query_runs(b, Hq, Nq, h0, qtiles), len(qtiles))
        q_load, q_store = rt.index_table(rows_i, pos, B * Hq * Nq, keys=False)
        groups = [(qt,) for qt in qtiles]
    else:
        groups = query_groups(qtiles, cfg.D, 4 if do.dtype == nl.float32 else 2)
    for group in groups:
        hh, rows, s0, n = h0 + group[0].h, group[0].rows, group[0].slot, len(group)
        do_in, o_in, lse_t = _load_query_rows(cfg, rt, q, do, o, lse, b, hh, group, q_nat,
                                              q_load, gen3)
        lse_floor = nisa.tensor_scalar(lse_t, np.maximum, BWD_LSE_NO_KEY, dtype=nl.float32)
        no_key = nisa.tensor_scalar(lse_t, np.less, BWD_LSE_NO_KEY, dtype=nl.float32)
        exp_bias[0:rows, s0:s0 + n] = nisa.scalar_tensor_tensor(
            data=no_key, op0=np.multiply, operand0=BWD_EXP_BIAS_NO_KEY,
            op1=np.subtract, operand1=lse_floor, dtype=nl.float32)
        for j, qt in enumerate(group):
            s = qt.slot
            prod = nisa.tensor_tensor(do_in[0:rows, j, :], o_in[0:rows, j, :], np.multiply,
                                      dtype=nl.float32)
            neg_delta[0:rows, s:s + 1] = nisa.tensor_reduce(np.add, prod, axis=(1,),
                                                            negate=True, dtype=nl.float32,
                                                            keepdims=True)
            if do_in.dtype == op_dtype:
                do_nat[0:rows, s, :] = do_in[0:rows, j, :]
            else:
                do_nat[0:rows, s, :] = nisa.tensor_copy(do_in[0:rows, j, :], dtype=op_dtype)
            for c, (d0, dsz) in enumerate(cfg.d_chunks):
                cols = nl.ds(s * PMAX, rows)
                _transpose_into(q_T[0:dsz, c, cols], q_nat[0:rows, s, d0:d0 + dsz], tp_dtype,
                                scale=cfg.q_scale)
                _transpose_into(do_T[0:dsz, c, cols], do_nat[0:rows, s, d0:d0 + dsz],
                                tp_dtype)
    if rt is not None and rt.mask_row is not None:
        n = len(qtiles) * PMAX
        neg = nisa.memset((1, n), FWD_MASK_NEG, dtype=op_dtype, engine=nisa.gpsimd_engine)
        nisa.dma_copy(dst=q_T[rt.mask_row:rt.mask_row + 1, len(cfg.d_chunks) - 1, 0:n], src=neg)
    return q_store


# ---------------------------------------------------------------------------------------------
# Phase 2: one K/V tile (K natural for dQ, K^T and V^T for S and dP)
# ---------------------------------------------------------------------------------------------


def key_tables(rt, k, b, g):
    """Gather/scatter indices of every 128-key block of the program's keys (column = block):
    ``(load, store)`` int32 ``[128, ceil(Nk/128)]``, store None unless the keys are rotated
    (:meth:`RuntimeMasks.index_table`); ``(None, None)`` without ``kv_lens``."""
    if rt is None or not rt.has_k:
        return None, None
    B, Hkv, Nk, _ = k.shape
    n_blocks = -(-Nk // PMAX)
    rows_i, pos = M.position_table([(0, n_blocks, (b * Hkv + g) * Nk, 0)], n_blocks)
    return rt.index_table(rows_i, pos, B * Hkv * Nk, keys=True)


def load_kv_tile(cfg, k, v, b, g, kt, k_nat, k_T, v_T, k_load):
    """Keys ``kt.c0 ..`` of kv head g: ``k_nat[keys, blk, D]``, ``k_T[D chunk, c, keys]``,
    ``v_T[D chunk, c, keys]`` (V itself is only needed transposed). With ``kv_lens`` the keys
    are gathered through ``k_load`` (:func:`key_tables`): padding keys are never read and
    stay 0."""
    op_dtype, tp_dtype, D = cfg.op_dtype, cfg.tp_dtype, cfg.D
    if k_load is not None:
        n_rows = k.shape[0] * k.shape[1] * k.shape[2]
        k_rows, v_rows = k.reshape((n_rows, D)), v.reshape((n_rows, D))
    nb = len(kt.blocks)
    if k_load is None and kt.cols == nb * PMAX:
        # One DMA per tensor for the whole key tile. K is needed in natural blocks (keys
        # c0 + 128 bi + p on partition p of block bi: the moving operand of dQ), V only
        # transposed, so V comes in wide rows -- partition p holds the nb consecutive keys
        # c0 + nb p + j, one nb * D-element chunk -- and the copies out of PSUM put block j's
        # column p back at key nb p + j of V^T.
        k_nat[:, 0:nb, :] = nl.load(_row_view(k, b, g, kt.c0, nb, D), dtype=op_dtype)
        ip = nl.arange(PMAX)[:, None, None]
        ij = nl.arange(nb)[None, :, None]
        v_wide = nl.load(v[b, g, kt.c0 + nb * ip + ij, nl.arange(D)[None, None, :]],
                         dtype=op_dtype)
        for bi in range(nb):
            for c, (d0, dsz) in enumerate(cfg.d_chunks):
                _transpose_into(k_T[0:dsz, c, nl.ds(bi * PMAX, PMAX)],
                                k_nat[:, bi, d0:d0 + dsz], tp_dtype)
                iv = nl.arange(dsz)[:, None]
                _transpose_into(v_T[iv, c, bi + nb * nl.arange(PMAX)[None, :]],
                                v_wide[:, bi, d0:d0 + dsz], tp_dtype)
        return
    for bi, (off, n) in enumerate(kt.blocks):
        if k_load is not None:
            col = (kt.c0 + off) // PMAX
            k_nat[0:n, bi, :] = nisa.memset((n, D), 0.0, dtype=op_dtype,
                                            engine=nisa.gpsimd_engine)
            M.gather_rows(k_nat[0:n, bi, :], k_rows, k_load, col, n, D)
            v_in = nisa.memset((n, D), 0.0, dtype=op_dtype, engine=nisa.gpsimd_engine)
            M.gather_rows(v_in, v_rows, k_load, col, n, D)
        else:
            ksl = nl.ds(kt.c0 + off, n)
            k_nat[0:n, bi, :] = nl.load(k[b, g, ksl, :], dtype=op_dtype)
            v_in = nl.load(v[b, g, ksl, :], dtype=op_dtype)
        for c, (d0, dsz) in enumerate(cfg.d_chunks):
            _transpose_into(k_T[0:dsz, c, nl.ds(off, n)], k_nat[0:n, bi, d0:d0 + dsz], tp_dtype)
            _transpose_into(v_T[0:dsz, c, nl.ds(off, n)], v_in[0:n, d0:d0 + dsz], tp_dtype)


# ---------------------------------------------------------------------------------------------
# Phase 3: the per-visit math (recompute P, softmax backward, accumulate dV, dK, dQ)
# ---------------------------------------------------------------------------------------------


def recompute_p(cfg, spec, rt, vis, kt, key_row, q_T, k_T, exp_bias):
    """``P = exp(scale * Q K^T - LSE)`` for the visit's rows and keys, ``[rows, w]`` in the
    operand dtype. Masked keys get ``fp32.min`` (band edges, GpSimd) or ``MASK_NEG`` (keys past
    kv_len, TensorE) before the exp: P = 0 exactly."""
    qt = vis.qt
    rows, s, w = qt.rows, qt.slot, vis.w
    s_psum = nl.ndarray((rows, w), dtype=nl.float32, buffer=nl.psum)
    last = len(cfg.d_chunks) - 1
    for c, (d0, dsz) in enumerate(cfg.d_chunks):
        if c == last and rt is not None and rt.mask_row is not None:
            dsz += 1    # MASK_NEG row (x) key row: the key mask inside the S matmul
        _accumulate(s_psum, c == 0, nisa.nc_matmul(q_T[0:dsz, c, nl.ds(s * PMAX, rows)],
                                                   k_T[0:dsz, c, nl.ds(vis.a, w)]))
    if key_row is not None:
        s_psum[...] += nisa.nc_matmul(rt.neg_row[0:1, 0:rows], key_row[0:1, nl.ds(vis.a, w)])
    bias = exp_bias[0:rows, s:s + 1]
    if not (vis.mask_hi or vis.mask_lo):
        return nisa.activation(np.exp, s_psum, bias=bias, scale=cfg.exp_scale,
                               dtype=cfg.op_dtype)

    # Row i = qt.r0 + iq, key j = kt.c0 + vis.a + ik; keep i + off + lo <= j <= i + off + hi.
    # GpSimd selects on the diagonal tiles only: TensorE, where the forward adds its masks, is
    # the backward's busiest engine.
    scores = nisa.activation(nl.copy, s_psum, scale=cfg.exp_scale, dtype=nl.float32)
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
    return nisa.activation(np.exp, scores, bias=bias, scale=1.0, dtype=cfg.op_dtype)


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


def visit_groups(cfg, spec, qtiles, kt):
    """The visits of key tile kt, in query-tile order, as groups that share one dS DMA
    transpose: consecutive visits of whole query tiles over the same whole 128-key blocks, at
    most ``tiles.BWD_DS_GROUP_BYTES`` of dS per partition (4 visits of 512 keys in bf16), when
    dS^T goes by DMA into the on-chip dQ. Every DMA pays a fixed cost (81.25 ns, a third of a
    128 x 512 bf16 transpose), so this saves 3 of 4 on the visits off the causal diagonal. Any
    other visit is a group of one."""
    op_itemsize = 4 if cfg.op_dtype == nl.float32 else 2
    groupable = ("dq" in cfg.grads and cfg.dq_accumulate == "sbuf" and cfg.ds_transpose == "dma")
    groups = []
    for qt in qtiles:
        vis = plan_visit(spec, qt, kt)
        if vis is None:
            continue
        ok = (groupable and qt.rows == PMAX
              and all(kt.blocks[bi][1] == PMAX for bi in range(vis.b_lo, vis.b_hi)))
        last = groups[-1] if groups else None
        if (ok and last is not None and last[0] is not None
                and last[0][-1][1:] == vis[1:] and last[0][-1].qt.slot + 1 == qt.slot
                and (len(last[0]) + 1) * vis.w * op_itemsize <= BWD_DS_GROUP_BYTES):
            last[0].append(vis)
        else:
            groups.append(([vis] if ok else None, vis))
    return [tuple(g) if g is not None else (v,) for g, v in groups]


def grouped_visits(cfg, spec, rt, group, kt, key_row, q_T, k_T, do_T, v_T, q_nat, do_nat,
                   k_nat, neg_delta, exp_bias, dv_psum, dk_psum, dq_acc):
    """The visits of a :func:`visit_groups` group (same keys, consecutive whole query tiles):
    each computes P and dS and accumulates dV, dK as alone, with its dS written into one
    ``[128, n w]`` buffer; then one DMA transpose gives every dS^T block of the group
    ``[128 keys, n * blocks, 128 rows]``, and each visit adds its ``dS K`` into dQ."""
    v0 = group[0]
    n, w, nb = len(group), v0.w, v0.b_hi - v0.b_lo
    op_dtype, D = cfg.op_dtype, cfg.D
    ds_buf = nl.ndarray((PMAX, n * w), dtype=op_dtype, buffer=nl.sbuf)
    for m, vis in enumerate(group):
        p = recompute_p(cfg, spec, rt, vis, kt, key_row, q_T, k_T, exp_bias)
        ds_buf[:, nl.ds(m * w, w)] = softmax_backward(vis, cfg.d_chunks, do_T, v_T, neg_delta,
                                                      p, op_dtype)
        if "dk" in cfg.grads:
            accumulate_dv_dk(vis, kt, p, ds_buf[:, nl.ds(m * w, w)], q_nat, do_nat, dv_psum,
                             dk_psum, D)
    ds_T = nl.ndarray((PMAX, n * nb, PMAX), dtype=op_dtype, buffer=nl.sbuf)
    ds_T[...] = nisa.dma_transpose(_blocks_view(ds_buf, PMAX, n * nb))
    for m, vis in enumerate(group):
        s = vis.qt.slot
        dq_psum = nl.ndarray((PMAX, D), dtype=nl.float32, buffer=nl.psum)
        for j in range(nb):
            _accumulate(dq_psum, j == 0, nisa.nc_matmul(ds_T[:, m * nb + j, :],
                                                        k_nat[:, v0.b_lo + j, :]))
        dq_acc[:, s, :] = nisa.tensor_tensor(dq_acc[:, s, :], dq_psum, np.add,
                                             dtype=nl.float32)


# ---------------------------------------------------------------------------------------------
# Phase 4: write-out
# ---------------------------------------------------------------------------------------------


def write_dk_dv(dk, dv, b, g, kt, dk_psum, dv_psum, D, scale, out_dtype, scratch, first, last,
                k_store):
    """Store ``dK_j = scale * dK_psum`` and ``dV_j = dV_psum`` for the keys of tile kt (to the
    HBM rows ``k_store`` when the keys are rotated).

    With several passes the partial sums go through fp32 ``scratch = (dk_acc, dv_acc)`` in HBM
    (in the kernel's key order): the first pass writes them, later passes add theirs, the last
    one writes the outputs."""
    nb = len(kt.blocks)
    if first and last and k_store is None and kt.cols == nb * PMAX:
        # one copy out of PSUM and one DMA per tensor for the whole key tile
        for out, psum, factor in ((dk, dk_psum, scale), (dv, dv_psum, 1.0)):
            tile = nl.ndarray((PMAX, nb, D), dtype=out_dtype, buffer=nl.sbuf)
            ip = nl.arange(PMAX)[:, None, None]
            acc = D * nl.arange(nb)[None, :, None] + nl.arange(D)[None, None, :]
            tile[...] = nisa.activation(nl.copy, psum[ip, acc], scale=factor, dtype=out_dtype)
            nl.store(_row_view(out, b, g, kt.c0, nb, D), value=tile)
        return
    for bi, (off, n) in enumerate(kt.blocks):
        ksl = nl.ds(kt.c0 + off, n)
        acc = nl.ds(bi * D, D)
        for out, psum, factor, part in ((dk, dk_psum, scale, 0), (dv, dv_psum, 1.0, 1)):
            if first and last:
                tile = nisa.activation(nl.copy, psum[0:n, acc], scale=factor, dtype=out_dtype)
                M.store_rows(out, b, g, kt.c0 + off, n, tile, k_store, (kt.c0 + off) // PMAX)
                continue
            total = nisa.activation(nl.copy, psum[0:n, acc], scale=factor, dtype=nl.float32)
            if not first:
                prev = nl.load(scratch[part][ksl, :])
                total = nisa.tensor_tensor(total, prev, np.add, dtype=nl.float32)
            if last:
                M.store_rows(out, b, g, kt.c0 + off, n,
                             nisa.tensor_copy(total, dtype=out_dtype), k_store,
                             (kt.c0 + off) // PMAX)
            else:
                nl.store(scratch[part][ksl, :], value=total)


def write_dq(dq, b, h0, qtiles, dq_acc, scale, out_dtype, q_store):
    """Store ``dQ_i = scale * dq_acc_i`` for every query tile of a pass (to the HBM rows
    ``q_store`` when the rows are rotated)."""
    if q_store is not None:
        for qt in qtiles:
            tile = nisa.activation(nl.copy, dq_acc[0:qt.rows, qt.slot, :], scale=scale,
                                   dtype=out_dtype)
            M.store_rows(dq, b, h0 + qt.h, qt.r0, qt.rows, tile, q_store, qt.slot)
        return
    D = dq_acc.shape[2]
    for group in query_groups(qtiles, D, 4 if out_dtype == nl.float32 else 2):
        rows, s0, n = group[0].rows, group[0].slot, len(group)
        tile = nl.ndarray((rows, n, D), dtype=out_dtype, buffer=nl.sbuf)
        tile[...] = nisa.activation(nl.copy, dq_acc[0:rows, s0:s0 + n, :], scale=scale,
                                    dtype=out_dtype)
        nl.store(_row_view(dq, b, h0 + group[0].h, group[0].r0, n, D, rows), value=tile)


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


def write_dq_from_scratch(dq, b, h0, qtiles, dq_scratch, scale, out_dtype, q_store):
    """Store ``dQ_i = scale * dq_acc_i`` from the HBM scratch."""
    for qt in qtiles:
        acc = nl.load(dq_scratch[qt.h, nl.ds(qt.r0, qt.rows), :])
        tile = nisa.activation(nl.copy, acc, scale=scale, dtype=out_dtype)
        M.store_rows(dq, b, h0 + qt.h, qt.r0, qt.rows, tile, q_store, qt.slot)


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------


class _Config(NamedTuple):
    """Compile-time choices of a launch."""

    scale: float
    exp_scale: float
    q_scale: float
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


def backward_program(cfg, spec, rt, q, k, v, o, do, lse, dq, dk, dv, b, g, scratch,
                     dq_scratch):
    """All gradients of kv head g of sequence b: passes over the query tiles of the group,
    each streaming K/V once (see the module docstring)."""
    G, D, d_chunks = cfg.G, cfg.D, cfg.d_chunks
    op_dtype = cfg.op_dtype
    n_dc, d_part = len(d_chunks), min(D, PMAX)
    # Q^T, K^T: one more partition when the key mask row rides in a D < 128 contraction
    s_part = d_part + (1 if rt is not None and rt.mask_row is not None and D < PMAX else 0)
    n_kblk = cfg.key_tile // PMAX
    Nq, Nk = q.shape[2], k.shape[2]
    passes = plan_q_tiles(G, Nq, cfg.rows_per_pass)
    ktiles = plan_k_tiles(Nk, cfg.key_tile)
    h0 = g * G
    k_load, k_store = key_tables(rt, k, b, g)

    for p_idx, qtiles in enumerate(passes):
        n_slots = len(qtiles)
        q_nat = nl.ndarray((PMAX, n_slots, D), dtype=op_dtype, buffer=nl.sbuf)
        do_nat = nl.ndarray((PMAX, n_slots, D), dtype=op_dtype, buffer=nl.sbuf)
        q_T = nl.ndarray((s_part, n_dc, n_slots * PMAX), dtype=op_dtype, buffer=nl.sbuf)
        do_T = nl.ndarray((d_part, n_dc, n_slots * PMAX), dtype=op_dtype, buffer=nl.sbuf)
        neg_delta = nl.ndarray((PMAX, n_slots), dtype=nl.float32, buffer=nl.sbuf)
        exp_bias = nl.ndarray((PMAX, n_slots), dtype=nl.float32, buffer=nl.sbuf)
        q_store = load_query_side(cfg, rt, q, do, o, lse, b, h0, qtiles, q_nat, q_T, do_nat,
                                  do_T, neg_delta, exp_bias)
        dq_acc = (nl.zeros((PMAX, n_slots, D), dtype=nl.float32, buffer=nl.sbuf)
                  if cfg.dq_accumulate == "sbuf" else None)
        if cfg.dq_accumulate != "sbuf":
            zero_dq_scratch(dq_scratch, qtiles, D)

        for kt in ktiles:
            k_nat = nl.ndarray((PMAX, n_kblk, D), dtype=op_dtype, buffer=nl.sbuf)
            k_T = nl.ndarray((s_part, n_dc, cfg.key_tile), dtype=op_dtype, buffer=nl.sbuf)
            v_T = nl.ndarray((d_part, n_dc, cfg.key_tile), dtype=op_dtype, buffer=nl.sbuf)
            load_kv_tile(cfg, k, v, b, g, kt, k_nat, k_T, v_T, k_load)
            key_row = rt.key_row(kt) if rt is not None else None
            if key_row is not None and rt.mask_row is not None:
                nisa.dma_copy(dst=k_T[rt.mask_row:rt.mask_row + 1, n_dc - 1, 0:kt.cols],
                              src=key_row)
                key_row = None     # in the S matmul now
            dk_psum = nl.zeros((PMAX, n_kblk * D), dtype=nl.float32, buffer=nl.psum)
            dv_psum = nl.zeros((PMAX, n_kblk * D), dtype=nl.float32, buffer=nl.psum)

            for group in visit_groups(cfg, spec, qtiles, kt):
                if len(group) > 1:
                    grouped_visits(cfg, spec, rt, group, kt, key_row, q_T, k_T, do_T, v_T,
                                   q_nat, do_nat, k_nat, neg_delta, exp_bias, dv_psum,
                                   dk_psum, dq_acc)
                    continue
                vis, qt = group[0], group[0].qt
                p = recompute_p(cfg, spec, rt, vis, kt, key_row, q_T, k_T, exp_bias)
                ds = softmax_backward(vis, d_chunks, do_T, v_T, neg_delta, p, op_dtype)
                if "dk" in cfg.grads:
                    accumulate_dv_dk(vis, kt, p, ds, q_nat, do_nat, dv_psum, dk_psum, D)
                if "dq" not in cfg.grads:
                    continue
                dq_psum = nl.ndarray((qt.rows, D), dtype=nl.float32, buffer=nl.psum)
                accumulate_dq(vis, kt, ds, k_nat, dq_psum, op_dtype, cfg.tp_dtype,
                              cfg.ds_transpose, cfg.act_evac_blocks)
                if cfg.dq_accumulate == "sbuf":
                    dq_acc[0:qt.rows, qt.slot, :] = nisa.tensor_tensor(
                        dq_acc[0:qt.rows, qt.slot, :], dq_psum, np.add, dtype=nl.float32)
                else:
                    accumulate_dq_in_hbm(dq_scratch, qt, dq_psum)

            if "dk" in cfg.grads:
                write_dk_dv(dk, dv, b, g, kt, dk_psum, dv_psum, D, cfg.scale, cfg.out_dtype,
                            scratch, first=(p_idx == 0), last=(p_idx == len(passes) - 1),
                            k_store=k_store)

        if "dq" not in cfg.grads:
            pass
        elif cfg.dq_accumulate == "sbuf":
            write_dq(dq, b, h0, qtiles, dq_acc, cfg.scale, cfg.out_dtype, q_store)
        else:
            write_dq_from_scratch(dq, b, h0, qtiles, dq_scratch, cfg.scale, cfg.out_dtype,
                                  q_store)


@nki.jit
def flash_attn_bwd(q, k, v, o, do, lse, kv_lens=None, q_lens=None, *, scale=1.0, causal=None,
                   window=None, mixed_precision=True, rows_per_pass=None, key_tile=None,
                   dq_accumulate="sbuf", ds_transpose=None, act_evac_blocks=None,
                   grads=("dq", "dk", "dv")):
    """Flash attention backward; one program per (sequence, kv head): grid ``[B, Hkv]``.

    Parameters
    ----------
    q, o, do : HBM (B, Hq, Nq, D), one float dtype (fp32, bf16 or fp16)
    k, v : HBM (B, Hkv, Nk, D), same dtype; ``Hq % Hkv == 0``, ``1 <= D <= 256``
    lse : HBM (B, Hq, Nq) float32, natural log, ``-inf`` for rows without a visible key
    kv_lens, q_lens : HBM (B,) int32, or None (runtime tensors, like the forward's)
        Valid lengths per sequence (None = all Nk / Nq), values in [0, Nk] / [0, Nq]. The
        compiled kernel depends only on whether each is given, never on its values: padding
        rows and keys are skipped by the loads and masked on chip (:class:`RuntimeMasks`), and
        their gradients come out as zeros.
    scale : float (compile-time)
    causal : None, "top_left" or "bottom_right" (compile-time)
    window : None or (left, right) ints, -1 = unbounded (compile-time)
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
    spec = band_spec(Nq, Nk, causal, window)
    # Runtime masks add MASK_NEG to the raw scores on TensorE, and the exp scales them: for
    # scale >= FWD_FOLD_SCALE_RANGE[0] a masked score becomes <= -2^76 (or -inf: there is no
    # running max here to overflow), whose exp is 0. Smaller scales (tiny, zero, negative) go
    # into Q^T as it leaves PSUM instead, as in the forward.
    scale = float(scale)
    fold = kv_lens is None or scale >= FWD_FOLD_SCALE_RANGE[0]
    cfg = _Config(
        scale=scale, exp_scale=scale if fold else 1.0, q_scale=1.0 if fold else scale,
        G=Hq // Hkv, D=D, d_chunks=tuple((d0, min(PMAX, D - d0)) for d0 in range(0, D, PMAX)),
        key_tile=bwd_key_tile(D) if key_tile is None else key_tile,
        rows_per_pass=rows_per_pass, op_dtype=op_dtype,
        tp_dtype=op_dtype if (gen3 and op_dtype != nl.float32) else nl.float32,
        out_dtype=in_dtype, dq_accumulate=dq_accumulate,
        ds_transpose=BWD_DS_TRANSPOSE[target] if ds_transpose is None else ds_transpose,
        act_evac_blocks=(BWD_ACT_EVAC_BLOCKS[target] if act_evac_blocks is None
                         else act_evac_blocks), grads=grads)
    multi_pass = "dk" in grads and len(plan_q_tiles(cfg.G, Nq, rows_per_pass)) > 1

    # conditional expressions, not if-blocks: a tensor bound inside a block is out of scope
    # after it (err_local_variable_used_out_of_scope)
    dq = (nl.ndarray((B, Hq, Nq, D), dtype=in_dtype, buffer=nl.shared_hbm)
          if "dq" in grads else None)
    dk = (nl.ndarray((B, Hkv, Nk, D), dtype=in_dtype, buffer=nl.shared_hbm)
          if "dk" in grads else None)
    dv = (nl.ndarray((B, Hkv, Nk, D), dtype=in_dtype, buffer=nl.shared_hbm)
          if "dk" in grads else None)
    scratch = ((nl.ndarray((Nk, D), dtype=nl.float32, buffer=nl.hbm),
                nl.ndarray((Nk, D), dtype=nl.float32, buffer=nl.hbm)) if multi_pass else None)
    dq_scratch = (nl.ndarray((cfg.G, Nq, D), dtype=nl.float32, buffer=nl.hbm)
                  if dq_accumulate == "hbm" else None)

    b, g = nl.program_id(0), nl.program_id(1)
    rt = (RuntimeMasks(spec, kv_lens, q_lens, b, Nq, Nk, D, op_dtype)
          if (kv_lens is not None or q_lens is not None) else None)
    backward_program(cfg, spec, rt, q, k, v, o, do, lse, dq, dk, dv, b, g, scratch, dq_scratch)
    if grads == ("dk", "dv"):
        return dk, dv
    if grads == ("dq",):
        return dq
    return dq, dk, dv
