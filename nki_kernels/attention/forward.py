"""Flash attention forward on a NeuronCore: O = softmax(scale Q K^T + mask) V and its LSE.

Algorithm 1 of the FlashAttention paper (seed 004), in FlashAttention-2's loop order (queries
outer, keys inner), fitted to TensorE/ScalarE/VectorE and the SBUF/PSUM budget. With ``c`` the
softmax scale, for one query tile Q_i (128 rows, one per partition) and the key blocks K_j, V_j
it may see::

    m_i = M_FLOOR;  [o_acc | l_i] = 0                                    fp32, on chip
    for each key block j (2048 keys = 4 PSUM banks of scores):
        S_ij  = Q_i K_j^T  (+ MASK_NEG * mask_ij)          TensorE -> PSUM fp32 (one bank per 512)
        m_new = max(m_i, rowmax S_ij)                      VectorE: one read of S per score
        P_ij  = exp(c S_ij - c m_new)                      ScalarE: one activation per bank,
                                                           scale and max folded in (bias)
        alpha = exp(c m_i - c m_new)                       ScalarE, on a (P, 1) column
        pv    = P_ij [V_j | 1]                             TensorE into a fresh PSUM tile: P^T by
                                                           PE transposes, copied to SBUF by
                                                           ScalarE/VectorE, then PV
        [o_acc | l_i] = alpha [o_acc | l_i] + pv           VectorE (scalar_tensor_tensor), SBUF
        m_i   = m_new
    O_i   = o_acc / l_i        (0 where l_i = 0: no visible key)
    LSE_i = c m_i + log l_i    (-inf where l_i = 0, by an explicit select)

The row sums l_i come out of the PV matmul for free: V carries an extra column of ones, so
``P [V | 1] = [P V | rowsum P]`` (one more moving column, 129 instead of 128 TensorE cycles per
chunk) and the rescale of o_acc rescales l_i with it. l_i is therefore the sum of the matmul-
precision P that multiplies V (O is normalised by exactly the weights it used).

Layouts (HBM, as the host API takes them): q ``(B, Hq, Nq, D)``, k and v ``(B, Hkv, Nk, D)``,
o ``(B, Hq, Nq, D)`` in q's dtype, lse ``(B, Hq, Nq)`` float32; optional ``kv_lens``/``q_lens``
``(B,)`` int32. Transposes happen on chip (TensorE ``nc_transpose``): Q^T and K^T put the head dim
on the partitions (the contraction of S), P^T puts keys on the partitions (the contraction of PV).

SPMD grid ``(B, Hkv)``: one instance per (batch, kv head) serves the G = Hq/Hkv query heads of its
group, so each K/V tile is loaded once for all of them (seed 003, "Option A").

Tile sizes (``nki_kernels/tiles.py``, ``FWD_*``) and why:

- **128 query rows** per tile: the partition count; Q^T [D, 128] is the matmul's stationary
  operand (at most 128 columns).
- **512 keys per score tile**: the widest moving operand and exactly one 2 KiB PSUM bank of fp32
  scores, so one matmul (per 128-wide head-dim pass) makes 128 x 512 scores.
- **2048 keys per softmax block** (4 banks): each online-softmax update costs a few (P, 1)
  instructions of >= 64 cycles (min-reduction, bias, alpha) and one rescale of [o_acc | l]; over
  2048 keys they are ~5 % of the per-score work. PSUM: 4 banks of S + 2 of P^T (double-buffered)
  + 1 for the block's PV = 7 of 8. The running [o_acc | l] stays in SBUF (fp32): TensorE never
  accumulates onto PSUM another engine wrote (undocumented), so every block's PV is its own
  accumulation group, folded in by VectorE.
- **128-key PV chunks, 4 per P^T tile**: P^T [128 keys, 128 queries] (PE transpose) is the
  stationary operand and [V | 1 | flag] [128 keys, D + 2] the moving one. Four chunks share a
  PSUM bank and one PSUM -> SBUF copy (512 columns), fine enough to split the copies between
  ScalarE and VectorE so both finish together (``tiles.fwd_act_evac_share``, computed from the
  shape).
- **K/V residency**: K^T ``[D, Nk]`` and [V | 1] (``Nk/128`` blocks) at matmul precision stay in
  SBUF for all query tiles of the group when they fit (bf16 D = 128: ~4 Nk bytes per partition,
  Nk up to ~32K on trn1's budget), so every HBM byte is read once (and with a causal band only
  the keys some span reaches, loaded span by span). Under nki.* K^T and Q^T come straight
  from HBM by DMA transposes (``Instance.direct_k``/``direct_q``, as nki-library's
  ``attention_cte`` loads them), with no TensorE pass or PSUM bank. Otherwise K/V streams in
  2048-key chunks past a group of query tiles kept on chip (``tiles.forward_hbm_bytes`` derives
  the resulting Theta(N^2 d^2 / M) traffic).
- **Head dim up to 256**: S contracts D in passes of 128 rows accumulating in the same PSUM bank;
  PV writes D + 1 <= 512 fp32 per partition (one bank).

Engine work per 128 x 2048 block (D = 128): TensorE 6160 cycles (S 2048, P transposes 2048,
PV 16 x 129); VectorE 2241 (row max: one fp32 PSUM read per score; min-reduction; the ``+ pv``
of ``o_acc = alpha o_acc + pv``, D + 1); ScalarE 2112 (exp; alpha); GpSimd the bias, the m_i
copy and the ``alpha o_acc`` rescale; plus the 2048-column P^T copy, split at a 32-column
boundary between ScalarE (1 cycle per column) and VectorE (1/2 on trn2) so both finish
together. trn2 N = 4096 models at ~195 us with TensorE at ~168 us (``nki-flash run``).
Dropout adds VectorE's draw (one cycle per score, ``nisa.dropout`` has no other engine), so
other per-block work moves off VectorE: the unit numbers go to GpSimd, the softmax sums
accumulate in ScalarE's registers during the exp, and through nki.* on NeuronCore-v3+ ScalarE
takes a share of the row maxima (``tiles.FWD_NKI_DROPOUT_MAX_ACT_SHARE``, counted over the
group's blocks; with a band ``FWD_NKI_DROPOUT_BAND_MAX_ACT_SHARE``, per block), the DMA engines
transpose all of P outside masked regions (``FWD_NKI_DROPOUT_P_DMA_SHARE``) and VectorE computes
the exp's bias; each 512-key group is drawn just before its transposes
(``benchmarks/forward.py``'s shape, trn2: legacy 390.2 us against 284.5 without dropout,
nki.* 264.7 against 208.1; each 128 x 128 unit's seed is a VectorE instruction).

Softmax scale: folded into the exp (``activation(exp, S, scale=c, bias=-c m_new)``) when
``2^-24 <= c <= 2^24``, where the masks' margin survives the scaling and nothing overflows; any
other finite scale (tiny, huge, zero, negative -- the API accepts them) is multiplied into Q^T as
it leaves PSUM after its transpose (free), and the exp runs with ``c = 1``.

Masks: see ``masks.py``. Partial last tiles (any Nq, Nk >= 1) are not padded: their tiles simply
have fewer rows/keys, so out-of-range keys never enter a max, an exp or a sum (the hazard of seed
001 cannot arise). Causal and window masks add a finite ``MASK_NEG`` to the scores on TensorE
before the row max (only on tiles crossing a band edge; whole key ranges a span of query tiles
cannot see are outside its loops, see "Loop structure"), and the running max is floored at ``M_FLOOR``, so a fully masked row ends with l_i = 0, O = 0 and
LSE = -inf, never NaN.

Non-finite inputs: the band and length masks select (a NaN or inf in a key a row cannot see
never reaches it), and V's non-finite entries are zeroed on chip and flagged in a column after
V's ones column (:func:`guard_values`): PV sums each row's weight on flagged keys, and a row with
a positive sum is written as NaN, so a non-finite value reaches exactly the rows that weigh it.

Score modifiers (soft-capping, ALiBi, sinks): ``score_mods.py``.

Lengths: ``kv_lens``/``q_lens`` are runtime int32 tensors, so one compiled kernel (shapes and
static options) serves every set of lengths. The band stays static, and so does the schedule
(the same tiles are skipped as without lengths):

- the query rows and keys are *gathered* by indirect DMAs that skip padding
  (``masks.RuntimeLengths``, shared with the backward): padding is never read, so NaN there
  cannot leak, and HBM reads are proportional to the valid lengths;
- bottom_right alignment (``causal=True``, or a window without causal) would put the diagonal
  at ``j - i = kv_len - q_len``: runtime data. The gathers *rotate* each sequence instead
  (on-chip row i' = HBM row ``(i' + q_len) mod Nq``, key j' = HBM key ``(j' + kv_len) mod Nk``)
  so its valid rows and keys end at Nq and Nk, where the band is the static bottom_right band
  of the padded shapes; O and LSE are scattered back through the same bijection.
- top_left needs no rotation: its band (``j <= i``) does not depend on lengths, and its valid
  rows and keys already start at row and key 0, the band's origin (rotating them would move
  the band by ``(Nk - kv_len) - (Nq - q_len)``, runtime data again). Its rows and keys are
  gathered in place.
- padding keys cost nothing on the score path: V's ones column is 0 for them and their V rows
  are 0, so they add nothing to o_acc or l_i, and their K rows hold a copy of the valid key
  next to the padding, which every row that sees both padding and valid keys also sees, so
  they cannot raise a row max (``edge_key_fill``). Padding query rows are zeroed (o = 0,
  LSE = -inf) at write-back. Work is that of the padded shape; the lengths cost O(N d) extra
  (gathers, fills, index tables).

With lengths the modeled time is that without them (the same loops run), plus a fixed
per-program setup; HBM reads with ``[N/2]`` are half of Q, K, V plus one key row.

Precision (docs/semantics.md): matmul operands in bf16/fp16 (fp32 inputs: bf16 with
``mixed_precision``, else fp32); PSUM, statistics, o_acc and LSE in fp32; O in q's dtype.

APIs whose legacy-NKI status is not fully confirmed (reference/nki-api-spec.md): bf16 PSUM
output of TensorE transposes on trn2 (gen3 "transpose mode"; fp32 PSUM is used on trn1),
``nisa.tensor_copy_predicated`` and ``reduce_cmd`` on ``nisa.activation`` (the dropout path's
chained row sums, :func:`port.activation_accumulate`; both documented from 2.22), and
``nisa.dma_transpose`` SBUF ->
SBUF (``p_dma_transpose_share``: opt-in under legacy; under nki.* the planner's default, as
in AWS's NKI 0.7 ``attention_cte``).

One source, two namespaces (:mod:`nki_kernels.port`): the kernel traces through ``nki.*``
(NKI 0.7: trn2, trn3) and the legacy ``neuronxcc.nki`` (trn1). It is a fixed nest of compiled
loops (:func:`port.loop`: ``nl.fori_loop`` in 0.7; in legacy ``nl.affine_range`` over heads,
query tiles and K/V pieces, ``nl.sequential_range`` over query-tile groups, key blocks and
streamed chunks; "Loop structure" below): Python only picks tile sizes and unrolls small
constant loops (head-dim passes, score tiles and P^T chunks of one block, the spans and regions
of a band), so the compiled program does not grow with N. Every tile shape is a compile-time
constant; tile positions are affine expressions of the loop indices. Where the namespaces
differ:

- *grid*: legacy launches an SPMD grid over (batch, kv head); 0.7 launches ``kernel[lnc]`` and
  the kernel loops over the instances (:func:`port.for_programs`, :func:`forward_grid`);
- *band edges*: legacy predicates the instructions of a masked region's blocks on the block
  meeting the tile's band (``mask=``) and selects a tile's band by ``affine_select`` of a
  loop-index expression. 0.7 has neither predicates nor runtime affine offsets: every block
  runs (a block outside the band has every score at ``MASK_NEG`` and leaves the online softmax
  exactly as it was, ``attend_block``), and the distance's loop-index part is read as data
  from a table built once per launch (:class:`port.OffsetColumns`) and compared on VectorE.
  The outputs are the same bit for bit; the nki.* program issues the skipped blocks' work;
- *dropout*: the unit numbers that seed each 128 x 128 unit's draw are loop-index
  expressions; 0.7 reads the indices from a table (:class:`port.OffsetColumns`, its ``exact``
  form) and combines them in int32 on GpSimd (exact at any size, and off VectorE, which the
  draws keep busiest); ``nisa.set_rng_seed`` seeds the draw;
- *runtime lengths*: the gathers and scatters are indirect DMAs (:func:`port.rows`: an
  index-tile subscript in legacy, ``.ap(vector_offset=)`` in 0.7); the flat HBM rows of a
  program's sequence are loop-index expressions, which 0.7 reads from the same table (fp32
  sums on VectorE; int32 ones with dropout, or when q, k or v has 2^24 rows or more). The
  key-length mask row of lengths with dropout or ALiBi (:func:`masks.key_length_row`)
  starts at a loop-index key, which 0.7 reads from the distance table
  (:func:`port.iota_compare`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import NamedTuple, Optional, Tuple

import numpy as np  # compile-time constants only (-inf)

from nki_kernels import port
from nki_kernels import tiles as T
from nki_kernels.attention import masks as M
from nki_kernels.attention import score_mods as SM
from nki_kernels.port import nl

# ============================================================================================
# Loop structure (plain Python, compile time)
# ============================================================================================
#
# The kernel is a fixed nest of compiled loops whose bounds are compile-time constants:
#
#   for (b, g) in the instances (legacy: the SPMD grid; nki.*: a compiled loop):
#   for span in plan.spans:                                    <= FWD_Q_SPANS + 1, unrolled
#     [resident: load the next span's new keys and query rows (prefetch, a span ahead)]
#     group 0 (peeled), then for grp in loop(1, groups of the span, carried):
#       load Q^T of the group's tiles (every query head of the kv group); o_acc = 0, m = M_FLOOR
#       store the previous group's O, LSE (waiting in SBUF: the stores, which wait for that
#         group's last softmax step, come after this group's loads in the DMA queues)
#       for region in span.regions:                            <= 3, unrolled
#         [streaming: for chunk in loop(..., carried): load K/V chunk]
#         for kb in loop(full key blocks, carried):            the online softmax
#           for each batch of <= FWD_STAGE_SLOTS tiles (loops over heads and tiles):
#             first halves of every tile: scores, max, exp   (fold_front)
#             second halves of every tile: P^T, P V, update  (fold_back)
#                                           unmasked region: no predicate
#                                           masked region: (legacy) every instruction predicated
#                                           on the block intersecting the tile's band; score
#                                           tiles crossing an edge masked by a selection
#         [one static tail block; a group of compile-time tiles: in a masked region one
#          block per tile over its own keys, the unmasked region's tail block joined to it]
#       finish O, LSE of the group's tiles into SBUF
#   store the last group's O, LSE
#
# A span is a run of query tiles whose key range is split into *regions*: keys every row of the
# span sees (no mask, no predicate) and the keys around the band's edges that only some rows
# see (masked). Splitting the query tiles into a fixed number of spans (FWD_Q_SPANS, whatever
# N; fewer when they would hold fewer than ForwardTiles.span_tiles tiles) is what lets a
# causal or windowed kernel skip most fully masked blocks with compile-time loop bounds: a
# span's loops only cover the union of its rows' key ranges, and within the masked regions
# predicated-off blocks still issue (the hardware runs the loop, the predicate disables the
# instruction; nki.* runs them). A band bounded on both sides (a window) instead gives its interior
# query tiles one *sliding* span: each tile sweeps the same key regions relative to its own
# first row (an affine offset of the tile index), the fixed spans only cover the tiles near the
# sequence edges, and the tail block's indicators are compile-time tiles built once.
# When a group's tiles are compile-time (a span of one group on one core), a masked region is
# swept per tile instead (sweep_slots): each tile's block covers only the keys its own rows
# may see, so the masked triangle costs each tile its own 128-key units, and the unmasked
# region's partial last block opens that block (_joins: one online-softmax update fewer). With
# fixed spans the resident keys are loaded span by span, a span ahead of use (the first span
# starts on its own keys, not on all of K/V; each key is still read once).
# Partial query tiles (Nq % q_tile rows) form their own span and
# partial key blocks a static tail block, so every tile shape is compile-time and the program
# has a constant number of loop bodies.


@dataclass(frozen=True)
class Region:
    """Keys ``[k0, k1)`` of a span's sweep; ``masked``: some rows of the span do not see all of
    them (predicates and indicator masks), else every row sees every key of the region."""

    k0: int
    k1: int
    masked: bool


@dataclass(frozen=True)
class Span:
    """Query tiles ``t0 .. t0 + tiles - 1`` (of ``q_tile`` rows; ``rows`` rows each, fewer only
    for the partial last tile, alone in its span) and the key regions they sweep in order.

    ``slide``: None, or the regions are relative to each tile -- tile t sweeps keys
    ``t q_tile + slide + [k0, k1)`` (a band bounded on both sides moves with its rows; the
    offset is a multiple of 128 so K^T columns and V blocks stay affine in t)."""

    t0: int
    tiles: int
    rows: int
    regions: Tuple[Region, ...]
    slide: Optional[int] = None


@dataclass(frozen=True)
class ForwardPlan:
    """The compile-time loop structure of one grid instance (identical for every instance)."""

    spans: Tuple[Span, ...]
    q_tile: int
    q_group: int        # query tiles per head in a group
    resident: bool
    kv_chunk: int


def _regions(spec: M.MaskSpec, r0: int, r1: int) -> Tuple[Region, ...]:
    """Key regions of query rows ``[r0, r1)``: the union of their key ranges (``k_lo`` a
    multiple of 128), split into the 128-aligned part every row sees (unmasked) and the masked
    parts before and after it. Empty when every row is masked statically."""
    k_lo, k_hi = spec.key_range(r0, r1 - r0)
    if k_lo >= k_hi:
        return ()
    if not spec.has_diag:
        return (Region(k_lo, k_hi, False),)
    P, off = T.FWD_V_CHUNK, spec.static_offset
    # keys seen by every row: from the last row's lower bound to the first row's upper bound
    f_lo = k_lo if spec.lo is None else max(k_lo, T.ceil_div(r1 - 1 + off + spec.lo, P) * P)
    f_hi = k_hi if spec.hi is None else min(k_hi, ((r0 + off + spec.hi + 1) // P) * P)
    if f_lo >= f_hi:
        return (Region(k_lo, k_hi, True),)
    out = []
    if k_lo < f_lo:
        out.append(Region(k_lo, f_lo, True))
    out.append(Region(f_lo, f_hi, False))
    if f_hi < k_hi:
        out.append(Region(f_hi, k_hi, True))
    return tuple(out)


def plan_forward(Nq: int, Nk: int, group: int, spec: M.MaskSpec,
                 tiles: T.ForwardTiles, cores: int = 1) -> ForwardPlan:
    """Loop structure of one (batch, kv head) instance: the query tiles of a head split into at
    most ``FWD_Q_SPANS`` spans of full tiles (one span without a band) plus the partial last
    tile, and each span's key regions. A group (one loop body) holds the same
    ``max(1, q_group // G)`` tiles of each of the G query heads (fewer with ``cores`` 2, so
    that each span has a group per core).
    ``cores`` (2: the kernel splits each span's groups over two NeuronCores) keeps at least
    that many tiles per span."""
    qt = tiles.q_tile
    n_full, tail = Nq // qt, Nq % qt
    spans = []
    slide = _sliding_tiles(spec, n_full, qt, tiles) if tiles.kv_resident else None
    if slide is None:
        spans += _fixed_spans(spec, 0, n_full, qt, cores, tiles.span_tiles)
    else:
        t_lo, t_hi, off, width = slide
        spans += _fixed_spans(spec, 0, t_lo, qt, cores)
        # the regions of an interior tile, relative to its first key
        base = t_lo * qt + off
        rel = tuple(Region(rg.k0 - base, rg.k1 - base, rg.masked)
                    for rg in _regions(spec, t_lo * qt, (t_lo + 1) * qt))
        spans.append(Span(t_lo, t_hi - t_lo, qt, rel, off))
        spans += _fixed_spans(spec, t_hi, n_full, qt, cores)
    if tail:
        spans.append(Span(n_full, 1, tail, _regions(spec, n_full * qt, Nq)))
    q_group = max(1, tiles.q_group // group)
    if cores > 1:
        # every span must have at least `cores` groups for the cores to share it
        smallest = min((sp.tiles for sp in spans if sp.rows == qt), default=1)
        q_group = max(1, min(q_group, smallest // cores))
    return ForwardPlan(tuple(spans), qt, q_group, tiles.kv_resident, tiles.kv_chunk)


def _fixed_spans(spec: M.MaskSpec, t_from: int, t_to: int, qt: int, cores: int,
                 min_tiles: int = 1):
    """Full query tiles ``[t_from, t_to)`` in at most ``FWD_Q_SPANS`` spans (one without a
    band) of at least ``cores`` tiles, each with its key regions; of at least ``min_tiles``
    tiles unless that leaves fewer than ``FWD_MIN_Q_SPANS`` spans."""
    n_full = t_to - t_from
    n_spans = n_full // max(cores, min_tiles)
    if n_spans < T.FWD_MIN_Q_SPANS:
        n_spans = n_full // cores
    n_spans = max(1, min(n_spans, T.FWD_Q_SPANS if spec.has_diag else 1))
    n_spans = min(n_spans, n_full)
    spans, t = [], t_from
    for i in T.unrolled(n_spans):
        n = n_full // n_spans + (1 if i < n_full % n_spans else 0)
        spans.append(Span(t, n, qt, _regions(spec, t * qt, (t + n) * qt)))
        t += n
    return spans


def _sliding_tiles(spec: M.MaskSpec, n_full: int, qt: int, tiles: T.ForwardTiles):
    """For a band bounded on both sides (a window): ``(t_lo, t_hi, slide, width)`` -- full
    query tiles ``[t_lo, t_hi)`` whose keys ``t qt + slide + [0, width)`` lie inside ``[0,
    Nk)`` -- or None (no such band, 128 does not divide the tile, or no interior tile, or
    the sliding sweep would not be narrower than the tile spans' own)."""
    if spec.lo is None or spec.hi is None or qt % T.FWD_V_CHUNK:
        return None
    P, off = T.FWD_V_CHUNK, spec.static_offset
    slide = ((off + spec.lo) // P) * P                      # first key of tile 0, aligned down
    width = qt + off + spec.hi - slide                       # to one past tile 0's last key
    t_lo = max(0, T.ceil_div(-slide, qt))
    t_hi = min(n_full, (spec.nk - width - slide) // qt + 1)
    if t_hi - t_lo < 2 or width >= spec.nk:
        return None
    return t_lo, t_hi, slide, width


def _groups(span: Span, q_group: int):
    """``(first tile offset in the span, groups, tiles per group)`` of a span: its full groups
    (an NKI loop) and the remainder group (static)."""
    full, rest = span.tiles // q_group, span.tiles % q_group
    out = []
    if full:
        out.append((0, full, min(q_group, span.tiles)))
    if rest:
        out.append((full * q_group, 1, rest))
    return out


def _span_keys(span: Span, q_tile: int, Nk: int) -> int:
    """One past the last key any tile of ``span`` sweeps, rounded up to 128 (at most Nk): the
    resident keys that must be loaded before the span starts (0 without regions)."""
    if not span.regions:
        return 0
    end = max(rg.k1 for rg in span.regions)
    if span.slide is not None:
        end += (span.t0 + span.tiles - 1) * q_tile + span.slide
    return min(Nk, T.ceil_div(end, T.PMAX) * T.PMAX)


def _chunks(region: Region, plan: ForwardPlan):
    """``(first key, chunks, keys per chunk)`` runs of a region's streamed K/V chunks."""
    n = region.k1 - region.k0
    C = plan.kv_chunk
    out = []
    if n // C:
        out.append((region.k0, n // C, C))
    if n % C:
        out.append((region.k0 + (n // C) * C, 1, n % C))
    return out


def _valid_in(lo: int, hi: int, n_valid: int, N: int, rotated: bool) -> int:
    """Valid positions among frame positions ``[lo, hi)`` of a sequence with ``n_valid`` of N
    valid: ``[0, n_valid)``, or ``[N - n_valid, N)`` when the gathers rotate it."""
    v0, v1 = (N - n_valid, N) if rotated else (0, n_valid)
    return max(0, min(hi, v1) - max(lo, v0))


def plan_hbm_bytes(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, itemsize: int,
                   tiles: T.ForwardTiles, *, causal=None, window=None, q_lens=None,
                   kv_lens=None, cache_itemsize: Optional[int] = None,
                   lnc: int = 1) -> Tuple[int, int]:
    """HBM bytes (read, written) the kernel moves, counted from its own loop structure.

    ``q_lens``/``kv_lens``: the per-sequence valid lengths (B ints), ``True`` for given with
    every position valid, None/False for not given (``tiles.fwd_valid_lengths``).

    Reads: the rows of every query tile of a span with key regions, once; resident K/V once per
    instance up to the last key a span sweeps (:func:`_span_keys`; if any span has regions),
    streamed K/V once per group (all G heads) and region chunk; one int32
    per given length array. With lengths only the *valid* rows and keys are read (the gathers
    skip padding; with rotation the valid positions of the kernel's frame are the last
    ``q_lens[b]`` / ``kv_lens[b]``); ``kv_lens`` adds the edge key (one row of k,
    :func:`edge_key_fill`) per program whose ``kv_lens[b] > 0``. Writes: every row's output
    and LSE, padding included (rows without keys get zeros and -inf). Equals
    :func:`tiles.forward_hbm_bytes` when there is no causal/window mask. ``cache_itemsize`` 1:
    an FP8 cache (K/V and the edge key at 1 byte, 8 bytes of scales per instance,
    :func:`tiles.fwd_cache_bytes`).

    ``lnc``: the kernel's ``lnc`` argument (:func:`forward_grid`'s second value), 2 when the
    two cores of an LNC=2 logical core split every instance's query-tile groups (an odd number
    of (batch, kv head) instances; an even number is shared whole instance by instance and
    moves what ``lnc`` 1 does). Each core then runs every span (:func:`_core_range`: the first
    or last ``ceil(count / 2)`` groups of each group run, both the middle one of an odd count),
    so each core reads the resident K/V (or streams it once per group it runs), the rows of
    its own groups, the length arrays, edge key and FP8 scales, and writes its groups'
    outputs: K/V twice per instance, the rows of a middle group twice. The two physical cores of a logical core share HBM but not SBUF (AWS
    ``nki/get-started/about/lnc.rst``: "two physical cores ... that have shared HBM memory";
    ``about-neuron/arch/neuron-hardware/trainium2.rst``: SBUF capacity per NeuronCore-v3), so
    a key one core loaded is not on the other's chip.
    """
    if lnc not in (1, 2):
        raise ValueError(f"lnc: expected 1 or 2, got {lnc!r}")
    q_valid = T.fwd_valid_lengths(q_lens, B, Nq)
    k_valid = T.fwd_valid_lengths(kv_lens, B, Nk)
    spec = M.MaskSpec(Nq, Nk, causal, window, q_valid is not None, k_valid is not None)
    plan = plan_forward(Nq, Nk, Hq // Hkv, spec, tiles, cores=lnc)
    G = Hq // Hkv
    any_region = any(sp.regions for sp in plan.spans)
    # resident keys are loaded as far as the spans sweep (forward_instance's prefetch), all of
    # them when a span slides
    kv_end = (Nk if any(sp.slide is not None for sp in plan.spans)
              else max(_span_keys(sp, plan.q_tile, Nk) for sp in plan.spans))
    cs, scales = T.fwd_cache_bytes(itemsize, cache_itemsize)
    read = 0
    for b in T.unrolled(B):
        nq = Nq if q_valid is None else q_valid[b]
        nk = Nk if k_valid is None else k_valid[b]
        per_instance = 4 * (int(q_valid is not None) + int(k_valid is not None)) + scales
        per_instance += D * cs if k_valid is not None and nk > 0 else 0     # the edge key
        per_instance *= lnc                 # each core reads its instance's lengths and scales
        if plan.resident and any_region:
            per_instance += lnc * 2 * _valid_in(0, kv_end, nk, Nk, spec.rotate_k) * D * cs
        for sp, t0, tiles_run, groups in _core_runs(plan, lnc):
            if not sp.regions:
                continue
            r0 = t0 * plan.q_tile
            rows = _valid_in(r0, r0 + tiles_run * sp.rows, nq, Nq, spec.rotate_q)
            per_instance += G * rows * D * itemsize
            if not plan.resident:
                keys = sum(_valid_in(rg.k0, rg.k1, nk, Nk, spec.rotate_k) for rg in sp.regions)
                per_instance += groups * 2 * keys * D * cs
        read += Hkv * per_instance
    rows_out = sum(n * sp.rows for sp, _, n, _ in _core_runs(plan, lnc))
    return read, B * Hq * rows_out * (D * itemsize + 4)


def _core_runs(plan: ForwardPlan, lnc: int):
    """``(span, first tile, tiles, groups)`` of the consecutive query tiles each core runs per
    group run of each span (:func:`forward_instance`): all of them with ``lnc`` 1, else each
    core's :func:`_core_range`."""
    out = []
    for sp in plan.spans:
        for first, count, n in _groups(sp, plan.q_group):
            for core in T.unrolled(lnc):
                start, mine = (0, count) if lnc == 1 else _core_range(count, core)
                out.append((sp, sp.t0 + first + start * n, mine * n, mine))
    return out


# ============================================================================================
# Kernel state (plain Python holders of tiles and compile-time facts)
# ============================================================================================

def _and(*preds):
    """Conjunction of tile-level predicates (None = always on): ``&`` of the given ones."""
    out = None
    for p in preds:
        if p is None or p is True:      # no predicate, or one true at compile time
            continue
        out = p if out is None else out & p
    return out


@dataclass(frozen=True, eq=False)
class Config:
    """Compile-time facts of one grid instance (batch ``b``, kv head ``g``; the block-sparse
    kernels build theirs too): the HBM tensors, shapes, dtypes, softmax units, tiles and mask
    spec, fixed for the whole program. Fields after ``act_share`` are derived from the others.

    - ``offsets``: :class:`port.OffsetColumns` of key-minus-row distances (nki.*; None when no
      mask needs them); ``indices``: loop indices as data (nki.*; None when nothing reads them).
    - ``guard``: the non-finite V guard (:func:`guard_values`): V's non-finite entries zeroed
      and flagged in one more column, so they reach only the rows that see them.
    - ``act_share``: fraction of the P^T copies on ScalarE (:func:`balance_engines`; None in a
      kernel that splits no copies).
    - ``block_table``: a paged K/V cache's HBM ``(B, max_blocks)`` int32 table (None: k and v
      are ``(B, Hkv, Nk, D)``). k and v are then page pools ``(num_blocks, Hkv, page_size,
      D)`` and the key frame is the logical cache, ``Nk = max_blocks * page_size``
      (:func:`paged_key_rows`).
    - ``kv_scale``: an FP8 cache's HBM ``(Hkv, 2)`` float32 ``(k_scale, v_scale)`` per kv head
      (None: k and v in q's dtype). The K/V loads then cast to the matmul dtype
      (:attr:`kv_dtype`) and the scales are applied on chip (:class:`Instance` ``kvs``).
    """
    q: object
    k: object
    v: object
    o: object
    lse: object
    mm_dtype: str
    scale: float
    tiles: T.ForwardTiles
    spec: M.MaskSpec
    b: object
    g: object
    offsets: Optional[object]
    indices: Optional[object]
    guard: bool
    act_share: Optional[float]
    block_table: Optional[object] = None
    kv_scale: Optional[object] = None
    B: int = field(init=False)
    Hq: int = field(init=False)
    Nq: int = field(init=False)
    D: int = field(init=False)
    Hkv: int = field(init=False)
    Nk: int = field(init=False)
    G: int = field(init=False)
    nqu: int = field(init=False)        # 128-row query units (dropout's numbering)
    nku: int = field(init=False)        # 128-key units
    mm: object = field(init=False)      # matmul dtype
    act_scale: float = field(init=False)
    q_scale: float = field(init=False)
    gen3: bool = field(init=False)
    d_passes: Tuple[Tuple[int, int], ...] = field(init=False)
    dma_share: float = field(init=False)
    lse_col: object = field(init=False)
    per_head: int = field(init=False)

    def __post_init__(self):
        B, Hq, Nq, D = self.q.shape
        Hkv, Nk = self.k.shape[1], frame_keys(self.k, self.block_table)
        scale = float(self.scale)
        lo, hi = T.FWD_FOLD_SCALE_RANGE
        # softmax units: the exp scales raw scores (fold), or Q^T is pre-scaled (q_scale)
        fold_scale = lo <= scale <= hi
        gen3 = port.gen3()
        derived = dict(
            B=B, Hq=Hq, Nq=Nq, D=D, Hkv=Hkv, Nk=Nk, G=Hq // Hkv, scale=scale,
            nqu=T.ceil_div(Nq, T.PMAX), nku=T.ceil_div(Nk, T.PMAX),
            mm=getattr(nl, self.mm_dtype),
            act_scale=scale if fold_scale else 1.0, q_scale=1.0 if fold_scale else scale,
            gen3=gen3,
            # head-dim passes of the S contraction: (first row, rows)
            d_passes=tuple((d0, min(T.PMAX, D - d0)) for d0 in T.unrolled(0, D, T.PMAX)),
            dma_share=dma_share(self.tiles, gen3),
            lse_col=self.lse.reshape((B, Hq, Nq, 1)),         # (rows, 1) store targets
            per_head=T.ceil_div(Nq, self.tiles.q_tile))        # query tiles per head
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def kv_dtype(self):
        """dtype of the K/V staging tiles the loads write: k's, or with an FP8 cache the
        matmul dtype (the DMA casts on the way in, as the decode kernels' gathers do: AWS's
        DMA guide, nki-dma-overview.rst, casts when source and destination dtypes differ)."""
        return self.mm if self.kv_scale is not None else self.k.dtype

    @property
    def vcols(self) -> int:
        """Columns of ``[V | 1 (| flag)]`` and of ``[o_acc | l_i (| flags)]``."""
        return self.D + 1 + (1 if self.guard else 0)

    @property
    def kv_rows(self) -> int:
        """Rows of the flat ``(rows, D)`` views of k and v the key gathers read: ``B Hkv Nk``,
        or ``num_blocks Hkv page_size`` of page pools."""
        return self.k.shape[0] * self.Hkv * self.k.shape[2]

    def head(self, h):
        """HBM query head of group member h (a loop index)."""
        return self.g * self.G + h

    def q_col(self, h, t):
        """Column of query tile t of member head h in the query index tables."""
        return h * self.per_head + t

    def transpose_psum_dtype(self, src_dtype):
        """PSUM dtype of a TensorE transpose: the input's in nki.* (0.7 requires it); in legacy
        trn2's transpose mode writes bf16 as bf16 (and its PSUM -> SBUF copy then runs in
        VectorE's 2x mode), otherwise fp32.

        UNCONFIRMED (nki-api-spec §9.1/§10.2, [RE] only): bf16 PSUM output of nc_transpose on
        gen3 in legacy; trn1 and other dtypes use the documented fp32 PSUM."""
        legacy = nl.bfloat16 if self.gen3 and src_dtype == nl.bfloat16 else nl.float32
        return port.transpose_dtype(src_dtype, legacy=legacy)

    def psum_cols(self, src_dtype) -> int:
        """Transposed 128-column blocks per PSUM bank for that dtype (4 fp32, 8 16-bit)."""
        item = 4 if self.transpose_psum_dtype(src_dtype) == nl.float32 else 2
        return T.PSUM_FMAX * 4 // item // T.PMAX

    def evac_split(self):
        """A fresh engine split for the PSUM -> SBUF copies of one loop body (the same in every
        iteration: the split is program text)."""
        return _Splitter(self.act_share)

    def dma_split(self, masked: bool = False):
        return _Splitter(min(self.dma_share, T.FWD_MASKED_P_DMA_SHARE) if masked
                         else self.dma_share)


def dma_share(tiles: T.ForwardTiles, gen3: bool) -> float:
    """Share of the P^T transposes done by DMA (``tiles.p_dma_transpose_share``; gen3 only)."""
    return tiles.p_dma_transpose_share if gen3 else 0.0


class Lengths(NamedTuple):
    """Per-sequence lengths of one instance (``kv_lens`` and/or ``q_lens``;
    :func:`length_tables`).

    - ``rt``: :class:`masks.RuntimeLengths` of sequence b; ``q_rows``/``k_rows``/``v_rows``:
      ``(B H N, D)`` views of q, k, v for the gathers.
    - ``q_load``/``q_store``/``q_valid`` (with ``q_lens``, else None): int32 ``[128, G * tiles
      per head]`` query-row gather indices, scatter indices (rotated rows only, else None) and
      fp32 1.0 for valid rows, column :meth:`Config.q_col`.
    - ``k_load``/``k_fill`` (with ``kv_lens``, else None): int32 ``[128, ceil(Nk / 128)]`` key
      gather indices, and ``[128, D]`` in k's dtype, the edge key on every partition
      (:func:`edge_key_fill`).
    - ``key_neg``: the ``MASK_NEG`` row of the rank-1 key-length mask on the scores when
      :func:`_key_mask` asks for it, else None.
    """
    rt: M.RuntimeLengths
    q_rows: object
    k_rows: object
    v_rows: object
    q_load: Optional[object]
    q_store: Optional[object]
    q_valid: Optional[object]
    k_load: Optional[object]
    k_fill: Optional[object]
    key_neg: Optional[object]


class Dropout(NamedTuple):
    """Attention dropout of one instance (FlashAttention appendix Algorithm 2;
    :func:`load_dropout`): ``p`` (compile-time), ``seed`` int32 ``[1, 1]`` (the launch's seed,
    device data), ``ones`` ``[128, 128]`` of 1.0 (the draw of a keep mask), ``seed_row`` int32
    ``[1, n]``: the seed along a row for the int32 add of a block's unit numbers (the dense
    forward; None in the block-sparse kernels), ``mask_out`` the debug HBM keep mask the kernel
    draws into (None unless asked)."""
    p: float
    seed: object
    ones: object
    seed_row: Optional[object]
    mask_out: Optional[object]


class ScoreMods(NamedTuple):
    """Score modifiers of one instance (``score_mods.py``): ``mods`` (compile-time), ``unit``
    ``u`` (the exp's scale on raw units: the cap with softcap) and ``cols`` the
    :class:`score_mods.HeadColumns` of the instance's query heads."""
    mods: SM.Mods
    unit: float
    cols: SM.HeadColumns


def score_mods(c: Config, mods: SM.Mods, alibi_slopes, sinks,
               exp_scale: float) -> Optional[ScoreMods]:
    """The :class:`ScoreMods` of instance ``c`` for ``exp_scale`` (the exp's scale on raw
    scores), or None without modifiers."""
    if mods == SM.Mods():
        return None
    unit = mods.unit(exp_scale)
    return ScoreMods(mods, unit, SM.HeadColumns(mods, unit, alibi_slopes, sinks, c.b,
                                                c.head(0), c.G))


def load_dropout(p, seed, ones_dtype, seed_row: int = 0, mask_out=None) -> Dropout:
    """The :class:`Dropout` record: the HBM ``(1,)`` int32 ``seed`` loaded once per program,
    the ones tile (``ones_dtype``) and, with ``seed_row`` > 0, the seed along a row of that
    many columns."""
    seed_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.dma_copy(seed_sb, seed.reshape((1, 1)))
    row = None
    if seed_row:
        # the seed along a row, for the int32 add of a block's unit numbers (exact copies)
        row = nl.ndarray((1, seed_row), dtype=nl.int32, buffer=nl.sbuf)
        for c in T.unrolled(seed_row):
            port.tensor_copy(row[0:1, c:c + 1], seed_sb, engine="gpsimd")
    ones = nl.ndarray((T.PMAX, T.PMAX), dtype=ones_dtype, buffer=nl.sbuf)
    port.memset(ones, 1.0, engine="gpsimd")
    return Dropout(float(p), seed_sb, ones, row, mask_out)


def kv_scale_columns(c: Config):
    """An FP8 cache's scales of kv head g as fp32 ``[128, 2]`` columns on every partition:
    ``q_scale k_scale`` (the factor of Q^T's PSUM -> SBUF copy, :func:`load_q`: the scores of
    the stored keys are then those of the dequantized ones, in the units the exp expects) and
    ``v_scale`` (:func:`finalize`'s, with ``1 / l``). One 8-byte DMA of row g of ``kv_scale``
    per program, broadcast to the partitions."""
    cols = SM.head_values(c.kv_scale.reshape((2 * c.Hkv,)), c.b, c.g * 2, 2)
    if c.q_scale != 1.0:
        port.tensor_scalar(cols[:, 0:1], cols[:, 0:1], nl.multiply, c.q_scale,
                           engine="gpsimd")
    return cols


@dataclass(frozen=True, eq=False)
class Instance(Config):
    """A :class:`Config` with its optional feature records, each complete when present:
    ``lens`` (:class:`Lengths`), ``drop`` (:class:`Dropout`), ``score`` (:class:`ScoreMods`),
    and ``xq``: ``[128, G * tiles per head, D]`` query rows preloaded ahead of their groups
    (column :meth:`Config.q_col`, ``ForwardTiles.q_preload``; with :attr:`direct_q` their
    transposes, ``[128, head-dim passes, G * tiles per head, 128]``; None: loaded per
    group); ``kvs``: an FP8 cache's fp32 ``[128, 2]`` columns (:func:`kv_scale_columns`)."""
    lens: Optional[Lengths] = None
    drop: Optional[Dropout] = None
    score: Optional[ScoreMods] = None
    xq: Optional[object] = None
    kvs: Optional[object] = None

    @classmethod
    def of(cls, c: Config, **records) -> "Instance":
        """Instance ``c`` with ``records`` (keywords ``lens``, ``drop``, ``score``, ``xq``,
        ``kvs``)."""
        return cls(**{f.name: getattr(c, f.name) for f in fields(Config) if f.init}, **records)

    @property
    def direct_k(self) -> bool:
        """K^T comes straight from HBM by DMA transposes (:func:`load_piece`): under nki.* on
        NeuronCore-v3+ (``nisa.dma_transpose`` HBM -> SBUF, the 2.33 stub; nki-library's
        ``attention_cte`` loads its K that way), for plain loads (no length gathers: the
        transpose takes no indirect indices) of a k already at matmul dtype (the transpose does
        not cast). Otherwise 128-key blocks are transposed on TensorE."""
        return (port.api() == "nki" and self.gen3 and self.k.dtype == self.mm
                and (self.lens is None or self.lens.k_load is None))

    @property
    def nki_dropout(self) -> bool:
        """Dropout under nki.* on NeuronCore-v3+: ScalarE then takes a share of the row maxima
        (:class:`GroupState`, ``tiles.FWD_NKI_DROPOUT_MAX_ACT_SHARE``)."""
        return bool(self.dropout_p) and self.gen3 and port.api() == "nki"

    @property
    def direct_q(self) -> bool:
        """Q^T comes straight from HBM by DMA transposes (:func:`load_q`, :func:`preload_q`),
        as K^T does (:attr:`direct_k`), when nothing scales it on its way (the scale folded into
        the exp, no FP8 cache) and its rows are not gathered."""
        return (port.api() == "nki" and self.gen3 and self.q.dtype == self.mm
                and self.q_scale == 1.0 and self.kvs is None
                and (self.lens is None or self.lens.q_load is None))

    @property
    def mods(self) -> SM.Mods:
        """The score modifiers (none without the ``score`` record)."""
        return self.score.mods if self.score is not None else SM.Mods()

    @property
    def unit(self) -> float:
        """``u``: the exp's scale on raw units (``act_scale`` without modifiers)."""
        return self.score.unit if self.score is not None else self.act_scale

    @property
    def dropout_p(self) -> float:
        """The dropout probability (0.0 without the ``drop`` record)."""
        return self.drop.p if self.drop is not None else 0.0


def balance_engines(tiles: T.ForwardTiles, plan: ForwardPlan, spec: M.MaskSpec, mods: SM.Mods,
                    dropout: bool, guard: bool, G: int, Nk: int, D: int) -> float:
    """How the P^T copies split between ScalarE and VectorE (:attr:`Config.act_share`):
    ``tiles.act_evac_share``, or balanced from the work of the loop nest,
    ``tiles.fwd_act_evac_share``; the predicated-off blocks of masked regions count as work:
    they issue. Under dropout through nki.* on NeuronCore-v3+ the measured
    ``tiles.FWD_NKI_DROPOUT_ACT_EVAC_SHARE`` (ScalarE takes row maxima there, which the
    formula does not count)."""
    share = tiles.act_evac_share
    if share is None and dropout and port.gen3() and port.api() == "nki":
        share = T.FWD_NKI_DROPOUT_ACT_EVAC_SHARE
    if share is None:
        gen3 = port.gen3()
        Bk = tiles.softmax_block
        share_of = {False: dma_share(tiles, gen3)}
        share_of[True] = min(share_of[False], T.FWD_MASKED_P_DMA_SHARE)
        cols = blocks = n_tiles = evac = 0
        for sp in plan.spans:
            n = G * sp.tiles
            n_tiles += n
            for rg in sp.regions:
                w = rg.k1 - rg.k0
                cols += n * w
                evac += (1.0 - share_of[rg.masked]) * n * w * sp.rows
                blocks += n * T.ceil_div(w, Bk)
        act_extra, dve_extra = SM.engine_extra(mods, not SM.one_sided(spec))
        # the non-finite V guard: three VectorE passes over every V element loaded, two small
        # instructions per query tile at write-back
        loads = 1 if plan.resident else max(1, n_tiles // max(1, plan.q_group))
        guard_cycles = (3 * loads * Nk * D / T.PMAX + 2 * n_tiles * T.FWD_MIN_II) if guard else 0
        share = T.fwd_act_evac_share(
            "trn2" if gen3 else "trn1", score_cols=cols, blocks=blocks, rescales=blocks,
            q_tiles=n_tiles,
            evac_cols=int(evac // T.PMAX), D=D,
            dropout=dropout, act_extra=act_extra, dve_extra=dve_extra,
            dve_cycles=guard_cycles)
    return share


class _Splitter:
    """Deterministic split of a stream of work items (weighted by size) in a fixed proportion:
    ``take(n)`` says whether this item goes to the first kind, keeping the running share of the
    first kind within half an item of ``share``."""

    def __init__(self, share: float):
        self.share = share
        self.taken = 0
        self.total = 0

    def take(self, n: int) -> bool:
        self.total += n
        if self.taken + n <= self.share * self.total + n / 2:
            self.taken += n
            return True
        return False

    def engine(self, n: int) -> str:
        """Engine of the next PSUM -> SBUF copy of ``n`` columns (ScalarE or VectorE)."""
        return "scalar" if self.take(n) else "vector"


class KV:
    """K^T (one tile per head-dim pass, ``[rows, n]``) and ``[V | 1]`` (``[128, n/128 blocks,
    D + 1]``; with ``kv_lens`` the last column is 1.0 for valid keys only) of ``n`` keys from
    ``base`` (an index expression), in SBUF at matmul dtype."""

    def __init__(self, base, kT, v):
        self.base, self.kT, self.v = base, kT, v

    def v_block(self, kw: int, b):
        """``[V | 1]`` rows ``0 .. kw - 1`` of the tile's 128-key block ``b`` (an index
        expression): the moving operand of a P V matmul (:func:`fold_back`)."""
        return self.v[0:kw, b, :]


class GroupState:
    """SBUF state of a group of ``n`` query tiles (slot s = the group's s-th tile).

    - ``qT``: Q^T per head-dim pass, ``[d, n, rows]`` at matmul dtype.
    - ``o``: ``[o_acc | l_i]`` in fp32, D + 1 columns (the ones column of V makes PV produce the
      row sums); every block's PV is a fresh PSUM accumulation group folded in by VectorE.
    - ``stats``: per slot ``[-m_new | -m_i | -rowmax of each score tile]`` (raw score units): one
      min-reduction over columns 1.. gives ``-m_new`` (column 0); after alpha it is copied to
      column 1.
    - ``max_share``: the share of the score tiles whose row maxima ScalarE takes (the rest
      VectorE's, :meth:`max_split`): under dropout through nki.* on NeuronCore-v3+
      ``tiles.FWD_NKI_DROPOUT_MAX_ACT_SHARE`` (with a causal or window band
      ``FWD_NKI_DROPOUT_BAND_MAX_ACT_SHARE``), since VectorE also draws every mask
      (``nisa.dropout`` is VectorE only); else 0.

    ``zero_o`` False: ``o`` is left unwritten, for a caller whose first update of every slot
    writes it whole (:func:`fold_update` ``first``).
    """

    def __init__(self, f: Instance, n: int, rows: int, zero_o: bool = True):
        P, width = T.PMAX, f.tiles.softmax_block // f.tiles.k_tile
        self.n, self.rows = n, rows
        share = 0.0
        if f.nki_dropout:
            shares = (T.FWD_NKI_DROPOUT_BAND_MAX_ACT_SHARE if f.spec.has_diag
                      else T.FWD_NKI_DROPOUT_MAX_ACT_SHARE)
            share = shares[port.target()]
        self.max_share = share
        # without a band every block is a whole softmax block: one count over all the blocks
        # the group's program text folds (fixed at tracing), so a share between a block's
        # quarters alternates the blocks' splits (0.875: ScalarE takes 4 of one block's 4
        # tiles, 3 of the next traced one's). A band's blocks vary in width (masked regions,
        # joined partial blocks): each is split alone (trn2 causal N = 4096: 173.2 us, against
        # 174.0 at the best share counted over the group)
        self._split = None if f.spec.has_diag else _Splitter(share)
        self.qT = [nl.ndarray((d, n, rows), dtype=f.mm, buffer=nl.sbuf) for _, d in f.d_passes]
        self.o = nl.ndarray((P, n, f.vcols), dtype=nl.float32, buffer=nl.sbuf)
        if zero_o:
            port.memset(self.o, 0.0, engine="gpsimd")
        self.stats = nl.ndarray((P, n, 2 + width), dtype=nl.float32, buffer=nl.sbuf)
        port.memset(self.stats[:, :, 1:2], -T.FWD_M_FLOOR, engine="gpsimd")

    def max_split(self) -> _Splitter:
        """The split of the next block's row maxima between ScalarE and VectorE
        (``max_share``)."""
        return self._split if self._split is not None else _Splitter(self.max_share)

    def o_acc(self, s):
        """``[o_acc | l_i]`` of slot s, ``[rows, D + 1]`` fp32."""
        return self.o[0:self.rows, s, :]

    def neg_m(self, s):
        """``-m_i`` (raw score units) of slot s, ``[rows, 1]``."""
        return self.stats[0:self.rows, s, 1:2]

    def neg_m_new(self, s):
        return self.stats[0:self.rows, s, 0:1]


# ============================================================================================
# Phases
# ============================================================================================


def length_tables(c: Config, kv_lens, q_lens, key_mask: bool) -> Lengths:
    """The :class:`Lengths` of instance ``c``: the runtime lengths of sequence b
    (:class:`masks.RuntimeLengths`, shared with the backward) and the index tables of the
    gathers, built once per program for every query tile and key block in ``[128, n]``
    instructions: ``q_load``/``q_store``/``q_valid`` (column :meth:`Config.q_col`; store only
    when the rows are rotated) and ``k_load`` (column = 128-key block; keys are only read).
    Padding positions get out-of-bounds load indices: the ``oob_mode.skip`` gathers never read
    them. With ``kv_lens`` also the key mask's fill (:func:`edge_key_fill`), and with
    ``key_mask`` (:func:`_key_mask`) its ``MASK_NEG`` row. Either namespace: the flat rows of
    the sequence depend on the program's indices, a linear form 0.7 reads from ``c.indices``
    (summed in int32 when the rows may reach 2^24, or with dropout:
    :func:`flash_attention_fwd`), and the gathers are :func:`port.rows` accesses."""
    rt = M.RuntimeLengths(c.spec, kv_lens, q_lens, c.b, c.Nq, c.Nk, key_rows=key_mask)
    key_neg = M.neg_row(T.PMAX) if key_mask else None
    q_rows = c.q.reshape((c.B * c.Hq * c.Nq, c.D))
    k_rows = c.k.reshape((c.kv_rows, c.D))
    v_rows = c.v.reshape((c.kv_rows, c.D))
    q_load = q_store = q_valid = k_load = k_fill = None
    if rt.has_q:
        per_head = T.ceil_div(c.Nq, c.tiles.q_tile)
        runs = [(h * per_head, per_head,
                 [(c.b, c.Hq * c.Nq), (c.g, c.G * c.Nq), (h, c.Nq)], 0)
                for h in T.unrolled(c.G)]
        rows, pos = M.position_table(runs, c.G * per_head, stride=c.tiles.q_tile,
                                     offsets=c.indices)
        q_valid = rt.valid(pos, keys=False)
        q_load, q_store = rt.index_table(rows, pos, c.B * c.Hq * c.Nq, keys=False,
                                         valid=q_valid)
    if rt.has_k:
        n = T.ceil_div(c.Nk, T.PMAX)
        if c.block_table is None:
            rows, pos = M.position_table([(0, n, _key_rows0(c), 0)], n, offsets=c.indices)
            k_load, _ = rt.index_table(rows, pos, c.kv_rows, keys=True)
        else:
            pos = nl.ndarray((T.PMAX, n), dtype=nl.float32, buffer=nl.sbuf)
            port.iota(pos, [[T.PMAX, n]], channel_multiplier=1)
            valid = rt.valid(pos, keys=True)
            k_load = paged_key_rows(c, _hbm_keys(c, rt, pos, valid), valid)
        k_fill = edge_key_fill(c, rt, k_rows)
    return Lengths(rt, q_rows, k_rows, v_rows, q_load, q_store, q_valid, k_load, k_fill,
                   key_neg)


def _key_mask(dropout_p, mods: SM.Mods, kv_lens) -> bool:
    """Whether padding keys are masked on the scores (a rank-1 ``MASK_NEG`` key row,
    :meth:`masks.RuntimeLengths.key_mask_row`) rather than by the edge key alone: dropout sums
    P from the exp, and ALiBi could lift a padding key's score above the edge key's."""
    return (bool(dropout_p) or mods.alibi) and kv_lens is not None


def frame_keys(k, block_table) -> int:
    """Keys of the kernel's frame: ``Nk`` of a ``(B, Hkv, Nk, D)`` k, or the logical capacity
    ``max_blocks * page_size`` of a page pool with a block table."""
    return k.shape[2] if block_table is None else block_table.shape[1] * k.shape[2]


def _hbm_keys(c: Config, rt: M.RuntimeLengths, pos, valid):
    """fp32 (pos's shape): the sequence's key (its logical cache position) at frame positions
    ``pos``: ``pos`` itself, or with rotated keys ``pos + kv_len - Nk`` for valid ones and ``pos
    + kv_len`` for padding ones (``valid``: :meth:`masks.RuntimeLengths.valid`); all below
    ``2 Nk``."""
    if not rt.rotate_k:
        return pos
    shape = tuple(pos.shape)
    shift = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(shift, valid, nl.multiply, -float(c.Nk), op1=nl.add,
                       operand1=rt.kv_len_p[0:shape[0]])
    key = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(key, pos, shift, nl.add)
    return key


def paged_key_rows(c: Config, key, valid):
    """int32 (key's shape, ``[p, n]``): the rows of the page pools' flat ``(num_blocks Hkv
    page_size, D)`` views holding the sequence's keys ``key`` (fp32 logical positions, exact
    integers) for kv head g, pushed out of bounds where ``valid`` is 0.

    Key j is offset ``j mod page_size`` of page ``block_table[b, j // page_size]``, so its row
    is ``(page Hkv + g) page_size + j mod page_size`` (as the decode kernel's gathers find
    them). The pages come from the table by indirect DMA, one int32 per partition and column
    (a compiled loop over the columns); an invalid key's table index is pushed past the table,
    so it reads no entry and keeps the page number ``num_blocks``, one past the pool: its K/V
    gather is skipped too. page_size is a power of two (the division is exact in fp32); page
    numbers and rows in int32."""
    table = c.block_table
    B, MB = table.shape
    num_blocks, ps = c.k.shape[0], c.k.shape[2]
    shape = tuple(key.shape)
    p, n = shape
    within = M.int_mod(key, ps)
    block = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(block, key, within, nl.subtract)
    skip = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(skip, valid, nl.subtract, 1.0, op1=nl.multiply,
                       operand1=-float(M.oob_offset(B * MB)))
    block_i = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(block_i, block, nl.multiply, 1.0 / ps, nl.add, skip)
    first = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    port.iota(first, [[0, n]], runtime=[(c.b, MB)], offsets=c.indices)
    entry = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(entry, first, block_i, nl.add)
    page = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    port.memset(page, num_blocks, engine="gpsimd")
    table_flat = table.reshape((B * MB, 1))

    def table_column(j):
        port.dma_copy(page[0:p, nl.ds(j, 1)], port.rows(table_flat, entry, j, n=p),
                      oob_skip=True)

    port.loop(n, table_column)
    head = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    port.iota(head, [[0, n]], runtime=[(c.g, ps)], offsets=c.indices)
    offset = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(offset, head, within, nl.add)
    stride = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    port.memset(stride, c.Hkv * ps, engine="gpsimd")
    first_row = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(first_row, page, stride, nl.multiply)
    rows = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(rows, first_row, offset, nl.add)
    return rows


def _key_rows0(c: Config):
    """The flat row of key 0 of this program's sequence in ``(B Hkv Nk, D)`` views of k and v,
    ``(b Hkv + g) Nk``, as a linear form of the program's indices (:func:`port.iota`)."""
    return [(c.b, c.Hkv * c.Nk), (c.g, c.Nk)]


def edge_key_fill(c: Config, rt: M.RuntimeLengths, k_rows):
    """The key mask of ``kv_lens`` without a mask on the scores: ``[128, D]`` (the staging
    dtype :attr:`Config.kv_dtype`), the valid key next to the padding
    (:meth:`masks.RuntimeLengths.edge_key_index`; zeros when ``kv_len = 0``) on every
    partition. Key tiles start as copies of it, so every padding key the gathers skip holds the
    edge key.

    Why that masks: padding keys get V = 0 and a 0 in V's ones column (:func:`load_kv`), so
    they add nothing to o_acc or l_i whatever their P; the only place they could still act is
    the row max. The keys a row sees form an interval, and the padding keys of the frame form an
    interval next to the valid ones, so a row that sees a padding key and any valid key also
    sees the edge key: a padding score (a copy of the edge key's) never exceeds the row's true
    max. A row that sees only padding ends with l_i = 0 (o = 0, LSE = -inf). The copy need not
    be bit-exact (a K = 1 TensorE broadcast; fp32 matmuls are not guaranteed exact on
    hardware): a padding score within rounding of a visible one changes nothing. One gathered
    row (``D`` elements read) per program. Caveat: the edge key is valid data, so a NaN/inf in
    it also reaches the rows that see only padding keys (finite inputs: no effect)."""
    P, D = T.PMAX, c.D
    if c.block_table is None:
        idx = rt.edge_key_index(_key_rows0(c), c.kv_rows, offsets=c.indices)
    else:
        # the edge key's cache position (key 0 when rotated, else kv_len - 1), valid when
        # kv_len > 0, through the block table
        valid = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(valid, rt.kv_len_1, nl.greater_equal, 1.0)
        key = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        if rt.rotate_k:
            port.memset(key, 0.0, engine="gpsimd")
        else:
            port.tensor_scalar(key, rt.kv_len_1, nl.subtract, 1.0, op1=nl.maximum,
                               operand1=0.0)
        idx = paged_key_rows(c, key, valid)
    row = nl.ndarray((1, D), dtype=c.kv_dtype, buffer=nl.sbuf)
    port.memset(row, 0.0, engine="gpsimd")
    M.gather_rows(row, k_rows, idx, 0, 1, D)
    ones = nl.ndarray((1, P), dtype=c.kv_dtype, buffer=nl.sbuf)
    port.memset(ones, 1.0, engine="gpsimd")
    bcast = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.psum)
    port.nc_matmul(bcast, ones, row)
    fill = nl.ndarray((P, D), dtype=c.kv_dtype, buffer=nl.sbuf)
    port.tensor_copy(fill, bcast)
    return fill


def transpose_keys(f: Instance, kT, col0, pieces, src_dtype):
    """K^T columns from natural K blocks: ``pieces`` are (column offset from ``col0`` (static),
    keys, [keys, D] tile), consecutive; TensorE transposes them several per PSUM bank, one PSUM
    -> SBUF copy per bank casts to the matmul dtype (ScalarE or VectorE, balanced). ``col0``
    is an index expression (the first column of the pieces in ``kT``)."""
    P = T.PMAX
    per_bank = f.psum_cols(src_dtype)
    split = f.evac_split()
    for pi, (d0, rows) in enumerate(f.d_passes):
        for s0 in T.unrolled(0, len(pieces), per_bank):
            group = pieces[s0:s0 + per_bank]
            tp = nl.ndarray((rows, per_bank * P), dtype=f.transpose_psum_dtype(src_dtype),
                            buffer=nl.psum)
            for s, (col, kw, src) in enumerate(group):
                port.nc_transpose(tp[:, s * P:s * P + kw], src[0:kw, d0:d0 + rows])
            width = (group[-1][0] + group[-1][1]) - group[0][0]
            port.tensor_copy(kT[pi][:, nl.ds(col0 + group[0][0], width)], tp[:, 0:width],
                             engine=split.engine(width))


def load_piece(f: Instance, kT, v, cb, rb, ln: int, guard: bool = True,
               sum_on_scalar: bool = False, parts: str = "kv"):
    """Keys ``[128 (cb + rb), 128 (cb + rb) + ln)`` of the frame into K^T / ``[V | 1]`` of a K/V
    tile starting at key ``128 cb``, at its 128-key block ``rb`` (``cb``, ``rb`` index
    expressions; ``ln`` static, at most ``kv_load_block``). Plain loads (the full 128-key
    blocks in one DMA each for K and V, :func:`port.row_blocks`; K^T by DMA transposes with
    :attr:`Instance.direct_k`), or with ``kv_lens`` gathers
    of one 128-key block per DMA through ``k_load`` (rotated when the band needs it): padding
    keys are skipped -- never read -- and keep what the tiles were filled with, the edge key in
    K (:func:`edge_key_fill`) and zeros in V. V of another dtype than the matmul's is cast on
    GpSimd; an FP8 cache's gathers cast K and V to the matmul dtype themselves
    (:attr:`Config.kv_dtype`). ``sum_on_scalar``: :func:`guard_values`'. ``parts``: "kv"
    both, "k" K^T only, "v" V (and its guard) only (plain loads only)."""
    P, D = T.PMAX, f.D
    do_k, do_v = "k" in parts, "v" in parts
    nb = T.ceil_div(ln, P)
    full, tail = ln // P, ln % P
    rows = [min(P, ln - t * P) for t in T.unrolled(nb)]
    same = f.kv_dtype == f.mm
    key0 = (cb + rb) * P
    kx = None if f.direct_k else nl.ndarray((P, nb, D), dtype=f.kv_dtype, buffer=nl.sbuf)
    vx = None if same else nl.ndarray((P, nb, D), dtype=f.kv_dtype, buffer=nl.sbuf)

    def v_dst(p, t, n=1):
        """[p, n blocks, D] destination of V blocks t.. (v itself, or the cast buffer)."""
        if same:
            return v[0:p, nl.ds(rb + t, n), 0:D]
        return vx[0:p, t:t + n, :]

    lens = f.lens
    if lens is not None and lens.k_load is not None:
        if parts != "kv":
            raise ValueError(f"parts: the length gathers load K and V together, got {parts!r}")
        for t in T.unrolled(nb):
            port.tensor_copy(kx[:, t, :], lens.k_fill, engine="gpsimd")
        port.memset(v_dst(P, 0, nb), 0.0, engine="gpsimd")
        for t in T.unrolled(nb):
            M.gather_rows(kx[0:rows[t], t, :], lens.k_rows, lens.k_load, cb + rb + t, rows[t],
                          D)
            M.gather_rows(v_dst(rows[t], t)[:, 0, :], lens.v_rows, lens.k_load, cb + rb + t,
                          rows[t], D)
    else:
        if do_k and f.direct_k:
            for pi, (d0, dr) in enumerate(f.d_passes):
                port.dma_transpose(kT[pi][0:dr, nl.ds(rb * P, ln)],
                                   f.k[f.b, f.g, nl.ds(key0, ln), d0:d0 + dr])
        elif do_k:
            if full:
                port.dma_copy(kx[:, 0:full, :],
                              port.row_blocks(f.k, (f.b, f.g), key0, P, full, D),
                              legacy_isa=True)
            if tail:
                port.dma_copy(kx[0:tail, full, :],
                              f.k[f.b, f.g, nl.ds(key0 + full * P, tail), :], legacy_isa=True)
        if do_v:
            load_values(f, v_dst, key0, full, tail)
    if not same and do_v:
        if full:
            port.tensor_copy(v[:, nl.ds(rb, full), 0:D], vx[:, 0:full, :], engine="gpsimd")
        if tail:
            port.tensor_copy(v[0:tail, rb + full, 0:D], vx[0:tail, full, :], engine="gpsimd")
    if guard and do_v:
        guard_piece(f, v, rb, ln, sum_on_scalar)
    if not f.direct_k and do_k:
        transpose_keys(f, kT, rb * P, [(t * P, rows[t], kx[:, t, :]) for t in T.unrolled(nb)],
                       f.kv_dtype)


def guard_piece(f: Instance, v, rb, ln: int, sum_on_scalar: bool = False):
    """:func:`guard_values` of ``ln`` keys of ``[V | 1 | flag]`` from its 128-key block ``rb``
    (nothing without the guard)."""
    P, D = T.PMAX, f.D
    full, tail = ln // P, ln % P
    if not f.guard:
        return
    if full:
        guard_values(f, v[:, nl.ds(rb, full), 0:D], v[:, nl.ds(rb, full), D + 1:D + 2],
                     sum_on_scalar)
    if tail:
        guard_values(f, v[0:tail, nl.ds(rb + full, 1), 0:D],
                     v[0:tail, nl.ds(rb + full, 1), D + 1:D + 2], sum_on_scalar)


def load_values(f: Instance, v_dst, key0, full: int, tail: int):
    """Plain loads of V: ``full`` 128-key blocks from key ``key0`` in one DMA, then a partial
    block of ``tail`` keys, into ``v_dst(rows, first block, blocks)`` (:func:`load_piece`)."""
    P, D = T.PMAX, f.D
    if full:
        port.dma_copy(v_dst(P, 0, full), port.row_blocks(f.v, (f.b, f.g), key0, P, full, D),
                      legacy_isa=True)
    if tail:
        port.dma_copy(v_dst(tail, full)[:, 0, :],
                      f.v[f.b, f.g, nl.ds(key0 + full * P, tail), :], legacy_isa=True)


def guard_values(f: Instance, vals, flag, sum_on_scalar: bool = False):
    """Keep a non-finite value to the rows that see it: zero the non-finite entries of the V
    blocks ``vals`` (``[p, n, D]``, matmul dtype, in place) and set ``flag`` (``[p, n, 1]``,
    the column after V's ones column) to 1.0 for keys that had one. P V then never computes
    ``0 * inf`` for a row that cannot see the key (a NaN there would reach every row of the
    tile), while PV's extra column sums ``P_ij flag_j``: a row with a positive sum saw a
    non-finite value and gets NaN at write-back (:func:`finalize`), as ``P V`` would give it
    (unless its weight underflowed to 0 within its block). O(N D) per K/V load
    (:func:`masks.zero_non_finite` and one reduction, on GpSimd, or with ``sum_on_scalar`` as
    ScalarE sums: the block-sparse kernel guards every gathered block and its VectorE is the
    busier engine; its resident K/V load opens the kernel, every engine waiting on the guard,
    and ScalarE is idle there)."""
    if not sum_on_scalar:
        bad, _ = M.zero_non_finite(vals)
        # the flag: a max over the head dim by halving on GpSimd (VectorE, which selects the
        # zeros, is the busier engine when the K/V load opens the kernel)
        w = vals.shape[2]
        while w > 1:
            h = (w + 1) // 2
            port.tensor_tensor(bad[:, :, 0:w - h], bad[:, :, 0:w - h], bad[:, :, h:w],
                               nl.maximum, engine="gpsimd")
            w = h
        port.tensor_copy(flag, bad[:, :, 0:1], engine="gpsimd")
        return
    # the flag from ScalarE sums of bad (the count of a block row's non-finite entries), one
    # [p, D] activation per block, beside VectorE's select, and one small VectorE compare;
    # bad in one GpSimd instruction (no z)
    bad, _ = M.zero_non_finite(vals, want_z=False)
    p, n = vals.shape[0], vals.shape[1]
    sums = nl.ndarray((p, n), dtype=nl.float32, buffer=nl.sbuf)
    for w in T.unrolled(n):
        copied = nl.ndarray((p, vals.shape[2]), dtype=nl.float32, buffer=nl.sbuf)
        port.activation_reduce(copied, nl.copy, bad[:, w, :], reduce_op=nl.add,
                               reduce_res=sums[:, w:w + 1])
    port.tensor_scalar(flag[:, :, 0], sums, nl.not_equal, 0.0)


def ones_column(f: Instance, col):
    """Fill V's ones column ``col`` (``[p, n, 1]``): 1.0, so that P V also yields the softmax
    sums l_i, or 0.0 under dropout, whose sums are those of the undropped P and come from the
    exp (:func:`fold_front`): PV then adds nothing to l_i and the accumulator update adds it
    with O in one VectorE instruction (:func:`fold_update`)."""
    port.memset(col, 0.0 if f.dropout_p else 1.0, engine="gpsimd")


def load_kv(f: Instance, cb, n: int, zero_blocks: Optional[int] = None,
            load: bool = True, sum_on_scalar: bool = False, values_first: bool = False) -> KV:
    """Load ``n`` keys (static) of K and V from key ``128 cb`` (``cb`` an index expression):
    K^T via TensorE transposes of 128-key blocks (PSUM -> SBUF copy casts to the matmul dtype),
    V as 128-key blocks ``[128, D + 1]`` whose last column is :func:`ones_column`'s (0.0 for
    padding keys with ``kv_lens`` and no dropout, :func:`edge_key_fill`). ``zero_blocks`` (the
    block-sparse forward, which reads whole 128-key blocks; None: K^T has n columns): K^T and
    V hold ``ceil(n / 128) + zero_blocks`` whole blocks, and the keys past ``n`` are zeros in
    K^T and in V (their guard flag too; V's ones column stays :func:`ones_column`'s).
    ``load`` False: only the tiles and V's ones column; the keys are loaded later, a range at
    a time (:func:`load_keys`). ``sum_on_scalar``: :func:`guard_values`'. ``values_first``:
    every piece of V (and its guard) before the first of K (else piece by piece, K first)."""
    P, D = T.PMAX, f.D
    nblk = T.ceil_div(n, P)
    blocks = nblk if zero_blocks is None else nblk + zero_blocks
    cols = n if zero_blocks is None else blocks * P
    kT = [nl.ndarray((rows, cols), dtype=f.mm, buffer=nl.sbuf) for _, rows in f.d_passes]
    # V with a ones column: PV then also yields the row sums l_i = sum_j P_ij on TensorE
    v = nl.ndarray((P, blocks, f.vcols), dtype=f.mm, buffer=nl.sbuf)
    if cols > n:
        for t in kT:
            port.memset(t[:, n:cols], 0.0, engine="gpsimd")
        port.memset(v[:, n // P:blocks, :], 0.0, engine="gpsimd")
    if f.lens is None or f.lens.k_load is None or f.dropout_p:
        ones_column(f, v[:, :, D:D + 1])
    else:
        key = nl.ndarray((P, nblk, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(key, [[P, nblk], [1, 1]], channel_multiplier=1, runtime=[(cb, P)],
                  offsets=f.indices)
        f.lens.rt.valid(key, keys=True, dst=v[:, :, D:D + 1])
    kv = KV(cb * P, kT, v)
    if load:
        for parts in (("v", "k") if values_first else ("kv",)):
            load_keys(f, kv, cb, 0, n, sum_on_scalar=sum_on_scalar, parts=parts)
    return kv


def load_keys(f: Instance, kv: KV, cb, k0: int, k1: int, guard: bool = True,
              sum_on_scalar: bool = False, parts: str = "kv"):
    """Keys ``[k0, k1)`` (static; ``k0`` a multiple of 128) of the K/V tile ``kv`` starting at
    key ``128 cb``: a compiled loop of ``kv_load_block``-key pieces (:func:`load_piece`) plus
    a static tail piece. ``guard`` False: V's guard is left to :func:`guard_keys`."""
    _pieces(f, k0, k1, lambda rb, ln: load_piece(f, kv.kT, kv.v, cb, rb, ln, guard,
                                                 sum_on_scalar, parts))


def guard_keys(f: Instance, kv: KV, k0: int, k1: int):
    """The V guard (:func:`guard_piece`) of keys ``[k0, k1)`` loaded by :func:`load_keys`
    without it, in the same pieces."""
    _pieces(f, k0, k1, lambda rb, ln: guard_piece(f, kv.v, rb, ln))


def _pieces(f: Instance, k0: int, k1: int, body):
    """``body(first 128-key block, keys)`` of the ``kv_load_block``-key pieces of keys ``[k0,
    k1)`` (a compiled loop) and of the static tail piece."""
    P, LB = T.PMAX, f.tiles.kv_load_block
    per, n, rb = LB // P, k1 - k0, k0 // P
    port.loop(n // LB, lambda lb: body(rb + lb * per, LB))
    if n % LB:
        body(rb + (n // LB) * per, n % LB)


def load_q_rows(f: Instance, r: int, h, t, x):
    """Load the ``r`` rows of query tile t (an index expression) of member head h into ``x``
    (``[r, D]``). With ``q_lens`` the rows are gathered through ``q_load`` (rotated when the
    band needs it): padding rows are never read and stay 0."""
    if f.lens is None or f.lens.q_load is None:
        port.dma_copy(x, f.q[f.b, f.head(h), nl.ds(t * f.tiles.q_tile, r), :], legacy_isa=True)
    else:
        port.memset(x, 0.0, engine="gpsimd")
        M.gather_rows(x, f.lens.q_rows, f.lens.q_load, f.q_col(h, t), r, f.D)


def preload_q(f: Instance, r: int, h, t0, n: int):
    """Rows of query tiles ``t0 .. t0 + n - 1`` of member head h into the preload buffer
    ``f.xq`` (:attr:`tiles.ForwardTiles.q_preload`): issued a group ahead (with that group's
    keys, :func:`forward_instance`), the loads are out of the groups' way."""
    def one(i):
        col = f.q_col(h, t0 + i)
        if f.direct_q:
            transpose_q_rows(f, r, h, t0 + i, [f.xq[0:dr, pi, col, 0:r]
                                               for pi, (_, dr) in enumerate(f.d_passes)])
        else:
            load_q_rows(f, r, h, t0 + i, f.xq[0:r, col, :])

    port.loop(n, one)


def transpose_q_rows(f: Instance, r: int, h, t, dsts):
    """Q^T of the ``r`` rows of query tile t (an index expression) of member head h, straight
    from HBM by DMA transposes (:attr:`Instance.direct_q`): ``dsts[pi]`` ``[rows of pass pi,
    r]`` gets head-dim pass pi."""
    for dst, (d0, dr) in zip(dsts, f.d_passes):
        port.dma_transpose(dst, f.q[f.b, f.head(h), nl.ds(t * f.tiles.q_tile, r), d0:d0 + dr])


def load_q(f: Instance, st: GroupState, s, h, t):
    """Q^T of query tile t (an index expression) of member head h into slot s: its rows (the
    preloaded ones, or loaded now), each 128-wide head-dim slice transposed on TensorE and
    copied out of PSUM at matmul dtype (ScalarE), times the softmax scale when the scale is not
    folded into the exp (and an FP8 cache's K scale: the per-partition column of
    :func:`kv_scale_columns`, one rounding of the product). With :attr:`Instance.direct_q`
    the DMA transposes them (the same bits: a transpose only moves them)."""
    r = st.rows
    if f.direct_q:
        # transposed by the DMA: into the slot now, or copied from the preload buffer on
        # GpSimd (SBUF only, otherwise the least busy engine)
        if f.xq is None:
            transpose_q_rows(f, r, h, t, [qT[:, s, 0:r] for qT in st.qT])
        else:
            for pi, (_, dr) in enumerate(f.d_passes):
                port.tensor_copy(st.qT[pi][:, s, 0:r], f.xq[0:dr, pi, f.q_col(h, t), 0:r],
                                 engine="gpsimd")
        return
    if f.xq is not None:
        x = f.xq[0:r, f.q_col(h, t), :]
    else:
        x = nl.ndarray((r, f.D), dtype=f.q.dtype, buffer=nl.sbuf)
        load_q_rows(f, r, h, t, x)
    for pi, (d0, rows) in enumerate(f.d_passes):
        tp = nl.ndarray((rows, r), dtype=f.transpose_psum_dtype(x.dtype), buffer=nl.psum)
        port.nc_transpose(tp, x[0:r, d0:d0 + rows])
        port.activation(st.qT[pi][:, s, 0:r], nl.copy, tp,
                        scale=f.q_scale if f.kvs is None else f.kvs[0:rows, 0:1])


def band_predicates(f: Instance, d0, rows: int, width: int):
    """Tile-level predicates of ``rows`` query rows x ``width`` keys whose first key minus first
    row is ``d0`` (an index expression): ``(any, above, below)`` = some score is inside the
    band; some score is above its upper bound; some is below its lower bound (None: not
    applicable; False: statically false). Python bools when ``d0`` is an int; legacy
    loop-index predicates (combined with ``&``) otherwise, and under nki.* (no predicates)
    ``(None, True, True)`` for the bounds the band has: every side is selected."""
    spec, off = f.spec, f.spec.static_offset
    if not isinstance(d0, int) and not port.predicates():
        return (None, None if spec.hi is None else True, None if spec.lo is None else True)
    vis, above, below = [], None, None
    if spec.hi is not None:
        # d_min = d0 - (rows - 1) - off <= hi;  d_max = d0 + width - 1 - off > hi
        vis.append(d0 <= spec.hi + off + rows - 1)
        above = d0 > spec.hi + off - width + 1
    if spec.lo is not None:
        vis.append(d0 >= spec.lo + off - width + 1)
        below = d0 < spec.lo + off + rows - 1
    return _and(*vis), above, below


def contract(pairs, shape, pred=None):
    """A new fp32 PSUM tile of ``shape``: ``sum nc_matmul(stationary, moving)`` over ``pairs``
    (the head-dim passes of a contraction), one accumulation group -- the first product
    writes, the others add. Predicated on ``pred`` (legacy). Shared by the dense and
    block-sparse kernels."""
    acc = nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum)
    for i, (stationary, moving) in enumerate(pairs):
        port.nc_matmul(acc, stationary, moving, accumulate=i > 0, mask=pred)
    return acc


def scores(f: Instance, st: GroupState, s, i0, kv: KV, rel, j0, width: int, masked: bool,
           pred, dk: Optional[int] = None, h=None, neg_max=None):
    """S = Q_i K_j^T for one score tile of ``width`` keys (raw scores; Q^T carries the scale only
    when it is not folded into the exp), in one PSUM bank, plus its band mask.

    One matmul per head-dim pass (stationary Q^T [d, rows], moving K^T [d, width]) accumulating
    in PSUM. In a masked region the tile is copied to SBUF and each band edge it crosses
    selects ``MASK_NEG`` outside the band (:func:`port.affine_select` of the key-minus-row
    distance against the bound: one GpSimd instruction, predicated in legacy on the tile
    crossing that side; under nki.* the distance's loop-index part is read from
    ``f.offsets``): a selection, so a non-finite score a row cannot see never reaches it.
    ``dk``: ``j0 - i0`` when it is a compile-time constant (sliding spans). Padding keys
    (``kv_lens``) are never read (:func:`edge_key_fill`). Score modifiers (``score_mods``;
    ``h`` = member head) turn the scores into raw units of ``f.unit`` before the masks select.

    Returns ``(tile, fused)``. Under nki.* a tile crossing a band edge is instead selected by
    one VectorE ``range_select`` straight out of PSUM (:func:`port.band_select_max`: fp32.min
    outside the band, below ``FWD_M_FLOOR`` as ``MASK_NEG`` is) that also writes the negated
    row max into ``neg_max`` (``fused`` True: :func:`fold_front` skips its own max there).
    """
    r = st.rows
    sc = contract([(st.qT[pi][:, s, 0:r], kv.kT[pi][:, nl.ds(rel, width)])
                   for pi in T.unrolled(len(f.d_passes))], (r, width), pred)
    sides = []
    rel_d = (j0 - i0 if dk is None else dk) if masked or f.mods.alibi else None
    if masked:
        _, above, below = band_predicates(f, rel_d, r, width)
        off = f.spec.static_offset
        # select where (key - row) + rel_d - bound compares with 0 as the side allows
        if above is not None and above is not False:
            sides.append((_and(pred, above) if dk is None else pred,
                          -(f.spec.hi + off), nl.less_equal))
        if below is not None and below is not False:
            sides.append((_and(pred, below) if dk is None else pred,
                          -(f.spec.lo + off), nl.greater_equal))
    capped = f.mods.softcap is not None
    key_neg = f.lens.key_neg if f.lens is not None else None
    if key_neg is not None and not capped:
        # dropout or ALiBi with kv_lens: padding keys must have P = 0 on the scores (the
        # softmax sums come from the exp with dropout; ALiBi lifts a padding key above its
        # edge key): MASK_NEG (x) their key row, a rank-1 TensorE add
        key_row = f.lens.rt.key_mask_row(j0, width, f.offsets)
        port.nc_matmul(sc, key_neg[0:1, 0:r], key_row[0:1, 0:width], accumulate=True,
                       mask=pred)
    s_sb = None
    if f.mods.transforms:
        s_sb, _ = SM.modify_scores(f.mods, f.score.cols, sc, r, width, h, rel_d,
                                   f.act_scale / f.unit, not SM.one_sided(f.spec), pred,
                                   d_static=-f.spec.static_offset, offsets=f.offsets)
        if key_neg is not None and capped:
            # the key mask after the tanh (which would map MASK_NEG to -1): its own PSUM tile
            key_row = f.lens.rt.key_mask_row(j0, width, f.offsets)
            kneg = nl.ndarray((r, width), dtype=nl.float32, buffer=nl.psum)
            port.nc_matmul(kneg, key_neg[0:1, 0:r], key_row[0:1, 0:width], mask=pred)
            port.tensor_tensor(s_sb, s_sb, kneg, nl.add, mask=pred)
    if not sides:
        return (sc if s_sb is None else s_sb), False
    if port.api() == "nki" and neg_max is not None:
        out = nl.ndarray((r, width), dtype=nl.float32, buffer=nl.sbuf) if s_sb is None else s_sb
        port.band_select_max(out, sc if s_sb is None else s_sb,
                             [(bound, cmp) for _, bound, cmp in sides], runtime=rel_d,
                             offsets=f.offsets, neg_max=neg_max)
        return out, True
    # band edges by selection, not addition: a non-finite score a row cannot see (a NaN or inf
    # in a hidden key) is replaced, never carried into the row's max and sums. The scores are
    # copied out of PSUM (VectorE) unless a modifier already did, and each crossed side selects
    # MASK_NEG (GpSimd)
    if s_sb is None:
        s_sb = nl.ndarray((r, width), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(s_sb, sc, engine="vector", mask=pred)
    for p, bound, cmp in sides:
        port.affine_select(s_sb, [[1, width]], -1, s_sb, T.FWD_MASK_NEG, cmp, offset=bound,
                           runtime=rel_d, offsets=f.offsets, mask=p)
    return s_sb, False


def dropout_units(f: Instance, r: int, width: int, h, iu, ju, pred):
    """Attention dropout on a P block ``[r, width]`` of query tile ``iu`` (member head h) from
    128-key unit ``ju`` (index expressions): each 128 x 128 unit is zeroed with probability
    ``dropout_p`` by its own draw, the RNG reseeded with ``seed + unit`` where ``unit`` numbers
    (sequence, query head, query tile, key unit) -- so the mask depends on neither the tiling
    nor the schedule, and the backward regenerates it unit by unit (module docstring). The
    1 / (1 - p) rescale is applied to O at write-back. A unit is always drawn as ``[rows,
    128]`` (rows: the tile's, a prefix of the backward's 128), whatever part of it a block
    covers, so both kernels see the same bits (C-order prefix property of the draw; the
    simulator's generator is NumPy's, the hardware's is not reproduced).

    Computes the block's unit seeds and returns ``drop(p, c0, c1)``, which draws the units of
    columns ``c0 .. c1`` (128-aligned ``c0``; static) of the block's P ``p`` in place, so a
    caller can drop the block a P^T group at a time (:func:`fold_back`)."""
    P = T.PMAX
    n_units = T.ceil_div(width, P)
    # the block's unit seeds at once: one iota and one int32 add (GpSimd) for all its units;
    # the first unit ((b Hq + g G + h) nqu + iu) nku + ju as a linear form of the loop indices
    # (nki.*: read from f.indices, summed in int32 on GpSimd)
    per_head = f.nqu * f.nku
    unit0 = [(f.b, f.Hq * per_head), (f.g, f.G * per_head), (h, per_head), (iu, f.nku),
             (ju, 1)]
    units = nl.ndarray((1, n_units), dtype=nl.int32, buffer=nl.sbuf)
    port.iota(units, [[1, n_units]], runtime=unit0, offsets=f.indices)
    seeds = nl.ndarray((1, n_units), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(seeds, units, f.drop.seed_row[0:1, 0:n_units], nl.add)

    def drop(p, c_lo, c_hi):
        for c0 in T.unrolled(c_lo, c_hi, P):
            kw = min(P, c_hi - c0)
            seed = seeds[0:1, c0 // P:c0 // P + 1]
            port.random_seed(seed, mask=pred)
            if kw == P:
                port.dropout(p[:, c0:c0 + kw], p[:, c0:c0 + kw], f.dropout_p, mask=pred)
            else:
                # a unit is always drawn 128 keys wide (the backward may see it whole): keep
                # the first kw columns of the draw
                keep = nl.ndarray((r, P), dtype=f.mm, buffer=nl.sbuf)
                port.dropout(keep, f.drop.ones[0:r, 0:P], f.dropout_p, mask=pred)
                port.tensor_tensor(p[:, c0:c0 + kw], p[:, c0:c0 + kw], keep[:, 0:kw],
                                   nl.multiply, mask=pred)
            if f.drop.mask_out is not None:
                # debug: the same draw again, on ones, stored at the unit's frame position
                port.random_seed(seed, mask=pred)
                drawn = nl.ndarray((r, P), dtype=f.mm, buffer=nl.sbuf)
                port.dropout(drawn, f.drop.ones[0:r, 0:P], f.dropout_p, mask=pred)
                port.dma_copy(f.drop.mask_out[f.b, f.head(h), nl.ds(iu * P, r),
                                              nl.ds(ju * P + c0, kw)],
                              drawn[:, 0:kw], mask=pred)

    return drop


def attend_block(f: Instance, st: GroupState, s, i0, kv: KV, rb, j0, width: int,
                 masked: bool, d0: Optional[int] = None, du=None, h=None, part: str = "all",
                 stage=None):
    """Fold one key block of ``width`` keys (static; from the kv tile's 128-key block ``rb``,
    frame key ``j0``, both index expressions) into slot s (query rows from ``i0``): the body of
    Algorithm 1's inner loop.

    With ``c`` the softmax scale folded into the exp (1 when Q^T carries it):
    ``m_new = max(m_i, rowmax S)`` (raw units, kept negated, floored at ``M_FLOOR`` by the
    initial ``-m_i``); ``P = exp(c S - c m_new)``: one ScalarE activation per score tile, the
    bias carrying the max; ``alpha = exp(c m_i - c m_new)`` (0 for the first visible block:
    ``m_i = M_FLOOR``); ``pv = P [V | 1]`` in a fresh PSUM tile; ``[o_acc | l_i] = alpha [o_acc |
    l_i] + pv`` on VectorE. In a masked region every instruction is predicated (legacy) on the
    block meeting the tile's band, so a skipped block leaves the state as it was; nki.* has no
    predicates and runs the block, whose scores are all ``MASK_NEG``: ``P = exp(<= -2^99) = 0``
    and ``alpha = 1`` exactly (``tiles.FWD_MASK_NEG`` < ``FWD_M_FLOOR``), so the state is
    unchanged there too.

    ``part``: "all", or "front" (scores through the exp, :func:`fold_front`) / "back" (P^T
    through the update, :func:`fold_back`) for a staged tile, whose P, alpha and row sums live
    in the staging buffers ``stage = (p, alpha, row_sum, index)`` between the two halves. A
    tile's dropout (:func:`dropout_units`) is drawn in its back half: in the front halves each
    tile's draw (VectorE, one cycle per score) would wait for that tile's exp on ScalarE,
    ahead of the next tile's row max in VectorE's queue; in the back half its input is ready,
    and it delays only that tile's transposes (trn2 N = 4096: 450 -> 337 us modeled). It is
    drawn a P^T group (512 keys) at a time, just before the group's transposes
    (:func:`fold_back`), so the first groups' DMA transposes overlap the later groups' draws
    (trn2 N = 4096: 287.1 -> 270.4 us with three P^T groups in four on the DMA engines and the
    bias on GpSimd; at the final shares of ``tiles.py`` 253.0 either way, causal 192.4 ->
    192.2).
    """
    r, P = st.rows, T.PMAX
    if not masked or d0 is not None:
        # no band, or a compile-time offset (a sliding span): the block meets the band by
        # construction
        pred = None
    else:
        pred = band_predicates(f, j0 - i0, r, width)[0]
    kt = f.tiles.k_tile
    widths = [min(kt, width - c0) for c0 in T.unrolled(0, width, kt)]
    if part == "back":
        fold_back(f, st, s, staged_front(stage, r, width), widths, kv, rb, pred, masked,
                  dropout_units(f, r, width, *du, pred) if f.dropout_p else None)
        return
    stats = st.stats[0:r, s, :]
    s_tiles, fused = zip(*[scores(f, st, s, i0, kv, rb * P + n * kt, j0 + n * kt, w, masked,
                                  pred, None if d0 is None else d0 + n * kt, h,
                                  neg_max=stats[:, 2 + n:3 + n])
                           for n, w in enumerate(widths)])
    if part == "front":
        fold_front(f, st, s, s_tiles, widths, pred, out=staged_front(stage, r, width),
                   fused=fused)
        return
    fold_back(f, st, s, fold_front(f, st, s, s_tiles, widths, pred, fused=fused), widths, kv,
              rb, pred, masked, dropout_units(f, r, width, *du, pred) if f.dropout_p else None)


def staged_front(stage, rows: int, width: int):
    """Views ``(p, alpha, row_sum)`` of staged tile ``index`` in the staging buffers ``stage =
    (p, alpha, row_sum, index)``."""
    p_buf, a_buf, r_buf, k = stage
    return (p_buf[0:rows, k, 0:width], a_buf[0:rows, k, :],
            None if r_buf is None else r_buf[0:rows, k, :])


def fold_block(f: Instance, st: GroupState, s, s_tiles, widths, kv: KV, rb, pred, drop=None,
               fused=(), masked: bool = False):
    """The online-softmax update of slot s by one key block whose raw score tiles (masks
    already added) are ``s_tiles`` (PSUM, ``widths`` keys each, consecutive keys from the K/V
    tile's 128-key block ``rb``): new max, ``P = exp(...)``, alpha, ``pv = P [V | 1]``,
    ``[o_acc | l_i] = alpha [o_acc | l_i] + pv`` (:func:`attend_block`). ``drop``: None, or
    ``drop(p, rows, width, pred)`` applies attention dropout to P in place (the statistics
    stay those of the undropped P). Every instruction is predicated on ``pred`` (legacy).
    ``fused[n]``: tile n's negated row max is already in its statistics column
    (:func:`scores`)."""
    fold_back(f, st, s, fold_front(f, st, s, s_tiles, widths, pred, drop, fused=fused), widths,
              kv, rb, pred, masked)


def fold_front(f: Instance, st: GroupState, s, s_tiles, widths, pred, drop=None, out=None,
               fused=(), first: bool = False):
    """First half of :func:`fold_block`: the new max, alpha and P (under dropout its
    undropped row sums, and P dropped by ``drop`` unless that is None: the dense kernel drops
    it in :func:`fold_back`, a P^T group at a time, :func:`attend_block`). Returns ``(p,
    alpha, row_sum)`` (row_sum None without dropout), written into ``out`` (views of the same
    shapes) when given. ``first`` (no dropout): the slot's first update, whose accumulator
    is not read (:func:`fold_update`), so alpha is not computed (left unwritten)."""
    r = st.rows
    kt = f.tiles.k_tile
    width = sum(widths)
    nb = len(widths)
    stats = st.stats[0:r, s, :]
    neg_m_old, neg_m_new = st.neg_m(s), st.neg_m_new(s)
    c = f.unit

    # the row max of each score tile (negated): VectorE, or under dropout through nki.* on
    # NeuronCore-v3+ a share of the tiles on ScalarE (GroupState.max_share), whose -s output
    # is not used; either is exact, so the bits are equal
    on_act = st.max_split()
    # ScalarE's tiles first, VectorE's last: VectorE's max of the block's last score tile then
    # leads straight into its min-reduction and the bias (trn2 N = 4096: 253.0 -> 249.0 us;
    # causal 192.2 -> 194.5)
    own = [n for n in T.unrolled(nb) if not (fused and fused[n])]
    for n, on_scalar in zip(own, sorted((on_act.take(widths[n]) for n in own), reverse=True)):
        if on_scalar:
            unused = nl.ndarray((r, widths[n]), dtype=f.mm, buffer=nl.sbuf)
            port.activation_reduce(unused, nl.copy, s_tiles[n], reduce_op=nl.minimum,
                                   reduce_res=stats[:, 2 + n:3 + n], scale=-1.0, mask=pred)
        else:
            port.tensor_reduce(stats[:, 2 + n:3 + n], nl.maximum, s_tiles[n], axis=(1,),
                               negate=True, mask=pred)
    port.tensor_reduce(neg_m_new, nl.minimum, stats[:, 1:2 + nb], axis=(1,), mask=pred)
    if c == 1.0:
        bias = neg_m_new
    else:
        bias = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
        # c * (-m_new) on GpSimd (idle otherwise; ScalarE is a busiest engine), or under
        # dropout through nki.* on VectorE right after its min-reduction: GpSimd's queue then
        # holds the units' seeds, and the alpha and the exp wait for the bias (trn2 N = 4096:
        # 258.2 -> 253.0 us)
        port.tensor_scalar(bias, neg_m_new, nl.multiply, c,
                           engine="vector" if f.nki_dropout else "gpsimd", mask=pred)
    if out is None:
        p = nl.ndarray((r, width), dtype=f.mm, buffer=nl.sbuf)
        alpha = nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf)
        row_sum = (nl.ndarray((r, 1), dtype=nl.float32, buffer=nl.sbuf) if f.dropout_p
                   else None)
    else:
        p, alpha, row_sum = out
    if first and f.dropout_p:
        raise ValueError("first: a slot's first update without its alpha has no dropout "
                         "form (the row sums are added to the accumulator)")
    if not first:
        port.activation(alpha, nl.exp, neg_m_old, bias=bias, scale=-c, mask=pred)
    if f.dropout_p:
        # the row sums of the undropped P come from the exp itself (the [V | 1] column would
        # sum the dropped P): the softmax statistics are those of the undropped softmax. The
        # score tiles' sums accumulate in ScalarE's reduce registers, read out once per block
        # (one readout instead of one per tile, and no additions on another engine)
        for n in T.unrolled(nb):
            port.activation_accumulate(p[:, n * kt:n * kt + widths[n]], nl.exp, s_tiles[n],
                                       n == 0, row_sum if n == nb - 1 else None, bias=bias,
                                       scale=c, mask=pred)
        if drop is not None:
            drop(p, r, width, pred)
    else:
        for n in T.unrolled(nb):
            port.activation(p[:, n * kt:n * kt + widths[n]], nl.exp, s_tiles[n], bias=bias,
                            scale=c, mask=pred)
    # m_i = m_new (GpSimd: idle otherwise)
    port.tensor_copy(neg_m_old, neg_m_new, engine="gpsimd", mask=pred)
    return p, alpha, row_sum


def fold_back(f: Instance, st: GroupState, s, front, widths, kv: KV, rb, pred,
              masked: bool = False, drop=None, first: Optional[str] = None):
    """Second half of :func:`fold_block`: ``pv = P [V | 1]`` and the accumulator update, from
    :func:`fold_front`'s ``(p, alpha, row_sum)``; ``masked``: a block of a masked region (at
    most ``tiles.FWD_MASKED_P_DMA_SHARE`` of its P^T on the DMA engines). ``drop``: None, or
    :func:`dropout_units`' ``drop(p, c0, c1)``, applied to each P^T group's columns just
    before they are transposed: the group's transposes (DMA, 2 us from issue to data) then
    overlap the next group's draw on VectorE instead of waiting for the whole block's.
    ``first``: :func:`fold_update`'s."""
    p, alpha, row_sum = front
    r, P = st.rows, T.PMAX
    width = sum(widths)

    # pv = P [V | 1]: P^T by TensorE transposes of 128-key chunks (FWD_PT_CHUNKS per PSUM
    # tile), each tile copied to SBUF by ScalarE or VectorE (balanced); one matmul per chunk
    chunks = [(c0, min(P, width - c0)) for c0 in T.unrolled(0, width, P)]
    per_tile = T.FWD_PT_CHUNKS
    pt_dtype = f.transpose_psum_dtype(f.mm)
    on_dma = f.dma_split(masked)
    act_cols = 0
    pv = nl.ndarray((r, f.vcols), dtype=nl.float32, buffer=nl.psum)
    for g0 in T.unrolled(0, len(chunks), per_tile):
        group = chunks[g0:g0 + per_tile]
        n = len(group) * r
        if drop is not None:
            drop(p, group[0][0], group[-1][0] + group[-1][1])
        pts = nl.ndarray((P, per_tile * r), dtype=f.mm, buffer=nl.sbuf)
        if on_dma.take(n):
            # trn2: DMA-engine transposes SBUF -> SBUF, no TensorE pass and no PSUM copy
            # (opt-in; documented for gen3, AWS kept its own use of it disabled)
            full = [kw for _, kw in group].count(P)
            if full:
                port.dma_transpose_blocks(pts, p[:, group[0][0]:group[0][0] + full * P], full,
                                          P, mask=pred)
            for q, (c0, kw) in list(enumerate(group))[full:]:
                port.dma_transpose(pts[0:kw, q * r:(q + 1) * r], p[:, c0:c0 + kw], mask=pred)
        else:
            pt = nl.ndarray((P, per_tile * r), dtype=pt_dtype, buffer=nl.psum)
            for q, (c0, kw) in enumerate(group):
                port.nc_transpose(pt[0:kw, q * r:(q + 1) * r], p[:, c0:c0 + kw], mask=pred)
            # the block's ScalarE share of the copies, split at a 32-column boundary
            a = min(n, max(0, int(round((f.act_share * (g0 * r + n) - act_cols) / 32)) * 32))
            act_cols += a
            for e, (c0, c1) in (("scalar", (0, a)), ("vector", (a, n))):
                if c1 > c0:
                    port.tensor_copy(pts[:, c0:c1], pt[:, c0:c1], engine=e, mask=pred)
        for q, (c0, kw) in enumerate(group):
            port.nc_matmul(pv, pts[0:kw, q * r:(q + 1) * r], kv.v_block(kw, rb + c0 // P),
                           accumulate=not (g0 == 0 and q == 0), mask=pred)
    fold_update(f, st, s, alpha, row_sum, pv, pred, first)


def fold_update(f: Instance, st: GroupState, s, alpha, row_sum, pv, pred,
                first: Optional[str] = None):
    """``[o_acc | l_i] = alpha [o_acc | l_i] + pv`` of slot s (``pv``: the block's ``P [V | 1]``
    in PSUM): the rescale on GpSimd (SBUF only; otherwise idle), the add on VectorE (one PSUM
    read, 1 cycle per element). Under dropout ``l_i = alpha l_i + row_sum`` (the undropped
    sums, :func:`fold_front`) on GpSimd, and PV's l_i column is 0 (:func:`ones_column`), so
    the add is the same one instruction. The guard's flag column is not rescaled: its sum only
    needs to stay positive. ``first`` (no dropout; None: not the first update): the slot's
    first update (:func:`fold_front` ``first``), ``[o_acc | l_i] = pv`` -- what ``alpha 0 +
    pv`` gives, as values -- one copy out of PSUM on the engine ``first`` names ("scalar" or
    "vector"): the accumulator needs no zeroing (:class:`GroupState` ``zero_o``), no GpSimd
    rescale, no VectorE add."""
    o_acc = st.o_acc(s)
    if first is not None:
        port.tensor_copy(o_acc, pv, engine=first, mask=pred)
        return
    if f.dropout_p:
        port.tensor_scalar(o_acc[:, 0:f.D], o_acc[:, 0:f.D], nl.multiply, alpha,
                           engine="gpsimd", mask=pred)
        port.tensor_scalar(o_acc[:, f.D:f.D + 1], o_acc[:, f.D:f.D + 1], nl.multiply, alpha,
                           op1=nl.add, operand1=row_sum, engine="gpsimd", mask=pred)
    else:
        port.tensor_scalar(o_acc[:, 0:f.D + 1], o_acc[:, 0:f.D + 1], nl.multiply, alpha,
                           engine="gpsimd", mask=pred)
    port.tensor_tensor(o_acc, o_acc, pv, nl.add, mask=pred)


class _Outputs:
    """SBUF copies of the last group's finished outputs (o in o's dtype, lse fp32, one slot
    per query tile of the group), stored to HBM by the *next* group after it has issued its
    Q loads (:func:`flush`): a store waits for its group's last softmax step, and the DMA
    queues would otherwise hold the next group's loads behind it. Carried from one group to
    the next, so the group loops are sequential (``carried``)."""

    def __init__(self, f: Instance, slots: int):
        P = T.PMAX
        self.o = nl.ndarray((P, slots, f.D), dtype=f.o.dtype, buffer=nl.sbuf)
        self.lse = nl.ndarray((P, slots, 1), dtype=nl.float32, buffer=nl.sbuf)


def flush(f: Instance, out: _Outputs, pending):
    """Store a finished group's outputs from ``out``: ``pending = (t0, n, rows)`` -- its first
    query tile (an index expression), tiles per head, rows per tile."""
    t0, n, rows = pending
    q_store = f.lens.q_store if f.lens is not None else None

    def head(h):
        def tile(s):
            t = t0 + s
            col = f.q_col(h, t)
            for dst, src in ((f.o, out.o), (f.lse_col, out.lse)):
                M.store_rows(dst, f.b, f.head(h), t * f.tiles.q_tile, rows,
                             src[0:rows, h * n + s, :], q_store, col)

        port.loop(n, tile)

    port.loop(f.G, head)


def write_back(f: Instance, st: GroupState, s, h, t, out: _Outputs):
    """``O_i = o_acc / l_i`` and ``LSE_i = c m_i + log l_i`` (softmax units) of slot s (query tile
    t of member head h), into ``out`` (stored by :func:`flush`).

    A row with l_i = 0 (every key masked, or no key swept) has o_acc = 0 exactly, so ``o_acc /
    max(l_i, L_FLOOR)`` is 0; its LSE is -inf by an explicit select (``log`` only ever sees
    ``l_i >= L_FLOOR``). Padding rows (past ``q_len``) are selected the same way and their
    output multiplied by 0. Rotated rows are scattered back to their HBM rows (``q_store``),
    padding included.
    """
    r = st.rows
    col = f.q_col(h, t)
    in_range = f.lens.q_valid[0:r, nl.ds(col, 1)] if f.spec.q_lens else None
    finalize(f, st, s, in_range, (out.o[0:r, s, :], out.lse[0:r, s, :]))


def finalize(f: Instance, st: GroupState, s, in_range=None, dst=None, n: int = 1,
             act_slots: int = 0):
    """``(o, lse)`` tiles of the ``n`` slots ``s ..`` (:func:`write_back`): ``o_acc / max(l_i,
    L_FLOOR)`` in o's dtype (times ``1 / (1 - p)`` with dropout, times ``v_scale`` with an FP8
    cache) and ``c m_i + log l_i`` fp32, -inf where ``l_i = 0``. ``in_range``: None, or (one
    slot) an fp32 ``[rows, 1]`` column, 1.0 for real rows and 0.0 for padding rows (their o is
    multiplied by 0 and their lse is -inf). ``dst``: None, or ``(o, lse)`` views the results
    are written into (and returned): o ``[rows, n, D]`` or, one slot, ``[rows, D]``; lse
    ``[rows, n]``. The per-row statistics of the ``n`` slots are ``[rows, n]`` tiles, so each
    of their steps is one instruction for all of them (the block-sparse forward finalizes a
    group of query tiles so: two dozen small instructions per tile were a third of its time
    at low density); only o's scaling is one instruction per slot (its factors are
    per-partition columns): on GpSimd, or for the first ``act_slots`` slots on ScalarE (one
    activation scaled by the product of the two columns: the same bits, the factor being 1,
    0 or NaN)."""
    r, D = st.rows, f.D
    acc = st.o[0:r, nl.ds(s, n), :]
    if in_range is not None and n != 1:
        raise ValueError(f"in_range: one slot at a time, got n = {n}")
    l_i = acc[:, :, D]                       # [r, n]

    def cols(dtype=nl.float32):
        return nl.ndarray((r, n), dtype=dtype, buffer=nl.sbuf)

    if in_range is not None:
        # padding rows' accumulators zeroed by selection first (VectorE): a padding row's
        # scores meet every key of its tiles, so a non-finite key it cannot see would leave
        # a NaN there that the multiplies by 0 below keep
        live = cols(nl.uint8)
        port.tensor_scalar(live, in_range, nl.greater, 0.5, engine="gpsimd")
        port.keep_where(acc, port.repeat_last(live, acc.shape[2]), 0.0)

    # the SBUF-only element-wise steps on GpSimd (VectorE and ScalarE are the busy engines)
    l_safe = cols()
    port.tensor_scalar(l_safe, l_i, nl.maximum, T.FWD_L_FLOOR, engine="gpsimd")
    inv_l = cols()
    port.reciprocal(inv_l, l_safe)
    if f.dropout_p:
        port.tensor_scalar(inv_l, inv_l, nl.multiply, 1.0 / (1.0 - f.dropout_p),
                           engine="gpsimd")
    if f.kvs is not None:       # an FP8 cache: the output of the dequantized values
        port.tensor_scalar(inv_l, inv_l, nl.multiply, f.kvs[0:r, 1:2], engine="gpsimd")
    # padding rows: multiplied by 0 (o) and deselected (lse)
    op1 = None if in_range is None else nl.multiply
    factor = in_range
    if f.guard:
        # a row that saw a non-finite value (guard_values) is multiplied by NaN instead of 1
        poison = cols(nl.uint8)
        port.tensor_scalar(poison, acc[:, :, D + 1], nl.greater, 0.0, op1=op1,
                           operand1=in_range)
        nan_or_1 = cols()
        port.memset(nan_or_1, 1.0, engine="gpsimd")
        port.tensor_copy_predicated(nan_or_1, float("nan"), poison)
        factor = nan_or_1
        if in_range is not None:
            factor = cols()
            port.tensor_tensor(factor, nan_or_1, in_range, nl.multiply, engine="gpsimd")
    if dst is None:
        o_out = nl.ndarray((r, n, D) if n > 1 else (r, D), dtype=f.o.dtype, buffer=nl.sbuf)
        lse_out = cols()
    else:
        o_out, lse_out = dst
    scl = inv_l
    if act_slots and factor is not None:
        scl = cols()
        port.tensor_tensor(scl, inv_l, factor, nl.multiply, engine="gpsimd")
    for t in T.unrolled(n):
        o_t = o_out[:, t, :] if len(o_out.shape) == 3 else o_out
        if t < act_slots:
            port.activation(o_t, nl.copy, acc[:, t, 0:D], scale=scl[:, t:t + 1])
        else:
            port.tensor_scalar(o_t, acc[:, t, 0:D], nl.multiply, inv_l[:, t:t + 1],
                               op1=None if factor is None else nl.multiply,
                               operand1=None if factor is None else factor[:, t:t + 1],
                               engine="gpsimd")
    keep = cols(nl.uint8)
    port.tensor_scalar(keep, l_i, nl.greater, 0.0, op1=op1, operand1=in_range, engine="gpsimd")
    log_l = cols()
    port.activation(log_l, nl.log, l_safe)
    lse_val = cols()
    for t in T.unrolled(n):
        port.activation(lse_val[:, t:t + 1], nl.copy, st.neg_m(s + t), scale=-f.unit,
                        bias=log_l[:, t:t + 1])
    port.memset(lse_out, -np.inf, engine="gpsimd")
    # explicit select (documented from neuronx-cc 2.22; nki-api-spec §9.14)
    port.tensor_copy_predicated(lse_out, lse_val, keep)
    return o_out, lse_out


def _largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of n that is at most ``cap`` (at least 1); compile time."""
    return max(d for d in T.unrolled(1, max(1, min(n, cap)) + 1) if n % d == 0)


@dataclass(frozen=True)
class GroupSweep:
    """What a key block's visit to a group of query tiles needs (:func:`attend_group`): tiles
    ``t0 .. t0 + n - 1`` (``t0`` an index expression) of each member head, in ``st``'s slots
    ``h n + s``; ``ss`` tiles of each of ``hs`` heads are staged together (``ss hs > 1``:
    every first half of a block before the second halves)."""
    f: Instance
    st: GroupState
    span: Span
    t0: object
    n: int
    q_tile: int
    ss: int
    hs: int

    def each_tile(self, body):
        """``body(h, s)`` for every member head h and slot s of the group (compiled loops)."""
        port.loop(self.f.G, lambda h: port.loop(self.n, lambda s: body(h, s)))


def attend_group(f: Instance, plan: ForwardPlan, span: Span, t0, n: int, kv: Optional[KV],
                 out: _Outputs, flushes=()):
    """FlashAttention's Algorithm 1 (seed 002) for query tiles ``t0 .. t0 + n - 1`` of every
    query head of the kv group: load their Q^T, sweep the span's key regions (resident K/V, or
    chunks streamed once past the whole group) one key block at a time, write O and LSE. The
    group's SBUF state (O, l, m: ``GroupState``) is local to this body. A span without regions
    reads no Q and writes o = 0, LSE = -inf. The outputs go to ``out``; the previous group's
    are stored (``flushes``, :func:`flush`) right after this group's Q loads are issued.

    The loop nest (legacy: affine/sequential ranges; nki.*: ``nl.fori_loop``)::

        O, l, m = 0, 0, M_FLOOR (sinks: m, l start from the sink); load Q^T of every tile
        for region in span.regions:                         unrolled, <= 3
          for each K/V chunk (resident: the whole region)   compiled loop when streamed
            for kb in key blocks, then the tail block:      compiled loop, carried
              for every tile: S = Q K^T, m, P = exp, O = alpha O + P V      (sweep_block)
        O = O / l, LSE = m + log l of every tile
    """
    P, Bk, per = T.PMAX, f.tiles.softmax_block, f.tiles.softmax_block // T.PMAX
    st = GroupState(f, f.G * n, span.rows)
    ss = _largest_divisor(n, f.tiles.stage)
    g = GroupSweep(f, st, span, t0, n, plan.q_tile, ss, _largest_divisor(f.G, f.tiles.stage // ss))
    if f.mods.sinks:
        port.loop(f.G, lambda h: start_at_sink(f, st, h, n))
    if span.regions:
        g.each_tile(lambda h, s: load_q(f, st, h * n + s, h, t0 + s))
    for pending in flushes:
        flush(f, out, pending)

    def key_blocks(kv_t, rb, j0, keys, masked, ju, tail_block=True):
        # ju: the first 128-key unit of the keys (dropout), j0 // 128 as an affine expression
        full, tail = keys // Bk, keys % Bk
        port.loop(full, lambda kb: sweep_block(g, kv_t, rb + kb * per, j0 + kb * Bk, Bk, masked,
                                               ju + kb * per, None), carried=True)
        if tail and tail_block:
            sweep_block(g, kv_t, rb + full * per, j0 + full * Bk, tail, masked,
                        ju + full * per, j0 + full * Bk)

    regions = span.regions
    slots = [_slot_keys(f.spec, span, t0, n, plan.q_tile, rg, Bk) if plan.resident else None
             for rg in regions]
    for i, rg in enumerate(regions):
        if slots[i] is not None:
            sweep_slots(g, kv, slots[i])
            continue
        if plan.resident:
            # an unmasked region's partial last block joins the per-tile blocks of a masked
            # region right after it when they fit one softmax block (one update fewer per tile)
            tail = (rg.k1 - rg.k0) % Bk
            nxt = slots[i + 1] if i + 1 < len(regions) else None
            joined = nxt is not None and tail and _joins(nxt, rg.k1, tail, Bk)
            key_blocks(kv, rg.k0 // P, rg.k0, rg.k1 - rg.k0, rg.masked, rg.k0 // P,
                       tail_block=not joined)
            if joined:
                slots[i + 1] = tuple((rg.k1 - tail, tail + w) for _, w in nxt)
            continue
        for first, count, C in _chunks(rg, plan):
            def chunk(c, first=first, C=C, masked=rg.masked):
                u0 = first // P + c * (C // P)
                key_blocks(load_kv(f, u0, C), 0, first + c * C, C, masked, u0)

            port.loop(count, chunk, carried=True)
    g.each_tile(lambda h, s: write_back(f, st, h * n + s, h, t0 + s, out))


def _joins(slots, k0: int, tail: int, block: int) -> bool:
    """Whether ``tail`` keys ending at key ``k0`` can open every slot's block of ``slots``
    (:func:`_slot_keys`): each slot's keys start at ``k0`` (or it has none) and the joined
    block stays within one softmax ``block``."""
    return all((w == 0 or j == k0) and tail + w <= block for j, w in slots)


def _slot_keys(spec: M.MaskSpec, span: Span, t0, n: int, q_tile: int, region: Region,
               block: int):
    """Per slot of a group of ``n`` tiles from tile ``t0``: ``(first key, width)`` of the
    masked ``region``'s keys that slot's rows may see (from a multiple of 128; width 0: none),
    or None when the region is swept whole -- unmasked, a sliding span, a runtime ``t0``
    (a looped group, or two cores), or a slot wider than one softmax ``block``."""
    if not region.masked or span.slide is not None or not isinstance(t0, int):
        return None
    out = []
    for s in T.unrolled(n):
        lo, hi = spec.key_range((t0 + s) * q_tile, span.rows)
        lo, hi = max(lo, region.k0), min(hi, region.k1)
        if hi - lo > block:
            return None
        out.append((lo, hi - lo) if hi > lo else (region.k0, 0))
    return tuple(out)


def start_at_sink(f: Instance, st: GroupState, h, n: int, slot0=None):
    """The sink is the online softmax's first "key" for member head h's n slots (from
    ``slot0``, default ``h n``): ``m = max(sink / u, M_FLOOR)``, ``l = l_0``."""
    D, P = f.D, T.PMAX
    slot0 = h * n if slot0 is None else slot0
    l_slots = st.o[:, nl.ds(slot0, n), D:D + 1]
    port.tensor_scalar(st.stats[:, nl.ds(slot0, n), 1:2], l_slots, nl.add,
                       SM.HeadColumns.col(f.score.cols.neg_m0, h, P), engine="gpsimd")
    port.tensor_scalar(l_slots, l_slots, nl.add, SM.HeadColumns.col(f.score.cols.l0, h, P),
                       engine="gpsimd")


def sweep_block(g: GroupSweep, kv: KV, rb, j0, width: int, masked: bool, ju, static_d):
    """One key block of ``width`` keys (from the K/V tile's 128-key block ``rb``, frame key
    ``j0``, dropout unit ``ju``; ``static_d``: ``j0`` again for the tail block, None for the
    looped ones) for every
    tile of the group: the body of Algorithm 1's inner loop, each tile's steps in
    :func:`attend_block`. The key blocks are the outer (sequential) loop and the tiles the
    inner (independent) ones, so consecutive instructions belong to independent tiles: each
    engine's stream interleaves their dependency chains.

    Unstaged: each tile's block whole. Staged: per batch of ``hs`` heads x ``ss`` tiles,
    every first half (scores, max, exp) before the second halves (P^T, P V, update), two
    nests that share only the batch's SBUF staging buffers."""
    _sweep(g, lambda h, s, part="all", stage=None: tile_block(
        g, h, s, kv, rb, j0, width, masked, ju, static_d, part, stage), port.loop)


def sweep_slots(g: GroupSweep, kv: KV, slots):
    """A masked region of a group whose tiles are compile-time (``g.t0`` an int): slot s sweeps
    only the region's keys its own rows may see, ``slots[s] = (first key, width)``
    (:func:`_slot_keys`; width 0: none, the slot is skipped), as one block of resident keys.
    The other slots' band would mask the rest of the region to ``MASK_NEG`` (P = 0, the state
    unchanged, :func:`attend_block`), so the results are those of the region's full sweep; the
    work of a span's masked keys falls from ``tiles x region`` to its tiles' own keys (causal
    spans of 4 tiles: 16 to 10 128 x 128 units). The slots are unrolled (each has its own
    static width): at most ``ForwardTiles.q_group`` of them, whatever N."""
    P = T.PMAX

    def block(h, s, part="all", stage=None):
        k0, w = slots[s]
        if w:
            tile_block(g, h, s, kv, k0 // P, k0, w, True, k0 // P, k0, part, stage)

    _sweep(g, block, _unrolled)


def _unrolled(n: int, body):
    """``body(i)`` for ``i`` in ``range(n)`` at tracing (compile-time ``i``, both namespaces)."""
    for i in T.unrolled(n):
        body(i)


def _sweep(g: GroupSweep, block, each_slot):
    """``block(h, s, part, stage)`` for every member head h (a compiled loop) and slot s
    (``each_slot(n, body)``: a compiled loop, or :func:`_unrolled`), whole or staged
    (:func:`sweep_block`)."""
    f, ss, hs = g.f, g.ss, g.hs
    if ss * hs == 1:
        port.loop(f.G, lambda h: each_slot(g.n, lambda s: block(h, s)))
        return

    def batch(sb, hb):
        bufs = staging_buffers(f, ss * hs)
        for part in ("front", "back"):
            port.loop(hs, lambda hh, part=part: each_slot(ss, lambda k: block(
                hb * hs + hh, sb * ss + k, part, bufs + (hh * ss + k,))))

    each_slot(g.n // ss, lambda sb: port.loop(f.G // hs, lambda hb: batch(sb, hb)))


def staging_buffers(f: Instance, slots: int):
    """P, alpha and (dropout) row sums of ``slots`` staged tiles, one softmax block each
    (allocated per staged batch: the batches are independent iterations)."""
    P, Bk = T.PMAX, f.tiles.softmax_block
    return (nl.ndarray((P, slots, Bk), dtype=f.mm, buffer=nl.sbuf),
            nl.ndarray((P, slots, 1), dtype=nl.float32, buffer=nl.sbuf),
            nl.ndarray((P, slots, 1), dtype=nl.float32, buffer=nl.sbuf)
            if f.dropout_p else None)


def tile_block(g: GroupSweep, h, s, kv: KV, rb, j0, width: int, masked: bool, ju, static_d,
               part: str = "all", stage=None):
    """:func:`attend_block` of member head h's slot s (tile ``t0 + s``) for one key block of
    :func:`sweep_block`; a sliding span moves the block with the tile: keys from ``(t0 + s)
    q_tile + slide + j0``."""
    f, span, qt, P = g.f, g.span, g.q_tile, T.PMAX
    t = g.t0 + s
    iu = t * (qt // P)
    if span.slide is None:
        attend_block(f, g.st, h * g.n + s, t * qt, kv, rb, j0, width, masked,
                     du=(h, iu, ju), h=h, part=part, stage=stage)
        return
    attend_block(f, g.st, h * g.n + s, t * qt, kv, iu + span.slide // P + rb,
                 t * qt + span.slide + j0, width, masked,
                 None if static_d is None else span.slide + static_d,
                 du=(h, iu, iu + span.slide // P + ju), h=h, part=part, stage=stage)


# ============================================================================================
# The kernel
# ============================================================================================


def forward_grid(B: int, Hkv: int, lnc: int, api: str = "legacy"):
    """Launch grid and kernel ``lnc`` for ``lnc`` NeuronCores per logical core (1, or 2 on
    trn2), for the namespace ``api`` the kernel is traced through.

    Legacy: an SPMD grid over (batch, kv head). LNC=2 spreads independent grid instances over
    the two cores when it can -- kv heads when Hkv is even, else batches when B is even
    (``nl.spmd_dim(n, nl.nc(2))``; no extra HBM traffic) -- and otherwise adds an ``nl.nc(2)``
    grid dimension over which the kernel splits the query tiles (``lnc=2`` kernel argument;
    each core then reads all of K/V).

    nki.* (0.7 launches ``kernel[lnc]`` only): the grid is ``(lnc,)`` and the kernel loops over
    the (batch, kv head) instances itself (:func:`port.for_programs`); the two cores of LNC=2
    take half of the instances each when there is an even number of them, else (``lnc=2``
    kernel argument) each runs every instance and they split its query tiles."""
    if lnc not in (1, 2):
        raise ValueError(f"lnc: expected 1 or 2, got {lnc!r}")
    if api == "nki":
        return (lnc,), (2 if lnc == 2 and (B * Hkv) % 2 else 1)
    if lnc == 1:
        return (B, Hkv), 1
    if Hkv % 2 == 0:
        return (B, nl.spmd_dim(Hkv // 2, nl.nc(2))), 1
    if B % 2 == 0:
        return (nl.spmd_dim(B // 2, nl.nc(2)), Hkv), 1
    return (B, Hkv, nl.nc(2)), 2


def _core_range(count: int, core):
    """``(first, n)``: the affine slice of ``count`` groups one of two cores takes: ``n =
    ceil(count / 2)`` groups from ``core (count - n)`` (an odd count: the middle group is done
    by both cores, which write identical results)."""
    n = T.ceil_div(count, 2)
    return core * (count - n), n


@port.jit
def flash_attention_fwd(q, k, v, kv_lens=None, q_lens=None, seed=None, alibi_slopes=None,
                        sinks=None, block_table=None, kv_scale=None, scale=1.0, causal=None,
                        window=None, mm_dtype="bfloat16", tiles=None, lnc=1, dropout_p=0.0,
                        dropout_mask=False, softcap=None):
    """Flash attention forward: ``o, lse`` for q ``(B, Hq, Nq, D)``, k/v ``(B, Hkv, Nk, D)``.

    Launch on the grid of :func:`forward_grid` (legacy: ``(B, Hkv)``; nki.*: ``(lnc,)``).
    Tensor arguments live in HBM: q, k, v in fp32/bf16/fp16 (one dtype), optional
    ``kv_lens``/``q_lens`` ``(B,)`` int32 (values in [0, Nk] / [0, Nq]; the compiled kernel
    depends only on whether each is given: padding rows and keys are never read, bottom_right
    sequences are rotated on chip, module docstring). Compile-time arguments: ``scale`` (float,
    any finite value), ``causal`` (None, "top_left", "bottom_right"), ``window`` (None or
    (left, right), -1 = unbounded), ``mm_dtype`` ("bfloat16", "float16", "float32": matmul
    operand precision), ``tiles`` (:class:`tiles.ForwardTiles`), ``lnc`` (2: the two cores of a
    trn2 logical core split every span's query-tile groups, :func:`forward_grid`).

    Returns ``(o, lse)``: o ``(B, Hq, Nq, D)`` in q's dtype, lse ``(B, Hq, Nq)`` float32 (natural
    log; -inf for rows without a visible key). Limits: ``1 <= D <= 256``; any Nq, Nk >= 1.

    Attention dropout (FlashAttention appendix Algorithm 2): ``dropout_p`` in [0, 1)
    (compile-time) with ``seed`` an HBM ``(1,)`` int32 tensor (device data: one compilation
    serves every seed). Each 128 x 128 unit of P is dropped by its own draw after reseeding
    with ``seed + unit`` (:func:`dropout_units`); LSE and the softmax sums are those of the
    undropped P and O is rescaled by ``1 / (1 - p)``. ``dropout_mask=True`` (debugging, small
    shapes) also returns the keep mask the kernel drew, ``(B, Hq, Nq, Nk)`` float32 in the
    kernel's frame (rotated sequences: frame positions); positions of units no row sees are
    never written (unspecified; NaN on the simulator).

    Score modifiers (``score_mods.py``): ``softcap`` (compile-time float, ``cap tanh(s / cap)``),
    ``alibi_slopes`` (HBM ``(Hq,)``, ``(1, Hq)`` or ``(B, Hq)`` float32: ``- slope |qpos - j|``)
    and ``sinks`` (HBM ``(Hq,)`` float32: one more logit per head with a zero value; a row
    without visible keys then has ``lse = sink``, padding rows keep -inf).

    Paged K/V (chunked prefill over a paged cache, ``host.api.flash_attention_with_kvcache``):
    with ``block_table`` (HBM ``(B, max_blocks)`` int32) k and v are page pools ``(num_blocks,
    Hkv, page_size, D)``, page_size a power of two, and the kernel runs on the logical cache
    ``Nk = max_blocks * page_size``: key j of sequence b is offset ``j mod page_size`` of page
    ``block_table[b, j // page_size]``. ``kv_lens`` is then required (the key gathers are the
    lengths' gathers, their rows looked up in the table once per program:
    :func:`paged_key_rows`); everything else -- staging, residency, the loops -- is the
    contiguous kernel's.

    FP8 K/V cache (``host.api.flash_attention_with_kvcache`` over a float8 cache): with
    ``kv_scale`` (HBM ``(Hkv, 2)`` float32, ``(k_scale, v_scale)`` per kv head, device data)
    k and v hold ``k / k_scale`` and ``v / v_scale`` in an 8-bit float format; ``kv_lens`` is
    then required. The key gathers cast to ``mm_dtype`` on the way into SBUF, so HBM moves 1
    byte per element and the staging is the bf16 kernel's; K's scale joins Q^T's copy out of
    PSUM, V's the output normalization (:func:`kv_scale_columns`).

    Every option traces through both namespaces. Integer limits: the flat row numbers of the
    length gathers (``B Hq Nq``, ``B Hkv Nk``) and the dropout unit numbers (``B Hq ceil(Nq /
    128) ceil(Nk / 128)``; the seed is added to them) are int32 in both namespaces.
    """
    tiles = T.ForwardTiles() if tiles is None else tiles
    mods = SM.check_mods(softcap, alibi_slopes, sinks)
    if lnc not in (1, 2):
        raise ValueError(f"lnc: expected 1 or 2, got {lnc!r}")
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], frame_keys(k, block_table)
    if block_table is not None and kv_lens is None:
        raise ValueError("block_table: a paged K/V cache needs kv_lens (the keys are gathered "
                         "through the table)")
    if block_table is not None and max(2 * Nk, M.oob_offset(int(np.prod(
            block_table.shape)))) >= T.FWD_PAGED_INDEX_LIMIT:
        raise ValueError(f"block_table: the paged forward indexes keys and table entries in "
                         f"fp32 below 2^22; got {tuple(block_table.shape)} entries of "
                         f"{k.shape[2]} positions")
    if kv_scale is not None and kv_lens is None:
        raise ValueError("kv_scale: an FP8 K/V cache needs kv_lens (its keys are read by the "
                         "lengths' casting gathers)")
    lens = kv_lens is not None or q_lens is not None
    spec = M.MaskSpec(Nq, Nk, causal, window, q_lens is not None, kv_lens is not None,
                      mods.alibi)
    plan = plan_forward(Nq, Nk, Hq // Hkv, spec, tiles, cores=lnc)

    o = nl.ndarray((B, Hq, Nq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, Hq, Nq), dtype=nl.float32, buffer=nl.shared_hbm)
    mask_out = (nl.ndarray((B, Hq, Nq, Nk), dtype=nl.float32, buffer=nl.shared_hbm)
                if dropout_p and dropout_mask else None)
    # key-minus-row distances of the tiles (and the first keys of score tiles, for the key-length
    # mask row), as data for 0.7's compile-time affine patterns
    offsets = (port.OffsetColumns(-T.ceil_div(Nq, T.PMAX) * T.PMAX,
                                  T.ceil_div(Nq, T.PMAX) + T.ceil_div(Nk, T.PMAX) + 1, T.PMAX)
               if spec.has_diag or mods.alibi or _key_mask(dropout_p, mods, kv_lens) else None)
    # loop indices (batch, heads, query tiles, key units) as data: dropout's unit numbers, the
    # flat rows of the length gathers. Combined in int32 on GpSimd (exact) with dropout, whose
    # draw makes VectorE the busiest engine, and when the rows may reach 2^24 (beyond fp32's
    # exact integers); else in fp32 on VectorE
    exact = bool(dropout_p) or (lens and max(B * Hq * Nq, B * Hkv * Nk) >= T.FP32_EXACT_INT)
    indices = (port.OffsetColumns(0, max(B, Hkv, Hq, T.ceil_div(Nq, T.PMAX),
                                         T.ceil_div(Nk, T.PMAX)), 1, exact=exact)
               if dropout_p or lens else None)

    def instance(b, g):
        forward_instance(q, k, v, o, lse, mask_out, kv_lens, q_lens, seed, alibi_slopes,
                         sinks, b, g, scale, mm_dtype, tiles, lnc, dropout_p, mods, spec, plan,
                         (offsets, indices), block_table, kv_scale)

    port.for_programs((B, Hkv), instance, share=lnc == 1)
    if mask_out is not None:
        return o, lse, mask_out
    return o, lse


def forward_instance(q, k, v, o, lse, mask_out, kv_lens, q_lens, seed, alibi_slopes, sinks, b,
                     g, scale, mm_dtype, tiles, lnc, dropout_p, mods, spec, plan, tables,
                     block_table=None, kv_scale=None):
    """The work of grid instance (batch ``b``, kv head ``g``): the spans' groups of query tiles
    (:func:`attend_group`), each group storing its predecessor's outputs. ``tables``: the
    launch's ``(offsets, indices)``; ``block_table``, ``kv_scale``: a paged or FP8 cache's
    (:class:`Config`)."""
    D = q.shape[3]
    if dropout_p and seed is None:
        raise ValueError("dropout_p > 0 needs the seed tensor (HBM (1,) int32)")
    offsets, indices = tables
    share = balance_engines(tiles, plan, spec, mods, bool(dropout_p), True,
                            q.shape[1] // k.shape[1], frame_keys(k, block_table), D)
    c = Config(q, k, v, o, lse, mm_dtype, scale, tiles, spec, b, g, offsets, indices,
               guard=True, act_share=share, block_table=block_table, kv_scale=kv_scale)
    score = score_mods(c, mods, alibi_slopes, sinks, c.act_scale)
    drop = (load_dropout(dropout_p, seed, c.mm, mask_out=mask_out,
                         seed_row=T.ceil_div(max(tiles.softmax_block, T.PMAX), T.PMAX))
            if dropout_p else None)
    lens = (length_tables(c, kv_lens, q_lens, _key_mask(dropout_p, mods, kv_lens))
            if spec.kv_lens or spec.q_lens else None)
    f = Instance.of(c, lens=lens, drop=drop, score=score,
                    kvs=None if kv_scale is None else kv_scale_columns(c))

    needs_kv = any(sp.regions for sp in plan.spans)
    # resident keys are loaded span by span as the spans reach them (prefetch), unless a span
    # slides (a window's interior tiles, a compiled loop over tiles, sweep nearly every key)
    by_span = all(sp.slide is None for sp in plan.spans)
    kv = load_kv(f, 0, f.Nk, load=not by_span) if plan.resident and needs_kv else None
    core = port.spmd_core() if lnc == 2 else None
    groups = [(sp, grp) for sp in plan.spans for grp in _groups(sp, plan.q_group)]
    # (query rows transposed by the DMA take q_tile bytes per head-dim pass and tile instead of
    # D: preloaded only when that is no more than the budget counted, D a multiple of 128)
    preload = (tiles.q_preload and needs_kv and (len(plan.spans) > 1 or dropout_p)
               and (not f.direct_q or D % T.PMAX == 0))
    if preload:
        # every query row this core will use, loaded once, a group ahead of its use: with
        # several spans (a band) each span's first group would otherwise wait for its loads;
        # under dropout each group's first Q^T transposes would wait for them behind the
        # previous group's last P V in TensorE's queue (trn2 N = 4096: 260.0 -> 253.0 us)
        shape = ((T.PMAX, len(f.d_passes), f.G * f.per_head, f.tiles.q_tile) if f.direct_q
                 else (T.PMAX, f.G * f.per_head, D))
        f = dataclasses.replace(f, xq=nl.ndarray(shape, dtype=q.dtype, buffer=nl.sbuf))
    loaded = [0 if by_span else f.Nk]   # resident keys [0, loaded) are loaded or on their way
    unguarded = []              # keys loaded ahead whose V guard is still to be issued

    def prefetch(sp, first, count, n, ahead=True):
        # the resident keys the span sweeps and the group's query rows, issued before the
        # previous group's work: the first group starts on its own keys instead of waiting for
        # all of K/V, and later loads overlap the work before them. V's guard of keys loaded
        # ``ahead`` waits in the program until that work is issued (guard_ahead): in the
        # engines' queues it would precede the work that does not need it
        if preload and sp.regions:
            start, mine = (0, count) if core is None else _core_range(count, core)
            port.loop(f.G, lambda h, t=sp.t0 + first + start * n, c=mine * n:
                      preload_q(f, sp.rows, h, t, c))
        need = _span_keys(sp, plan.q_tile, f.Nk)
        if kv is not None and need > loaded[0]:
            load_keys(f, kv, 0, loaded[0], need, guard=not ahead)
            if ahead:
                unguarded.append((loaded[0], need))
            loaded[0] = need

    def guard_ahead():
        while unguarded:
            guard_keys(f, kv, *unguarded.pop(0))

    prefetch(groups[0][0], *groups[0][1], ahead=False)
    out = _Outputs(f, f.G * max(n for _, (_, _, n) in groups))
    pending = ()                # the group whose outputs are waiting in `out`
    for i, (sp, (first, count, n)) in enumerate(groups):
        start, mine = (0, count) if core is None else _core_range(count, core)
        t_first = sp.t0 + first + start * n
        # each group stores the previous one's outputs (_Outputs): the loop's first group is
        # peeled (its predecessor is another loop's last group, or none), the others are a
        # sequential loop (they carry `out`)
        if i + 1 < len(groups):
            prefetch(groups[i + 1][0], *groups[i + 1][1])
        attend_group(f, plan, sp, t_first, n, kv, out, pending)

        def later(grp, sp=sp, n=n, t_first=t_first):
            t0 = t_first + grp * n
            attend_group(f, plan, sp, t0, n, kv, out, [(t0 - n, n, sp.rows)])

        port.loop(mine, later, carried=True, start=1)
        guard_ahead()
        pending = [(t_first + (mine - 1) * n, n, sp.rows)]
    for p in pending:
        flush(f, out, p)
