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
  + 1 for [o_acc | l] = 7 of 8.
- **128-key PV chunks, 4 per P^T tile**: P^T [128 keys, 128 queries] (PE transpose) is the
  stationary operand and [V | 1] [128 keys, D + 1] the moving one. Four chunks share a PSUM bank
  and one PSUM -> SBUF copy (512 columns), fine enough to split the copies between ScalarE and
  VectorE so both finish together (``tiles.fwd_act_evac_share``, computed from the schedule).
- **K/V residency**: K^T ``[D, Nk]`` and [V | 1] (``Nk/128`` blocks) at matmul precision stay in
  SBUF for all query tiles of the group when they fit (bf16 D = 128: ~4 Nk bytes per partition,
  Nk up to ~32K on trn1's budget), so every HBM byte is read once. Otherwise K/V streams in
  2048-key chunks past a group of query tiles kept on chip (``tiles.forward_hbm_bytes`` derives
  the resulting Theta(N^2 d^2 / M) traffic).
- **Head dim up to 256**: S contracts D in passes of 128 rows accumulating in the same PSUM bank;
  PV writes D + 1 <= 512 fp32 per partition (one bank).

Engine work per 128 x 2048 block (D = 128): TensorE 6160 cycles (S 2048, P transposes 2048,
PV 16 x 129); VectorE 2112 (row max: one fp32 PSUM read per score; min-reduction); ScalarE 2305
(exp; bias, alpha, rescale); plus the 2048-column P^T copy (VectorE 1/2 cycle per column on trn2,
ScalarE 1). trn2 N = 4096 models at ~188 us with TensorE at ~168 us (benchmarks/forward.py).

Softmax scale: folded into the exp (``activation(exp, S, scale=c, bias=-c m_new)``) when
``2^-24 <= c <= 2^24``, where the masks' margin survives the scaling and nothing overflows; any
other finite scale (tiny, huge, zero, negative -- the API accepts them) is multiplied into Q^T as
it leaves PSUM after its transpose (free), and the exp runs with ``c = 1``.

Masks: see ``masks.py``. Partial last tiles (any Nq, Nk >= 1) are not padded: their tiles simply
have fewer rows/keys, so out-of-range keys never enter a max, an exp or a sum (the hazard of seed
001 cannot arise). Causal and window masks add a finite ``MASK_NEG`` to the scores on TensorE
before the row max (only on boundary tiles; fully masked tiles are never computed), and the
running max is floored at ``M_FLOOR``, so a fully masked row ends with l_i = 0, O = 0 and
LSE = -inf, never NaN.

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

Measured (``python benchmarks/forward.py --lens none full N/2``, simulator at e33fe61; one head,
bf16, D = 128): trn2 N = 4096 causal 104.7 us with ``kv_lens = q_lens = [N]`` or ``[N/2]``, as
without lengths (328.2 us before the rotation, which computed every tile with runtime diagonal
masks), non-causal 187.8 us (222.4 with the former rank-1 key mask); the same holds at
N = 16384 and on trn1. HBM reads with ``[N/2]`` are half of Q, K, V plus one key row.

Precision (docs/semantics.md): matmul operands in bf16/fp16 (fp32 inputs: bf16 with
``mixed_precision``, else fp32); PSUM, statistics, o_acc and LSE in fp32; O in q's dtype.

APIs whose legacy-NKI status is not fully confirmed (reference/nki-api-spec.md): bf16 PSUM
output of TensorE transposes on trn2 (gen3 "transpose mode"; fp32 PSUM is used on trn1),
``nisa.tensor_copy_predicated`` (documented from 2.22), ScalarE ``activation`` writing a PSUM
tile in place, and ``nisa.dma_transpose`` SBUF -> SBUF (opt-in, ``p_dma_transpose_share``).

The trace is fully unrolled at compile time (``nl.static_range`` and Python lists of the
schedule): every tile's shape and mask class is a compile-time constant.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np  # compile-time constants only (reduction ops)

from nki_kernels import tiles as T
from nki_kernels.attention import masks as M
from nki_kernels.nki import nisa, nki, nl

# ============================================================================================
# Schedule (plain Python, compile time)
# ============================================================================================


@dataclass(frozen=True)
class ScoreTile:
    """Keys ``[j0, j0 + width)`` of one score tile (<= 512 keys, one PSUM bank) and its mask
    class (``masks.FULL`` or ``BOUNDARY``)."""

    j0: int
    width: int
    kind: str


@dataclass(frozen=True)
class KeyBlock:
    """One online-softmax update: up to 4 consecutive score tiles, all inside one K/V chunk."""

    tiles: Tuple[ScoreTile, ...]
    chunk: int

    @property
    def j0(self) -> int:
        return self.tiles[0].j0

    @property
    def width(self) -> int:
        return sum(t.width for t in self.tiles)


@dataclass(frozen=True)
class QueryTile:
    """Rows ``[i0, i0 + rows)`` of query head ``head`` (0..G-1 within the kv group), the slot of
    its state in the group's SBUF arrays, and its key blocks in order."""

    head: int
    i0: int
    rows: int
    slot: int
    blocks: Tuple[KeyBlock, ...]


@dataclass(frozen=True)
class ForwardPlan:
    """The compile-time schedule of one grid instance (identical for every instance).

    ``groups``: tuples of query tiles processed together (their Q^T, o_acc, m_i, l_i live in SBUF
    during one pass over K/V); ``chunks``: ``(c0, c1)`` key ranges of K/V loaded at once (one
    chunk ``(0, Nk)`` when resident, loaded before the first group).
    """

    groups: Tuple[Tuple[QueryTile, ...], ...]
    chunks: Tuple[Tuple[int, int], ...]
    resident: bool


def _key_blocks(spec: M.MaskSpec, i0: int, rows: int, tiles: T.ForwardTiles,
                chunks) -> Tuple[KeyBlock, ...]:
    """Key blocks of one query tile: its key range split at softmax-block and chunk boundaries,
    each block split into <= 512-key score tiles, fully masked tiles dropped."""
    k_lo, k_hi = spec.key_range(i0, rows)
    blocks = []
    for ci, (c0, c1) in enumerate(chunks):
        lo, hi = max(k_lo, c0), min(k_hi, c1)
        b0 = (lo // tiles.softmax_block) * tiles.softmax_block
        while b0 < hi:
            bs, be = max(lo, b0), min(hi, b0 + tiles.softmax_block)
            score_tiles = []
            for j0 in range(bs, be, tiles.k_tile):
                width = min(tiles.k_tile, be - j0)
                kind = spec.classify(i0, rows, j0, width)
                if kind is not None:
                    score_tiles.append(ScoreTile(j0, width, kind))
            if score_tiles:
                blocks.append(KeyBlock(tuple(score_tiles), ci))
            b0 += tiles.softmax_block
    return tuple(blocks)


def plan_forward(Nq: int, Nk: int, group: int, spec: M.MaskSpec,
                 tiles: T.ForwardTiles) -> ForwardPlan:
    """Schedule of one (batch, kv head) instance: query tiles (all heads of the group) in groups
    of ``tiles.q_group``, K/V chunks, and each tile's key blocks."""
    if tiles.kv_resident:
        chunks = ((0, Nk),)
        per_group = 1
    else:
        chunks = tuple((c0, min(Nk, c0 + tiles.kv_chunk)) for c0 in range(0, Nk, tiles.kv_chunk))
        per_group = tiles.q_group
    flat = [(h, i0, min(tiles.q_tile, Nq - i0))
            for h in range(group) for i0 in range(0, Nq, tiles.q_tile)]
    groups = []
    for g0 in range(0, len(flat), per_group):
        members = flat[g0:g0 + per_group]
        groups.append(tuple(
            QueryTile(h, i0, rows, slot, _key_blocks(spec, i0, rows, tiles, chunks))
            for slot, (h, i0, rows) in enumerate(members)))
    return ForwardPlan(tuple(groups), chunks, tiles.kv_resident)


def _valid_in(lo: int, hi: int, n_valid: int, N: int, rotated: bool) -> int:
    """Valid positions among frame positions ``[lo, hi)`` of a sequence with ``n_valid`` of N
    valid: ``[0, n_valid)``, or ``[N - n_valid, N)`` when the gathers rotate it."""
    v0, v1 = (N - n_valid, N) if rotated else (0, n_valid)
    return max(0, min(hi, v1) - max(lo, v0))


def plan_hbm_bytes(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, itemsize: int,
                   tiles: T.ForwardTiles, *, causal=None, window=None, q_lens=None,
                   kv_lens=None) -> Tuple[int, int]:
    """HBM bytes (read, written) the kernel moves, counted from its own schedule.

    ``q_lens``/``kv_lens``: the per-sequence valid lengths (B ints), ``True`` for given with
    every position valid, None/False for not given (``tiles.fwd_valid_lengths``).

    Reads: each query tile with at least one key block loads its rows once; each K/V chunk is
    loaded once per group that needs it (resident: once if any tile needs it); one int32 per
    given length array. With lengths only the *valid* rows and keys of those tiles and chunks
    are read (the gathers skip padding; with rotation the valid positions of the kernel's frame
    are the last ``q_lens[b]`` / ``kv_lens[b]``), so the traffic is proportional to the valid
    lengths; ``kv_lens`` adds the edge key (one row of k, :func:`edge_key_fill`) per program
    whose ``kv_lens[b] > 0``. Writes: every row's output and LSE, padding included (rows
    without keys get zeros and -inf). Equals :func:`tiles.forward_hbm_bytes` when there is no
    causal/window mask.
    """
    q_valid = T.fwd_valid_lengths(q_lens, B, Nq)
    k_valid = T.fwd_valid_lengths(kv_lens, B, Nk)
    spec = M.MaskSpec(Nq, Nk, causal, window, q_valid is not None, k_valid is not None)
    plan = plan_forward(Nq, Nk, Hq // Hkv, spec, tiles)
    any_block = any(qt.blocks for grp in plan.groups for qt in grp)
    read = 0
    for b in range(B):
        nq = Nq if q_valid is None else q_valid[b]
        nk = Nk if k_valid is None else k_valid[b]
        per_instance = 4 * (int(q_valid is not None) + int(k_valid is not None))
        per_instance += D * itemsize if k_valid is not None and nk > 0 else 0     # the edge key
        kv_bytes = [2 * _valid_in(c0, c1, nk, Nk, spec.rotate_k) * D * itemsize
                    for c0, c1 in plan.chunks]
        if plan.resident and any_block:
            per_instance += kv_bytes[0]
        for grp in plan.groups:
            per_instance += sum(_valid_in(qt.i0, qt.i0 + qt.rows, nq, Nq, spec.rotate_q)
                                * D * itemsize for qt in grp if qt.blocks)
            if not plan.resident:
                needed = {blk.chunk for qt in grp for blk in qt.blocks}
                per_instance += sum(kv_bytes[c] for c in needed)
        read += Hkv * per_instance
    return read, B * Hq * Nq * (D * itemsize + 4)


# ============================================================================================
# Kernel state (plain Python holders of tiles and compile-time facts)
# ============================================================================================

_DTYPES = {"float32": nl.float32, "bfloat16": nl.bfloat16, "float16": nl.float16}


class _Instance:
    """Compile-time facts and shared constant tiles of one grid instance."""

    def __init__(self, q, k, v, o, lse, mm_dtype, scale, tiles, spec):
        self.q, self.k, self.v, self.o, self.lse = q, k, v, o, lse
        self.B, self.Hq, self.Nq, self.D = q.shape
        self.Hkv, self.Nk = k.shape[1], k.shape[2]
        self.G = self.Hq // self.Hkv
        self.b = nl.program_id(0)
        self.g = nl.program_id(1)
        self.mm = _DTYPES[mm_dtype]
        self.scale = float(scale)
        lo, hi = T.FWD_FOLD_SCALE_RANGE
        # softmax units: the exp scales raw scores (fold), or Q^T is pre-scaled (q_scale)
        self.fold_scale = lo <= self.scale <= hi
        self.act_scale = self.scale if self.fold_scale else 1.0
        self.q_scale = 1.0 if self.fold_scale else self.scale
        self.tiles = tiles
        self.spec = spec
        self.gen3 = nisa.get_nc_version() >= nisa.nc_version.gen3
        # head-dim passes of the S contraction: (first row, rows)
        self.d_passes = tuple((d0, min(T.PMAX, self.D - d0)) for d0 in range(0, self.D, T.PMAX))
        # how P^T copies split between ScalarE and VectorE, and which P^T groups the DMA
        # engines transpose (trn2, opt-in): set by balance_engines() once the schedule is known
        self.evac_on_act = None
        self.p_on_dma = None
        self.dma_share = tiles.p_dma_transpose_share if self.gen3 else 0.0
        self.lse_col = lse.reshape((self.B, self.Hq, self.Nq, 1))  # (rows, 1) store targets
        self.neg_eye = None        # MASK_NEG * I, for indicator tiles
        self.static_masks = None   # masks.StaticDiagMasks
        self.rt = None             # masks.RuntimeLengths (with kv_lens or q_lens)
        self.q_load = None         # int32 [128, G * tiles per head]: query-row gather indices,
        self.q_store = None        # scatter indices (rotated rows only),
        self.q_valid = None        # fp32 1.0 for valid rows
        self.k_load = None         # int32 [128, ceil(Nk / 128)]: key gather indices
        self.k_fill = None         # [128, D] in k's dtype: the edge key on every partition
        self.q_rows = self.k_rows = self.v_rows = None     # (B H N, D) views for the gathers

    def q_col(self, qt: "QueryTile") -> int:
        """Column of query tile qt in the query index tables."""
        return qt.head * T.ceil_div(self.Nq, self.tiles.q_tile) + qt.i0 // self.tiles.q_tile

    def evac_engine(self, n: int):
        """Engine of the next PSUM -> SBUF copy of ``n`` columns (ScalarE or VectorE)."""
        return nisa.scalar_engine if self.evac_on_act.take(n) else nisa.vector_engine

    def transpose_psum_dtype(self, src_dtype):
        """PSUM dtype of a TensorE transpose: trn2's transpose mode writes bf16 as bf16
        (and its PSUM -> SBUF copy then runs in VectorE's 2x mode); otherwise fp32.

        UNCONFIRMED (nki-api-spec §9.1/§10.2, [RE] only): bf16 PSUM output of nc_transpose on
        gen3; trn1 and other dtypes use the documented fp32 PSUM."""
        if self.gen3 and src_dtype == nl.bfloat16:
            return nl.bfloat16
        return nl.float32

    def psum_cols(self, src_dtype) -> int:
        """Transposed 128-column blocks per PSUM bank for that dtype (4 fp32, 8 bf16)."""
        item = 2 if self.transpose_psum_dtype(src_dtype) == nl.bfloat16 else 4
        return T.PSUM_FMAX * 4 // item // T.PMAX


def balance_engines(f: "_Instance", plan: "ForwardPlan"):
    """Choose how the P^T copies split between ScalarE and VectorE (``tiles.act_evac_share``, or
    balanced from the schedule's per-engine work, ``tiles.fwd_act_evac_share``)."""
    share = f.tiles.act_evac_share
    if share is None:
        qts = [qt for grp in plan.groups for qt in grp if qt.blocks]
        blocks = [(qt, blk) for qt in qts for blk in qt.blocks]
        share = T.fwd_act_evac_share(
            "trn2" if f.gen3 else "trn1",
            score_cols=sum(blk.width for _, blk in blocks), blocks=len(blocks),
            rescales=len(blocks) - len(qts), q_tiles=len(qts),
            evac_cols=int((1.0 - f.dma_share) * sum(blk.width * qt.rows for qt, blk in blocks)
                          // T.PMAX),
            D=f.D, folded_scale=f.fold_scale and f.act_scale != 1.0)
    f.evac_on_act = _Splitter(share)
    f.p_on_dma = _Splitter(f.dma_share)


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


class _KV:
    """K^T (one tile per head-dim pass, ``[rows, n]``) and ``[V | 1]`` (``[128, n/128 blocks,
    D + 1]``; with ``kv_lens`` the last column is 1.0 for valid keys only) of keys
    ``[base, base + n)``, in SBUF at matmul dtype."""

    def __init__(self, base, kT, v):
        self.base, self.kT, self.v = base, kT, v


class _GroupState:
    """SBUF/PSUM state of a group of query tiles (one slot per tile).

    - ``qT``: Q^T per head-dim pass, ``[d, slots, 128]`` at matmul dtype.
    - ``o``: ``[o_acc | l_i]`` in fp32, D + 1 columns (the ones column of V makes PV produce the
      row sums). With a single slot it lives in one PSUM bank: TensorE accumulates each block's
      PV on top of it after ScalarE rescaled it in place, so VectorE never touches it. With
      several slots it lives in SBUF.
    - ``stats``: per slot two alternating rows ``[-m_i | -rowmax of each score tile]`` (raw score
      units): one min-reduction over a row gives ``-m_new``, which goes to the other row's first
      column, so ``-m_i`` survives until alpha is computed.
    """

    def __init__(self, f: _Instance, n: int):
        P, width = T.PMAX, f.tiles.softmax_block // f.tiles.k_tile
        self.qT = [nl.ndarray((rows, n, P), dtype=f.mm, buffer=nl.sbuf) for _, rows in f.d_passes]
        # SBUF, fp32: each block's PV goes to a fresh PSUM tile (its own accumulation group)
        # and is folded in on ScalarE/VectorE; TensorE never accumulates onto PSUM that
        # another engine wrote
        self.o = nl.ndarray((P, n, f.D + 1), dtype=nl.float32, buffer=nl.sbuf)
        self.stats = nl.ndarray((P, n, 2, 1 + width), dtype=nl.float32, buffer=nl.sbuf)
        self.stats[:, :, 0, 0:1] = nisa.memset((P, n, 1), -T.FWD_M_FLOOR, dtype=nl.float32,
                                               engine=nisa.gpsimd_engine)
        self.parity = [0] * n          # which stats row holds -m_i
        self.started = [False] * n     # a key block has been folded in

    def o_acc(self, qt: "QueryTile"):
        """``[o_acc | l_i]`` of one query tile, ``[rows, D + 1]`` fp32."""
        return self.o[0:qt.rows, qt.slot, :]

    def neg_m(self, qt: "QueryTile", which: int):
        """``-m_i`` (raw score units) in stats row ``which`` of the tile's slot, ``[rows, 1]``."""
        return self.stats[0:qt.rows, qt.slot, which, 0:1]


# ============================================================================================
# Phases
# ============================================================================================


def length_tables(f: _Instance, kv_lens, q_lens):
    """Runtime lengths of sequence b (:class:`masks.RuntimeLengths`, shared with the backward)
    and the index tables of the gathers, built once per program for every query tile and key
    block in ``[128, n]`` instructions: ``q_load``/``q_store``/``q_valid`` (column
    :meth:`_Instance.q_col`; store only when the rows are rotated) and ``k_load`` (column =
    128-key block; keys are only read). Padding positions get out-of-bounds load indices: the
    ``oob_mode.skip`` gathers never read them. With ``kv_lens`` also the key mask's fill
    (:func:`edge_key_fill`)."""
    f.rt = M.RuntimeLengths(f.spec, kv_lens, q_lens, f.b, f.Nq, f.Nk, key_rows=False)
    f.q_rows = f.q.reshape((f.B * f.Hq * f.Nq, f.D))
    f.k_rows = f.k.reshape((f.B * f.Hkv * f.Nk, f.D))
    f.v_rows = f.v.reshape((f.B * f.Hkv * f.Nk, f.D))
    if f.rt.has_q:
        per_head = T.ceil_div(f.Nq, f.tiles.q_tile)
        runs = [(h * per_head, per_head, (f.b * f.Hq + f.g * f.G + h) * f.Nq, 0)
                for h in range(f.G)]
        rows, pos = M.position_table(runs, f.G * per_head, stride=f.tiles.q_tile)
        f.q_valid = f.rt.valid(pos, keys=False)
        f.q_load, f.q_store = f.rt.index_table(rows, pos, f.B * f.Hq * f.Nq, keys=False,
                                               valid=f.q_valid)
    if f.rt.has_k:
        n = T.ceil_div(f.Nk, T.PMAX)
        rows, pos = M.position_table([(0, n, (f.b * f.Hkv + f.g) * f.Nk, 0)], n)
        f.k_load, _ = f.rt.index_table(rows, pos, f.B * f.Hkv * f.Nk, keys=True)
        f.k_fill = edge_key_fill(f)


def edge_key_fill(f: _Instance):
    """The key mask of ``kv_lens`` without a mask on the scores: ``[128, D]`` (k's dtype), the
    valid key next to the padding (:meth:`masks.RuntimeLengths.edge_key_index`; zeros when
    ``kv_len = 0``) on every partition. Key tiles start as copies of it, so every padding key
    the gathers skip holds the edge key.

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
    P, D = T.PMAX, f.D
    idx = f.rt.edge_key_index((f.b * f.Hkv + f.g) * f.Nk, f.B * f.Hkv * f.Nk)
    row = nisa.memset((1, D), 0.0, dtype=f.k.dtype, engine=nisa.gpsimd_engine)
    M.gather_rows(row, f.k_rows, idx, 0, 1, D)
    ones = nisa.memset((1, P), 1.0, dtype=f.k.dtype, engine=nisa.gpsimd_engine)
    bcast = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.psum)
    bcast[...] = nisa.nc_matmul(ones, row)
    return nisa.tensor_copy(bcast, dtype=f.k.dtype)


def transpose_keys(f: _Instance, kT, pieces):
    """K^T columns from natural K blocks: ``pieces`` are (first column, keys, [keys, D] tile);
    TensorE transposes them several per PSUM bank, one PSUM -> SBUF copy per bank casts to the
    matmul dtype (ScalarE or VectorE, balanced)."""
    P = T.PMAX
    in_dt = pieces[0][2].dtype
    per_bank = f.psum_cols(in_dt)
    for pi, (d0, rows) in enumerate(f.d_passes):
        for s0 in nl.static_range(0, len(pieces), per_bank):
            group = pieces[s0:s0 + per_bank]
            tp = nl.ndarray((rows, per_bank * P), dtype=f.transpose_psum_dtype(in_dt),
                            buffer=nl.psum)
            for s, (col, kw, src) in enumerate(group):
                tp[:, s * P:s * P + kw] = nisa.nc_transpose(src[0:kw, d0:d0 + rows])
            width = (group[-1][0] + group[-1][1]) - group[0][0]
            col0 = group[0][0]
            kT[pi][:, col0:col0 + width] = nisa.tensor_copy(tp[:, 0:width], dtype=f.mm,
                                                            engine=f.evac_engine(width))


def gather_kv(f: _Instance, kT, v, c0: int, l0: int, ln: int):
    """Keys ``[l0, l0 + ln)`` of the frame (runtime ``kv_lens``): K and V gathered one 128-key
    block per DMA through ``k_load`` (rotated when the band needs it), padding keys skipped --
    never read -- and left at what the tiles were filled with: the edge key in K
    (:func:`edge_key_fill`), zeros in V. Then as :func:`load_kv`."""
    P, D = T.PMAX, f.D
    nb, b0 = T.ceil_div(ln, P), (l0 - c0) // P
    kx = nl.ndarray((P, nb, D), dtype=f.k.dtype, buffer=nl.sbuf)
    for t in nl.static_range(nb):
        kx[:, t, :] = nisa.tensor_copy(f.k_fill, engine=nisa.gpsimd_engine)
    same = f.v.dtype == f.mm
    if same:
        v[:, b0:b0 + nb, 0:D] = nisa.memset((P, nb, D), 0.0, dtype=f.mm,
                                            engine=nisa.gpsimd_engine)
    vx = None if same else nisa.memset((P, nb, D), 0.0, dtype=f.v.dtype,
                                       engine=nisa.gpsimd_engine)
    pieces = []
    for t in nl.static_range(nb):
        j0 = l0 + t * P
        kw = min(P, l0 + ln - j0)
        M.gather_rows(kx[0:kw, t, :], f.k_rows, f.k_load, j0 // P, kw, D)
        M.gather_rows(v[0:kw, b0 + t, 0:D] if same else vx[0:kw, t, :], f.v_rows, f.k_load,
                      j0 // P, kw, D)
        pieces.append((j0 - c0, kw, kx[:, t, :]))
    if not same:
        v[:, b0:b0 + nb, 0:D] = nisa.tensor_copy(vx, dtype=f.mm, engine=nisa.gpsimd_engine)
    transpose_keys(f, kT, pieces)


def load_kv(f: _Instance, c0: int, c1: int) -> _KV:
    """Load keys ``[c0, c1)`` of K and V once: K^T via TensorE transposes of 128-key blocks
    (PSUM -> SBUF copy casts to the matmul dtype), V as 128-key blocks ``[128, D + 1]`` whose last
    column is 1.0 (cast on GpSimd when the input dtype differs). DMAs move up to
    ``kv_load_block`` keys each. With ``kv_lens`` the keys are gathered (:func:`gather_kv`) and
    the ones column is 1.0 for valid keys only, 0.0 for padding (:func:`edge_key_fill`)."""
    P, D, n = T.PMAX, f.D, c1 - c0
    nblk = T.ceil_div(n, P)
    kT = [nl.ndarray((rows, n), dtype=f.mm, buffer=nl.sbuf) for _, rows in f.d_passes]
    # V with a ones column: PV then also yields the row sums l_i = sum_j P_ij on TensorE
    v = nl.ndarray((P, nblk, D + 1), dtype=f.mm, buffer=nl.sbuf)
    ip = nl.arange(P)[:, None, None]
    if f.k_load is None:
        v[:, :, D:D + 1] = nisa.memset((P, nblk, 1), 1.0, dtype=f.mm, engine=nisa.gpsimd_engine)
    else:
        key = nisa.iota(c0 + P * nl.arange(nblk)[None, :, None] + ip, dtype=nl.float32)
        v[:, :, D:D + 1] = f.rt.valid(key, keys=True, dtype=f.mm)
    idd = nl.arange(D)[None, None, :]
    for l0 in nl.static_range(c0, c1, f.tiles.kv_load_block):
        ln = min(f.tiles.kv_load_block, c1 - l0)
        if f.k_load is not None:
            gather_kv(f, kT, v, c0, l0, ln)
            continue
        full, tail = ln // P, ln % P
        if full:
            it = nl.arange(full)[None, :, None]
            kx = nl.load(f.k[f.b, f.g, l0 + ip + P * it, idd])
            b0 = (l0 - c0) // P
            if f.v.dtype == f.mm:
                v[:, b0:b0 + full, 0:D] = nl.load(f.v[f.b, f.g, l0 + ip + P * it, idd])
            else:
                vx = nl.load(f.v[f.b, f.g, l0 + ip + P * it, idd])
                v[:, b0:b0 + full, 0:D] = nisa.tensor_copy(vx, dtype=f.mm,
                                                           engine=nisa.gpsimd_engine)
            transpose_keys(f, kT, [(l0 + P * t - c0, P, kx[:, t, :]) for t in range(full)])
        if tail:
            t0 = l0 + full * P
            kt_ = nl.load(f.k[f.b, f.g, t0:t0 + tail, :])
            vt_ = nl.load(f.v[f.b, f.g, t0:t0 + tail, :])
            v[0:tail, (t0 - c0) // P, 0:D] = nisa.tensor_copy(vt_, dtype=f.mm,
                                                              engine=nisa.gpsimd_engine)
            transpose_keys(f, kT, [(t0 - c0, tail, kt_)])
    return _KV(c0, kT, v)


def load_q_tile(f: _Instance, st: _GroupState, qt: QueryTile):
    """Q_i^T for one query tile: load [rows, D], transpose each 128-wide head-dim slice on
    TensorE, copy it out of PSUM at matmul dtype (ScalarE), times the softmax scale when the
    scale is not folded into the exp. With ``q_lens`` the rows are gathered through ``q_load``
    (rotated when the band needs it): padding rows are never read and stay 0."""
    r, h = qt.rows, f.g * f.G + qt.head
    if f.q_load is None:
        x = nl.load(f.q[f.b, h, qt.i0:qt.i0 + r, :])
    else:
        x = nisa.memset((r, f.D), 0.0, dtype=f.q.dtype, engine=nisa.gpsimd_engine)
        M.gather_rows(x, f.q_rows, f.q_load, f.q_col(qt), r, f.D)
    for pi, (d0, rows) in enumerate(f.d_passes):
        tp = nl.ndarray((rows, r), dtype=f.transpose_psum_dtype(x.dtype), buffer=nl.psum)
        tp[...] = nisa.nc_transpose(x[0:r, d0:d0 + rows])
        st.qT[pi][:, qt.slot, 0:r] = nisa.activation(nl.copy, tp, scale=f.q_scale, dtype=f.mm)


def scores(f: _Instance, st: _GroupState, qt: QueryTile, tile: ScoreTile, kv: _KV):
    """S_ij = Q_i K_j^T for one score tile (raw scores; Q^T carries the scale only when it is not
    folded into the exp), in one PSUM bank, plus its masks.

    One matmul per head-dim pass (stationary Q^T [d, rows], moving K^T [d, width]) accumulating
    in PSUM; then ``MASK_NEG * indicator`` for boundary tiles (a matmul with ``MASK_NEG * I``).
    Padding keys (``kv_lens``) need nothing here (:func:`edge_key_fill`).
    """
    r, w, jr = qt.rows, tile.width, tile.j0 - kv.base
    s = nl.ndarray((r, w), dtype=nl.float32, buffer=nl.psum)
    for pi, (d0, rows) in enumerate(f.d_passes):
        prod = nisa.nc_matmul(st.qT[pi][:, qt.slot, 0:r], kv.kT[pi][:, jr:jr + w])
        if pi == 0:
            s[...] = prod
        else:
            s[...] += prod
    if tile.kind == M.BOUNDARY:
        ind = f.static_masks.get(qt.i0, tile.j0)
        s[...] += nisa.nc_matmul(f.neg_eye[0:r, 0:r], ind[0:r, 0:w])
    return s


def online_softmax(f: _Instance, st: _GroupState, qt: QueryTile, blk: KeyBlock, s_tiles):
    """The statistics update of one key block; returns (P_ij, alpha or None for the first).

    With ``c`` the softmax scale folded into the exp (1 when Q^T carries it):
    ``m_new = max(m_i, rowmax S_ij)`` (raw units, kept negated, floored at ``M_FLOOR`` by the
    initial ``-m_i``); ``P_ij = exp(c S_ij - c m_new)``: one ScalarE activation per score tile,
    the bias carrying the max; ``alpha = exp(c m_i - c m_new)``. The row sums l_i come with the
    PV matmul (ones column of V).
    """
    r, nb = qt.rows, len(s_tiles)
    old = st.parity[qt.slot]
    row = st.stats[0:r, qt.slot, old, :]
    neg_m_old, neg_m_new = st.neg_m(qt, old), st.neg_m(qt, 1 - old)
    c = f.act_scale

    for t in nl.static_range(nb):
        row[:, 1 + t:2 + t] = nisa.tensor_reduce(np.max, s_tiles[t], axis=(1,), negate=True,
                                                 keepdims=True)
    neg_m_new[...] = nisa.tensor_reduce(np.min, row[:, 0:1 + nb], axis=(1,), keepdims=True)
    bias = neg_m_new if c == 1.0 else nisa.activation(nl.copy, neg_m_new, scale=c)

    alpha = (nisa.activation(nl.exp, neg_m_old, bias=bias, scale=-c)
             if st.started[qt.slot] else None)

    p = nl.ndarray((r, blk.width), dtype=f.mm, buffer=nl.sbuf)
    col = 0
    for t in nl.static_range(nb):
        w = blk.tiles[t].width
        p[:, col:col + w] = nisa.activation(nl.exp, s_tiles[t], bias=bias, scale=c, dtype=f.mm)
        col += w
    st.parity[qt.slot] = 1 - old
    return p, alpha


def pv_accumulate(f: _Instance, p, qt: QueryTile, blk: KeyBlock, kv: _KV, dst, overwrite: bool):
    """``dst (+)= [P_ij V_j | rowsum P_ij]`` in PSUM: P^T by TensorE transposes of 128-key chunks
    (4 per PSUM tile), each tile copied to SBUF by ScalarE or VectorE (balanced), then one matmul
    per chunk (stationary P^T [keys, rows], moving ``[V | 1]`` [keys, D + 1])."""
    r, P = qt.rows, T.PMAX
    chunks = [(c0, min(P, blk.width - c0)) for c0 in range(0, blk.width, P)]
    per_tile = T.FWD_PT_CHUNKS
    pt_dtype = f.transpose_psum_dtype(f.mm)
    first = overwrite
    for g0 in nl.static_range(0, len(chunks), per_tile):
        group = chunks[g0:g0 + per_tile]
        n = len(group) * r
        pts = nl.ndarray((P, per_tile * r), dtype=f.mm, buffer=nl.sbuf)
        if f.p_on_dma.take(n):
            # trn2: DMA-engine transposes SBUF -> SBUF, no TensorE pass and no PSUM copy
            # (opt-in; documented for gen3, AWS kept its own use of it disabled)
            for s, (c0, kw) in enumerate(group):
                pts[0:kw, s * r:(s + 1) * r] = nisa.dma_transpose(p[:, c0:c0 + kw])
        else:
            pt = nl.ndarray((P, per_tile * r), dtype=pt_dtype, buffer=nl.psum)
            for s, (c0, kw) in enumerate(group):
                pt[0:kw, s * r:(s + 1) * r] = nisa.nc_transpose(p[:, c0:c0 + kw])
            pts[:, 0:n] = nisa.tensor_copy(pt[:, 0:n], dtype=f.mm, engine=f.evac_engine(n))
        for s, (c0, kw) in enumerate(group):
            vb = (blk.j0 + c0 - kv.base) // P
            prod = nisa.nc_matmul(pts[0:kw, s * r:(s + 1) * r], kv.v[0:kw, vb, :])
            if first:
                dst[...] = prod
                first = False
            else:
                dst[...] += prod


def attend_block(f: _Instance, st: _GroupState, qt: QueryTile, blk: KeyBlock, kv: _KV):
    """Fold one key block into the query tile's state (the body of Algorithm 1's inner loop):
    ``[o_acc | l_i] = alpha [o_acc | l_i] + [P_ij V_j | rowsum P_ij]``."""
    s_tiles = [scores(f, st, qt, tile, kv) for tile in blk.tiles]
    p, alpha = online_softmax(f, st, qt, blk, s_tiles)
    o_acc = st.o_acc(qt)
    pv = nl.ndarray((qt.rows, f.D + 1), dtype=nl.float32, buffer=nl.psum)
    pv_accumulate(f, p, qt, blk, kv, pv, overwrite=True)
    if alpha is None:
        o_acc[...] = nisa.activation(nl.copy, pv, dtype=nl.float32)
    else:
        # o_acc = alpha o_acc + pv in one VectorE pass (alpha a per-row scalar)
        o_acc[...] = nisa.scalar_tensor_tensor(data=o_acc, op0=nl.multiply, operand0=alpha,
                                               op1=nl.add, operand1=pv)
    st.started[qt.slot] = True


def write_back(f: _Instance, st: _GroupState, qt: QueryTile):
    """``O_i = o_acc / l_i`` and ``LSE_i = c m_i + log l_i`` (softmax units), stored to HBM.

    A row with l_i = 0 (every key masked) has o_acc = 0 exactly, so ``o_acc / max(l_i, L_FLOOR)``
    is 0; its LSE is -inf by an explicit select (``log`` only ever sees ``l_i >= L_FLOOR``).
    Padding rows (past ``q_len``) are selected the same way and their output multiplied by 0.
    Rotated rows are scattered back to their HBM rows (``q_store``), padding included.
    """
    r, h = qt.rows, f.g * f.G + qt.head

    def store(out, tile):
        M.store_rows(out, f.b, h, qt.i0, r, tile, f.q_store, f.q_col(qt))

    if not st.started[qt.slot]:
        store(f.o, nisa.memset((r, f.D), 0.0, dtype=f.o.dtype))
        store(f.lse_col, nisa.memset((r, 1), -np.inf, dtype=nl.float32))
        return
    o_acc = st.o_acc(qt)
    l_i = o_acc[:, f.D:f.D + 1]
    neg_m = st.neg_m(qt, st.parity[qt.slot])

    l_safe = nisa.tensor_scalar(l_i, nl.maximum, T.FWD_L_FLOOR, dtype=nl.float32)
    inv_l = nisa.reciprocal(l_safe)
    # padding rows: multiplied by 0 (o) and deselected (lse)
    col = f.q_col(qt)
    in_range = f.q_valid[0:r, col:col + 1] if f.spec.q_lens else None
    op1 = nl.multiply if f.spec.q_lens else None
    o_out = nisa.tensor_scalar(o_acc[:, 0:f.D], nl.multiply, inv_l, op1=op1, operand1=in_range,
                               dtype=f.o.dtype)
    keep = nisa.tensor_scalar(l_i, nl.greater, 0.0, op1=op1, operand1=in_range, dtype=nl.uint8)
    store(f.o, o_out)

    log_l = nisa.activation(nl.log, l_safe, dtype=nl.float32)
    lse_val = nisa.activation(nl.copy, neg_m, scale=-f.act_scale, bias=log_l, dtype=nl.float32)
    lse_out = nisa.memset((r, 1), -np.inf, dtype=nl.float32, engine=nisa.gpsimd_engine)
    # explicit select (documented from neuronx-cc 2.22; nki-api-spec §9.14)
    nisa.tensor_copy_predicated(src=lse_val, dst=lse_out, predicate=keep)
    store(f.lse_col, lse_out)


def attend_group(f: _Instance, plan: ForwardPlan, group, kv: Optional[_KV]):
    """One group of query tiles: load their Q^T, stream K/V chunks past them (or use the
    resident K/V), fold in every key block, write O and LSE. The group's SBUF state is local to
    this call, so it is freed before the next group allocates its own."""
    st = _GroupState(f, len(group))
    for qt in group:
        if qt.blocks:
            load_q_tile(f, st, qt)
    for ci, (c0, c1) in enumerate(plan.chunks):
        work = [(qt, blk) for qt in group for blk in qt.blocks if blk.chunk == ci]
        if not work:
            continue
        chunk_kv = kv if plan.resident else load_kv(f, c0, c1)
        for qt, blk in work:
            attend_block(f, st, qt, blk, chunk_kv)
    for qt in group:
        write_back(f, st, qt)


# ============================================================================================
# The kernel
# ============================================================================================


@nki.jit
def flash_attention_fwd(q, k, v, kv_lens=None, q_lens=None, *, scale=1.0, causal=None,
                        window=None, mm_dtype="bfloat16", tiles=None):
    """Flash attention forward: ``o, lse`` for q ``(B, Hq, Nq, D)``, k/v ``(B, Hkv, Nk, D)``.

    Launch on the grid ``(B, Hkv)``. Tensor arguments live in HBM: q, k, v in fp32/bf16/fp16
    (one dtype), optional ``kv_lens``/``q_lens`` ``(B,)`` int32 (values in [0, Nk] / [0, Nq];
    the compiled kernel depends only on whether each is given: padding rows and keys are never
    read, bottom_right sequences are rotated on chip, module docstring). Compile-time arguments:
    ``scale`` (float, any finite value), ``causal`` (None, "top_left", "bottom_right"),
    ``window`` (None or (left, right), -1 = unbounded), ``mm_dtype`` ("bfloat16", "float16",
    "float32": matmul operand precision), ``tiles`` (:class:`tiles.ForwardTiles`).

    Returns ``(o, lse)``: o ``(B, Hq, Nq, D)`` in q's dtype, lse ``(B, Hq, Nq)`` float32 (natural
    log; -inf for rows without a visible key). Limits: ``1 <= D <= 256``; any Nq, Nk >= 1.
    """
    tiles = T.ForwardTiles() if tiles is None else tiles
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    spec = M.MaskSpec(Nq, Nk, causal, window, q_lens is not None, kv_lens is not None)
    plan = plan_forward(Nq, Nk, Hq // k.shape[1], spec, tiles)

    o = nl.ndarray((B, Hq, Nq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, Hq, Nq), dtype=nl.float32, buffer=nl.shared_hbm)

    f = _Instance(q, k, v, o, lse, mm_dtype, scale, tiles, spec)
    balance_engines(f, plan)
    if spec.has_diag:
        f.neg_eye = M.neg_identity(T.PMAX)
        offsets = {t.j0 - qt.i0 for grp in plan.groups for qt in grp for blk in qt.blocks
                   for t in blk.tiles if t.kind == M.BOUNDARY}
        f.static_masks = M.StaticDiagMasks(spec, tiles.q_tile, tiles.k_tile, offsets)
    if spec.kv_lens or spec.q_lens:
        length_tables(f, kv_lens, q_lens)

    needs_kv = any(qt.blocks for grp in plan.groups for qt in grp)
    kv = load_kv(f, 0, Nk) if plan.resident and needs_kv else None
    for group in plan.groups:
        attend_group(f, plan, group, kv)
    return o, lse
