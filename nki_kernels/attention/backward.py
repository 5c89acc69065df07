"""Flash attention backward: dQ, dK, dV recomputed from O and LSE, K/V streamed once per pass.

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

Design: one kernel, K/V streamed once per pass, no atomics
----------------------------------------------------------
GPUs either run one kernel whose dQ is accumulated with atomics in HBM (10 N^2 d FLOPs) or two
kernels, one for dK/dV and one for dQ, that recompute P and dP twice (14 N^2 d FLOPs by the
matmul count: S, dP, dV, dK in the first and S, dP, dQ in the second). A NeuronCore has 24-28
MiB of SBUF, enough to keep the query-side state of many query tiles on chip: Q, Q^T, dO, dO^T,
D, LSE and the fp32 dQ accumulator. So the kernel keeps a *pass* of query tiles resident and
streams K/V past it in tiles of ``Bk`` keys (the outer loop), and for each K/V tile visits every
resident query tile of every head of the group (the inner loops):

* dK_j and dV_j accumulate in PSUM across the inner loops (TensorE ``+=`` onto ``nl.zeros``:
  one accumulation group each) and are written once per pass;
* dQ_i of every resident query tile stays in SBUF (fp32) and gains ``dS_ij K_j`` per visit (a
  VectorE add of [128, d] per 128 x Bk scores);
* with one pass, Q, dO, O, LSE, K, V are each read from HBM once and dQ, dK, dV written once:
  the minimum traffic, ``itemsize * (4 Nq d + 2 Nk d) + 4 Nq`` in and ``itemsize * (Nq d + 2 Nk
  d)`` out per (query head, kv head) pair.

That is 5 matmuls per score (10 N^2 d FLOPs) plus the dS transposes: dQ contracts over keys, so
it needs dS^T (keys on the partitions). By default they are TensorE transposes (a 6th PE pass;
the copies out of PSUM split between ScalarE and VectorE) on trn1 and trn2 alike: the SBUF ->
SBUF DMA transpose that would leave TensorE its 5 passes on trn2 is one AWS disables in its own
kernels as not yet stable (nki-samples 0898a77, ``transpose_p_local``), so it is opt-in here
(``ds_transpose="dma"``).

Loop structure: a fixed nest of NKI loops with compile-time bounds, so the compiled program does
not grow with N (``simulate.measure(...).program_instructions``)::

    for p in sequential_range(P):                  passes; slot t of pass p = query tile t P + p
      load the query side of the pass             affine loops over heads and slot groups
      for span in key spans (<= BWD_K_SPANS + 1):  unrolled; compile-time key-tile ranges
        for j in sequential_range(tiles of span):  a K/V tile (dQ is carried across it)
          load the K/V tile; dK, dV = 0 in PSUM
          for region in span.regions:              unrolled: the slots the span's keys reach
            for h in affine_range(G):
              for t in affine_range(slots of the region):
                visit: recompute P, dS; dV += P^T dO; dK += dS^T Q; dQ_slot += dS K
          write dK, dV (with P > 1: add them to an fp32 scratch in HBM)
      write dQ of the pass

Passes interleave their query tiles (tile ``t P + p`` sits in slot t of pass p), so every pass
meets the causal or window band in the same place: the key spans, and within each the ranges
of slots its keys can reach, are compile-time constants valid for every pass. The kernel thus
skips the band's fully masked part at span granularity with one pass or many. Regions where
every row sees every key run without masks; in the others the scores are masked before the exp
by GpSimd ``affine_select`` on loop-index predicates (row ``(t P + p) 128 + i``, key
``j Bk + k``). The partial last key tile (``Nk % Bk`` keys) is a span of its own with static
code. Every query tile is 128 rows: the last, partial one (and, with several passes, up to
``P - 1`` padding tiles that balance them) is loaded under a row mask into zero-filled tiles
with LSE = -inf, so its padding rows have P = 0 and contribute nothing, and its dQ store is
masked.

Limits. A pass holds ``tiles.bwd_slot_bytes`` per 128 query rows (bf16, D = 128: 1544 bytes per
partition) next to a fixed working set, within 90 % of SBUF (``tiles.BWD_SBUF_BUDGET_BYTES``),
so one pass covers ``G * Nq`` up to ``tiles.bwd_rows_per_pass`` query rows per kv head. Beyond
that the query tiles are split into :func:`tiles.bwd_passes` passes; every pass streams K/V
again and read-add-writes its dK/dV partial sums into an fp32 scratch in HBM (zeroed first,
copied out to dK/dV after the last pass; deterministic, no atomics): one more read of K/V and
``16 Nk d`` bytes of scratch traffic per extra pass.

Layouts (all on chip, from the standard ``(B, H, N, D)`` layout in HBM):

* "natural" tiles ``[128 rows (partitions), D]``: Q, dO (moving operands of dK, dV), K (moving
  operand of dQ), O (for D);
* "transposed" tiles ``[D (partitions), rows]``: Q^T, dO^T, K^T, V^T (operands of S and dP,
  which contract over D), made on chip with TensorE transposes (once per input tile);
* S, P, dP, dS are ``[128 query rows, Bk keys]``: the per-row LSE and D are per-partition
  scalars (ScalarE bias, VectorE scalar operand).

Masks. Causal and window masks follow the forward's :class:`masks.MaskSpec` of the padded
shapes: key spans x slot regions entirely outside the band are not in any loop, regions
entirely inside it run unmasked, and in the others the scaled scores are masked *before* the
exp by GpSimd ``affine_select`` on loop-index predicates (masked entries become ``fp32.min``,
whose exp is 0) -- not by the forward's TensorE mask-add, because TensorE is the backward's
busiest engine.
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
where the band is static again (scatter stores undo the rotation), so the span plan holds with
lengths too. What runtime lengths cannot do is skip work by value: every tile the
static band allows is computed, padding included -- a padded batch costs its padded shape
(the lengths only save the HBM reads of padding). ``kv_lens`` adds one rank-1 matmul per score
tile when D is a multiple of 128 (``w`` TensorE cycles per 128 x w scores: a 6th pass next to
the 5 at D = 128, +20 % TensorE); otherwise the mask rides in a spare contraction row of the S
matmul for free. ``q_lens`` costs only O(N d) work (index tables, zero fills).

One source, two namespaces (:mod:`nki_kernels.port`): the kernel traces through ``nki.*``
(NKI 0.7: trn2, trn3) and the legacy ``neuronxcc.nki`` (trn1), the loop nest above being
:func:`port.loop` (``nl.fori_loop`` in 0.7; in legacy the ``sequential_range`` /
``affine_range`` shown). Where the namespaces differ:

* *grid*: legacy launches the SPMD grid ``(B, Hkv)``; 0.7 launches ``kernel[lnc]`` and the
  kernel loops over the programs (:func:`port.for_programs`, :func:`backward_grid`);
* *band edges*: the offset of a visit's band selection is its key-minus-row distance, a
  loop-index expression. The upper edge is a :class:`port.DiagonalMask` (legacy
  ``affine_select``; 0.7 one ``range_select`` against a per-row bound table made once); the
  lower one, ALiBi's distances and the key-length row read the distance (or the first key)
  from a table built once per launch (:class:`port.OffsetColumns`) and compare on VectorE.
  Dropout's unit numbers and the flat rows of the gathers are linear forms of the loop
  indices, read from a second table (summed in fp32 on VectorE, exact below 2^24; where they
  may reach 2^24, in int32 on GpSimd from the table's ``exact`` form);
* *row masks*: legacy loads and stores the query tiles of a pass under a row mask (the partial
  last tile, the padding tiles that balance several passes). 0.7 has no masks: with one pass
  the partial tile is a statically short group of its own; with several passes (or
  ``q_lens``) every slot is gathered and scattered by indirect DMA (:func:`port.rows`), rows
  past Nq pushed out of bounds;
* *copies by assignment* (legacy) are VectorE ``tensor_copy`` in 0.7.

The gradients are the same bit for bit and, without masks, so is the modeled time (a band's
lower edge costs 0.7 a few VectorE instructions per masked visit); the program stays flat in N
under both.

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

import numpy as np  # compile-time constants only (-inf)

from nki_kernels import port
from nki_kernels.attention import masks as M
from nki_kernels.attention import score_mods as SM
from nki_kernels.port import nl
from nki_kernels.tiles import (
    unrolled,
    FP32_EXACT_INT,
    BWD_ACT_EVAC_BLOCKS,
    BWD_DQ_ACCUMULATE_MODES,
    BWD_DS_TRANSPOSE,
    BWD_EXP_BIAS_NO_KEY,
    BWD_GROUP_BYTES,
    BWD_K_SPANS,
    BWD_LSE_NO_KEY,
    BWD_MASK_FILL,
    FWD_FOLD_SCALE_RANGE,
    FWD_MASK_NEG,
    PMAX,
    bwd_key_tile,
    bwd_passes,
    bwd_rows_per_pass,
    ceil_div,
)

# ---------------------------------------------------------------------------------------------
# Compile-time plan (pure Python on ints: the loop bounds)
# ---------------------------------------------------------------------------------------------


class Region(NamedTuple):
    """Slots ``[t0, t0 + n)`` of every pass that a key span's keys reach; ``masked``: some of
    their rows do not see every key of the span (the scores go through the band mask)."""

    t0: int
    n: int
    masked: bool


class KeySpan(NamedTuple):
    """Key tiles ``j0 .. j0 + n - 1`` of ``cols`` keys each (key ``j Bk + k``; only the partial
    last tile, alone in its span, has ``cols < Bk``) and the slot regions they visit."""

    j0: int
    n: int
    cols: int
    regions: Tuple[Region, ...]


class BackwardPlan(NamedTuple):
    """The loop bounds of one grid instance (identical for every instance)."""

    passes: int
    slots: int          # resident query tiles per head and pass
    key_tile: int
    spans: Tuple[KeySpan, ...]
    row_mask: bool      # some slot holds rows past Nq (partial last tile, balancing padding)


def band_spec(Nq: int, Nk: int, causal: Optional[str], window, alibi: bool = False
              ) -> M.MaskSpec:
    """The visibility band of docs/semantics.md as the forward's :class:`masks.MaskSpec` of the
    padded shapes, always static: its ``static_offset`` is 0 for top_left and ``Nk - Nq``
    otherwise. With lengths the kernel makes that true on chip: top_left needs nothing (the
    valid rows and keys start at 0), and for the length-dependent bottom_right alignment
    (``off_b = kv_len - q_len``) the gathers rotate each sequence so that its valid rows and
    keys end at Nq and Nk (:class:`RuntimeMasks`). ALiBi's distance rotates the same way
    (``MaskSpec.alibi``)."""
    return M.MaskSpec(Nq, Nk, causal, window, alibi=alibi)


def slot_regions(spec: M.MaskSpec, passes: int, slots: int, Nq: int, c0: int, width: int):
    """Regions of the slots that keys ``[c0, c0 + width)`` reach: slot t holds rows
    ``[t P 128, (t + 1) P 128)`` over the P passes, so its class (skipped, unmasked, masked) is
    that of those rows (:meth:`MaskSpec.classify`), the same in every pass."""
    out = []
    for t in unrolled(slots):
        r0 = t * passes * PMAX
        r1 = min(Nq, (t + 1) * passes * PMAX)
        kind = spec.classify(r0, r1 - r0, c0, width) if r0 < r1 else None
        if kind is None:
            continue
        masked = kind != M.FULL
        if out and out[-1].t0 + out[-1].n == t and out[-1].masked == masked:
            out[-1] = Region(out[-1].t0, out[-1].n + 1, masked)
        else:
            out.append(Region(t, 1, masked))
    return tuple(out)


def plan_backward(Nq: int, Nk: int, G: int, spec: M.MaskSpec, key_tile: int,
                  rows_per_pass: int) -> BackwardPlan:
    """Passes and slots (:func:`tiles.bwd_passes`), the full key tiles in at most
    ``BWD_K_SPANS`` spans (one without a band), the partial key tile as a span of its own, and
    each span's slot regions. A span no slot sees has no regions: its keys are never loaded and
    their dK, dV are zeros (:func:`write_unseen_keys`)."""
    passes, slots = bwd_passes(G, Nq, rows_per_pass)
    n_full, tail = Nk // key_tile, Nk % key_tile
    spans = []
    n_spans = min(n_full, BWD_K_SPANS if spec.has_diag else 1)
    j = 0
    for i in unrolled(n_spans):
        n = n_full // n_spans + (1 if i < n_full % n_spans else 0)
        spans.append(KeySpan(j, n, key_tile,
                             slot_regions(spec, passes, slots, Nq, j * key_tile, n * key_tile)))
        j += n
    if tail:
        spans.append(KeySpan(n_full, 1, tail,
                             slot_regions(spec, passes, slots, Nq, n_full * key_tile, tail)))
    return BackwardPlan(passes, slots, key_tile, tuple(spans),
                        row_mask=passes * slots * PMAX > Nq)


def _valid_in(lo: int, hi: int, n_valid: int, N: int, rotated: bool) -> int:
    """Valid positions among frame positions ``[lo, hi)`` of a sequence with ``n_valid`` of N
    valid: ``[0, n_valid)``, or ``[N - n_valid, N)`` when the gathers rotate it."""
    v0, v1 = (N - n_valid, N) if rotated else (0, n_valid)
    return max(0, min(hi, v1) - max(lo, v0))


def plan_hbm_bytes(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, itemsize: int,
                   plan: BackwardPlan, spec: M.MaskSpec, *, q_lens=None, kv_lens=None):
    """HBM bytes ``(read, written)`` the kernel moves, counted from its own loop structure.

    ``q_lens``/``kv_lens``: per-sequence valid lengths (B ints) or None. Per (sequence b, kv
    head): the valid query rows of its G heads (q, do, o and the fp32 lse) once; per pass the
    valid keys of every span some slot sees (k, v); one int32 per given length array; dq, dk, dv
    in full. With several passes, the fp32 dK/dV scratch: zeroed, read-add-written per pass
    over the seen spans, read once at the end."""
    G = Hq // Hkv
    rot_q = spec.rotates and q_lens is not None
    rot_k = spec.rotates and kv_lens is not None
    seen = [(sp.j0 * plan.key_tile, min(Nk, (sp.j0 + sp.n) * plan.key_tile))
            for sp in plan.spans if sp.regions]
    multi = plan.passes > 1
    read = written = 0
    for b in unrolled(B):
        nq = Nq if q_lens is None else int(q_lens[b])
        nk = Nk if kv_lens is None else int(kv_lens[b])
        nq = _valid_in(0, Nq, nq, Nq, rot_q)
        keys = sum(_valid_in(lo, hi, nk, Nk, rot_k) for lo, hi in seen)
        read += Hkv * (G * nq * (3 * D * itemsize + 4) + plan.passes * 2 * keys * D * itemsize)
        read += 4 * Hkv * ((q_lens is not None) + (kv_lens is not None))
        written += Hkv * itemsize * (G * Nq * D + 2 * Nk * D)
        if multi:
            rmw = plan.passes * sum(hi - lo for lo, hi in seen) * 2 * D * 4
            read += Hkv * (rmw + 2 * Nk * D * 4)
            written += Hkv * (rmw + 2 * Nk * D * 4)
    return read, written


def slot_groups(slots: int, cap: int):
    """``(first slot, groups, slots per group)`` runs covering ``[0, slots)``: full groups of
    ``cap`` slots (an NKI loop) and the remainder (one static group)."""
    out = []
    if slots // cap:
        out.append((0, slots // cap, cap))
    if slots % cap:
        out.append(((slots // cap) * cap, 1, slots % cap))
    return out


# ---------------------------------------------------------------------------------------------
# Runtime lengths: gathers that skip padding, and the masks built from the lengths (the shared
# pieces live in masks.py: RuntimeLengths, position_table, gather_rows)
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
      shapes (:func:`band_spec`). Padding is then at the start (rows ``i' < Nq - q_len``
      skipped by the loads, keys ``j' < Nk - kv_len`` masked), and the stores scatter dQ, dK,
      dV back through the same bijection, zero rows included.
    """

    def __init__(self, spec: M.MaskSpec, kv_lens, q_lens, b, Nq: int, Nk: int, D: int,
                 op_dtype, softcap: bool = False):
        super().__init__(spec, kv_lens, q_lens, b, Nq, Nk)
        # With a spare partition in the last head-dim chunk (D % 128 != 0) the rank-1 key mask
        # rides in the S matmul itself: Q^T gets a MASK_NEG row there and K^T the key row
        # (free on TensorE). fp16 operands cannot hold MASK_NEG: separate bf16 matmul. With
        # soft-capping the mask must follow the tanh (which maps MASK_NEG to -1): separate.
        self.mask_row = D % PMAX if (self.has_k and D % PMAX and op_dtype != nl.float16
                                     and not softcap) else None
        self.neg_row = None
        if self.has_k and self.mask_row is None:
            self.neg_row = M.neg_row(PMAX)

    def key_row(self, c0, cols: int, offsets=None):
        """bf16 ``[1, cols]``: 1.0 at the padding keys of keys ``[c0, c0 + cols)`` (None without
        kv_lens; ``c0`` a multiple of 128, read from ``offsets`` under nki.*)."""
        return self.key_mask_row(c0, cols, offsets=offsets)


def query_tables(cfg, plan: BackwardPlan, rt, q_shape, b, g, p):
    """Gather and scatter indices ``[128, G * slots]`` of pass p's query rows (column ``h
    slots + t``: head ``g G + h``, query tile ``t P + p``) in q's ``(B Hq Nq, D)`` view, with
    ``q_lens`` (``rt``) or, under nki.* with several passes (no row masks there), without.
    Rows past Nq (the partial tile, balancing padding) are never read or written: both tables
    push them out of bounds; so do padding rows in the load table (:meth:`RuntimeMasks.
    index_table`). The flat rows and positions depend on the program and pass: linear forms of
    ``b``, ``g``, ``p``, read from ``cfg.indices`` under nki.*."""
    B, Hq, Nq, _ = q_shape
    G = cfg.G
    runs = [(h * plan.slots, plan.slots, [(b, Hq * Nq), (g, G * Nq), (p, PMAX), (h * Nq, 1)],
             [(p, PMAX)]) for h in unrolled(G)]
    rows, pos = M.position_table(runs, G * plan.slots, plan.passes * PMAX, offsets=cfg.indices)
    total = B * Hq * Nq
    shape = tuple(pos.shape)
    inside = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(inside, pos, nl.less, float(Nq))
    if rt is None:
        load = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_scalar(load, inside, nl.subtract, 1.0, op1=nl.multiply,
                           operand1=-float(M.oob_offset(total)))
        port.tensor_tensor(load, rows, load, nl.add)
        return load, load
    valid = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(valid, rt.valid(pos, keys=False), inside, nl.multiply)
    load, store = rt.index_table(rows, pos, total, keys=False, valid=valid)
    beyond = None
    if store is not None or not port.predicates():
        beyond = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_scalar(beyond, inside, nl.subtract, 1.0, op1=nl.multiply,
                           operand1=-float(M.oob_offset(total)))
    if store is None and beyond is not None:
        # nki.*: dQ is scattered too (its grouped stores would need row masks): every row
        # in place but those past Nq
        store = rows
    if beyond is not None:
        moved = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_tensor(moved, store, beyond, nl.add)
        store = moved
    return load, store


def key_tables(rt, k, b, g, indices=None):
    """Gather/scatter indices of every 128-key block of the program's keys (column = block):
    ``(load, store)`` int32 ``[128, ceil(Nk/128)]``, store None unless the keys are rotated
    (:meth:`RuntimeMasks.index_table`); ``(None, None)`` without ``kv_lens``."""
    if rt is None or not rt.has_k:
        return None, None
    B, Hkv, Nk, _ = k.shape
    n_blocks = ceil_div(Nk, PMAX)
    rows_i, pos = M.position_table([(0, n_blocks, [(b, Hkv * Nk), (g, Nk)], 0)], n_blocks,
                                   offsets=indices)
    return rt.index_table(rows_i, pos, B * Hkv * Nk, keys=True)


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _transpose_into(dst, src, tp_dtype, engine="scalar", scale=1.0):
    """``dst[D, rows] = scale * src[rows, D]^T`` through a TensorE transpose and a PSUM -> SBUF
    copy on ScalarE (default; it applies ``scale``) or VectorE. ``tp_dtype``: the PSUM dtype of
    the legacy trace (:func:`port.transpose_dtype`; nki.* requires the input's)."""
    rows, cols = src.shape
    t_psum = nl.ndarray((cols, rows), dtype=port.transpose_dtype(src.dtype, legacy=tp_dtype),
                        buffer=nl.psum)
    port.nc_transpose(t_psum, src)
    if engine == "scalar":
        port.activation(dst, nl.copy, t_psum, scale=scale)
    else:
        port.tensor_copy(dst, t_psum)


def _copy(dst, src):
    """``dst = src`` between SBUF tiles: an assignment in legacy (the copy its estimates were
    made with), a VectorE ``tensor_copy`` in 0.7 (which has no tile assignment)."""
    if port.api() == "nki":
        port.tensor_copy(dst, src, engine="vector")
    else:
        dst[...] = src


def _split_free(t, n: int, width: int):
    """The first ``n * width`` columns of a 2-D tile ``[rows, cols]`` seen as ``[rows, n,
    width]`` (a free-dim access pattern, no copy): an ``nl.arange`` expression in legacy,
    ``reshape_dim`` in 0.7."""
    if port.api() == "nki":
        return t[:, 0:n * width].reshape_dim(1, (n, width))
    ip = nl.arange(t.shape[0])[:, None, None]
    ib = nl.arange(n)[None, :, None]
    ik = nl.arange(width)[None, None, :]
    return t[ip, ib * width + ik]


def _blocks(cols: int):
    """``(offset, keys)`` of the 128-key blocks of a key tile of ``cols`` keys."""
    return tuple((o, min(PMAX, cols - o)) for o in unrolled(0, cols, PMAX))


class _Rows(NamedTuple):
    """Query rows of ``n`` consecutive slots of one head in one pass: slot ``s0 + j`` holds
    rows ``r0 + j stride + i`` (i < 128) of head ``hh``."""

    hh: object
    s0: object
    r0: object
    n: int
    stride: int


def _rows_view(t, b, rw: _Rows, width=None):
    """HBM rows of :class:`_Rows` as ``[128 (i), n (j), width]`` (``[128, n]`` for lse). Under
    nki.* one pass holds every query tile (``stride`` 128): consecutive rows, reshaped."""
    if port.api() == "nki":
        if width is None:
            return t[b, rw.hh, nl.ds(rw.r0, rw.n * PMAX)].reshape_dim(0, (rw.n, PMAX)).permute(
                (1, 0))
        return port.row_blocks(t, (b, rw.hh), rw.r0, PMAX, rw.n, width)
    ip = nl.arange(PMAX)[:, None, None] if width is not None else nl.arange(PMAX)[:, None]
    ij = nl.arange(rw.n)[None, :, None] if width is not None else nl.arange(rw.n)[None, :]
    if width is None:
        return t[b, rw.hh, rw.r0 + rw.stride * ij + ip]
    return t[b, rw.hh, rw.r0 + rw.stride * ij + ip, nl.arange(width)[None, None, :]]


def _row_mask(rw: _Rows, Nq: int, width=None):
    """Rows of :class:`_Rows` inside ``[0, Nq)`` (a legacy predicate on the view's shape)."""
    ip = nl.arange(PMAX)[:, None, None] if width is not None else nl.arange(PMAX)[:, None]
    ij = nl.arange(rw.n)[None, :, None] if width is not None else nl.arange(rw.n)[None, :]
    return rw.r0 + rw.stride * ij + ip < Nq


def _query_groups(plan: BackwardPlan, Nq: int, cap: int):
    """``(first slot, groups, slots per group, rows)`` runs covering the slots of a head: the
    :func:`slot_groups` of ``cap``, every slot of ``rows = 128`` rows (rows past Nq masked in
    legacy). 0.7 has no masks: there (one pass) the partial last tile is a static group of its
    own, of ``Nq % 128`` rows."""
    partial = plan.row_mask and not port.predicates()
    full = plan.slots - (1 if partial else 0)
    out = [(t0, n_groups, n, PMAX) for t0, n_groups, n in slot_groups(full, cap)]
    if partial:
        out.append((full, 1, 1, Nq - full * PMAX))
    return out


# ---------------------------------------------------------------------------------------------
# Phase 1: query-side state of a pass (Q, Q^T, dO, dO^T, D = rowsum(dO * O), exp bias)
# ---------------------------------------------------------------------------------------------


class _State(NamedTuple):
    """Resident query-side state of a pass: slot ``h slots + t`` (head h0 + h, tile t P + p)."""

    q_nat: object       # [128, S, D]         operand dtype
    do_nat: object      # [128, S, D]
    q_T: object         # [D chunk, n_dc, S 128]  (Q^T times q_scale)
    do_T: object        # [D chunk, n_dc, S 128]
    neg_delta: object   # [128, S] fp32: -rowsum(dO * O)
    exp_bias: object    # [128, S] fp32: -LSE, or the no-key bias
    dq_acc: object      # [128, S, D] fp32 (None when dQ accumulates in HBM)
    sink_terms: object = None   # [128, S] fp32: -exp(sink - LSE) D per row (with sinks)


def _derive(cfg, st: _State, do_in, o_in, lse_t, s0, n: int, h=None):
    """From the loaded dO, O ``[128, n, D]`` and LSE ``[128, n]`` of slots ``s0 .. s0 + n - 1``
    (Q already in ``q_nat``) of member head ``h``: exp bias, -D, dO in the operand dtype, Q^T
    and dO^T; with sinks each row's share of dsink, ``-exp(sink - LSE) D`` (0 for rows
    without a visible key: their exp bias is the no-key one).

    ``exp_bias = -LSE``, or ``BWD_EXP_BIAS_NO_KEY`` where LSE = -inf (a row with no visible
    key, a padding row), computed as ``m * BIAS_NO_KEY - max(LSE, LSE_NO_KEY)`` with ``m =
    [LSE < LSE_NO_KEY]`` so every intermediate is finite."""
    op_dtype, tp_dtype = cfg.op_dtype, cfg.tp_dtype
    lse_floor = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(lse_floor, lse_t, nl.maximum, BWD_LSE_NO_KEY)
    no_key = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(no_key, lse_t, nl.less, BWD_LSE_NO_KEY)
    port.scalar_tensor_tensor(st.exp_bias[:, nl.ds(s0, n)], no_key, nl.multiply,
                              BWD_EXP_BIAS_NO_KEY, nl.subtract, lse_floor)
    for j in unrolled(n):
        s = s0 + j
        prod = nl.ndarray((PMAX, cfg.D), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(prod, do_in[:, j, :], o_in[:, j, :], nl.multiply)
        port.tensor_reduce(st.neg_delta[:, nl.ds(s, 1)], nl.add, prod, axis=(1,), negate=True)
        if do_in.dtype == op_dtype:
            _copy(st.do_nat[:, s, :], do_in[:, j, :])
        else:
            port.tensor_copy(st.do_nat[:, s, :], do_in[:, j, :])
        for c, (d0, dsz) in enumerate(cfg.d_chunks):
            cols = nl.ds(s * PMAX, PMAX)
            _transpose_into(st.q_T[0:dsz, c, cols], st.q_nat[:, s, d0:d0 + dsz], tp_dtype,
                            scale=cfg.q_scale)
            _transpose_into(st.do_T[0:dsz, c, cols], st.do_nat[:, s, d0:d0 + dsz], tp_dtype)
    if st.sink_terms is not None:
        p_sink = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
        port.activation(p_sink, nl.exp, st.exp_bias[:, nl.ds(s0, n)],
                        bias=SM.HeadColumns.col(cfg.cols.sink, h, PMAX), scale=1.0)
        port.tensor_tensor(st.sink_terms[:, nl.ds(s0, n)], p_sink,
                           st.neg_delta[:, nl.ds(s0, n)], nl.multiply, engine="gpsimd")


def _zeros(shape, dtype):
    """A zero-filled SBUF tile (GpSimd memset: attention kernels leave GpSimd mostly idle)."""
    t = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    port.memset(t, 0.0, engine="gpsimd")
    return t


def _lse_tile(n: int):
    """fp32 ``[128, n]`` filled with -inf (the LSE of rows never loaded: no visible key)."""
    t = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(t, -np.inf, engine="gpsimd")
    return t


def load_query_side(cfg, plan: BackwardPlan, rt, q, do, o, lse, b, h0, p, st: _State,
                    q_load):
    """Load pass p's query tiles of every head and derive what the visits need (:func:`_derive`).

    Without ``q_lens`` the slots move in groups of up to ``BWD_GROUP_BYTES`` per partition per
    tensor (one DMA each: every DMA pays a fixed cost), under a row mask when some rows lie past
    Nq (their tiles are zero-filled first, LSE -inf; under nki.* the partial tile is a group of
    its own whose load is statically short). With ``q_lens`` every slot is gathered through its
    column of ``q_load``: padding rows are never read."""
    D, G, Nq = cfg.D, cfg.G, q.shape[2]
    P, S_h = plan.passes, plan.slots
    stride = P * PMAX
    if q_load is not None:
        n_rows = q.shape[0] * q.shape[1] * q.shape[2]

        def gather_slot(h, t):
            s = h * S_h + t
            do_in = _zeros((PMAX, 1, D), do.dtype)
            M.gather_rows(do_in[:, 0, :], do.reshape((n_rows, D)), q_load, s, PMAX, D)
            o_in = _zeros((PMAX, 1, D), o.dtype)
            M.gather_rows(o_in[:, 0, :], o.reshape((n_rows, D)), q_load, s, PMAX, D)
            port.memset(st.q_nat[:, s, :], 0.0, engine="gpsimd")
            M.gather_rows(st.q_nat[:, s, :], q.reshape((n_rows, D)), q_load, s, PMAX, D)
            lse_t = _lse_tile(1)
            M.gather_rows(lse_t, lse.reshape((n_rows, 1)), q_load, s, PMAX, 1)
            _derive(cfg, st, do_in, o_in, lse_t, s, 1, h)

        port.loop(G, lambda h: port.loop(S_h, lambda t: gather_slot(h, t)))
        return
    cap = max(1, BWD_GROUP_BYTES // (D * (4 if do.dtype == nl.float32 else 2)))

    def group(h, t, n: int, rows: int):
        rw = _Rows(h0 + h, h * S_h + t, (t * P + p) * PMAX, n, stride)
        sl = nl.ds(rw.s0, n)
        if rows < PMAX:
            # nki.*: the partial last tile (one slot), loaded statically short
            port.memset(st.q_nat[:, sl, :], 0.0, engine="gpsimd")
            port.dma_copy(st.q_nat[0:rows, rw.s0, :], q[b, rw.hh, nl.ds(rw.r0, rows), :])
            do_in = _zeros((PMAX, n, D), do.dtype)
            port.dma_copy(do_in[0:rows, 0, :], do[b, rw.hh, nl.ds(rw.r0, rows), :])
            o_in = _zeros((PMAX, n, D), o.dtype)
            port.dma_copy(o_in[0:rows, 0, :], o[b, rw.hh, nl.ds(rw.r0, rows), :])
            lse_t = _lse_tile(n)
            port.dma_copy(lse_t[0:rows, 0:1],
                          lse.reshape(lse.shape + (1,))[b, rw.hh, nl.ds(rw.r0, rows), :])
        elif plan.row_mask and port.predicates():
            m3, m2 = _row_mask(rw, Nq, D), _row_mask(rw, Nq)
            port.memset(st.q_nat[:, sl, :], 0.0, engine="gpsimd")
            port.dma_copy(st.q_nat[:, sl, :], _rows_view(q, b, rw, D), mask=m3)
            do_in = _zeros((PMAX, n, D), do.dtype)
            port.dma_copy(do_in, _rows_view(do, b, rw, D), mask=m3)
            o_in = _zeros((PMAX, n, D), o.dtype)
            port.dma_copy(o_in, _rows_view(o, b, rw, D), mask=m3)
            lse_t = _lse_tile(n)
            port.dma_copy(lse_t, _rows_view(lse, b, rw), mask=m2)
        else:
            port.dma_copy(st.q_nat[:, sl, :], _rows_view(q, b, rw, D))
            do_in = nl.ndarray((PMAX, n, D), dtype=do.dtype, buffer=nl.sbuf)
            port.dma_copy(do_in, _rows_view(do, b, rw, D))
            o_in = nl.ndarray((PMAX, n, D), dtype=o.dtype, buffer=nl.sbuf)
            port.dma_copy(o_in, _rows_view(o, b, rw, D))
            lse_t = nl.ndarray((PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
            port.dma_copy(lse_t, _rows_view(lse, b, rw))
        _derive(cfg, st, do_in, o_in, lse_t, rw.s0, n, h)

    for t0, n_groups, n, rows in _query_groups(plan, Nq, cap):
        port.loop(G, lambda h, t0=t0, n_groups=n_groups, n=n, rows=rows: port.loop(
            n_groups, lambda gi: group(h, t0 + gi * n, n, rows)))


def mask_row_in_q_T(cfg, rt, st: _State):
    """With the key mask in the S matmul: Q^T's row ``rt.mask_row`` of the last head-dim chunk
    is ``MASK_NEG`` (one SBUF -> SBUF DMA for the whole pass)."""
    n = st.q_T.shape[2]
    neg = nl.ndarray((1, n), dtype=cfg.op_dtype, buffer=nl.sbuf)
    port.memset(neg, FWD_MASK_NEG, engine="gpsimd")
    port.dma_copy(st.q_T[rt.mask_row:rt.mask_row + 1, len(cfg.d_chunks) - 1, 0:n], neg,
                  legacy_isa=True)


# ---------------------------------------------------------------------------------------------
# Phase 2: one K/V tile (K natural for dQ, K^T and V^T for S and dP)
# ---------------------------------------------------------------------------------------------


class _KV(NamedTuple):
    k_nat: object       # [128, blocks, D]  operand dtype
    k_T: object         # [D chunk (+1), n_dc, Bk]
    v_T: object         # [D chunk, n_dc, Bk]


def _wide_rows(t, b, g, c0, nb: int, D: int):
    """``[128, nb, D]`` HBM view whose partition p holds the nb consecutive rows ``c0 + nb p +
    j`` of ``t[b, g]`` (one ``nb * D``-element chunk per partition)."""
    if port.api() == "nki":
        return t[b, g, nl.ds(c0, nb * PMAX), :].reshape_dim(0, (PMAX, nb))
    ip = nl.arange(PMAX)[:, None, None]
    ij = nl.arange(nb)[None, :, None]
    return t[b, g, c0 + nb * ip + ij, nl.arange(D)[None, None, :]]


def _every_nth_col(t, rows: int, first, n: int, count: int):
    """Columns ``first, first + n, ...`` (count of them) of the first ``rows`` partitions of
    the 2-D tile view ``t``."""
    if port.api() == "nki":
        return t[0:rows, first:first + n * (count - 1) + 1:n]
    return t[nl.arange(rows)[:, None], first + n * nl.arange(count)[None, :]]


def load_kv_tile(cfg, k, v, b, g, c0, cols: int, kv: _KV, k_load, col0):
    """Keys ``c0 .. c0 + cols - 1`` of kv head g (``c0`` an NKI expression): ``k_nat``,
    ``k_T``, ``v_T`` (V itself is only needed transposed). With ``kv_lens`` the keys are
    gathered through columns ``col0 + block`` of ``k_load``: padding keys are never read and
    stay 0.

    Non-finite entries are zeroed in ``v_T`` (the dP operand) and ``k_nat`` (the dQ operand),
    not in ``k_T`` (S): a row that sees such a key or value still gets NaN -- through its P and
    dS (key) or its D = rowsum(dO O) (value, O being NaN there) -- while a row that cannot see
    it (P = 0) no longer computes ``0 * inf`` in dP or dQ."""
    op_dtype, tp_dtype, D = cfg.op_dtype, cfg.tp_dtype, cfg.D
    blocks = _blocks(cols)
    nb = len(blocks)
    if k_load is None and cols == nb * PMAX:
        # One DMA per tensor for the whole key tile. K is needed in natural blocks (keys
        # c0 + 128 bi + p on partition p of block bi: the moving operand of dQ), V only
        # transposed, so V comes in wide rows -- partition p holds the nb consecutive keys
        # c0 + nb p + j, one nb * D-element chunk -- and the copies out of PSUM put block j's
        # column p back at key nb p + j of V^T.
        port.dma_copy(kv.k_nat[:, 0:nb, :], port.row_blocks(k, (b, g), c0, PMAX, nb, D))
        v_wide = nl.ndarray((PMAX, nb, D), dtype=op_dtype, buffer=nl.sbuf)
        port.dma_copy(v_wide, _wide_rows(v, b, g, c0, nb, D))
        M.zero_non_finite(v_wide)
        for bi in unrolled(nb):
            for c, (d0, dsz) in enumerate(cfg.d_chunks):
                _transpose_into(kv.k_T[0:dsz, c, nl.ds(bi * PMAX, PMAX)],
                                kv.k_nat[:, bi, d0:d0 + dsz], tp_dtype)
                _transpose_into(_every_nth_col(kv.v_T[:, c, :], dsz, bi, nb, PMAX),
                                v_wide[:, bi, d0:d0 + dsz], tp_dtype)
        M.zero_non_finite(kv.k_nat[:, 0:nb, :])
        return
    if k_load is not None:
        n_rows = k.shape[0] * k.shape[1] * k.shape[2]
        k_rows, v_rows = k.reshape((n_rows, D)), v.reshape((n_rows, D))
    for bi, (off, n) in enumerate(blocks):
        if k_load is not None:
            port.memset(kv.k_nat[0:n, bi, :], 0.0, engine="gpsimd")
            M.gather_rows(kv.k_nat[0:n, bi, :], k_rows, k_load, col0 + bi, n, D)
            v_in = _zeros((n, D), op_dtype)
            M.gather_rows(v_in, v_rows, k_load, col0 + bi, n, D)
        else:
            port.dma_copy(kv.k_nat[0:n, bi, :], k[b, g, nl.ds(c0 + off, n), :])
            v_in = nl.ndarray((n, D), dtype=op_dtype, buffer=nl.sbuf)
            port.dma_copy(v_in, v[b, g, nl.ds(c0 + off, n), :])
        M.zero_non_finite(v_in)
        for c, (d0, dsz) in enumerate(cfg.d_chunks):
            _transpose_into(kv.k_T[0:dsz, c, nl.ds(off, n)], kv.k_nat[0:n, bi, d0:d0 + dsz],
                            tp_dtype)
            _transpose_into(kv.v_T[0:dsz, c, nl.ds(off, n)], v_in[0:n, d0:d0 + dsz], tp_dtype)
        M.zero_non_finite(kv.k_nat[0:n, bi, :])


# ---------------------------------------------------------------------------------------------
# Phase 3: one visit (recompute P, softmax backward, accumulate dV, dK, dQ)
# ---------------------------------------------------------------------------------------------


class _Visit(NamedTuple):
    """A (slot, key tile) pair: slot ``s`` holds query rows ``i0 .. i0 + 127`` of head ``h0 +
    h``, the tile keys
    ``c0 .. c0 + cols - 1`` (NKI expressions of the loop indices; ``cols`` static); ``masked``:
    the band's edges may cut it."""

    s: object
    i0: object
    h: object
    c0: object
    cols: int
    masked: bool
    r: object = None    # (i0 - c0) / 128: the visit's diagonal (``cfg.diagonal``)


def recompute_p(cfg, spec, rt, vis: _Visit, key_row, st: _State, kv: _KV):
    """``(P, g)``: ``P = exp(scale * Q K^T - LSE)``, ``[128, cols]`` in the operand dtype.
    Masked keys get ``fp32.min`` (band edges, GpSimd ``affine_select`` on the row and key
    indices; under nki.* their loop-index part read from ``cfg.offsets``) or ``MASK_NEG``
    (keys past kv_len, TensorE) before the exp: P = 0 exactly. With score modifiers
    (``score_mods``) the scores are modified first (raw units of ``cfg.unit``) and ``g = 1 -
    tanh^2`` is the soft-cap's derivative (else None)."""
    w = vis.cols
    s_psum = nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.psum)
    last = len(cfg.d_chunks) - 1
    for c, (d0, dsz) in enumerate(cfg.d_chunks):
        if c == last and rt is not None and rt.mask_row is not None:
            dsz += 1    # MASK_NEG row (x) key row: the key mask inside the S matmul
        port.nc_matmul(s_psum, st.q_T[0:dsz, c, nl.ds(vis.s * PMAX, PMAX)],
                       kv.k_T[0:dsz, c, 0:w], accumulate=c > 0)
    capped = cfg.mods.softcap is not None
    if key_row is not None and not capped:
        port.nc_matmul(s_psum, rt.neg_row[0:1, 0:PMAX], key_row[0:1, 0:w], accumulate=True)
    bias = st.exp_bias[:, nl.ds(vis.s, 1)]
    off = spec.static_offset
    # the key-minus-row distance of the tile's first score (a multiple of 128)
    dist = vis.c0 - vis.i0
    g = None
    if cfg.mods.transforms:
        y, t = SM.modify_scores(cfg.mods, cfg.cols, s_psum, PMAX, w, vis.h, dist,
                                cfg.exp_scale / cfg.unit, not SM.one_sided(spec),
                                d_static=-off, offsets=cfg.offsets)
        if t is not None:
            g = SM.softcap_grad_factor(t, PMAX, w)
        if key_row is not None and capped:
            # the key mask after the tanh: its own PSUM tile, added on VectorE
            kneg = nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.psum)
            port.nc_matmul(kneg, rt.neg_row[0:1, 0:PMAX], key_row[0:1, 0:w])
            y_k = nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_tensor(y_k, y, kneg, nl.add)
            y = y_k
        if not vis.masked:
            p = nl.ndarray((PMAX, w), dtype=cfg.op_dtype, buffer=nl.sbuf)
            port.activation(p, nl.exp, y, bias=bias, scale=cfg.unit)
            return p, g
        scores, exp_scale = y, cfg.unit
    elif not vis.masked:
        p = nl.ndarray((PMAX, w), dtype=cfg.op_dtype, buffer=nl.sbuf)
        port.activation(p, nl.exp, s_psum, bias=bias, scale=cfg.exp_scale)
        return p, g
    else:
        scores = nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.sbuf)
        port.activation(scores, nl.copy, s_psum, scale=cfg.exp_scale)
        exp_scale = 1.0
    # Row i = i0 + iq, key j = c0 + ik; keep i + off + lo <= j <= i + off + hi, i.e. the
    # distance dist + ik - iq between off + lo and off + hi. The lower bound: legacy selects
    # into a new tile (the trace its estimates were made with); 0.7, whose selection with a
    # runtime offset is a predicated copy, selects in place (no copy of the scores first)
    in_place = port.api() == "nki"
    if spec.hi is not None:
        # j <= i + off + hi: keys on or below a diagonal that moves with the loop indices
        # (:class:`port.DiagonalMask`: legacy affine_select, 0.7 one range_select)
        upper = nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.sbuf)
        cfg.diagonal.select(upper, scores, vis.r)
        scores = upper
    if spec.lo is not None:
        lower = scores if in_place else nl.ndarray((PMAX, w), dtype=nl.float32, buffer=nl.sbuf)
        port.affine_select(lower, [[1, w]], -1, scores, BWD_MASK_FILL, nl.greater_equal,
                           offset=-(off + spec.lo), runtime=dist, offsets=cfg.offsets)
        scores = lower
    p = nl.ndarray((PMAX, w), dtype=cfg.op_dtype, buffer=nl.sbuf)
    port.activation(p, nl.exp, scores, bias=bias, scale=exp_scale)
    return p, g


def softmax_backward(cfg, vis: _Visit, st: _State, kv: _KV, p, pz=None, g=None):
    """``dS = P * (dP - D)`` with ``dP = dO V^T``, ``[128, cols]`` in the operand dtype; with
    soft-capping times ``g = 1 - tanh^2`` (folded into P on GpSimd; with dropout a last
    multiply of the fp32 dS).

    ``dP - D`` is formed by ScalarE while it evacuates PSUM (identity with a per-row bias), so
    VectorE does a single multiply per score. With dropout (``pz = Z * P``, unscaled) it is
    ``Z P dP / (1 - p) - P D``: two GpSimd passes and one VectorE pass (VectorE also draws
    Z)."""
    w = vis.cols
    shape = (PMAX, w)
    dp_psum = nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum)
    for c, (d0, dsz) in enumerate(cfg.d_chunks):
        port.nc_matmul(dp_psum, st.do_T[0:dsz, c, nl.ds(vis.s * PMAX, PMAX)],
                       kv.v_T[0:dsz, c, 0:w], accumulate=c > 0)
    neg_d = st.neg_delta[:, nl.ds(vis.s, 1)]
    if pz is not None:
        # dS = P (Z dP / (1 - p) - D) = Z P dP / (1 - p) - P D   (appendix Algorithm 4).
        # VectorE already draws Z (nisa.dropout is VectorE-only): two of the three
        # element-wise passes run on GpSimd, which the backward otherwise leaves idle
        dp = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        port.activation(dp, nl.copy, dp_psum, scale=1.0 / (1.0 - cfg.dropout_p))
        zp_dp = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(zp_dp, dp, pz, nl.multiply, engine="gpsimd")
        p_d = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(p_d, p, nl.multiply, neg_d, engine="vector")
        ds = nl.ndarray(shape, dtype=cfg.op_dtype if g is None else nl.float32,
                        buffer=nl.sbuf)
        port.tensor_tensor(ds, zp_dp, p_d, nl.add, engine="gpsimd")
        if g is None:
            return ds
        ds_g = nl.ndarray(shape, dtype=cfg.op_dtype, buffer=nl.sbuf)
        port.tensor_tensor(ds_g, ds, g, nl.multiply)
        return ds_g
    dp_minus_d = nl.ndarray(shape, dtype=cfg.op_dtype, buffer=nl.sbuf)
    port.activation(dp_minus_d, nl.copy, dp_psum, bias=neg_d, scale=1.0)
    if g is not None:
        # P (1 - t^2) on GpSimd, rounded to the operand dtype as P is
        p_g = nl.ndarray(shape, dtype=cfg.op_dtype, buffer=nl.sbuf)
        port.tensor_tensor(p_g, p, g, nl.multiply, engine="gpsimd")
        p = p_g
    ds = nl.ndarray(shape, dtype=cfg.op_dtype, buffer=nl.sbuf)
    port.tensor_tensor(ds, dp_minus_d, p, nl.multiply)
    return ds


def accumulate_dv_dk(cfg, vis: _Visit, p, ds, st: _State, dv_psum, dk_psum):
    """``dV_j += P^T dO_i`` and ``dK_j += dS^T Q_i`` (scale applied at write-out), per 128-key
    block: stationary ``P[:, block]`` / ``dS[:, block]`` ``[rows, keys]``, moving ``dO_i`` /
    ``Q_i`` ``[rows, D]``, result ``[keys, D]`` accumulating in PSUM across the visits."""
    D = cfg.D
    for bi, (off, n) in enumerate(_blocks(vis.cols)):
        acc = nl.ds(bi * D, D)
        port.nc_matmul(dv_psum[0:n, acc], p[:, nl.ds(off, n)], st.do_nat[:, vis.s, :],
                       accumulate=None)
        port.nc_matmul(dk_psum[0:n, acc], ds[:, nl.ds(off, n)], st.q_nat[:, vis.s, :],
                       accumulate=None)


def accumulate_dq(cfg, vis: _Visit, ds, kv: _KV, st: _State, dq_scratch):
    """``dQ_i += dS K_j`` (scale applied at write-out), into the slot's fp32 accumulator (or,
    ``dq_accumulate="hbm"``, read-add-written in the HBM scratch: what a GPU does with
    atomics). dQ contracts over keys, so dS goes through a transpose to ``[keys, rows]`` per
    128-key block, the stationary operand against ``K[keys, D]``:

    * ``ds_transpose="pe"`` (default): a TensorE transpose per block into PSUM, copied to SBUF
      by ScalarE for the first ``act_evac_blocks`` blocks and by VectorE for the rest;
    * ``"dma"`` (opt-in; whole 128-key blocks only): one SBUF -> SBUF DMA transpose of the
      visit's ``[rows, blocks, 128]`` dS into ``[128, blocks, rows]`` (under nki.*, whose DMA
      transpose is 2-D, one per block).
    """
    op_dtype, D = cfg.op_dtype, cfg.D
    blocks = _blocks(vis.cols)
    dq_psum = nl.ndarray((PMAX, D), dtype=nl.float32, buffer=nl.psum)
    if cfg.ds_transpose == "dma" and all(n == PMAX for _, n in blocks):
        nb = len(blocks)
        ds_T = nl.ndarray((PMAX, nb, PMAX), dtype=op_dtype, buffer=nl.sbuf)
        if port.api() == "nki":
            for bi in unrolled(nb):
                port.dma_transpose(ds_T[:, bi, :], ds[:, nl.ds(bi * PMAX, PMAX)])
        else:
            port.dma_transpose(ds_T, _split_free(ds, nb, PMAX))
        for bi in unrolled(nb):
            port.nc_matmul(dq_psum, ds_T[:, bi, :], kv.k_nat[:, bi, :], accumulate=bi > 0)
    else:
        for bi, (off, n) in enumerate(blocks):
            ds_T = nl.ndarray((n, PMAX), dtype=op_dtype, buffer=nl.sbuf)
            engine = "scalar" if bi < cfg.act_evac_blocks else "vector"
            _transpose_into(ds_T, ds[:, nl.ds(off, n)], cfg.tp_dtype, engine)
            port.nc_matmul(dq_psum, ds_T, kv.k_nat[0:n, bi, :], accumulate=bi > 0)
    if st.dq_acc is not None:
        port.tensor_tensor(st.dq_acc[:, vis.s, :], st.dq_acc[:, vis.s, :], dq_psum, nl.add)
        return
    rows = dq_scratch[vis.h, nl.ds(vis.i0, PMAX), :]
    prev = nl.ndarray((PMAX, D), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(prev, rows)
    total = nl.ndarray((PMAX, D), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(total, prev, dq_psum, nl.add)
    port.dma_copy(rows, total)


def visit(cfg, spec, rt, vis: _Visit, key_row, st: _State, kv: _KV, dv_psum, dk_psum,
          dq_scratch, dr=None, unit=None):
    """All the work of one (slot, key tile) pair; with dropout ``unit = (member head, query
    tile, first key unit)``."""
    p, g = recompute_p(cfg, spec, rt, vis, key_row, st, kv)
    pz = dropout_mask_units(cfg, dr, vis, p, *unit) if dr is not None else None
    ds = softmax_backward(cfg, vis, st, kv, p, pz, g)
    if "dk" in cfg.grads:
        accumulate_dv_dk(cfg, vis, p if pz is None else pz, ds, st, dv_psum, dk_psum)
    if "dq" in cfg.grads:
        accumulate_dq(cfg, vis, ds, kv, st, dq_scratch)


# ---------------------------------------------------------------------------------------------
# Phase 4: write-out
# ---------------------------------------------------------------------------------------------


def _store_keys(out, b, g, c0, cols: int, tile, k_store, col0):
    """``out[b, g, c0 : c0 + cols, :] = tile`` (``[128, blocks, D]``, key ``c0 + 128 bi + p`` on
    partition p of block bi), scattered through ``k_store`` when the keys are rotated."""
    D = out.shape[3]
    blocks = _blocks(cols)
    if k_store is None and cols == len(blocks) * PMAX:
        port.dma_copy(port.row_blocks(out, (b, g), c0, PMAX, len(blocks), D), tile)
        return
    for bi, (off, n) in enumerate(blocks):
        if k_store is None:
            port.dma_copy(out[b, g, nl.ds(c0 + off, n), :], tile[0:n, bi, :])
        else:
            B, H, N, _ = out.shape
            rows = out.reshape((B * H * N, D))
            port.dma_copy(port.rows(rows, k_store, col0 + bi, n=n), tile[0:n, bi, :],
                          legacy_isa=True)


def write_dk_dv(cfg, dk, dv, b, g, c0, cols: int, dk_psum, dv_psum, scratch, k_store, col0):
    """dK_j = scale * dK_psum and dV_j = dV_psum for keys ``c0 ..`` (one pass), or their sums
    added into the fp32 ``scratch = (dk_acc, dv_acc)`` in HBM (several passes;
    :func:`finish_dk_dv` writes the outputs)."""
    D, nb = cfg.D, len(_blocks(cols))
    dv_factor = 1.0 / (1.0 - cfg.dropout_p)      # dV = (Z P)^T dO / (1 - p)
    for out, psum, factor, part in ((dk, dk_psum, cfg.scale, 0), (dv, dv_psum, dv_factor, 1)):
        if scratch is None:
            tile = nl.ndarray((PMAX, nb, D), dtype=cfg.out_dtype, buffer=nl.sbuf)
            port.activation(tile, nl.copy, _split_free(psum, nb, D), scale=factor)
            _store_keys(out, b, g, c0, cols, tile, k_store, col0)
            continue
        for bi, (off, n) in enumerate(_blocks(cols)):
            rows = scratch[part][nl.ds(c0 + off, n), :]
            total = nl.ndarray((n, D), dtype=nl.float32, buffer=nl.sbuf)
            port.activation(total, nl.copy, psum[0:n, nl.ds(bi * D, D)], scale=factor)
            prev = nl.ndarray((n, D), dtype=nl.float32, buffer=nl.sbuf)
            port.dma_copy(prev, rows)
            acc = nl.ndarray((n, D), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_tensor(acc, total, prev, nl.add)
            port.dma_copy(rows, acc)


def write_unseen_keys(cfg, dk, dv, b, g, span: KeySpan, Bk: int, k_store):
    """dK = dV = 0 for the keys of a span no query row sees (never loaded)."""
    nb = len(_blocks(span.cols))
    zeros = nl.zeros((PMAX, nb, cfg.D), dtype=cfg.out_dtype, buffer=nl.sbuf)

    def key_tile(jj):
        j = span.j0 + jj
        for out in (dk, dv):
            _store_keys(out, b, g, j * Bk, span.cols, zeros, k_store, j * nb)

    port.loop(span.n, key_tile)


def zero_scratch(scratch, Nk: int, D: int):
    """``dk_acc = dv_acc = 0`` (fp32 HBM, 128 keys per store)."""
    zeros = nl.zeros((PMAX, D), dtype=nl.float32, buffer=nl.sbuf)
    for part in unrolled(2):
        port.loop(Nk // PMAX, lambda j, part=part: port.dma_copy(
            scratch[part][nl.ds(j * PMAX, PMAX), :], zeros))
        if Nk % PMAX:
            n = Nk % PMAX
            port.dma_copy(scratch[part][nl.ds(Nk - n, n), :], zeros[0:n, :])


def finish_dk_dv(cfg, dk, dv, b, g, scratch, Nk: int, k_store):
    """dK, dV from the fp32 scratch after the last pass (cast to the output dtype)."""
    D = cfg.D
    n_full = Nk // PMAX
    for out, part in ((dk, 0), (dv, 1)):
        def block(j, out=out, part=part):
            tile = nl.ndarray((PMAX, 1, D), dtype=cfg.out_dtype, buffer=nl.sbuf)
            acc = nl.ndarray((PMAX, D), dtype=nl.float32, buffer=nl.sbuf)
            port.dma_copy(acc, scratch[part][nl.ds(j * PMAX, PMAX), :])
            port.tensor_copy(tile[:, 0, :], acc)
            _store_keys(out, b, g, j * PMAX, PMAX, tile, k_store, j)

        port.loop(n_full, block)
        if Nk % PMAX:
            n = Nk % PMAX
            tile = nl.ndarray((PMAX, 1, D), dtype=cfg.out_dtype, buffer=nl.sbuf)
            acc = nl.ndarray((n, D), dtype=nl.float32, buffer=nl.sbuf)
            port.dma_copy(acc, scratch[part][nl.ds(Nk - n, n), :])
            port.tensor_copy(tile[0:n, 0, :], acc)
            _store_keys(out, b, g, n_full * PMAX, n, tile, k_store, n_full)


def write_dq(cfg, plan: BackwardPlan, dq, b, h0, p, st: _State, q_store, dq_scratch):
    """dQ_i = scale * dQ accumulator of every slot of pass p: grouped stores under the row mask
    (under nki.*, the partial last tile stored statically short), or scattered per slot
    through ``q_store`` (rotated rows; rows past Nq skipped)."""
    D, G, Nq = cfg.D, cfg.G, dq.shape[2]
    S_h, stride = plan.slots, plan.passes * PMAX
    if q_store is not None:
        B, H, N, _ = dq.shape
        rows = dq.reshape((B * H * N, D))

        def scatter_slot(h, t):
            s = h * S_h + t
            if st.dq_acc is not None:
                acc = st.dq_acc[:, s, :]
            else:
                acc = nl.ndarray((PMAX, D), dtype=nl.float32, buffer=nl.sbuf)
                port.dma_copy(acc, dq_scratch[h, nl.ds((t * plan.passes + p) * PMAX, PMAX), :])
            tile = nl.ndarray((PMAX, D), dtype=cfg.out_dtype, buffer=nl.sbuf)
            port.activation(tile, nl.copy, acc, scale=cfg.scale)
            port.dma_copy(port.rows(rows, q_store, s), tile, oob_skip=True)

        port.loop(G, lambda h: port.loop(S_h, lambda t: scatter_slot(h, t)))
        return
    cap = max(1, BWD_GROUP_BYTES // (D * (4 if cfg.out_dtype == nl.float32 else 2)))

    def group(h, t, n: int, rows: int):
        rw = _Rows(h0 + h, h * S_h + t, (t * plan.passes + p) * PMAX, n, stride)
        if st.dq_acc is not None:
            acc = st.dq_acc[:, nl.ds(rw.s0, n), :]
        else:
            acc = nl.ndarray((PMAX, n, D), dtype=nl.float32, buffer=nl.sbuf)
            port.dma_copy(acc, _rows_view(dq_scratch.reshape((1,) + tuple(dq_scratch.shape)),
                                          0, rw._replace(hh=h), D))
        tile = nl.ndarray((PMAX, n, D), dtype=cfg.out_dtype, buffer=nl.sbuf)
        port.activation(tile, nl.copy, acc, scale=cfg.scale)
        if rows < PMAX:
            port.dma_copy(dq[b, rw.hh, nl.ds(rw.r0, rows), :], tile[0:rows, 0, :])
        elif plan.row_mask and port.predicates():
            port.dma_copy(_rows_view(dq, b, rw, D), tile, mask=_row_mask(rw, Nq, D))
        else:
            port.dma_copy(_rows_view(dq, b, rw, D), tile)

    for t0, n_groups, n, rows in _query_groups(plan, Nq, cap):
        port.loop(G, lambda h, t0=t0, n_groups=n_groups, n=n, rows=rows: port.loop(
            n_groups, lambda gi: group(h, t0 + gi * n, n, rows)))


def zero_dq_scratch(cfg, plan: BackwardPlan, dq_scratch):
    """``dq_acc = 0`` in the fp32 HBM scratch of the ``dq_accumulate="hbm"`` variant."""
    zeros = nl.zeros((PMAX, cfg.D), dtype=nl.float32, buffer=nl.sbuf)
    port.loop(cfg.G, lambda h: port.loop(plan.passes * plan.slots, lambda i: port.dma_copy(
        dq_scratch[h, nl.ds(i * PMAX, PMAX), :], zeros)))


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
    op_dtype: object
    tp_dtype: object
    out_dtype: object
    dq_accumulate: str
    ds_transpose: str
    act_evac_blocks: int
    grads: Tuple[str, ...]
    dropout_p: float = 0.0
    mods: SM.Mods = SM.Mods()
    unit: float = 1.0           # u: the exp's scale on modified scores (score_mods)
    cols: object = None         # score_mods.HeadColumns of the program's query heads
    offsets: object = None      # port.OffsetColumns of key-minus-row distances (nki.*)
    diagonal: object = None     # port.DiagonalMask of the band's upper edge
    indices: object = None      # port.OffsetColumns 0, 1, ...: loop indices as data (nki.*)


class _Dropout(NamedTuple):
    """The regeneration of the forward's dropout mask: the seed tile and the unit numbering of
    :func:`nki_kernels.attention.forward.dropout_units` (query tiles x 128-key units)."""

    seed: object
    b: object
    g: object
    Hq: int
    nqu: int
    nku: int
    ones: object        # [128, 128] in the operand dtype: partial units are drawn whole
    seed_row: object    # int32 [1, n]: the seed repeated (for the int32 add of unit numbers)


def dropout_mask_units(cfg, dr: _Dropout, vis: "_Visit", p, h, qi, ku0):
    """``Z * P`` for a visit: each 128-key block of P dropped by the draw the forward made for
    that unit (reseeded with ``seed + unit``), so the mask is the forward's whatever the two
    kernels' tilings. Unscaled: the 1 / (1 - p) goes into dV's write-out and dP's copy.
    ``h``: member head; ``qi``, ``ku0``: the query tile and first key unit, linear forms
    ``[(loop index, coefficient), ...]`` of the loop indices (nki.* reads the indices from
    ``cfg.indices``)."""
    pz = nl.ndarray((PMAX, vis.cols), dtype=cfg.op_dtype, buffer=nl.sbuf)
    blocks = _blocks(vis.cols)
    # every unit's seed of the visit at once: one iota and one int32 add; the first unit
    # ((b Hq + g G + h) nqu + qi) nku + ku0
    per_head = dr.nqu * dr.nku
    unit0 = ([(dr.b, dr.Hq * per_head), (dr.g, cfg.G * per_head), (h, per_head)]
             + [(e, c * dr.nku) for e, c in qi] + list(ku0))
    units = nl.ndarray((1, len(blocks)), dtype=nl.int32, buffer=nl.sbuf)
    port.iota(units, [[1, len(blocks)]], runtime=unit0, offsets=cfg.indices)
    seeds = nl.ndarray((1, len(blocks)), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(seeds, units, dr.seed_row[0:1, 0:len(blocks)], nl.add)
    for bi, (off, n) in enumerate(blocks):
        port.random_seed(seeds[0:1, bi:bi + 1])
        if n == PMAX:
            port.dropout(pz[:, nl.ds(off, n)], p[:, nl.ds(off, n)], cfg.dropout_p)
        else:
            # drawn 128 keys wide, as the forward draws every unit
            keep = nl.ndarray((PMAX, PMAX), dtype=cfg.op_dtype, buffer=nl.sbuf)
            port.dropout(keep, dr.ones, cfg.dropout_p)
            port.tensor_tensor(pz[:, nl.ds(off, n)], p[:, nl.ds(off, n)], keep[:, 0:n],
                               nl.multiply)
    return pz


def backward_program(cfg, plan: BackwardPlan, spec, rt, q, k, v, o, do, lse, dq, dk, dv, b, g,
                     scratch, dq_scratch, seed=None, dsinks=None):
    """All gradients of kv head g of sequence b (the loop nest of the module docstring); with
    sinks also ``dsinks[b, heads of g]`` (summed over the sequence's rows on chip)."""
    G, D, d_chunks, op_dtype = cfg.G, cfg.D, cfg.d_chunks, cfg.op_dtype
    n_dc, d_part = len(d_chunks), min(D, PMAX)
    # Q^T, K^T: one more partition when the key mask row rides in a D < 128 contraction
    s_part = d_part + (1 if rt is not None and rt.mask_row is not None and D < PMAX else 0)
    Bk, n_kblk = plan.key_tile, plan.key_tile // PMAX
    Nk = k.shape[2]
    h0 = g * G
    k_load, k_store = key_tables(rt, k, b, g, cfg.indices)
    n_slots = G * plan.slots
    P = plan.passes
    dr = None
    if cfg.dropout_p:
        seed_t = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        port.dma_copy(seed_t, seed.reshape((1, 1)))
        n_row = max(1, Bk // PMAX)
        seed_row = nl.ndarray((1, n_row), dtype=nl.int32, buffer=nl.sbuf)
        for c in unrolled(n_row):
            port.tensor_copy(seed_row[0:1, c:c + 1], seed_t, engine="gpsimd")
        ones = nl.ndarray((PMAX, PMAX), dtype=op_dtype, buffer=nl.sbuf)
        port.memset(ones, 1.0, engine="gpsimd")
        dr = _Dropout(seed_t, b, g, q.shape[1], ceil_div(q.shape[2], PMAX), ceil_div(Nk, PMAX),
                      ones, seed_row)
    if scratch is not None:
        zero_scratch(scratch, Nk, D)
    if dq_scratch is not None:
        zero_dq_scratch(cfg, plan, dq_scratch)
    # per-partition partial sums of dsink, one column per member head, carried across passes
    dsink_acc = _zeros((PMAX, G), nl.float32) if dsinks is not None else None

    def one_pass(p):
        st = _State(
            q_nat=nl.ndarray((PMAX, n_slots, D), dtype=op_dtype, buffer=nl.sbuf),
            do_nat=nl.ndarray((PMAX, n_slots, D), dtype=op_dtype, buffer=nl.sbuf),
            q_T=nl.ndarray((s_part, n_dc, n_slots * PMAX), dtype=op_dtype, buffer=nl.sbuf),
            do_T=nl.ndarray((d_part, n_dc, n_slots * PMAX), dtype=op_dtype, buffer=nl.sbuf),
            neg_delta=nl.ndarray((PMAX, n_slots), dtype=nl.float32, buffer=nl.sbuf),
            exp_bias=nl.ndarray((PMAX, n_slots), dtype=nl.float32, buffer=nl.sbuf),
            dq_acc=(nl.zeros((PMAX, n_slots, D), dtype=nl.float32, buffer=nl.sbuf)
                    if cfg.dq_accumulate == "sbuf" else None),
            sink_terms=(nl.ndarray((PMAX, n_slots), dtype=nl.float32, buffer=nl.sbuf)
                        if dsinks is not None else None))
        q_load = q_store = None
        if (rt is not None and rt.has_q) or (P > 1 and not port.predicates()):
            q_load, q_store = query_tables(cfg, plan, rt if rt is not None and rt.has_q
                                           else None, q.shape, b, g, p)
        load_query_side(cfg, plan, rt, q, do, o, lse, b, h0, p, st, q_load)
        if dsink_acc is not None:
            def sink_part(h):
                part = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
                port.tensor_reduce(part, nl.add, st.sink_terms[:, nl.ds(h * plan.slots,
                                                                        plan.slots)], axis=(1,))
                port.tensor_tensor(dsink_acc[:, nl.ds(h, 1)], dsink_acc[:, nl.ds(h, 1)], part,
                                   nl.add)

            port.loop(G, sink_part)
        if rt is not None and rt.mask_row is not None:
            mask_row_in_q_T(cfg, rt, st)

        for span in plan.spans:
            if not span.regions:
                continue

            def key_tile(jj, span=span):
                j = span.j0 + jj
                c0 = j * Bk
                kv = _KV(k_nat=nl.ndarray((PMAX, n_kblk, D), dtype=op_dtype, buffer=nl.sbuf),
                         k_T=nl.ndarray((s_part, n_dc, Bk), dtype=op_dtype, buffer=nl.sbuf),
                         v_T=nl.ndarray((d_part, n_dc, Bk), dtype=op_dtype, buffer=nl.sbuf))
                load_kv_tile(cfg, k, v, b, g, c0, span.cols, kv, k_load, j * n_kblk)
                key_row = rt.key_row(c0, span.cols, cfg.offsets) if rt is not None else None
                if key_row is not None and rt.mask_row is not None:
                    port.dma_copy(kv.k_T[rt.mask_row:rt.mask_row + 1, n_dc - 1, 0:span.cols],
                                  key_row, legacy_isa=True)
                    key_row = None     # in the S matmul now
                dk_psum = nl.zeros((PMAX, n_kblk * D), dtype=nl.float32, buffer=nl.psum)
                dv_psum = nl.zeros((PMAX, n_kblk * D), dtype=nl.float32, buffer=nl.psum)
                for region in span.regions:
                    def slot(h, tt, region=region):
                        t = region.t0 + tt
                        vis = _Visit(s=h * plan.slots + t, i0=(t * P + p) * PMAX, h=h,
                                     c0=c0, cols=span.cols, masked=region.masked,
                                     r=t * P + p - j * n_kblk)
                        # dropout's query tile t P + p and first key unit j n_kblk, as linear
                        # forms of the loop indices
                        unit = (h, [(tt, P), (p, 1), (region.t0 * P, 1)],
                                [(jj, n_kblk), (span.j0 * n_kblk, 1)])
                        visit(cfg, spec, rt, vis, key_row, st, kv, dv_psum, dk_psum,
                              dq_scratch, dr, unit)

                    port.loop(G, lambda h, slot=slot, n=region.n: port.loop(
                        n, lambda tt: slot(h, tt)))
                if "dk" in cfg.grads:
                    write_dk_dv(cfg, dk, dv, b, g, c0, span.cols, dk_psum, dv_psum, scratch,
                                k_store, j * n_kblk)

            port.loop(span.n, key_tile, carried=True)
        if "dq" in cfg.grads:
            write_dq(cfg, plan, dq, b, h0, p, st, q_store, dq_scratch)

    port.loop(P, one_pass, carried=True)

    if dsink_acc is not None:
        # the sum over partitions: a ones column against the [128, G] partials (TensorE)
        ones = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.memset(ones, 1.0, engine="gpsimd")
        tot = nl.ndarray((1, G), dtype=nl.float32, buffer=nl.psum)
        port.nc_matmul(tot, ones, dsink_acc)
        out = nl.ndarray((1, G), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(out, tot)
        port.dma_copy(dsinks[nl.ds(b, 1), nl.ds(h0, G)], out, legacy_isa=True)
    if "dk" not in cfg.grads:
        return
    if scratch is not None:
        finish_dk_dv(cfg, dk, dv, b, g, scratch, Nk, k_store)
        return
    for span in plan.spans:
        if not span.regions:
            write_unseen_keys(cfg, dk, dv, b, g, span, Bk, k_store)


def backward_grid(B: int, Hkv: int, lnc: int, api: str = "legacy"):
    """Launch grid for ``lnc`` NeuronCores per logical core (1, or 2 on trn2), for the
    namespace ``api`` the kernel is traced through.

    Legacy: an SPMD grid over (sequence, kv head). LNC=2 spreads the independent programs over
    the two cores -- kv heads when Hkv is even, else sequences when B is even
    (``nl.spmd_dim(n, nl.nc(2))``; no extra HBM traffic). With both odd the grid stays on one
    core: splitting one program's work would leave dK/dV or dQ as partial sums on two cores
    with no way to add them on chip.

    nki.* (0.7 launches ``kernel[lnc]`` only): ``(2,)`` when the ``B Hkv`` programs split
    evenly over two cores (each takes half of them, :func:`port.for_programs`), else
    ``(1,)``: one core loops over all of them."""
    if lnc not in (1, 2):
        raise ValueError(f"lnc: expected 1 or 2, got {lnc!r}")
    if api == "nki":
        return (2,) if lnc == 2 and (B * Hkv) % 2 == 0 else (1,)
    if lnc == 2 and Hkv % 2 == 0:
        return (B, nl.spmd_dim(Hkv // 2, nl.nc(2)))
    if lnc == 2 and B % 2 == 0:
        return (nl.spmd_dim(B // 2, nl.nc(2)), Hkv)
    return (B, Hkv)


@port.jit
def flash_attn_bwd(q, k, v, o, do, lse, kv_lens=None, q_lens=None, seed=None,
                   alibi_slopes=None, sinks=None, *, scale=1.0, causal=None, window=None,
                   mixed_precision=True, rows_per_pass=None, key_tile=None,
                   dq_accumulate="sbuf", ds_transpose=None, act_evac_blocks=None,
                   grads=("dq", "dk", "dv"), dropout_p=0.0, softcap=None):
    """Flash attention backward; one program per (sequence, kv head), launched on the grid of
    :func:`backward_grid` (legacy: the SPMD grid ``(B, Hkv)``; nki.*: ``(lnc,)``, the kernel
    looping over the programs itself, :func:`port.for_programs`).

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
        Query rows (all heads of the group) resident per pass, at least 128; None = as many as
        fit 90 % of SBUF (``tiles.bwd_rows_per_pass``).
    key_tile : int, optional
        Keys per K/V tile (a multiple of 128, at most one PSUM bank of fp32 dK per row); None =
        ``tiles.bwd_key_tile`` (128 keys: short visits overlap best; 256 with soft-capping or
        ALiBi, 512 with both or with ``ds_transpose="dma"``, at most a PSUM bank of dK).
    dq_accumulate : "sbuf" (default) or "hbm"
        Where dQ accumulates across K/V tiles: on chip, or (the atomics analogue, for
        measurement) read-add-written to an fp32 HBM scratch after every visit.
    ds_transpose : "pe", "dma" or None
        How dS is transposed for dQ (see :func:`accumulate_dq`); None = ``BWD_DS_TRANSPOSE``
        of the target generation ("pe").
    act_evac_blocks : int, optional
        With PE transposes, dS^T blocks per visit copied out of PSUM by ScalarE; None =
        ``BWD_ACT_EVAC_BLOCKS`` of the target.
    seed, dropout_p :
        Attention dropout as in the forward (``flash_attention_fwd``): ``dropout_p`` in [0, 1)
        compile-time, ``seed`` an HBM (1,) int32 tensor; the mask is regenerated unit by unit
        (:func:`dropout_mask_units`), never stored.
    grads : ("dq", "dk", "dv") (default), ("dk", "dv") or ("dq",)
        Which gradients to compute. The subsets exist to measure the two-kernel design of
        GPU backwards (one kernel for dK/dV, one for dQ, each recomputing P and dP) against the
        single pass; see benchmarks/backward.py.
    softcap, alibi_slopes, sinks :
        The forward's score modifiers (``score_mods.py``; ``lse`` is the forward's, sinks
        included): soft-capping multiplies dS by ``1 - tanh^2``, ALiBi is a constant bias, and
        sinks add the output ``dsinks``.

    Under nki.* the gathers' flat rows with lengths or several passes, where ``B Hq Nq`` (or,
    with ``kv_lens``, ``B Hkv Nk``) reaches 2^24, and dropout's unit numbers, where ``B Hq
    ceil(Nq / 128) ceil(Nk / 128)`` does, are summed in int32 on GpSimd (fp32 below).

    Returns
    -------
    The requested gradients in the order dq (B, Hq, Nq, D), dk, dv (B, Hkv, Nk, D), in the
    input dtype; with ``sinks`` then ``dsinks`` (B, Hq) float32, each sequence's share (the
    gradient is their sum over B).
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
    gen3 = port.gen3()
    target = "trn2" if gen3 else "trn1"
    op_itemsize = 4 if op_dtype == nl.float32 else 2
    if rows_per_pass is None:
        rows_per_pass = bwd_rows_per_pass(D, op_itemsize, target,
                                          dq_on_chip=(dq_accumulate == "sbuf"))
    if rows_per_pass < PMAX:
        raise ValueError(f"rows_per_pass: expected at least {PMAX}, got {rows_per_pass}")
    mods = SM.check_mods(softcap, alibi_slopes, sinks)
    ds_transpose = BWD_DS_TRANSPOSE[target] if ds_transpose is None else ds_transpose
    if key_tile is None:
        key_tile = bwd_key_tile(D, ds_transpose, (mods.softcap is not None) + mods.alibi)
    spec = band_spec(Nq, Nk, causal, window, mods.alibi)
    G = Hq // Hkv
    plan = plan_backward(Nq, Nk, G, spec, key_tile, rows_per_pass)
    # Runtime masks add MASK_NEG to the raw scores on TensorE, and the exp scales them: for
    # scale >= FWD_FOLD_SCALE_RANGE[0] a masked score becomes <= -2^76 (or -inf: there is no
    # running max here to overflow), whose exp is 0. Smaller scales (tiny, zero, negative) go
    # into Q^T as it leaves PSUM instead, as in the forward.
    scale = float(scale)
    fold = kv_lens is None or scale >= FWD_FOLD_SCALE_RANGE[0]
    cfg = _Config(
        scale=scale, exp_scale=scale if fold else 1.0, q_scale=1.0 if fold else scale,
        G=G, D=D, d_chunks=tuple((d0, min(PMAX, D - d0)) for d0 in unrolled(0, D, PMAX)),
        op_dtype=op_dtype,
        tp_dtype=op_dtype if (gen3 and op_dtype != nl.float32) else nl.float32,
        out_dtype=in_dtype, dq_accumulate=dq_accumulate,
        ds_transpose=ds_transpose,
        act_evac_blocks=(BWD_ACT_EVAC_BLOCKS[target] if act_evac_blocks is None
                         else act_evac_blocks), grads=grads, dropout_p=float(dropout_p),
        mods=mods, unit=mods.unit(scale if fold else 1.0))
    if cfg.dropout_p and seed is None:
        raise ValueError("dropout_p > 0 needs the seed tensor (HBM (1,) int32)")
    multi_pass = "dk" in grads and plan.passes > 1
    # nki.*: the query rows of q_lens or of several passes, and the keys of kv_lens, are
    # gathered by flat row numbers, which 0.7 computes in fp32
    gathered = q_lens is not None or plan.passes > 1 or kv_lens is not None
    n_flat = max(B * Hq * Nq, B * Hkv * Nk if kv_lens is not None else 0)
    n_units = B * Hq * ceil_div(Nq, PMAX) * ceil_div(Nk, PMAX)
    # row or unit numbers that may reach 2^24 are summed in int32 on GpSimd under nki.*
    # (port.OffsetColumns(exact=True)); below that the fp32 sums on VectorE are exact and cheaper
    exact = ((gathered and n_flat >= FP32_EXACT_INT)
             or (bool(cfg.dropout_p) and n_units >= FP32_EXACT_INT))

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
    dq_scratch = (nl.ndarray((G, plan.passes * plan.slots * PMAX, D), dtype=nl.float32,
                             buffer=nl.hbm)
                  if dq_accumulate == "hbm" else None)

    dsinks = (nl.ndarray((B, Hq), dtype=nl.float32, buffer=nl.shared_hbm)
              if mods.sinks else None)

    # nki.*: the key-minus-row distances of the visits (multiples of 128) and the loop
    # indices (dropout's unit numbers, the gathers' flat rows) as data, for 0.7's compile-time
    # affine patterns
    n_rows = plan.passes * plan.slots * PMAX
    cfg = cfg._replace(
        offsets=(port.OffsetColumns(-n_rows, n_rows // PMAX + ceil_div(Nk, PMAX) + 1, PMAX)
                 if spec.lo is not None or mods.alibi or kv_lens is not None else None),
        diagonal=(port.DiagonalMask(PMAX, PMAX, -ceil_div(Nk, PMAX), n_rows // PMAX + 1,
                                    base=spec.static_offset + spec.hi)
                  if spec.hi is not None else None),
        indices=(port.OffsetColumns(0, max(B, Hkv, G, plan.slots, plan.passes,
                                           max(sp.n for sp in plan.spans)), 1, exact=exact)
                 if cfg.dropout_p or gathered else None))

    def program(b, g):
        rt = (RuntimeMasks(spec, kv_lens, q_lens, b, Nq, Nk, D, op_dtype,
                           softcap=mods.softcap is not None)
              if (kv_lens is not None or q_lens is not None) else None)
        pcfg = cfg
        if mods != SM.Mods():
            pcfg = cfg._replace(cols=SM.HeadColumns(mods, cfg.unit, alibi_slopes, sinks, b,
                                                    g * G, G))
        backward_program(pcfg, plan, spec, rt, q, k, v, o, do, lse, dq, dk, dv, b, g, scratch,
                         dq_scratch, seed, dsinks)

    port.for_programs((B, Hkv), program)
    extra = (dsinks,) if dsinks is not None else ()
    if grads == ("dk", "dv"):
        return (dk, dv) + extra
    if grads == ("dq",):
        return (dq,) + extra if extra else dq
    return (dq, dk, dv) + extra
