"""Block-sparse flash attention forward (FlashAttention section 3.3, appendix Algorithm 5).

A pattern of 128 x 128 blocks says which key blocks each query tile attends to
(``host/block_sparse.py``); a missing block is skipped entirely -- no K/V load, no matmul, no
exponential -- so HBM traffic and work fall with the density s (Proposition 4: Theta(Nd +
N^2 d^2 M^-1 s)). Inside an active block the usual masks still apply (causal, window, valid
lengths), and GQA and attention dropout compose as in the dense forward.

**Resident K/V (nki.*).** Where K^T and ``[V | 1]`` of a (batch, kv head) fit in SBUF
beside the rest (:func:`tiles.bsp_fwd_kv_resident`) the nki.* trace loads, guards and
transposes them once per instance, as the dense kernel's resident staging does
(:func:`forward.load_kv`, whole 128-key blocks, zeros past Nk), and every step reads its
blocks in place: block w of a step is the tile's key-block number ``first_w / 128`` (an int32
table per tile) used as a runtime offset into the resident tiles (NKI 0.7's
``NkiTensor.select`` with a tensor index, :func:`port.select_block`). HBM traffic is then the
dense kernel's plus the tables', whatever the density and the form; the time is the active
blocks' matmuls and softmax work plus each tile's fixed work. Legacy NKI has no tensor-valued
SBUF offset, so the legacy trace gathers as below, with the same steps (one matmul per block
in both, so the outputs are the same bits). With the DMA queues free, the P^T transposes of
a class go partly to the DMA engines (:func:`tiles.bsp_p_dma_share` of the device's share,
growing with the class's slots).

**Natural order.** A class whose order position p holds query tile p (``natural``: the
index form's one class, and a bool mask's classes whose tiles need no regrouping -- under
nki.* with resident K/V the tables never regroup, :func:`keeps_order`) loads Q and stores O
and LSE by plain DMAs at rows ``128 p``, affine in the loop indices, where the tiles are
whole and there are no lengths (:func:`_direct_rows`); each group holds its outputs in SBUF
and stores them after the next group has issued its loads (:class:`_Held`, as the dense
forward's ``_Outputs``). Otherwise a tile's rows are data (its table's first row): indirect
gathers and scatters, and the scheduler orders the scatters into one tensor one after the
other (an indirect write may touch any row, ``simulate._sched``).

The pattern is device data: ``meta (b, h, n, 2 + trip)`` float32, one row per query tile in
processing order, ``[first row, count, first key of block_0, ...]`` with
``tiles.BSP_PAD_FIRST`` in padding slots (``host.block_sparse.kernel_tables``).
The compile-time part is ``classes``: runs of order positions, each a compiled loop over its
query tiles with an inner sequential (carried: the online-softmax state) compiled loop over
``trip`` slots, at most ``tiles.BSP_MAX_CLASSES`` of them whatever N, so the program does not
grow with N.

- **Compile-time pattern** (a dense bool block mask): the host sorts the query tiles by their
  count and cuts the runs tightly (``exact`` classes have no masked slot and no mask work).
  Within a class it groups the tiles (``tiles.BSP_GROUP_TILES`` per loop body) by the key
  blocks they have in common and lists those first: the first ``shared`` slots of a class
  (one compile-time count per class, the least over its groups) hold the same blocks in every
  tile of a group, so their K/V are gathered, guarded and transposed once per group -- the
  dense kernel's K/V reuse across query tiles, following the pattern's structure.
- **Runtime pattern** (FlexAttention's ``(num_blocks, indices)``): one class of every query
  tile with ``trip = max_blocks``; one compilation serves every pattern of that bound. Slots
  past a tile's count are *padding slots*: their K/V gathers are skipped by ``oob_mode.skip``
  (the index is pushed out of bounds: no HBM read) and their scores are masked, so they cost
  on-chip work but no traffic. Legacy NKI has no data-dependent trip count (``dynamic_range``
  is an ``nki.*`` API on trn2/trn3 only; reference/nki-api-spec.md), so there every slot runs.
  Under nki.* (0.7's ``nl.fori_loop`` takes a register bound, :func:`port.loop_between`) the
  own-slot sweep of a group with more than one step of own slots runs only the steps below
  the largest count of its tiles (:func:`_trip_counts`: two register loads per group, the full
  steps and the tail step), so a step of padding slots in every tile costs nothing; padding
  slots inside a run step are still masked. The outputs are the legacy trace's: a masked step changes nothing.
- **Runtime pattern past SBUF** (nki.*, K/V not resident, :func:`shares_at_runtime`): the
  host groups the query tiles by their common blocks as for a compile-time pattern, but
  keeps every group's own count of them (``host.block_sparse.shared_bound_tables``): ``trip =
  2 max_blocks`` slots, the first ``max_blocks`` the group's common blocks then padding, the
  others each tile's own blocks then padding; ``shared = max_blocks`` and the class depend on
  the bound only (``shared_runtime``). The common sweep runs only its steps below the group's
  count of common blocks (:func:`_shared_count`, read from the table at run time) and the
  own sweep only those below its tiles' largest own count; the padding slots' gathers are
  skipped into zeroed tiles, so their scores are 0 and one ScalarE multiply-add per block
  masks them (:func:`_pads_only`). A group's common blocks are gathered once, as a bool
  mask's: the same K/V bytes on a pattern whose groups share as many blocks.
- **Key-block window** (nki.*, K/V not resident, either form, where the host finds it
  gathers fewer blocks than the grouping: ``host.block_sparse.window_plan``): a window of
  ``window_blocks`` key blocks in SBUF, laid out as resident K/V with its block of zeros
  (:func:`forward.load_kv` without the load). The host orders the query tiles so that
  nearby ones share blocks and plans, per group (``window_group`` tiles: the largest of
  ``tiles.BSP_WINDOW_GROUPS`` whose plan gathers no more blocks than the dense forward, else
  the one gathering the fewest), the blocks it gathers into the window
  and their positions (``window_tables``); a group first gathers its new blocks
  (:func:`_load_window`: a loop of a runtime trip count, ``tiles.BSP_WINDOW_LOAD_BLOCKS``
  blocks a step of :func:`_gather_kv`, each copied to its position at a runtime SBUF
  offset), then its tiles read
  every slot's block in place at the position ``window_slots`` gives (:class:`_Window`), as
  with resident K/V. One class, natural where the host's order is (:func:`_direct_rows`). A
  group's gathers wait for the previous group's reads of the window (a runtime offset may
  touch any block: ``simulate._sched``). Under GQA, where the ``G = Hq / Hkv`` member heads
  of a kv head have the same tables (``window_shared``: a pattern broadcast over heads, or
  heads the host finds alike), a group gathers its new blocks once and runs its tiles for
  every member head before the next group (the member-head loop inside the group loop), so
  K/V are gathered once per kv head as the dense forward reads them; otherwise each member
  head runs every group with its own gathers (trn2, N = 32K, D = 128, Hq = 4, Hkv = 1, bf16,
  index form, fixed_density s = 3/4, K/V past SBUF: 136.62 -> 86.07 MB, the dense forward's
  84.41 plus the tables; 33338.5 -> 32316.4 us, dense 47466.0: the window's work, not its
  gathers, sets the time).
- **Super-groups** (nki.*, K/V not resident, where the host finds they gather fewer blocks
  than the window or the grouping: ``host.block_sparse.supergroup_tables``; any launch but
  one that returns its dropout mask, the band, lengths, ALiBi and dropout through slot
  columns made per step, :func:`_supergroup`): the dense forward's own schedule
  past SBUF with the pattern. The host sorts the query tiles of each (batch, head) by block
  set and cuts each run of identical sets into super-groups of up to
  :func:`tiles.bsp_fwd_supergroup_tiles` tiles (about as many as the dense forward's
  streaming group), each with one union row (its count and the blocks' first keys) and its
  tiles' first rows (idle slots past the run: rows past every query, skipped). Per
  super-group (:func:`_supergroup`, a compiled loop over the table's rows) the tiles' Q^T
  and ``[o_acc | l]`` stay in SBUF while the union streams past once in steps of
  ``tiles.BSP_SHARED_STEP_BLOCKS`` blocks, each gathered and transposed once for all of them;
  the steps of real blocks run unmasked (a runtime trip count), the one holding padding
  slots after them masks them. Every tile uses every block of the union, so there is no
  per-tile table: SBUF holds the union's few ``[128, U]`` tables and the tiles' state. HBM:
  Q, O once and each super-group's union once (``host.block_sparse.supergroup_hbm_bytes``),
  at s = 1 the dense forward's passes. *Masked* super-groups (consecutive tiles of different
  sets, whole key blocks: ``host.block_sparse.masked_supergroup_tables``) load per step a
  ``[step, tiles]`` table of keep flags (one DMA) and TensorE adds MASK_NEG to the scores of
  each tile's blocks not its own (one matmul per score tile); K's non-finite values are then
  guarded as V's (a row that sees such a key gets NaN, the others never meet it). *Sparse*
  super-groups (the masked ones' super-groups and unions, in steps of
  ``tiles.BSP_SG_OWN_STEP_BLOCKS`` blocks: ``host.block_sparse.sparse_supergroup_tables``)
  compute only each tile's own blocks of a step: per (step, tile) a row of ``sg_own`` gives
  runtime trip counts of sub-steps of 8, 4, 2 and 1 blocks and the blocks' positions in the
  step, which the sub-steps read in place (:func:`_own_blocks`; no padding slot, no mask).
  The bytes are the masked ones' (each union streamed once), the work the active pairs'.
  trn2, N = 64K, D = 128, bf16, index form, random patterns (``run_sparse(inputs(65536,
  128), random_pattern(512, s, 1), "index", ["fwd"], "trn2")`` of
  ``benchmarks/block_sparse.py``, ``NKI_FLASH_API=nki``), against the dense forward's
  168.0 MB, 48773.4 us: s = 1/8 169.27 MB, 14512.5 us (the window before: 313.80 MB,
  12186.8 us); s = 1/4 169.27 MB, 21874.7 us (the window: 11123 block loads, about 5.4x
  the dense K/V bytes); s = 1/2 169.27 MB, 35701.0 us (masked super-groups: 169.09 MB,
  50529.2 us). The host takes them where masked ones would compute more than
  ``tiles.BSP_SG_SPARSE_PAIR_COST`` times the active pairs (``host.api._supergroups``).
  Legacy has no runtime trip count and keeps the grouping.

Per group of query tiles (a loop body; the gathers are the legacy trace's and, where K/V
do not fit in SBUF, the nki.* one's)::

    the group's table rows (one DMA) -> fp32 on every partition where used (a K=1 ones
        matmul, exact for ints < 2^24); per tile gather Q rows (indirect DMA; rows past Nq or
        q_len skipped), Q^T by TensorE (natural order: plain loads, or DMA transposes)
    for step over the shared slots, then over the others, each a sequential loop of W =
    tiles.BSP_STEP_BLOCKS blocks (BSP_RESIDENT_STEP_BLOCKS where K/V fit; + a static tail step):
        gather K_j, V_j rows of the step's blocks (indirect DMA, padding skipped), K^T by
        TensorE: once for the group (shared slots) or per tile
        per tile: S = Q K^T, one PSUM bank of 512 keys per score tile (+ MASK_NEG x
        indicator: padding slot, keys past the length, causal/window band -- comparisons of
        iota tiles with per-slot columns); online-softmax update over the step's score tiles
        (forward.fold_front and fold_back, shared with the dense kernel; a tile's front is
        issued before the back halves of up to tiles.bsp_pipeline_depth earlier tiles; a
        first sweep of one step is peeled: its update is a copy of PV, no rescale)
    O, LSE of the group's tiles finalized together (forward.finalize), scattered to the
    tiles' rows (rows past Nq skipped; natural order: one plain store each for the group,
    LSE as [tiles, 128] rows after a TensorE transpose in short classes on gen3+)

Masks here are computed at run time from the block's position (the dense kernel's band
predicates are affine in loop indices; here the key block is data). The alignment offset of
the band is ``Nk - Nq`` (bottom_right), 0 (top_left) or, with lengths, ``kv_len - q_len`` per
sequence; positions are those of the padded frame, the block pattern's own (no rotation).

One source, two namespaces (:mod:`nki_kernels.port`): the (batch, kv head) instances are the
legacy SPMD grid, or under nki.* (NKI 0.7) one compiled loop of a ``kernel[1]`` launch
(:func:`port.for_programs`), and every loop above is a :func:`port.loop`. LNC=2 is only a
launch grid (``backward.backward_grid``, the host's choice): the instances are independent, so
the two cores take half of them each (legacy ``nl.spmd_dim(n, nl.nc(2))``; nki.* ``kernel[2]``,
shared by ``nl.program_id(0)``). Where the traces
differ: an indirect view in 0.7 takes no runtime leading index, so the gathers and scatters of
a ``(b, head)`` slice index the flattened tensor (:func:`port.lead_rows`) and the index tables
carry the slice's first row (:class:`RowFrame`, read from a table of the loop indices; summed
in fp32, or in int32 where the rows or dropout units may reach 2^24, :func:`exact_indices`);
dropout's unit numbers come from the same table. The
instructions on the data are the same: the outputs are the legacy trace's bit for bit, the
0.7 program adds a few ``[128, 1]`` instructions per instance, head and row.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

from nki_kernels import port
from nki_kernels import tiles as T
from nki_kernels.attention import forward as F
from nki_kernels.attention import masks as M
from nki_kernels.attention import score_mods as SM
from nki_kernels.port import nl

P = T.PMAX


def check_classes(classes, n: int, trip_max: int):
    """Validate the compile-time classes against the table: contiguous runs covering the
    ``n`` order positions, trips within the table's columns."""
    pos = 0
    for a, m, t, _exact in classes:
        if a != pos or m < 1 or not 0 <= t <= trip_max:
            raise ValueError(f"classes: expected contiguous runs of positions with trips in "
                             f"[0, {trip_max}], got {classes!r}")
        pos += m
    if pos != n or len(classes) > T.BSP_MAX_CLASSES:
        raise ValueError(f"classes: must cover the {n} rows in at most {T.BSP_MAX_CLASSES} runs, "
                         f"got {classes!r}")


def _per_class(name: str, values, classes, default, what: str, ok):
    """``values`` (one per class; None: ``default`` for each) as a tuple, checked by ``ok(value,
    class)``; else a ValueError naming ``name`` and ``what`` was expected."""
    if values is None:
        return (default,) * len(classes)
    values = tuple(values)
    if len(values) != len(classes) or not all(ok(x, c) for x, c in zip(values, classes)):
        raise ValueError(f"{name}: expected {what} per class of {classes!r}, got {values!r}")
    return values


def check_shared(shared, classes):
    """The per-class counts of leading slots a group's query tiles share (None: none), as a
    tuple: one int in ``[0, trip]`` per class."""
    return _per_class("shared", shared, classes, 0, "one count in [0, trip]",
                      lambda s, c: isinstance(s, int) and 0 <= s <= c[2])


def check_natural(natural, classes):
    """The per-class flags of natural order (None: none), as a tuple of bools: order position
    p of a flagged class holds query tile p in every ``(b, h)`` of the table."""
    return _per_class("natural", natural, classes, False, "one bool",
                      lambda x, _c: isinstance(x, bool))


def exact_indices(rows: int, units: int = 0) -> bool:
    """Whether a launch numbers its rows and dropout units in int32 under nki.*: when
    ``rows`` (the largest flattened row count the indirect DMAs address,
    :func:`port.lead_rows`) or ``units`` (dropout's, 0 without dropout) may reach 2^24, past
    fp32's exact integers (:class:`port.OffsetColumns` ``exact``, :class:`RowFrame`). Below
    that the fp32 sums on VectorE are exact and cheaper."""
    return max(rows, units) >= T.FP32_EXACT_INT


class KVSource(NamedTuple):
    """Where the block-sparse forward's steps take their key blocks: ``res`` the (batch, kv
    head)'s resident K^T and ``[V | 1]`` (nki.*, :func:`forward.load_kv`), or None: gathered
    per step (:func:`_gather_kv`); ``step`` the key blocks of a step over a query tile's own
    slots (``tiles.BSP_STEP_BLOCKS`` or ``BSP_RESIDENT_STEP_BLOCKS``); ``p_dma_share`` the
    device's share of P^T transposes on the DMA engines when they do not gather (resident;
    else 0), a class's share is :func:`tiles.bsp_p_dma_share` of it; ``sel`` a class's slot
    selector (:meth:`for_class`; None: none); ``win`` (:class:`_Window`; None: none): ``res``
    is a key-block window the groups fill (:func:`_load_window`), not the whole K/V."""

    res: Optional[object]
    step: int
    p_dma_share: float
    sel: Optional[object] = None
    win: Optional["_Window"] = None

    def for_class(self, f, geo: "Geometry", trip: int, exact: bool) -> "KVSource":
        """The source of a class of ``trip`` slots: with :func:`_pads_by_matmul` and at most
        128 slots (one partition per slot), ``sel``
        the ``[trip, 128 trip]`` selector (matmul dtype) of the slots' score columns (1 at
        row k, columns ``128 k .. 128 k + 127``, else 0): the ``[trip, trip]`` identity,
        each column repeated 128 times (three GpSimd instructions per class; fp32
        temporaries of ``trip`` columns, not ``128 trip``: at 49 slots 75 KB fewer SBUF
        bytes per partition at the class's start, where a key-block window is already
        allocated)."""
        if trip > P or not _pads_by_matmul(f, geo, self.res, exact):
            return self._replace(sel=None)   # (the padding matmul contracts over the slots)
        return self._replace(sel=_slot_selector(f, trip))

    def instance(self, f, trip: int):
        """``f`` with the P^T DMA-transpose share of a class of ``trip`` slots."""
        share = T.bsp_p_dma_share(self.p_dma_share, trip)
        if share == f.tiles.p_dma_transpose_share:
            return f
        return dataclasses.replace(f, tiles=dataclasses.replace(
            f.tiles, p_dma_transpose_share=share))


def _mask_mm(f):
    """The operand dtype of the matmuls that add MASK_NEG to scores (:func:`_slot_selector`,
    :func:`_padding_rows`, the masked super-groups' keep rows): the matmul dtype, but bf16
    for fp16, whose range ends at 65504 (MASK_NEG = -2^100 would round to -inf, and -inf x 0
    is NaN in every score the matmul touches). bf16 holds MASK_NEG exactly at the same
    TensorE rate."""
    return nl.bfloat16 if f.mm == nl.float16 else f.mm


def _slot_selector(f, trip: int):
    """``[trip, 128 trip]`` (:func:`_mask_mm`): 1 at row k, columns ``128 k .. 128 k + 127``,
    else 0 (:meth:`KVSource.for_class`, :func:`_supergroup`). nki.* only: seen as ``[trip,
    trip, 128]`` by a 0.7 access pattern."""
    d = nl.ndarray((trip, trip), dtype=nl.float32, buffer=nl.sbuf)     # c - k
    port.iota(d, [[1, trip]], channel_multiplier=-1)
    eye = nl.ndarray((trip, trip), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(eye, d, nl.equal, 0.0, engine="gpsimd")
    sel = nl.ndarray((trip, trip * P), dtype=_mask_mm(f), buffer=nl.sbuf)
    port.tensor_copy(sel.reshape_dim(1, (trip, P)), port.repeat_last(eye, P), engine="gpsimd")
    return sel


class RowFrame(NamedTuple):
    """How the indirect DMAs address the rows of one 2-D slice ``t[b, h]`` of an HBM tensor
    (:func:`port.lead_rows`): ``base`` is the slice's first row in the view they index (fp32
    ``[128, 1]`` under 0.7, which indexes the flattened tensor; None in legacy, which indexes
    the slice itself) and ``oob`` what pushes an index out of bounds of that view (a power of
    two, :func:`masks.oob_offset`). ``ints``: under 0.7 with an ``exact`` table of indices
    (:func:`exact_indices`), the first row as int32 instead (``base`` None): positions stay
    those of the slice, and :meth:`rows` adds it to the int32 indices on GpSimd (exact at
    any size; fp32 would round flat rows past 2^24)."""

    base: object
    oob: float
    ints: object = None

    @staticmethod
    def of(t, lead, indices) -> "RowFrame":
        """The frame of ``t[*lead]`` (``indices``: the launch's :class:`port.OffsetColumns` of
        0, 1, ..., read under 0.7 only)."""
        if indices.ints is not None:            # 0.7 only: legacy builds no table
            return RowFrame(None, float(M.oob_offset(math.prod(t.shape[:-1]))),
                            port.lead_first_row(t, lead, indices, ints=True))
        base = port.lead_first_row(t, lead, indices)
        n = t.shape[-2] if base is None else math.prod(t.shape[:-1])
        return RowFrame(base, float(M.oob_offset(n)))

    def shift(self, col):
        """``col`` (fp32 ``[128, 1]``, positions of the slice) as rows of the indexed view:
        ``col + base`` (VectorE) under 0.7, ``col`` itself in legacy and in an int32 frame
        (whose first row :meth:`rows` adds)."""
        if self.base is None:
            return col
        out = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(out, col, self.base, nl.add)
        return out

    def rows(self, idx):
        """int32 indices ``idx`` (shifted positions, or pushed out of bounds by ``oob``) as
        rows of the indexed view: ``idx + ints`` (one GpSimd int32 add, exact) in an int32
        frame, else ``idx`` itself (already rows of the view)."""
        if self.ints is None:
            return idx
        out = nl.ndarray(tuple(idx.shape), dtype=nl.int32, buffer=nl.sbuf)
        port.add_int_column(out, idx, self.ints[0:idx.shape[0], 0:1])
        return out


class Geometry:
    """Compile-time facts of one launch shared by the forward and the backward: lengths, the
    band, the constant iota tiles the runtime masks compare against, and how the indirect DMAs
    address K and V (``kv``: the :class:`RowFrame` of ``k[b, g]``; ``k_part``/``k_len``: the
    partition index and kv_len shifted into it)."""

    def __init__(self, spec: M.MaskSpec, kv_lens, q_lens, k, b, g, Nq: int, Nk: int, indices):
        self.spec, self.Nq, self.Nk = spec, Nq, Nk
        self.indices = indices
        self.has_lens = kv_lens is not None or q_lens is not None
        _, self.lens_p = M.load_lengths(kv_lens, q_lens, b, Nk, Nq)
        self.kv_len = self.lens_p[:, 0:1]       # fp32 [128, 1]: kv_len (or Nk)
        self.q_len = self.lens_p[:, 1:2]        # q_len (or Nq)
        # the alignment offset of the band (and of ALiBi's distance): 0, Nk - Nq, or kv_len -
        # q_len with lengths
        self.offset = None
        if spec.rotates and self.has_lens:
            self.offset = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_tensor(self.offset, self.kv_len, self.q_len, nl.subtract)
        self.static_offset = 0 if spec.top_left else Nk - Nq
        self.diff = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)       # c - p
        port.iota(self.diff, [[1, P]], channel_multiplier=-1)
        self.part = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)       # p
        port.iota(self.part, [[0, 1]], channel_multiplier=1)
        self.col = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)        # c
        port.tensor_scalar(self.col, self.diff, nl.add, self.part)
        self.kv = RowFrame.of(k, (b, g), indices)
        self.k_part, self.k_len = self.kv.shift(self.part), self.kv.shift(self.kv_len)

    def needs_key_mask(self, exact: bool) -> bool:
        """Whether scores need the key-side indicator: padding slots (not ``exact``), keys past
        kv_len, or the partial last key block."""
        return (not exact) or self.Nk % P != 0 or self.has_lens

    def band_columns(self, gap):
        """``(hi_thr, lo_thr)`` fp32 (None when unbounded), the shape of ``gap``: a score at
        row p, key column c of a block pair is outside the band when ``c - p > hi_thr`` or ``c
        - p < lo_thr``. ``gap``: fp32, first key minus first query row of each pair."""
        if not self.spec.has_diag:
            return None, None
        return self.band_limits(self.distance_columns(gap))

    def band_limits(self, e):
        """:meth:`band_columns` from the distance columns ``e`` (:meth:`distance_columns`),
        the band's ``c - p + e in [lo, hi]``."""
        spec = self.spec
        if not spec.has_diag:
            return None, None
        shape = tuple(e.shape)
        hi = lo = None
        if spec.hi is not None:
            hi = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(hi, e, nl.subtract, float(spec.hi), op1=nl.multiply,
                               operand1=-1.0)
        if spec.lo is not None:
            lo = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(lo, e, nl.subtract, float(spec.lo), op1=nl.multiply,
                               operand1=-1.0)
        return hi, lo

    def distance_columns(self, gap):
        """fp32, the shape of ``gap``: ``e = gap - off``, so that ``c - p + e`` is the distance
        ``j - i - off`` of the score at row p, key column c of each block pair (the band's and
        ALiBi's, ``score_mods``). One VectorE instruction."""
        e = nl.ndarray(tuple(gap.shape), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(e, gap, nl.subtract,
                           self.offset if self.offset is not None else float(self.static_offset))
        return e

    def distance_tile(self, e, s0, n: int):
        """fp32 ``[128, 128 n]``: the distances ``j - i - off`` of slots ``s0 .. s0 + n - 1``
        (``e`` from :meth:`distance_columns`), ``c - p`` plus each slot's column: n GpSimd
        instructions (the key positions are data, so not an iota of loop indices)."""
        d = nl.ndarray((P, n * P), dtype=nl.float32, buffer=nl.sbuf)
        for w in T.unrolled(n):
            port.tensor_scalar(d[:, w * P:(w + 1) * P], self.diff, nl.add, e[:, nl.ds(s0 + w, 1)],
                               engine="gpsimd")
        return d

    def indicator(self, key_thr, hi_thr, lo_thr, out, rows: int = P):
        """1 at the scores to mask -- key column ``c >= key_thr`` (a padding slot has ``key_thr
        <= 0``: every column), ``c - p > hi_thr``, ``c - p < lo_thr`` (each a ``[rows, 1]``
        column, or None) -- else 0, written into ``out`` (``[rows, 128]``, uint8).
        GpSimd/VectorE. False when there is nothing to mask (``out`` untouched)."""
        parts = []
        if key_thr is not None:
            kp = nl.ndarray((rows, P), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(kp, self.col[0:rows], nl.greater_equal, key_thr, engine="gpsimd")
            parts.append(kp)
        if hi_thr is not None:
            hp = nl.ndarray((rows, P), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(hp, self.diff[0:rows], nl.greater, hi_thr, engine="gpsimd")
            parts.append(hp)
        if lo_thr is not None:
            lp = nl.ndarray((rows, P), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(lp, self.diff[0:rows], nl.less, lo_thr, engine="vector")
            parts.append(lp)
        if not parts:
            return False
        if len(parts) == 1:
            port.tensor_copy(out, parts[0], engine="vector")
            return True
        ind = parts[0]
        if len(parts) == 3:
            ind = nl.ndarray((rows, P), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_tensor(ind, parts[0], parts[1], nl.maximum)
        port.tensor_tensor(out, ind, parts[-1], nl.maximum)
        return True


class Row:
    """The tables of one processing-order position (a *row*: a query tile, or a key block in
    the backward's dK/dV sweep) and its *entries* (the blocks of the other side it meets), on
    every partition (``host.block_sparse.KernelTables``): ``first`` (fp32 ``[128, 1]``), the
    row's first position; ``block_first`` (fp32 ``[128, trip]``), the entries' first positions
    (``tiles.BSP_PAD_FIRST`` for padding slots); ``bad`` (1.0 where position ``block_first + p``
    of a slot's entry is not read: at or past ``other_len``, which every padding slot is) and
    ``rows`` (int32 ``[128, trip]``: the indexed rows of those positions, pushed out of bounds
    where ``bad``: the gathers skip those rows). ``part``/``other_len``: the partition index
    and the other side's valid length as rows of ``frame`` (:meth:`RowFrame.shift`; None: the
    entries are not gathered, no ``rows``). Four instructions after the broadcast (``bc``: one
    already made); none without ``gathers`` (the block-sparse forward's resident K/V: ``bad``
    and ``rows`` are then None, and the broadcast is made where first used: a tile of whole
    query rows in natural order without masks needs none)."""

    def __init__(self, meta_row, trip: int, part, other_len, frame: Optional[RowFrame],
                 gathers: bool = True, bc=None):
        self._meta_row, self._bc = meta_row, bc
        self.trip = trip
        self.bad = self.rows = None
        if not gathers:
            return
        pos = nl.ndarray((P, trip), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(pos, self.block_first, nl.add, part)
        self.bad = nl.ndarray((P, trip), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(self.bad, pos, nl.greater_equal, other_len)
        if frame is None:
            return
        # in range: pos exactly; out: pos + OOB (>= OOB, past every row, exact enough to stay out)
        rows = nl.ndarray((P, trip), dtype=nl.int32, buffer=nl.sbuf)
        port.scalar_tensor_tensor(rows, self.bad, nl.multiply, frame.oob, nl.add, pos)
        self.rows = frame.rows(rows)

    def slot_loop(self, exact: bool, body, count=None):
        """``body(sl)`` over the row's slots, a sequential compiled loop: under nki.* (unless
        ``exact``: no padding slot) only the row's count of them (a register loaded from the
        table, or from ``count``, an int32 ``[1, 1]`` tile holding it; :func:`port.
        loop_between`), in legacy all ``trip`` (no runtime trip count; the padding slots run
        masked and contribute nothing, so the outputs are the same)."""
        if exact or port.api() != "nki":
            port.loop(self.trip, body, carried=True)
            return
        if count is None:
            count = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_copy(count, self.bc[0:1, 1:2], engine="gpsimd")
        port.loop_between(0, port.register(count), body)

    @property
    def bc(self):
        """fp32 ``[128, 2 + trip]``: the meta row on every partition (:func:`masks.
        broadcast_row`, made on first use)."""
        if self._bc is None:
            self._bc = M.broadcast_row(self._meta_row, 2 + self.trip)
        return self._bc

    @property
    def first(self):
        return self.bc[:, 0:1]

    @property
    def block_first(self):
        return self.bc[:, 2:2 + self.trip]


def own_rows(geo: Geometry, first, length, frame: RowFrame):
    """``(idx, pos)``: int32 ``[128, 1]`` gather/scatter indices (rows of ``frame``) of the 128
    positions from ``first`` (fp32 column) of a slice, out of bounds at positions ``>=
    length`` (a ``[128, 1]`` column or a number), and the positions themselves (fp32)."""
    pos = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(pos, first, nl.add, geo.part)
    return rows_at(pos, length, frame), pos


def rows_at(pos, length, frame: RowFrame):
    """int32 gather/scatter indices (rows of ``frame``) of the positions ``pos`` (fp32, ``[rows,
    n]``, rows <= 128: the first partitions), out of bounds at positions ``>= length`` (a
    ``[rows, 1]`` column or a number)."""
    length = float(length) if isinstance(length, (int, float)) else length
    shape = tuple(pos.shape)
    pushed = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(pushed, pos, nl.greater_equal, length, op1=nl.multiply,
                       operand1=frame.oob)
    idx = nl.ndarray(shape, dtype=nl.int32, buffer=nl.sbuf)
    if frame.base is None:
        port.tensor_tensor(idx, pushed, pos, nl.add)
    else:
        port.scalar_tensor_tensor(idx, pushed, nl.add, frame.base[0:shape[0], 0:1], nl.add,
                                  pos)
    return frame.rows(idx)


def gather(dst, src, lead, idx, col, skip: bool):
    """``dst[p] = src[*lead][idx[p, col]]`` (``col`` an index expression; ``idx`` rows of the
    slice's :class:`RowFrame`); with ``skip`` the destination is zeroed first and
    out-of-bounds rows are not read."""
    if skip:
        port.memset(dst, 0.0, engine="gpsimd")
    port.dma_copy(dst, port.lead_rows(src, lead, idx, col), legacy_isa=True, oob_skip=skip)


def scatter(dst, lead, idx, src):
    """``dst[*lead][idx[p, 0]] = src[p]`` (rows out of bounds skipped)."""
    port.dma_copy(port.lead_rows(dst, lead, idx, 0), src, oob_skip=True)


def unit_seeds(f, head, q_first, k_first):
    """int32 ``[1, n]``: the dropout seed ``seed + ((b Hq + head) nqu + i) nku + j`` of the
    128 x 128 units whose first query row / first key are the fp32 ``[1, n]`` (or ``[1, 1]``)
    ``q_first`` / ``k_first`` (``i = q_first / 128``, ``j = k_first / 128``; exact in fp32:
    nqu nku < 2^24) -- the dense kernels' numbering. ``(b Hq + head) nqu nku`` is a linear form
    of the loop indices (:func:`port.iota`; 0.7 reads them from ``f.indices``)."""
    n = max(q_first.shape[1], k_first.shape[1])
    u = nl.ndarray((1, n), dtype=nl.int32, buffer=nl.sbuf)
    if q_first.shape[1] == 1:
        q_col = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(q_col, q_first, nl.multiply, float(f.nku) / P)
        port.tensor_scalar(u, k_first, nl.multiply, 1.0 / P, op1=nl.add, operand1=q_col)
    else:
        k_col = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(k_col, k_first, nl.multiply, 1.0 / P)
        port.tensor_scalar(u, q_first, nl.multiply, float(f.nku) / P, op1=nl.add,
                           operand1=k_col)
    per_head = f.nqu * f.nku
    unit0 = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.iota(unit0, [[1, 1]], runtime=[(f.b, f.Hq * per_head), (head, per_head)],
              offsets=f.indices)
    base = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(base, unit0, f.drop.seed, nl.add)
    return _add_int_column(u, base)


def _add_int_column(u, base):
    """``u + base`` for int32 ``[1, n]`` and ``[1, 1]`` (GpSimd int32 adds, column by column
    when n > 1: an exact broadcast add)."""
    n = u.shape[1]
    out = nl.ndarray((1, n), dtype=nl.int32, buffer=nl.sbuf)
    if n == 1:
        port.tensor_tensor(out, u, base, nl.add)
        return out
    port.loop(n, lambda c: port.tensor_tensor(out[0:1, nl.ds(c, 1)], u[0:1, nl.ds(c, 1)],
                                              base, nl.add))
    return out


def _attend_tiles(f, geo: Geometry, meta, h, q_frame: RowFrame, pos0, n_tiles: int,
                  trip: int, exact: bool, shared: int, src: "KVSource",
                  held: Optional["_Held"] = None, shared_runtime: bool = False):
    """``n_tiles`` query tiles of one class (order positions ``pos0 ..``, member head h, whose
    rows ``q_frame`` addresses): the body of a class loop. Their ``trip`` slots are swept in
    steps of key blocks (a sequential loop of full steps and a static tail step), each one
    online-softmax update per tile; within a step the tiles follow each other, so every engine
    has another tile's independent work while one waits. The first ``shared`` slots list the
    same key blocks in every tile of the group (the host's grouping,
    ``host.block_sparse.kernel_tables``): their K/V are gathered, guarded and transposed once
    per group, not once per tile, in steps of ``tiles.BSP_SHARED_STEP_BLOCKS``; the others per
    tile in steps of ``src.step`` blocks. With ``src.res`` (nki.*: the instance's resident K^T
    and ``[V | 1]``) nothing is gathered: every step reads its blocks in place
    (:class:`_ResidentKV`), with the same steps and so the same outputs. ``held``
    (:class:`_Held`; a class in natural order, :func:`_direct_rows`): order position ``pos0 +
    t`` holds query tile ``pos0 + t``, whose rows are then affine in the loop indices: Q is
    loaded by plain DMAs, not gathered, the outputs stay in ``held`` and the previous group's
    held ones are stored, by plain DMAs, once this group's loads are issued.
    ``shared_runtime`` (a runtime pattern's grouped tables, ``host.block_sparse.
    shared_bound_tables``): ``shared`` is a bound, the group's common blocks come first and
    padding slots after them; under nki.* the common sweep runs only its steps below their
    count (:func:`_shared_count`), in legacy all of them (padding gathers skipped, scores
    masked: the same outputs)."""
    head = f.head(h)
    res, sel = src.res, src.sel
    direct = held is not None
    hb = f.b if meta.shape[0] > 1 else 0
    hh = head if meta.shape[1] > 1 else 0
    skip = geo.needs_key_mask(exact)
    W = min(src.step, trip)                    # a tile's own slots per step
    Ws = min(T.BSP_SHARED_STEP_BLOCKS, shared)  # the group's shared slots per step
    # a class whose first sweep is one step (the shared slots', else the own slots'; every
    # density up to 1/2 at N = 4096 with resident K/V): that step's accumulator update is a
    # copy (forward.fold_update first), so the accumulators need no zeroing. Not with sinks
    # (the sink is the first "key") or dropout (its row sums are added)
    once = shared <= Ws if shared else 0 < trip <= W
    # (a runtime count of common blocks may be 0: no step to peel)
    peel = once and not f.dropout_p and not f.mods.sinks and not shared_runtime
    st = F.GroupState(f, n_tiles, P, zero_o=not peel)
    if f.mods.sinks:
        F.start_at_sink(f, st, h, n_tiles, slot0=0)
    # the group's table rows (consecutive rows of the table) in one DMA: at the start the
    # DMA queues also hold the resident K/V load, and a group's loads wait for queues (trn2
    # N = 4096, D = 128, index form, s = 1/8: one DMA per row 55.4 us, per group 55.0; the
    # Q rows of a natural-order group in one DMA too: 56.4, the first tile then waits for
    # the whole group's rows)
    grp = nl.ndarray((1, n_tiles, 2 + trip), dtype=nl.float32, buffer=nl.sbuf)
    cols = meta.shape[3]
    port.dma_copy(grp, meta.reshape((meta.shape[0], meta.shape[1], 1, meta.shape[2], cols))[
        hb, hh, 0:1, nl.ds(pos0, n_tiles), 0:2 + trip], legacy_isa=True)
    rows = [Row(grp[:, t, :], trip, geo.k_part, geo.k_len, geo.kv, gathers=res is None)
            for t in T.unrolled(n_tiles)]
    blocks = None
    if src.win is not None:
        blocks = src.win.positions(hb, hh, pos0, n_tiles, trip)
    elif res is not None:
        blocks = _block_numbers(grp, trip, f.nku)
    # nki.*: the own-slot sweep's trip counts, planned before the tiles' setup so that their
    # register loads (below) find them written. Only where a group may skip a step and still
    # run one (more than W own slots): each register load stops every engine until its value
    # is written (simulate._sched.register_wait), which cost the band+strided pattern's
    # groups of one step 141.3 -> 161.1 us (benchmarks/block_sparse.py, N = 4096, D = 128)
    # (shared_runtime: a group may have no own block, and its own sweep then no step)
    runtime = (not exact and (trip - shared > W or shared_runtime)
               and port.api() == "nki")
    n_full, tail = divmod(trip - shared, W)
    plan = _trip_counts(_group_count(rows), shared, W, n_full, tail) if runtime else None
    shared_plan = None
    if shared_runtime and shared and port.api() == "nki":
        shared_plan = _trip_counts(_shared_count(grp, shared), 0, Ws, *divmod(shared, Ws))
    # resident K/V whose only masked keys are the padding slots' (_pads_only): TensorE
    # masks them (the class's selector, _pads_by_matmul), or one ScalarE multiply-add per
    # block (_scores)
    pad_only = _pads_only(f, geo, res, exact, zeros=shared_runtime)
    pad_rows = (_padding_rows(f, meta, hb, hh, pos0, n_tiles, trip) if sel is not None
                else None)
    tiles = []
    for t, rw in enumerate(rows):
        # valid key columns of slot s: c < kv_len - first_s (none in a padding slot)
        thr = pad = pad_mm = None
        if pad_rows is not None:
            pad_mm = (pad_rows[:, t, :], sel)
        elif pad_only:
            pad = _padding_columns(rw.block_first, f.Nk)
        elif skip:
            thr = _key_thresholds(geo, rw.block_first)
        hi_thr, lo_thr, dist, seeds = _slot_columns(f, geo, head, rw.block_first, rw.first)
        # Q rows of the tile: skipped past q_len (they output 0), scattered back below Nq
        q_idx = q_pos = None
        if direct and f.direct_q:
            # Q^T straight from HBM by DMA transposes (the dense forward's direct_q: the same
            # bits, no TensorE transpose, no ScalarE copy, no 256-byte rows' descriptors;
            # trn2 N = 4096, D = 128, index form, with the values-first K/V load and the
            # finalize's ScalarE share: s = 1/8 49.4 -> 48.9 us, s = 1/32 33.2 -> 32.8; alone,
            # before those, s = 1/16 38.7 -> 40.1)
            F.transpose_q_rows(f, P, h, pos0 + t, [qT[:, t, :] for qT in st.qT])
        else:
            x = nl.ndarray((P, f.D), dtype=f.q.dtype, buffer=nl.sbuf)
            if direct:
                port.dma_copy(x, f.q[f.b, head, nl.ds((pos0 + t) * P, P), :], legacy_isa=True)
            else:
                if geo.has_lens or f.Nq % P:
                    q_idx, q_pos = own_rows(geo, rw.first, geo.q_len, q_frame)
                else:
                    q_idx = _tile_rows(geo, rw.first, q_frame)
                gather(x, f.q, (f.b, head), q_idx, 0, geo.has_lens or f.Nq % P != 0)
            _transpose_q(f, st, t, x)
        # the source of a step's own blocks: their key-block numbers (resident K/V), or
        # [V | 1] to gather them into (the ones column gives the row sums, forward module
        # doc; none when the group shares every slot)
        src = None
        if res is not None:
            src = (blocks, t)
        elif trip > shared:
            src = nl.ndarray((P, W, f.vcols), dtype=f.mm, buffer=nl.sbuf)
            F.ones_column(f, src[:, :, f.D:f.D + 1])
        tiles.append((rw, src, dict(thr=thr, hi=hi_thr, lo=lo_thr, pad=pad, pad_mm=pad_mm),
                      seeds, q_idx,
                      q_pos, dist))

    if direct and held.prev is not None:
        _store_held(f, head if held.head is None else held.head, held, held.prev,
                    held.o.shape[1] if held.n is None else held.n, trip)

    def step_kv(rw, src, s0, n):
        if res is not None:
            return _ResidentKV(res, src, s0)
        return _gather_kv(f, rw, src, s0, n, skip)

    def one_step(s0, n, common, first=False):
        """Slots ``s0 .. s0 + n - 1``: a shared slot's K/V are gathered once (from the first
        tile's table, which lists the same block there as every tile's) and serve every
        tile. ``first``: the tiles' first step (``peel``)."""
        kv = step_kv(tiles[0][0], shared_src, s0, n) if common else None
        # software pipelined: tile t's scores and softmax front are issued before the back
        # halves (P^T, PV, the accumulator update) of the `depth` tiles before it, so that an
        # in-order engine does not hold one tile's front behind another tile's whole chain
        # (tiles.bsp_pipeline_depth)
        backs = []
        depth = T.bsp_pipeline_depth(n)
        for t, (rw, src, cols, seeds, _, _, dist) in enumerate(tiles):
            own = kv if common else step_kv(rw, src, s0, n)
            backs.append(_step(f, geo, st, t, rw, own, cols, seeds, h, q_frame, s0, n, dist,
                               first))
            if len(backs) > depth:
                backs.pop(0)()
        for back in backs:
            back()

    def sweep(lo: int, hi: int, common: bool, width: int, first: bool = False):
        """Slots lo .. hi - 1 in steps of up to ``width`` blocks (a sequential loop of full
        steps and a static tail); ``first``: they are one step, the tiles' first (``peel``)."""
        w = min(width, hi - lo)
        if w == 0:
            return
        if first:
            one_step(lo, w, common, True)
            return
        port.loop((hi - lo) // w, lambda s: one_step(lo + s * w, w, common), carried=True)
        if (hi - lo) % w:
            one_step(lo + ((hi - lo) // w) * w, (hi - lo) % w, common)

    shared_src = tiles[0][1] if res is not None else None
    if shared and res is None:
        shared_src = nl.ndarray((P, Ws, f.vcols), dtype=f.mm, buffer=nl.sbuf)
        F.ones_column(f, shared_src[:, :, f.D:f.D + 1])
    if shared_plan is None:
        sweep(0, shared, True, Ws, peel)
    else:
        _runtime_sweep(one_step, shared_plan, 0, Ws, shared // Ws, shared % Ws, True)
    if plan is None:
        # legacy: no runtime trip count, padding slots run masked (gathers skipped)
        sweep(shared, trip, False, W, peel and not shared)
    else:
        _runtime_sweep(one_step, plan, shared, W, n_full, tail, False)
    # the outputs (q_lens: never in natural order, _direct_rows)
    n = n_tiles
    dst = None if not direct else (held.o[:, 0:n, :] if n > 1 else held.o[:, 0, :],
                                   held.lse[:, 0:n, 0])
    outs = _finalize_tiles(f, geo, st, n, [tile[5] for tile in tiles], dst)
    if direct:
        return
    for (rw, _, _, _, q_idx, _, _), (o_out, lse_out) in zip(tiles, outs):
        out_idx = q_idx if not geo.has_lens else own_rows(geo, rw.first, f.Nq, q_frame)[0]
        store_tile(f, out_idx, head, o_out, lse_out)


def _finalize_tiles(f, geo: Geometry, st, n: int, q_pos, dst=None):
    """``[(o, lse)]`` of a group's ``n`` query tiles (``st``'s slots 0 .. n - 1): without
    q_lens one :func:`forward.finalize` of them all (each step over the rows' statistics one
    instruction for all of them; ``dst`` its), else tile by tile, each with its rows in range
    (``q_pos``: each tile's fp32 row positions, ``[128, 1]``)."""
    if not f.spec.q_lens:
        o_all, lse_all = F.finalize(f, st, 0, None, dst, n=n,
                                    act_slots=int(n * T.BSP_FINALIZE_ACT_SHARE))
        return [(o_all[:, t, :] if n > 1 else o_all, lse_all[:, t:t + 1])
                for t in T.unrolled(n)]
    outs = []
    for t in T.unrolled(n):
        in_range = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(in_range, q_pos[t], nl.less, geo.q_len)
        outs.append(F.finalize(f, st, t, in_range))
    return outs


def _transpose_q(f, st, t, x):
    """Q^T of query tile t from its rows ``x`` (``[128, D]`` in SBUF): TensorE transposes,
    one per head-dim pass, copied with the softmax scale into ``st.qT`` by ScalarE."""
    for pi, (d0, dr) in enumerate(f.d_passes):
        tp = nl.ndarray((dr, P), dtype=f.transpose_psum_dtype(f.q.dtype), buffer=nl.psum)
        port.nc_transpose(tp, x[:, d0:d0 + dr])
        port.activation(st.qT[pi][:, t, :], nl.copy, tp, scale=f.q_scale)


def _key_thresholds(geo: Geometry, block_first):
    """fp32, the shape of ``block_first`` (``[128, n]``: slots' first keys, a :class:`Row`'s
    or a step's): ``kv_len - first_s`` of each slot, the valid key columns of slot s (``c <
    kv_len - first_s``; none in a padding slot)."""
    thr = nl.ndarray(tuple(block_first.shape), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(thr, block_first, nl.subtract, geo.kv_len, op1=nl.multiply,
                       operand1=-1.0)
    return thr


def _slot_columns(f, geo: Geometry, head, block_first, first):
    """``(hi_thr, lo_thr, dist, seeds)`` of a query tile's slots (``block_first``: fp32
    ``[128, n]``, their first keys; ``first``: fp32 ``[128, 1]``, the tile's first query
    row): the band's columns (:meth:`Geometry.band_columns`), ALiBi's distance columns
    (:meth:`Geometry.distance_columns`) and the dropout units' seeds (:func:`unit_seeds`),
    each None where the launch has no band, no ALiBi, no dropout."""
    hi_thr = lo_thr = dist = seeds = None
    if f.spec.has_diag or f.mods.alibi:
        gap = nl.ndarray(tuple(block_first.shape), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(gap, block_first, nl.subtract, first)
        # the distances j - i - off of the slots, less the c - p of a score (Geometry): the
        # band's limits and ALiBi's columns
        e = geo.distance_columns(gap)
        hi_thr, lo_thr = geo.band_limits(e)
        dist = e if f.mods.alibi else None
    if f.dropout_p:
        seeds = unit_seeds(f, head, first[0:1, 0:1], block_first[0:1, :])
    return hi_thr, lo_thr, dist, seeds


def _direct_rows(f, geo: Geometry, natural: bool) -> bool:
    """Whether a class's query tiles load Q and store O, LSE by plain DMAs at rows ``128
    pos`` of their order position ``pos`` (a loop index expression): ``natural`` order, no
    lengths, whole query tiles. Otherwise their rows are data (the table's first row, gathers
    and scatters that skip rows past the lengths), and the scheduler orders the indirect
    writes of one tensor one after the other (``simulate._sched``: an indirect write covers
    its whole tensor)."""
    return natural and not geo.has_lens and f.Nq % P == 0


def keeps_order(api: str, Nq: int, Nk: int, D: int, mm_dtype: str, trip: int,
                lengths: bool) -> bool:
    """Whether the forward's tables should keep the query tiles in their (sorted) order
    rather than group them by their common key blocks (``host.block_sparse.launch_tables``
    ``keep_order``): under nki.* with K/V resident (``tiles.bsp_fwd_kv_resident``, ``trip``
    the pattern's bound) a group's common blocks are read in place like the others, so
    grouping saves nothing, while tiles in natural order load and store their rows by plain
    DMAs (:func:`_direct_rows`: whole query tiles, no ``lengths``). Legacy gathers K/V per
    step and keeps the grouping (its sums then run over a tile's blocks in another order:
    the outputs agree to rounding, not bit for bit)."""
    return (api == "nki" and not lengths and Nq % P == 0
            and T.bsp_fwd_kv_resident(Nk, D, T.fwd_itemsize(mm_dtype), trip))


def window_capacity(D: int, mm_dtype: str, trip: int, Nk: int, causal, window,
                    lengths: bool, mods: bool, dropout: bool) -> int:
    """Key blocks the forward's key-block window may hold in a launch of ``trip`` slots
    (:func:`tiles.bsp_fwd_window_blocks`): ``plain`` (fewer per-slot tables) where only its
    padding slots are masked -- no ``causal`` or local ``window`` band, no ``lengths``, no
    score modifier (``mods``), no ``dropout`` and whole key blocks (Nk a multiple of 128).
    The host plans with it and the kernel checks against it."""
    plain = not (causal or window or lengths or mods or dropout) and Nk % P == 0
    return T.bsp_fwd_window_blocks(D, T.fwd_itemsize(mm_dtype), trip, plain)


def shares_at_runtime(api: str, Nk: int, D: int, mm_dtype: str, trip: int,
                      runtime: bool) -> bool:
    """Whether a ``runtime`` pattern (the index form, bound ``trip``) takes grouped tables of
    bounded shape (``host.block_sparse.launch_tables`` ``share_runtime``): under nki.* where
    K/V are not resident (``tiles.bsp_fwd_kv_resident``) the tiles of a group then gather
    their common blocks once, as a bool mask's do, and the padding slots of the bound cost
    no step (runtime trip counts). Legacy has no runtime trip count: the common region's
    padding slots would all run, so it keeps one natural-order class."""
    return (runtime and api == "nki"
            and not T.bsp_fwd_kv_resident(Nk, D, T.fwd_itemsize(mm_dtype), trip))


def _group_count(rows):
    """fp32 ``[1, 1]``: the largest count of a group's tiles (``rows``: their :class:`Row`)."""
    c = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(c, rows[0].bc[0:1, 1:2], engine="gpsimd")
    for rw in rows[1:]:
        port.tensor_tensor(c, c, rw.bc[0:1, 1:2], nl.maximum, engine="gpsimd")
    return c


def _shared_count(grp, shared: int):
    """fp32 ``[1, 1]``: how many of the first ``shared`` slots of a group's first tile
    (``grp``: the group's meta rows ``[1, n, 2 + trip]``) hold a key block, not padding
    (``shared_runtime`` tables list the group's common blocks first). Two VectorE
    instructions per group."""
    live = nl.ndarray((1, shared), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(live, grp[0:1, 0, 2:2 + shared], nl.less, float(T.BSP_PAD_FIRST))
    c = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_reduce(c, nl.add, live, axis=1)
    return c


def _runtime_sweep(one_step, plan, lo: int, W: int, n_full: int, tail: int, common: bool):
    """nki.*: slots ``lo ..`` in ``n_full`` steps of ``W`` and a tail step of ``tail`` slots,
    each loop running only the steps of ``plan`` (:func:`_trip_counts`)."""
    port.loop_between(0, port.register(plan[0]), lambda s: one_step(lo + s * W, W, common))
    if tail:
        port.loop_between(0, port.register(plan[1]),
                          lambda _: one_step(lo + n_full * W, tail, common))


def _trip_counts(c, shared: int, W: int, n_full: int, tail: int):
    """nki.*: the runtime trip counts of a sweep of slots ``shared ..`` (steps of ``W``,
    ``n_full`` full ones and a tail of ``tail`` slots) whose slots from ``c`` (fp32 ``[1,
    1]``, :func:`_group_count` or :func:`_shared_count`) on are padding in every tile, as
    registers (int32 ``[1, 1]`` tiles to load into registers, :func:`port.register`):
    ``(steps, last)``, ``steps = min(ceil((c - shared) / W), n_full)`` and ``last`` 1 if the
    tail step holds a slot below ``c`` (else 0; None without a tail). The steps past ``c``
    hold only padding slots, which contribute nothing (their scores are masked, their
    gathers skipped): skipping them leaves the outputs of the masked sweep.
    GpSimd/VectorE ``[1, 1]`` instructions; floor by the int32 conversion's round to nearest
    even, as :func:`masks.int_mod`."""
    # x + 0.5 with x = max(c - shared + W - 1, 0); floor(x / W) = RNE((x + 0.5) / W - 0.5)
    x = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(x, c, nl.add, float(W - 1 - shared) + 0.5, op1=nl.maximum, operand1=0.5)
    qf = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(qf, x, nl.multiply, 1.0 / W, op1=nl.subtract, operand1=0.5)
    n = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_scalar(n, qf, nl.minimum, float(n_full))
    last = None
    if tail:
        t = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_scalar(t, c, nl.greater, float(shared + n_full * W))
        last = t
    return n, last


def _gather_kv(f, rw: Row, v, s0, n: int, skip: bool, guard_keys: bool = False) -> F.KV:
    """The K and V blocks of slots ``s0 .. s0 + n - 1`` (``s0`` an index expression, n static)
    of ``rw``'s table: K^T (TensorE) and ``v`` (``[128, >= n, vcols]``, its ones column
    already set) guarded (:func:`forward.guard_values`). Once per tile and step, or once per
    group and step for the slots its tiles share (``_attend_tiles``). ``guard_keys`` (masked
    super-groups, whose masks add, not select): K's non-finite entries are zeroed too and
    flag their keys as V's do (:func:`forward.guard_values`: a row that sees the key gets
    NaN, the others never meet the value)."""
    D = f.D
    kx = nl.ndarray((P, n, D), dtype=f.k.dtype, buffer=nl.sbuf)
    same = f.v.dtype == f.mm
    vx = v if same else nl.ndarray((P, n, D), dtype=f.v.dtype, buffer=nl.sbuf)
    if skip:
        port.memset(kx, 0.0, engine="gpsimd")
        port.memset(vx[:, 0:n, 0:D], 0.0, engine="gpsimd")
    for w in T.unrolled(n):
        port.dma_copy(kx[:, w, :], port.lead_rows(f.k, (f.b, f.g), rw.rows, s0 + w),
                      legacy_isa=True, oob_skip=skip)
        port.dma_copy(vx[:, w, 0:D], port.lead_rows(f.v, (f.b, f.g), rw.rows, s0 + w),
                      legacy_isa=True, oob_skip=skip)
    if not same:
        port.tensor_copy(v[:, 0:n, 0:D], vx, engine="gpsimd")
    F.guard_values(f, v[:, 0:n, 0:D], v[:, 0:n, D + 1:D + 2], sum_on_scalar=True)
    if guard_keys:
        kflag = nl.ndarray((P, n, 1), dtype=f.mm, buffer=nl.sbuf)
        F.guard_values(f, kx, kflag, sum_on_scalar=True)
        port.tensor_tensor(v[:, 0:n, D + 1:D + 2], v[:, 0:n, D + 1:D + 2], kflag, nl.maximum)
    kT = [nl.ndarray((rows, n * P), dtype=f.mm, buffer=nl.sbuf) for _, rows in f.d_passes]
    F.transpose_keys(f, kT, 0, [(w * P, P, kx[:, w, :]) for w in T.unrolled(n)], f.k.dtype)
    return _StepKV(None, kT, v)


class _BlocksKV(F.KV):
    """K^T and ``[V | 1]`` of a step's blocks, block by block (:meth:`key_block`)."""

    def key_block(self, pi: int, w: int):
        """K^T ``[rows, 128]`` of head-dim pass ``pi`` of the step's block ``w``."""
        raise NotImplementedError

    def scores(self, qT, slot, c0: int, n: int):
        """``S = Q K^T`` of the step's blocks ``c0 .. c0 + n - 1`` for query tile ``slot``
        (``qT``: the group's Q^T per head-dim pass): one fp32 PSUM tile ``[128, 128 n]``, one
        matmul per block and pass, whether the blocks are adjacent (gathered) or not
        (resident), so both give the same bits (TensorE's cost is per moving column,
        ``simulate._cost``)."""
        acc = nl.ndarray((P, n * P), dtype=nl.float32, buffer=nl.psum)
        for w in T.unrolled(n):
            for pi in T.unrolled(len(self.kT)):
                port.nc_matmul(acc[:, w * P:(w + 1) * P], qT[pi][:, slot, :],
                               self.key_block(pi, c0 + w), accumulate=pi > 0)
        return acc


class _StepKV(_BlocksKV):
    """The K^T and ``[V | 1]`` of a step's blocks gathered side by side (:func:`_gather_kv`)."""

    def key_block(self, pi: int, w: int):
        return self.kT[pi][:, w * P:(w + 1) * P]


class _ResidentKV(_BlocksKV):
    """nki.*: a step's blocks read in place from the (batch, kv head)'s resident K^T and
    ``[V | 1]`` (:func:`block_sparse_attention_fwd`): block w of the step is resident block
    ``blocks[0, t, s0 + w]`` (``blocks``: ``(tile, t)``, the int32 ``[1, n, trip]`` key-block
    numbers of a group's tiles, :func:`_block_numbers`, and the query tile's), a runtime offset into the tiles (:func:`port.select_block`):
    no DMA, no transpose. The values are those :func:`_gather_kv` would gather, so the
    outputs are the legacy trace's."""

    def __init__(self, res: F.KV, blocks, s0):
        super().__init__(None, res.kT, res.v)
        (self.blocks, self.tile), self.s0 = blocks, s0

    def _index(self, w):
        return self.blocks[0:1, self.tile, nl.ds(self.s0 + w, 1)]

    def key_block(self, pi: int, w: int):
        return port.select_block(self.kT[pi], self._index(w), P)

    def v_block(self, kw: int, b):
        view = port.select_block(self.v, self._index(b))
        return view if kw == P else view[0:kw, :]


class _OwnKV(_ResidentKV):
    """Sparse super-groups: a sub-step's blocks read in place from the step's gathered K^T
    and ``[V | 1]`` (``kv``, :func:`_gather_kv`) at their positions in the step: block w of
    the sub-step is position ``own[row, s0 + w]`` (``blocks``: ``(own, row)``, the step's
    int32 table of the tiles and the tile's partition, :func:`_own_blocks`), a runtime
    offset (:func:`port.select_block`)."""

    def _index(self, w):
        return self.blocks[self.tile:self.tile + 1, nl.ds(self.s0 + w, 1)]


def _block_numbers(grp, trip: int, nkb: int):
    """int32 ``[1, n, trip]``: the key-block numbers ``first / 128`` of the slots of a group's
    n query tiles (``grp``: their fp32 meta rows ``[1, n, 2 + trip]`` on partition 0); a
    padding slot's (past every block) is ``nkb``, the resident block of zeros after the
    ``nkb`` blocks of keys: its scores are 0, finite, and masked. One VectorE instruction
    for the group (exact: integers in fp32)."""
    blocks = nl.ndarray((1, grp.shape[1], trip), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_scalar(blocks, grp[0:1, :, 2:2 + trip], nl.multiply, 1.0 / P, op1=nl.minimum,
                       operand1=float(nkb), engine="vector")
    return blocks


def _step(f, geo: Geometry, st, slot, rw: Row, kv: F.KV, cols, seeds, h, q_frame: RowFrame,
          s0, n: int, dist=None, first: bool = False):
    """Slots ``s0 .. s0 + n - 1`` (``s0`` an index expression, n static) of a query tile of
    member head h, whose K and V blocks ``kv`` holds (:func:`_gather_kv`): the score tiles of
    ``128 n`` keys, one PSUM bank each (:func:`_scores`: ``S = Q K^T``, the score modifiers,
    ``dist``: the tile's ALiBi columns, :meth:`Geometry.distance_columns`, the runtime masks),
    then the front half of one online-softmax update over them (``forward.fold_front``).
    Returns its back half (``forward.fold_back``), to be called once the next tile's front is
    issued (:func:`_attend_tiles`): the two halves are ``forward.fold_block``'s. ``first``:
    the tile's first step (``forward.fold_update`` first)."""
    head = f.head(h)
    per_bank = f.tiles.k_tile // P
    s_tiles = [_scores(f, geo, st, slot, kv, cols, h, s0, c0, min(per_bank, n - c0), dist)
               for c0 in T.unrolled(0, n, per_bank)]
    def drop(p, r, width, pred):
        """Attention dropout of the step's blocks of P in place (one seed per unit)."""
        for w in T.unrolled(n):
            us = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_copy(us, seeds[0:1, nl.ds(s0 + w, 1)], engine="gpsimd")
            port.random_seed(us)
            port.dropout(p[:, w * P:(w + 1) * P], p[:, w * P:(w + 1) * P], f.dropout_p)
            if f.drop.mask_out is not None:
                port.random_seed(us)
                keep = nl.ndarray((P, P), dtype=f.drop.ones.dtype, buffer=nl.sbuf)
                port.dropout(keep, f.drop.ones, f.dropout_p)
                _store_mask(f, geo, rw, head, q_frame, s0 + w, keep)

    widths = [t.shape[1] for t in s_tiles]
    front = F.fold_front(f, st, slot, s_tiles, widths, None, drop if f.dropout_p else None,
                         first=first)
    # the first step's accumulator copy (PSUM -> SBUF): ScalarE for one-block steps, where
    # VectorE's row maxima and updates make it the busier engine, else VectorE
    # (tiles.BSP_FIRST_COPY_ACT_MAX_BLOCKS)
    copy = "scalar" if n <= T.BSP_FIRST_COPY_ACT_MAX_BLOCKS else "vector"
    return lambda: F.fold_back(f, st, slot, front, widths, kv, 0, None,
                               first=copy if first else None)


#: The slot columns of a step whose scores nothing masks (:func:`_scores`' ``cols``).
_NO_MASKS = dict(thr=None, hi=None, lo=None, pad=None, pad_mm=None)


def _scores(f, geo: Geometry, st, slot, kv, cols, h, s0, c0: int, n: int, dist):
    """The score tile of slots ``s0 + c0 .. s0 + c0 + n - 1`` (n blocks: at most one PSUM
    bank, ``tiles.k_tile`` keys): ``S = Q K^T`` (``kv``: :class:`_StepKV` or
    :class:`_ResidentKV`), the score modifiers, then the runtime masks (:func:`_step`)."""
    sc = kv.scores(st.qT, slot, c0, n)
    if cols["pad_mm"] is not None:
        # padding slots (the block of zeros: scores exactly 0) become MASK_NEG: TensorE adds
        # the tile's rows of MASK_NEG or 0 (_padding_rows) times the slots' selector into the
        # scores' PSUM, one matmul of K = trip rows per score tile. Exact: one product
        # (MASK_NEG = -2^100 or 0, by 1) per column, added in fp32 to s: the bits of the
        # ScalarE multiply-add below (s keep + neg), which it replaces where no modifier
        # transforms the scores: ScalarE (exponentials, P^T copies) was the busiest engine,
        # TensorE the idlest (trn2 N = 4096, D = 128, index form, band+strided 60.7 -> 51.5 us)
        rows_t, sel = cols["pad_mm"]
        port.nc_matmul(sc, rows_t, sel[:, nl.ds((s0 + c0) * P, n * P)], accumulate=True)
    s_tile = sc
    if f.mods.transforms:
        # soft-capping, ALiBi (raw units of f.unit), the dense kernels' instructions; the masks
        # select after them (a tanh would map MASK_NEG to -1)
        s_tile, _ = SM.modify_scores(
            f.mods, f.score.cols, sc, P, n * P, h, None, f.act_scale / f.unit,
            not SM.one_sided(f.spec),
            dist=geo.distance_tile(dist, s0 + c0, n) if dist is not None else None)
    if any(cols[k] is not None for k in ("thr", "hi", "lo")):
        # masks by selection: scores a row cannot see become MASK_NEG, whatever they were (a
        # NaN or inf in a hidden key never reaches the row); VectorE copies the scores out of
        # PSUM (unless a modifier did) and overwrites the masked ones
        ind = nl.ndarray((P, n * P), dtype=nl.uint8, buffer=nl.sbuf)
        for w in T.unrolled(n):
            geo.indicator(*(None if cols[k] is None else cols[k][:, nl.ds(s0 + c0 + w, 1)]
                            for k in ("thr", "hi", "lo")), out=ind[:, w * P:(w + 1) * P])
        if s_tile is sc:
            s_tile = nl.ndarray((P, n * P), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_copy(s_tile, sc, engine="vector")
        port.tensor_copy_predicated(s_tile, T.FWD_MASK_NEG, ind)
    if cols["pad"] is not None:
        # padding slots (the block of zeros: finite scores) become MASK_NEG, the others stay
        # as they are: copy(s keep + neg), one ScalarE instruction per block with per-partition
        # scale and bias columns (_padding_columns; fp32, exact as VectorE's s keep + neg).
        # ScalarE, not VectorE, whose max reductions lead each step: trn2 N = 4096, index
        # form band+strided, D = 128 81.2 -> 69.6 us (half on each: 73.2), D = 64 72.1 -> 58.3
        # (benchmarks/block_sparse.py)
        keep, neg = cols["pad"]
        out = nl.ndarray((P, n * P), dtype=nl.float32, buffer=nl.sbuf)
        for w in T.unrolled(n):
            sl = nl.ds(s0 + c0 + w, 1)
            port.activation(out[:, w * P:(w + 1) * P], nl.copy, s_tile[:, w * P:(w + 1) * P],
                            bias=neg[:, sl], scale=keep[:, sl])
        s_tile = out
    return s_tile


def _tile_rows(geo: Geometry, first, frame: RowFrame):
    """int32 ``[128, 1]``: the rows (of ``frame``) of the 128 positions from ``first`` (fp32
    column) of a slice whose rows are all in range (no lengths, whole query tiles): one
    instruction (:func:`own_rows` with nothing to push out of bounds)."""
    idx = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
    if frame.base is None:
        port.tensor_tensor(idx, geo.part, first, nl.add)
    else:
        port.scalar_tensor_tensor(idx, geo.part, nl.add, frame.base, nl.add, first)
    return idx


def _pads_only(f, geo: Geometry, res, exact: bool, zeros: bool = False) -> bool:
    """Whether a class's only masked keys are its padding slots' and resident K/V serve them
    (nki.*), or ``zeros``, their gathers leave them zero (``shared_runtime``: the skipped
    gathers of zeroed tiles, :func:`_gather_kv`): whole 128-key blocks, no lengths, so a
    padding slot reads a block of zeros (finite scores) and one operation per block masks it
    (_scores), no per-key indicator."""
    return ((res is not None or zeros) and geo.needs_key_mask(exact) and f.Nk % P == 0
            and not geo.has_lens)


def _pads_by_matmul(f, geo: Geometry, res, exact: bool) -> bool:
    """:func:`_pads_only` without a score modifier that transforms the scores (the masks
    select after it, a tanh would map MASK_NEG to -1): TensorE then masks the padding slots
    in PSUM (:func:`_padding_rows`, :meth:`KVSource.for_class`)."""
    return _pads_only(f, geo, res, exact) and not f.mods.transforms


def _padding_rows(f, meta, hb, hh, pos0, n: int, trip: int):
    """``[trip, n, 128]`` (:func:`_mask_mm`): row k of query tile t (order position ``pos0 + t``)
    is ``MASK_NEG`` if its slot k is a padding slot (first key past Nk) else 0, on every
    column: the stationary operand of :func:`_scores`' padding matmul. The slots' first keys
    come from the table transposed (one DMA of ``n trip`` elements), then two GpSimd
    instructions for the group. MASK_NEG = -2^100 is exact in bf16."""
    first = nl.ndarray((trip, n), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(first, port.transposed_rows(meta, (hb, hh), pos0, n, 2, trip))
    neg = nl.ndarray((trip, n), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(neg, first, nl.greater_equal, float(f.Nk), op1=nl.multiply,
                       operand1=T.FWD_MASK_NEG, engine="gpsimd")
    rows = nl.ndarray((trip, n, P), dtype=_mask_mm(f), buffer=nl.sbuf)
    port.tensor_copy(rows, port.repeat_last(neg, P), engine="gpsimd")
    return rows


def _padding_columns(block_first, Nk: int):
    """``(keep, neg)`` fp32, the shape of ``block_first`` (``[128, n]``: slots' first keys):
    1 and 0 for a slot with a key block, 0 and ``MASK_NEG`` for a padding slot (first key
    past Nk), so that ``s keep + neg`` is s or exactly ``MASK_NEG`` for finite s (the bits of
    the selection). Two VectorE instructions."""
    shape = tuple(block_first.shape)
    keep = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(keep, block_first, nl.less, float(Nk), engine="vector")
    neg = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(neg, keep, nl.multiply, -T.FWD_MASK_NEG, op1=nl.add,
                       operand1=T.FWD_MASK_NEG, engine="vector")
    return keep, neg


def store_tile(f, out_idx, head, o_tile, lse_tile):
    """Scatter a query tile's o ``[128, D]`` and lse ``[128, 1]`` of query head ``head`` to the
    rows ``out_idx`` (int32 ``[128, 1]``; rows past Nq out of bounds, skipped)."""
    scatter(f.o, (f.b, head), out_idx, o_tile)
    scatter(f.lse_col, (f.b, head), out_idx, lse_tile)


def _store_mask(f, geo: Geometry, rw: Row, head, q_frame: RowFrame, sl, keep):
    """Debug: the keep mask of slot sl (:func:`store_unit_mask`; padding slots are skipped)."""
    pos = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(pos, rw.first, nl.add, geo.part)
    store_unit_mask(f, head, q_frame, pos, rw.block_first[:, nl.ds(sl, 1)], keep)


def store_unit_mask(f, head, q_frame: RowFrame, pos, first, keep):
    """Debug: the keep mask ``keep`` ``[128, 128]`` of the unit of query rows ``pos`` and
    first key ``first`` (fp32 ``[128, 1]`` columns) into ``mask_out``'s ``(B, Hq, Nq nku,
    128)`` view at row ``i nku + first / 128`` (one 128-key unit per row; rows past Nq and
    units from Nk on are skipped). The row within the slice is exact in fp32 for debug
    shapes (``Nq nku < 2^24``); in an int32 frame (:class:`RowFrame`) the slice's first row
    of the flattened mask is added in int32."""
    nku = f.nku
    mask_rows = f.drop.mask_out.reshape((f.B, f.Hq, f.Nq * nku, P))
    unit = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(unit, first, nl.multiply, 1.0 / P)
    rel = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    # under 0.7 the rows of the flattened mask: the query row's flat row (q_frame) times nku
    port.scalar_tensor_tensor(rel, q_frame.shift(pos), nl.multiply, float(nku), nl.add, unit)
    # out of bounds of the mask rows the indices address: the slice's, or every slice's (0.7)
    flat = q_frame.base is not None or q_frame.ints is not None
    rows = math.prod(mask_rows.shape[:3]) if flat else mask_rows.shape[2]
    past = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(past, pos, nl.greater_equal, float(f.Nq))
    pad = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(pad, first, nl.greater_equal, float(f.Nk))
    bad = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(bad, past, pad, nl.maximum)
    idx = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(idx, bad, nl.multiply, float(M.oob_offset(rows)), nl.add, rel)
    if q_frame.ints is not None:
        # the slice's first row of the flattened mask, added in int32
        idx = RowFrame.of(mask_rows, (f.b, head), f.indices).rows(idx)
    port.dma_copy(port.lead_rows(mask_rows, (f.b, head), idx, 0), keep, oob_skip=True)


@port.jit
def block_sparse_attention_fwd(q, k, v, meta, kv_lens=None, q_lens=None, seed=None,
                               alibi_slopes=None, sinks=None, window_loads=None,
                               window_slots=None, sg_rows=None, sg_keys=None, sg_own=None, *,
                               classes,
                               shared=None,
                               natural=None, shared_runtime=False, window_blocks=0,
                               window_group=T.BSP_GROUP_TILES, window_shared=False, scale=1.0,
                               causal=None, window=None, mm_dtype="bfloat16", dropout_p=0.0,
                               dropout_mask=False, softcap=None):
    """Block-sparse flash attention forward: ``o, lse`` for q ``(B, Hq, Nq, D)``, k/v ``(B,
    Hkv, Nk, D)``, over the instances ``(B, Hkv)`` (:func:`port.for_programs`: the SPMD grid
    ``(B, Hkv)`` in legacy, ``kernel[1]`` looping over them in 0.7; :func:`port.launch_grid`;
    LNC=2: ``backward.backward_grid``'s grids).

    ``meta``: float32 ``(B or 1, Hq or 1, ceil(Nq/128), 2 + trip)`` HBM table of the pattern in
    processing order and ``classes`` its compile-time runs, ``shared`` and ``natural`` one
    entry per class (``host.block_sparse.kernel_tables``; None: 0 and False);
    ``shared_runtime``: ``shared`` is a bound and each group's common blocks are counted at
    run time (``host.block_sparse.shared_bound_tables``, :func:`_attend_tiles`).
    ``window_blocks`` > 0 (nki.*, K/V not resident): the groups read their blocks from a
    window of that many blocks in SBUF, which each group first fills from ``window_loads``
    (float32 ``(B or 1, Hq or 1, groups, 2 + 2 L)``) and whose positions ``window_slots``
    (float32 ``(B or 1, Hq or 1, ceil(Nq/128), trip)``) gives per slot
    (``host.block_sparse.window_tables``, :func:`_load_window`), in groups of ``window_group``
    query tiles (1 .. ``tiles.BSP_GROUP_TILES``, the host's choice: ``window_plan``);
    ``window_shared``: the tables are the same for the ``Hq / Hkv`` query heads of each kv
    head (the host's promise: a pattern broadcast over heads, or heads found alike), so each
    group gathers its new blocks once and runs its tiles for every member head before the
    next group (:func:`_head` with ``h`` None): K/V gathered once per kv head, not per query
    head. Other arguments as
    :func:`forward.flash_attention_fwd` (``mm_dtype``, ``scale``, ``causal``, ``window``,
    lengths, ``dropout_p`` with ``seed``, ``dropout_mask``: the mask is returned as ``(B, Hq,
    Nq, 128 ceil(Nk/128))`` float32, positions of blocks never drawn unspecified; the score
    modifiers ``softcap``, ``alibi_slopes``, ``sinks``, ``score_mods.py``). The same outputs
    as the dense kernel restricted to the active blocks; rows that see no key get o = 0 and
    lse = -inf (with sinks lse = sink, padding rows -inf).

    Where ``B Hq Nq``, ``B Hkv Nk`` (or with ``dropout_mask`` ``B Hq Nq ceil(Nk/128)``) rows
    or ``B Hq ceil(Nq/128) ceil(Nk/128)`` dropout units reach 2^24, 0.7 numbers them in int32
    (:func:`exact_indices`).
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    nqt = T.ceil_div(Nq, P)
    trip_max = meta.shape[3] - 2
    for name, given in (("sg_keys", sg_keys), ("sg_own", sg_own)):
        if sg_rows is None and given is not None:
            raise ValueError(f"{name}: given without sg_rows; allowed: None")
    rows = nqt if sg_rows is None else meta.shape[2]
    if sg_rows is None and tuple(meta.shape[2:3]) != (nqt,):
        raise ValueError(f"meta: expected {nqt} rows (one per query tile), got {meta.shape}")
    check_classes(classes, rows, trip_max)
    shared = check_shared(shared, classes)
    natural = check_natural(natural, classes)
    nku = T.ceil_div(Nk, P)
    mask_rows = B * Hq * Nq * nku if dropout_p and dropout_mask else 0
    int_rows = exact_indices(max(B * Hq * Nq, B * Hkv * Nk, mask_rows),
                             B * Hq * nqt * nku if dropout_p else 0)
    mods = SM.check_mods(softcap, alibi_slopes, sinks)
    spec = M.MaskSpec(Nq, Nk, causal, window, q_lens is not None, kv_lens is not None,
                      mods.alibi)
    # K/V resident where they fit (nki.*: runtime offsets into SBUF; legacy gathers), and then
    # longer own-slot steps in both namespaces (the same steps, the same outputs)
    fits = T.bsp_fwd_kv_resident(Nk, D, T.fwd_itemsize(mm_dtype), trip_max)
    resident = fits and port.api() == "nki"
    most = window_capacity(D, mm_dtype, trip_max, Nk, causal, window,
                           q_lens is not None or kv_lens is not None, mods != SM.Mods(),
                           bool(dropout_p))
    win = _check_window(window_loads, window_slots, window_blocks, window_group,
                        window_shared, meta, classes, shared, shared_runtime, fits, most,
                        trip_max)
    sg = _check_supergroups(meta, sg_rows, sg_keys, sg_own, classes, shared, shared_runtime,
                            window_blocks, fits, trip_max, Nk % P == 0, mods,
                            bool(dropout_p), bool(dropout_p and dropout_mask))
    step = T.BSP_RESIDENT_STEP_BLOCKS if fits or win else T.BSP_STEP_BLOCKS
    tiles = T.ForwardTiles(q_tile=P, kv_resident=False, kv_load_block=T.BSP_FWD_KV_LOAD_BLOCK)
    o = nl.ndarray((B, Hq, Nq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, Hq, Nq), dtype=nl.float32, buffer=nl.shared_hbm)
    mask_out = (nl.ndarray((B, Hq, Nq, nku * P), dtype=nl.float32, buffer=nl.shared_hbm)
                if dropout_p and dropout_mask else None)
    if dropout_p and seed is None:
        raise ValueError("dropout_p > 0 needs the seed tensor (HBM (1,) int32)")
    # loop indices (batch, heads) as data for 0.7: the first rows of the (b, head) slices the
    # indirect DMAs address, dropout's unit numbers
    indices = port.OffsetColumns(0, max(B, Hq), 1, exact=int_rows)

    def instance(b, g):
        # the P^T copies split evenly between ScalarE and VectorE; guard: non-finite values
        # reach only the rows that see them
        c = F.Config(q, k, v, o, lse, mm_dtype, scale, tiles, spec, b, g, None, indices,
                     guard=True, act_share=0.5)
        score = F.score_mods(c, mods, alibi_slopes, sinks, c.act_scale)
        drop = (F.load_dropout(dropout_p, seed, c.mm, mask_out=mask_out) if dropout_p
                else None)
        f = F.Instance.of(c, drop=drop, score=score)
        geo = Geometry(spec, kv_lens, q_lens, k, b, g, Nq, Nk, indices)
        # nki.*: K^T and [V | 1] of the instance loaded, guarded and transposed once, as the
        # dense kernel's resident staging; every query tile reads its blocks in place
        # (one more block of zeros: the padding slots' block, finite scores to mask). The V
        # guard's flags as ScalarE sums (forward.guard_values): every engine waits on the
        # guard here, and ScalarE is idle (trn2 N = 4096, D = 128, index form, s = 1/8 56.0
        # -> 55.4 us, s = 1/32 42.2 -> 40.3). V first, then K: the guard of the last V piece
        # then runs while K loads (s = 1/16 38.7 -> 37.9 us with the finalize's ScalarE share,
        # tiles.BSP_FINALIZE_ACT_SHARE)
        src = KVSource(F.load_kv(f, 0, Nk, zero_blocks=1, sum_on_scalar=True,
                                 values_first=True) if resident else None, step,
                       T.FWD_NKI_P_DMA_SHARE[port.target()] if resident or win else 0.0)
        if win is not None:
            # the window: its tiles and a block of zeros (the padding slots'), filled by the
            # groups (_load_window)
            src = src._replace(res=F.load_kv(f, 0, window_blocks * P, zero_blocks=1,
                                             load=False), win=win)
        if sg is not None:
            port.loop(f.G, lambda h: _supergroups(f, geo, sg, h))
            return
        if win is not None and win.shared:
            # one window for the member heads: the member-head loop inside its groups
            _head(f, geo, meta, classes, shared, natural, None, src, shared_runtime)
            return
        port.loop(f.G, lambda h: _head(f, geo, meta, classes, shared, natural, h, src,
                                       shared_runtime))

    port.for_programs((B, Hkv), instance)
    if mask_out is not None:
        return o, lse, mask_out
    return o, lse


def _head(f, geo: Geometry, meta, classes, shared, natural, h, src: KVSource,
          shared_runtime: bool):
    """Every class of query tiles of member head h (a loop body): each class a loop over its
    tiles in groups of ``tiles.BSP_GROUP_TILES`` (a window's: ``window_group``; and a static
    remainder group) whose first
    ``shared`` slots (one count per class) are the group's common key blocks (``src``: where
    their key blocks come from; ``natural``: one flag per class, its positions are its query
    tiles; :func:`_attend_tiles`). ``h`` None: a window the member heads share
    (``src.win.shared``, its one class): each group's tiles run for every member head
    (:func:`_member_heads`)."""
    q_frame = None if h is None else _q_frame(f, geo, h)
    for (first, count, trip, exact), sh, nat in zip(classes, shared, natural):
        f = src.instance(f, trip)
        csrc = src.for_class(f, geo, trip, exact)
        if trip == 0:
            # rows without any active block: o = 0, lse = -inf (still one loop body)
            port.loop(count, lambda c, first=first: _empty_tile(f, geo, meta, h, q_frame,
                                                                 first + c))
            continue
        g = min(T.BSP_GROUP_TILES if csrc.win is None else csrc.win.group, count)
        if csrc.win is not None and not _direct_rows(f, geo, nat):
            _window_groups(f, geo, meta, h, q_frame, count, g, trip, exact, csrc)
            continue
        if _direct_rows(f, geo, nat):
            _deferred_groups(f, geo, meta, h, q_frame, first, count, g, trip, exact, sh, csrc,
                             shared_runtime)
            continue
        port.loop(count // g, lambda c, first=first, g=g, trip=trip, exact=exact, sh=sh,
                  csrc=csrc: _attend_tiles(f, geo, meta, h, q_frame, first + c * g, g, trip,
                                           exact, sh, csrc, shared_runtime=shared_runtime))
        if count % g:
            _attend_tiles(f, geo, meta, h, q_frame, first + (count // g) * g, count % g, trip,
                          exact, sh, csrc, shared_runtime=shared_runtime)


class _Held(NamedTuple):
    """SBUF copies of a group's finished outputs (``o`` in o's dtype, ``lse`` fp32, one slot
    per query tile), stored by the *next* group right after it has issued its loads
    (:func:`_attend_tiles`): ``prev`` that group's first position (an index expression; None:
    nothing held yet), ``head`` its query head (None: the storing group's) and ``n`` its
    tiles (None: every slot). A store waits for its group's last softmax step, and the DMA
    queues would otherwise hold the next group's loads behind it (the dense forward's
    ``forward._Outputs``)."""

    o: object
    lse: object
    prev: object = None
    head: object = None
    n: Optional[int] = None


def _deferred_groups(f, geo: Geometry, meta, h, q_frame: RowFrame, first: int, count: int,
                     g: int, trip: int, exact: bool, sh: int, src: KVSource,
                     shared_runtime: bool):
    """The groups of a class in natural order (:func:`_direct_rows`), each storing the
    previous one's outputs (:class:`_Held`): the first group is peeled (nothing to store
    before it), the other full groups are a sequential loop (they carry the held outputs),
    then the remainder group and the last stores. With a window (``src.win``, its one
    class) each group first gathers its new blocks (:func:`_load_window`). ``h`` None (a
    window the member heads share): each group runs its tiles for every member head in
    turn, each storing the outputs held before it -- member head 0 the previous group's
    last head's, member head m > 0 the same group's head m - 1's (one buffer: a group's
    outputs are stored before the next head's finalize overwrites them)."""
    held = _Held(nl.ndarray((P, g, f.D), dtype=f.o.dtype, buffer=nl.sbuf),
                 nl.ndarray((P, g, 1), dtype=nl.float32, buffer=nl.sbuf))
    full = count // g

    def group(c, n: int, prev):
        if src.win is not None:
            _load_window(f, geo, src, 0 if h is None else h, c)
        pos0 = first + c * g

        def attend(m, frame, before):
            _attend_tiles(f, geo, meta, m, frame, pos0, n, trip, exact, sh, src, before,
                          shared_runtime)

        if h is not None:
            attend(h, q_frame, held._replace(prev=prev))
            return
        # (a group before this one is whole: g tiles held)
        attend(0, _q_frame(f, geo, 0), held._replace(prev=prev, head=f.head(f.G - 1)))
        _member_heads(f, geo, None, None, lambda m, frame: attend(
            m, frame, held._replace(prev=pos0, head=f.head(m - 1), n=n)), start=1)

    group(0, g, None)
    port.loop(full, lambda c: group(c, g, first + (c - 1) * g), carried=True, start=1)
    last, n = first + (full - 1) * g, g
    if count % g:
        group(full, count % g, last)
        last, n = first + full * g, count % g
    _store_held(f, f.head(f.G - 1 if h is None else h), held, last, n, trip)


def _q_frame(f, geo: Geometry, h) -> RowFrame:
    """The :class:`RowFrame` of member head h's query rows ``q[b, head(h)]``."""
    return RowFrame.of(f.q, (f.b, f.head(h)), geo.indices)


def _member_heads(f, geo: Geometry, h, q_frame: Optional[RowFrame], body, start: int = 0):
    """``body(h, q_frame)`` for member head h (``q_frame``: its query rows), or with ``h``
    None (a window the member heads share) for each member head from ``start`` in a
    sequential compiled loop (it may carry held outputs, :func:`_deferred_groups`): the
    window's blocks read in place by every member head's tiles, each with its own rows,
    masks, score modifiers (ALiBi slopes, sinks) and dropout units (:func:`_attend_tiles`
    takes the head)."""
    if h is not None:
        body(h, q_frame)
        return
    port.loop(f.G, lambda m: body(m, _q_frame(f, geo, m)), carried=True, start=start)


class _Window(NamedTuple):
    """nki.*, K/V not resident: the key-block window's tables (``host.block_sparse.
    window_tables``, HBM float32): ``loads`` ``(b, h, groups, 2 + 2 L)``, per group the count
    of steps of ``tiles.BSP_WINDOW_LOAD_BLOCKS`` blocks it gathers into the window, 0, their
    first keys and their positions (padding entries: past every key, to the block of zeros);
    ``slots`` ``(b, h, rows, trip)``, each slot's window position (the block of zeros for a
    padding slot); ``group``: query tiles per kernel group (``window_group``); ``shared``:
    the tables are the same for the member heads of a kv head (``window_shared``), so each
    group gathers once for all of them."""

    loads: object
    slots: object
    group: int
    shared: bool = False

    def positions(self, hb, hh, pos0, n: int, trip: int):
        """int32 ``[1, n, trip]``: the window positions of the slots of a group's ``n`` tiles
        (order positions ``pos0 ..``): one DMA and one VectorE conversion (exact: small
        integers in fp32), as :func:`_block_numbers` for resident K/V."""
        s = self.slots
        x = nl.ndarray((1, n, trip), dtype=nl.float32, buffer=nl.sbuf)
        port.dma_copy(x, s.reshape((s.shape[0], s.shape[1], 1, s.shape[2], s.shape[3]))[
            hb, hh, 0:1, nl.ds(pos0, n), 0:trip], legacy_isa=True)
        out = nl.ndarray((1, n, trip), dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_copy(out, x, engine="vector")
        return out


def _check_window(loads, slots, blocks, group, heads_share, meta, classes, shared,
                  shared_runtime: bool, fits: bool, most: int, trip: int) -> Optional[_Window]:
    """The window of a launch (``window_blocks`` > 0; None: none), checked: nki.* only (a
    runtime trip count fills it), K/V not resident, at most ``most`` blocks (what fits in
    SBUF, :func:`window_capacity`), both tables given, one class of the tables' ``trip``
    slots, not shared (``host.block_sparse.window_tables``), and the tables' shapes
    (the kernel's DMAs read them at positions its loops compute: a short table would be read
    out of bounds): ``window_slots`` ``meta``'s leading dims, one row of ``trip`` slots per
    position; ``window_group`` an int from 1 to ``tiles.BSP_GROUP_TILES`` (the SBUF of
    :func:`window_capacity` holds that many tiles' tables; the default where there is no
    window); ``window_loads`` ``meta``'s leading dims, one row per kernel group (the class's
    rows in groups of ``window_group``, then a remainder), ``2 + 2 L`` columns with ``L`` a
    positive multiple of ``tiles.BSP_WINDOW_LOAD_BLOCKS`` (the steps' blocks);
    ``window_shared`` (``heads_share``) a bool, True only with a window."""
    if not isinstance(blocks, int) or blocks < 0:
        raise ValueError(f"window_blocks: expected an int >= 0, got {blocks!r}")
    if isinstance(group, bool) or not isinstance(group, int) \
            or not 1 <= group <= T.BSP_GROUP_TILES:
        raise ValueError(f"window_group: expected an int from 1 to {T.BSP_GROUP_TILES}, got "
                         f"{group!r}")
    if not isinstance(heads_share, bool):
        raise ValueError(f"window_shared: expected a bool, got {heads_share!r}")
    if not blocks:
        if heads_share:
            raise ValueError("window_shared: given (True) with window_blocks=0; allowed: "
                             "False (no window)")
        if loads is not None or slots is not None:
            raise ValueError("window_loads, window_slots: given with window_blocks=0; allowed: "
                             "None (no window)")
        if group != T.BSP_GROUP_TILES:
            raise ValueError(f"window_group: given ({group}) with window_blocks=0; allowed: "
                             f"{T.BSP_GROUP_TILES} (the default: no window)")
        return None
    if port.api() != "nki" or fits or blocks > most:
        raise ValueError(f"window_blocks: a window of {blocks} blocks needs nki.*, K/V not "
                         f"resident and at most {most} blocks; got api={port.api()!r}, "
                         f"resident={fits}")
    if loads is None or slots is None:
        raise ValueError("window_loads, window_slots: both needed with window_blocks > 0, got "
                         f"{type(loads).__name__}, {type(slots).__name__}")
    if len(classes) != 1 or classes[0][2] != trip:
        raise ValueError(f"classes: a window needs one class of the table's {trip} slots, got "
                         f"{classes!r}")
    if any(shared):
        raise ValueError(f"shared: a window's class shares no slots (allowed: None or (0,)), "
                         f"got {shared!r}")
    if shared_runtime:
        raise ValueError("shared_runtime: a window's class shares no slots (allowed: False), "
                         "got True")
    lead, count = tuple(meta.shape[:2]), classes[0][1]
    want = lead + (count, trip)
    if tuple(slots.shape) != want:
        raise ValueError(f"window_slots: expected shape {want} (meta's leading dims, one row "
                         f"of {trip} slots per position), got {tuple(slots.shape)}")
    g = min(group, count)
    groups = T.ceil_div(count, g)
    Wl = T.BSP_WINDOW_LOAD_BLOCKS
    shape = tuple(loads.shape)
    L = (shape[3] - 2) // 2 if len(shape) == 4 else 0
    if len(shape) != 4 or shape[:3] != lead + (groups,) or L < 1 or shape[3] != 2 + 2 * L \
            or L % Wl:
        raise ValueError(f"window_loads: expected shape {lead + (groups,)} + (2 + 2 L,) "
                         f"(meta's leading dims, one row per group of {g} of the {count} rows, "
                         f"L a positive multiple of {Wl}), got {shape}")
    return _Window(loads, slots, group, heads_share)


def _window_groups(f, geo: Geometry, meta, h, q_frame: RowFrame, count: int, g: int,
                   trip: int, exact: bool, src: KVSource):
    """The groups of the one class of a window's tables (``src.win``): each gathers its new
    blocks into the window (:func:`_load_window`), then its tiles read every block in place
    (:func:`_attend_tiles` with the window as resident K/V). A sequential loop: a group
    reads blocks earlier groups gathered. ``h`` None (``src.win.shared``): each group
    gathers once, from the first member head's tables (the same as the others'), and its
    tiles run for every member head (:func:`_member_heads`)."""
    def group(c, n: int):
        _load_window(f, geo, src, 0 if h is None else h, c)
        _member_heads(f, geo, h, q_frame, lambda m, frame: _attend_tiles(
            f, geo, meta, m, frame, c * g, n, trip, exact, 0, src))

    port.loop(count // g, lambda c: group(c, g), carried=True)
    if count % g:
        group(count // g, count % g)


class _SuperGroups(NamedTuple):
    """nki.*, K/V not resident: the super-group tables (``host.block_sparse.
    supergroup_tables``, HBM float32): ``meta`` ``(b, h, groups, 2 + U)`` per super-group
    ``[0, count, first key of union block 0, ...]`` (padding past ``count``), ``rows`` ``(b,
    h, groups, tiles)`` the first query row of each of its tiles (``tiles.BSP_PAD_FIRST`` for
    an idle slot: its Q gather and output scatter are skipped). ``keys`` (masked super-groups,
    whose tiles use different blocks of the union; None: every tile uses every block) ``(b,
    h, groups U, tiles)``: at row ``c U + k``, column t, 1.0 where slot k of super-group c's
    union is one of tile t's blocks, else 0 (also for a padding slot)."""

    meta: object
    rows: object
    keys: Optional[object] = None
    own: Optional[object] = None

    @property
    def tiles(self) -> int:
        return self.rows.shape[3]

    @property
    def steps(self) -> int:
        """Steps of a union's table row (``U // step``)."""
        return self.width // self.step

    @property
    def width(self) -> int:
        return self.meta.shape[3] - 2

    @property
    def step(self) -> int:
        """Key blocks per step (:func:`tiles.bsp_sg_step`)."""
        return T.bsp_sg_step(self.width, self.own is not None)


def _check_supergroups(meta, rows, keys, own, classes, shared, shared_runtime: bool,
                       window_blocks: int, fits: bool, trip: int, whole: bool,
                       mods: SM.Mods, dropout: bool,
                       dropout_mask: bool) -> Optional[_SuperGroups]:
    """The super-group tables of a launch (``sg_rows`` given; None: none), checked: nki.*
    (runtime trip counts), K/V not resident, no dropout mask returned (its store reads a
    table row per tile), masked ones with no score transform and no dropout (``softcap``:
    the mask adds MASK_NEG before the tanh, which would map it to -cap; ``alibi`` and
    ``dropout``: its bias, or a dropped unit, can make a row's P 0 at a key whose non-finite
    K the mask's guard turned into a flag, and the row would lose the NaN the reference gives
    it), one class of the union table's rows and ``trip`` slots, nothing shared, no window,
    ``U`` a multiple of the step and ``sg_rows`` ``meta``'s leading dims and one row per
    super-group; ``sg_keys`` (masked super-groups; None: none) their leading dims, ``U`` rows
    per super-group and a column per tile (given without ``sg_rows``: refused by the
    caller), with whole key blocks; ``sg_own`` (sparse super-groups; None: none) not with
    ``sg_keys``, its leading dims, one row per step and tile of each super-group
    (``U / step`` steps) and the columns of :func:`tiles.bsp_sg_own_layout`."""
    if rows is None:
        return None
    if port.api() != "nki" or fits or dropout_mask:
        raise ValueError(f"sg_rows: super-groups need nki.*, K/V not resident and no "
                         f"returned dropout mask; got api={port.api()!r}, resident={fits}, "
                         f"dropout_mask={dropout_mask}")
    if keys is not None and (mods.transforms or dropout):
        raise ValueError(f"sg_keys: masked super-groups take no soft-cap, ALiBi or dropout "
                         f"(the mask adds before the tanh; ALiBi's bias or a dropped unit can "
                         f"hide a guarded key's NaN); got softcap={mods.softcap!r}, "
                         f"alibi={mods.alibi}, dropout={dropout}, allowed: none of them (or "
                         f"sparse super-groups, sg_own)")
    if window_blocks or any(shared) or shared_runtime:
        raise ValueError("sg_rows: super-groups take no window and share no slots (allowed: "
                         "window_blocks=0, shared=None, shared_runtime=False)")
    if keys is not None and own is not None:
        raise ValueError("sg_own: given with sg_keys (a super-group is masked or sparse, not "
                         "both); allowed: None")
    sg = _SuperGroups(meta, rows, keys, own)
    n = meta.shape[2]
    if classes != ((0, n, trip, False),) or trip % sg.step:
        raise ValueError(f"classes: super-groups need ((0, {n}, U, False),) with U a "
                         f"multiple of {sg.step}, got {classes!r}")
    want = tuple(meta.shape[:3])
    if len(rows.shape) != 4 or tuple(rows.shape[:3]) != want or rows.shape[3] < 1:
        raise ValueError(f"sg_rows: expected shape {want} + (tiles,) (meta's leading dims, one "
                         f"row per super-group), got {tuple(rows.shape)}")
    keyed = want[:2] + (n * trip, rows.shape[3])
    if keys is not None and not whole:
        raise ValueError("sg_keys: masked super-groups need whole key blocks (Nk a multiple of "
                         f"{P}); allowed: None")
    if own is not None and not whole:
        raise ValueError("sg_own: sparse super-groups need whole key blocks (Nk a multiple of "
                         f"{P}); allowed: None")
    if keys is not None and tuple(keys.shape) != keyed:
        raise ValueError(f"sg_keys: expected shape {keyed} (sg_rows' leading dims, U rows per "
                         f"super-group, one column per tile), got {tuple(keys.shape)}")
    if own is not None:
        mine = want[:2] + (n * sg.steps * sg.tiles, T.bsp_sg_own_layout(sg.step)[1])
        if tuple(own.shape) != mine:
            raise ValueError(f"sg_own: expected shape {mine} (sg_rows' leading dims, one row "
                             f"per step of {sg.step} blocks and tile of each super-group, the "
                             f"columns of tiles.bsp_sg_own_layout), got {tuple(own.shape)}")
    return sg


def _supergroups(f, geo: Geometry, sg: _SuperGroups, h):
    """Every super-group of member head h: a compiled loop over the table's rows. The P^T
    transposes take the device's DMA share (``tiles.FWD_NKI_P_DMA_SHARE``, as the dense
    forward's): the DMA queues gather one step for the whole super-group (trn2, N = 16K,
    D = 128, index form s = 1, K/V forced past SBUF, one super-group of 128 tiles: 3963.9 ->
    2865.9 us; one matmul per 512 keys instead of per block then: 3123.8, not taken).
    Sparse super-groups too (``tiles.BSP_SG_OWN_WIDTHS`` gives the measurements)."""
    # (a class of BSP_P_DMA_FULL_SLOTS slots takes the full share)
    f = KVSource(None, 0, T.FWD_NKI_P_DMA_SHARE[port.target()]).instance(
        f, T.BSP_P_DMA_FULL_SLOTS)
    q_frame = RowFrame.of(f.q, (f.b, f.head(h)), geo.indices)
    port.loop(sg.meta.shape[2], lambda c: _supergroup(f, geo, sg, h, q_frame, c))


def _supergroup(f, geo: Geometry, sg: _SuperGroups, h, q_frame: RowFrame, c):
    """Super-group ``c`` of member head h (a loop body): its ``sg.tiles`` query tiles keep
    Q^T and the online-softmax state in SBUF while the union of their key blocks streams
    past once, in steps of ``sg.step`` blocks, each step's K/V gathered, guarded and
    transposed once for all of them (:func:`_gather_kv`); every tile does one online-softmax
    update per step; one finalize for all. The host cut the super-groups so that every tile
    uses every block of the union (``host.block_sparse.supergroup_tables``): no per-tile
    mask. Steps whose blocks are all real (``count // step``, a register) run unmasked; the
    one step holding the padding slots after them (if any) skips their gathers into zeroed
    tiles and masks their scores (:func:`_padding_columns`: one ScalarE instruction per
    block and tile). Keys past a partial last key block are masked in every step (the
    key-side indicator, :func:`_scores`). Masked super-groups (``sg.keys``: tiles that use
    different blocks of the union; whole key blocks) mask every step per tile from the
    step's keep flags instead: TensorE adds MASK_NEG to the scores of a tile's blocks not
    its own (one matmul per score tile), K's non-finite values guarded as V's (trn2, N =
    16K, D = 128, random s = 1/2, K/V forced past SBUF, one super-group of 128 tiles: 9256.9
    us with the key-side indicator per block and tile instead). Sparse super-groups
    (``sg.own``) stream the union as the masked ones do, in wider steps, and each tile
    computes only its own blocks of a step (:func:`_own_blocks`): no mask, no K guard.

    A launch with a band, lengths, ALiBi or dropout (*stepwise*) makes its slot columns per
    step from the step's first keys: the key thresholds (lengths, a partial last block) and
    padding columns once per step, each tile's band, distance and seed columns
    (:func:`_slot_columns`) per tile and step, as the grouping makes them per tile for its
    table row. Q rows past q_len are skipped (zeros in) and finalized to o = 0, lse = -inf,
    tile by tile; sinks start every tile's softmax (:func:`forward.start_at_sink`). The
    soft-cap needs no column (a transform of the scores before the masks select)."""
    head = f.head(h)
    meta, n, U, Ws = sg.meta, sg.tiles, sg.width, sg.step
    hb = f.b if meta.shape[0] > 1 else 0
    hh = head if meta.shape[1] > 1 else 0
    st = F.GroupState(f, n, P)
    if f.mods.sinks:
        F.start_at_sink(f, st, h, n, slot0=0)
    union = nl.ndarray((1, 2 + U), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(union, meta[hb, hh, nl.ds(c, 1), :], legacy_isa=True)
    rw = Row(union, U, geo.k_part, geo.k_len, geo.kv)
    firsts = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(firsts, sg.rows[hb, hh, nl.ds(c, 1), :], legacy_isa=True)
    firsts = M.broadcast_row(firsts, n)
    q_len = geo.q_len if geo.has_lens else f.Nq
    q_idx, q_pos = [], []
    for t in T.unrolled(n):
        # rows past Nq or q_len (the partial last tile, an idle slot) are skipped: zeros in,
        # nothing out past Nq
        idx, pos = own_rows(geo, firsts[:, t:t + 1], q_len, q_frame)
        x = nl.ndarray((P, f.D), dtype=f.q.dtype, buffer=nl.sbuf)
        gather(x, f.q, (f.b, head), idx, 0, True)
        _transpose_q(f, st, t, x)
        q_idx.append(idx if not geo.has_lens
                     else own_rows(geo, firsts[:, t:t + 1], f.Nq, q_frame)[0])
        if f.spec.q_lens:
            q_pos.append(pos)
    whole = f.Nk % P == 0
    stepwise = f.spec.has_diag or f.mods.alibi or bool(f.dropout_p) or geo.has_lens
    sel = None
    if sg.keys is not None or sg.own is not None:
        cols_full = cols_pad = None
        sel = _slot_selector(f, Ws) if sg.own is None else None
    elif stepwise:
        cols_full = cols_pad = None
    elif whole:
        cols_full = _NO_MASKS
        cols_pad = dict(_NO_MASKS, pad=_padding_columns(rw.block_first, f.Nk))
    else:
        cols_full = cols_pad = dict(_NO_MASKS, thr=_key_thresholds(geo, rw.block_first))
    depth = T.bsp_pipeline_depth(Ws)

    def step(s, padded: bool):
        v = nl.ndarray((P, Ws, f.vcols), dtype=f.mm, buffer=nl.sbuf)
        F.ones_column(f, v[:, :, f.D:f.D + 1])
        kv = _gather_kv(f, rw, v, s * Ws, Ws, padded or not whole or geo.has_lens,
                        guard_keys=sg.keys is not None)
        bf = thr = pad = None
        if stepwise:
            # the step's first keys (a copy: sparse super-groups select from it at runtime
            # offsets), the key thresholds and the padding columns, for every tile
            bf = nl.ndarray((P, Ws), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_copy(bf, rw.bc[:, nl.ds(2 + s * Ws, Ws)], engine="gpsimd")
            if geo.has_lens or not whole:
                thr = _key_thresholds(geo, bf)
            elif padded and sg.keys is None and sg.own is None:
                pad = _padding_columns(bf, f.Nk)
        if sg.own is not None:
            _own_blocks(f, geo, st, sg, kv, hb, hh, c, s, h, q_frame,
                        None if bf is None else (bf, firsts))
            return
        cols = cols_pad if padded else cols_full
        neg = None
        if sg.keys is not None:
            # the step's keep flags, slot-major [Ws, tiles] (one DMA), as 0 or MASK_NEG
            keep = nl.ndarray((Ws, n), dtype=nl.float32, buffer=nl.sbuf)
            port.dma_copy(keep, sg.keys[hb, hh, nl.ds(c * U + s * Ws, Ws), :])
            neg = nl.ndarray((Ws, n), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(neg, keep, nl.multiply, -T.FWD_MASK_NEG, op1=nl.add,
                               operand1=T.FWD_MASK_NEG, engine="gpsimd")
        backs = []
        for t in T.unrolled(n):
            seeds = dist = None
            tile_cols, s0 = cols, 0
            if stepwise:
                hi, lo, dist, seeds = _slot_columns(f, geo, head, bf, firsts[:, t:t + 1])
                tile_cols = dict(_NO_MASKS, thr=thr, hi=hi, lo=lo, pad=pad)
            elif neg is None:
                s0 = s * Ws
            if neg is not None:
                # tile t's blocks not its own: TensorE adds MASK_NEG to their scores in PSUM
                # (its [Ws, 128] rows of 0 or MASK_NEG times the slots' selector, one matmul
                # per score tile, as _padding_rows; exact: K's non-finite values are guarded,
                # so the scores are finite). One GpSimd copy per tile and step makes its rows
                rows_t = nl.ndarray((Ws, P), dtype=_mask_mm(f), buffer=nl.sbuf)
                port.tensor_copy(rows_t.reshape_dim(1, (1, P)),
                                 port.repeat_last(neg[:, t:t + 1], P), engine="gpsimd")
                tile_cols = dict(_NO_MASKS if tile_cols is None else tile_cols,
                                 pad_mm=(rows_t, sel))
            backs.append(_step(f, geo, st, t, rw, kv, tile_cols, seeds, h, q_frame, s0, Ws,
                               dist))
            if len(backs) > depth:
                backs.pop(0)()
        for back in backs:
            back()

    # count // Ws steps of real blocks, then ceil(count / Ws) - count // Ws (0 or 1) padded;
    # floor(count / Ws) = RNE((count + 0.5 - Ws / 2) / Ws) by the int32 conversion's round
    # to nearest even (as _trip_counts); ceil(count / Ws) = floor((count + Ws - 1) / Ws)
    count = union[0:1, 1:2]
    hi = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_scalar(hi, count, nl.add, Ws / 2.0 - 0.5, op1=nl.multiply, operand1=1.0 / Ws)
    if sg.keys is not None or sg.own is not None:
        # masked: every step's blocks are masked per tile, the padding slots with them;
        # sparse: no tile reads a padding slot (its gathers skipped into zeroed tiles)
        port.loop_between(0, port.register(hi), lambda s: step(s, True))
    else:
        lo = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_scalar(lo, count, nl.add, 0.5 - Ws / 2.0, op1=nl.multiply,
                           operand1=1.0 / Ws)
        port.loop_between(0, port.register(lo), lambda s: step(s, False))
        port.loop_between(port.register(lo), port.register(hi), lambda s: step(s, True))
    for t, (o_out, lse_out) in enumerate(_finalize_tiles(f, geo, st, n, q_pos)):
        store_tile(f, q_idx[t], head, o_out, lse_out)


def _own_blocks(f, geo: Geometry, st, sg: _SuperGroups, kv, hb, hh, c, s, h,
                q_frame: RowFrame, stepwise):
    """Sparse super-groups (``sg.own``): step ``s`` of super-group ``c`` (``kv``: its
    ``sg.step`` gathered blocks) for each of its tiles, only the tile's own blocks of the
    step. The step's rows of ``sg_own`` (one per tile, tiles on partitions: one DMA per
    128 tiles and one int32 conversion) give per tile the trip count of each sub-step width
    of ``tiles.BSP_SG_OWN_WIDTHS`` and the blocks' positions in the step; each width is a
    compiled loop of that runtime trip count (:func:`port.loop_between`) whose body reads
    its blocks in place at those positions (:class:`_OwnKV`) and makes one online-softmax
    update (:func:`_step`). Every slot a tile reads is one of its blocks: no padding mask,
    and the values of a block it does not use never reach it. ``stepwise`` (a launch with a
    band, lengths, ALiBi or dropout; else None): ``(bf, firsts)``, the step's first keys
    ``[128, step]`` and the tiles' first rows ``[128, tiles]``; a sub-step then copies its
    blocks' first keys out of ``bf`` at their positions (one GpSimd copy per block) and makes
    its slot columns from them (:func:`_key_thresholds`, :func:`_slot_columns`)."""
    n = sg.tiles
    head = f.head(h)
    sections, cols = T.bsp_sg_own_layout(sg.step)
    row0 = (c * sg.steps + s) * n

    def substep(t, own_kv: "_OwnKV", w: int):
        seeds = dist = None
        slot_cols = _NO_MASKS
        if stepwise is not None:
            bf, firsts = stepwise
            sub = nl.ndarray((P, w), dtype=nl.float32, buffer=nl.sbuf)
            for i in T.unrolled(w):
                port.tensor_copy(sub[:, i:i + 1], port.select_block(bf, own_kv._index(i), 1),
                                 engine="gpsimd")
            hi, lo, dist, seeds = _slot_columns(f, geo, head, sub, firsts[:, t:t + 1])
            thr = _key_thresholds(geo, sub) if geo.has_lens else None
            slot_cols = dict(_NO_MASKS, thr=thr, hi=hi, lo=lo)
        _step(f, geo, st, t, None, own_kv, slot_cols, seeds, h, q_frame, 0, w, dist)()

    for p0 in T.unrolled(0, n, P):
        m = min(P, n - p0)
        raw = nl.ndarray((m, cols), dtype=nl.float32, buffer=nl.sbuf)
        port.dma_copy(raw, sg.own[hb, hh, nl.ds(row0 + p0, m), :])
        own = nl.ndarray((m, cols), dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_copy(own, raw, engine="vector")
        for t in T.unrolled(p0, p0 + m):
            for i, (w, col0) in enumerate(sections):
                port.loop_between(
                    0, port.register(own[t - p0:t - p0 + 1, i:i + 1]),
                    lambda j, t=t, w=w, col0=col0, own=own, p0=p0: substep(
                        t, _OwnKV(kv, (own, t - p0), col0 + j * w), w))


def _load_window(f, geo: Geometry, src: KVSource, h, c):
    """Gather group ``c``'s new key blocks into the window (``src.res``): its row of
    ``window_loads`` in one DMA, made a :class:`Row` of the blocks' first keys (their gather
    indices for every block at once), then a loop of the group's steps (a register bound) of
    ``tiles.BSP_WINDOW_LOAD_BLOCKS`` blocks, each gathered as a step of :func:`_gather_kv`
    (K, V rows by indirect DMA, padding entries skipped into zeros, V guarded, K^T by
    TensorE) and copied block by block into the window at its position (a runtime SBUF
    offset, :func:`port.select_block`; VectorE and GpSimd)."""
    loads = src.win.loads
    head = f.head(h)
    hb = f.b if loads.shape[0] > 1 else 0
    hh = head if loads.shape[1] > 1 else 0
    width = loads.shape[3]
    L = (width - 2) // 2
    Wl = T.BSP_WINDOW_LOAD_BLOCKS
    row = nl.ndarray((1, width), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(row, loads[hb, hh, nl.ds(c, 1), :], legacy_isa=True)
    n = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_copy(n, row[0:1, 0:1], engine="gpsimd")
    pos = nl.ndarray((1, L), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_copy(pos, row[0:1, 2 + L:width], engine="gpsimd")
    rw = Row(row[0:1, 0:2 + L], L, geo.k_part, geo.k_len, geo.kv)

    def step(j):
        v = nl.ndarray((P, Wl, f.vcols), dtype=f.mm, buffer=nl.sbuf)
        F.ones_column(f, v[:, :, f.D:f.D + 1])
        kv = _gather_kv(f, rw, v, j * Wl, Wl, True)
        for w in T.unrolled(Wl):
            at = pos[0:1, nl.ds(j * Wl + w, 1)]
            for pi in T.unrolled(len(kv.kT)):
                port.tensor_copy(port.select_block(src.res.kT[pi], at, P),
                                 kv.kT[pi][:, w * P:(w + 1) * P], engine="vector")
            port.tensor_copy(port.select_block(src.res.v, at), v[:, w, :], engine="gpsimd")

    port.loop_between(0, port.register(n), step)


def _store_held(f, head, held: _Held, pos0, n: int, trip: int):
    """Store the ``n`` query tiles held in ``held`` (positions ``pos0 ..``, natural order: rows
    ``128 pos``) to o and lse by plain DMAs, one for each ``[128, n, cols]`` (their rows are
    consecutive): two DMAs per group instead of two per tile, each waiting on one DMA queue
    for the group's finalize (:func:`forward.finalize` of the group's tiles at once; trn2
    N = 4096, D = 128, index form, s = 1/8: 58.7 us with two stores per tile, 56.0 with
    two per group). LSE: with at most ``tiles.BSP_LSE_ROWS_MAX_SLOTS`` slots (``trip``) on
    NeuronCore-v3+, transposed to ``[n, 128]`` first (below)."""
    port.dma_copy(port.row_blocks(f.o, (f.b, head), pos0 * P, P, n, f.D), held.o[:, 0:n, :])
    if not port.gen3() or trip > T.BSP_LSE_ROWS_MAX_SLOTS:
        port.dma_copy(port.row_blocks(f.lse_col, (f.b, head), pos0 * P, P, n, 1),
                      held.lse[:, 0:n, :])
        return
    # LSE rows of the group's tiles: a [128, n] column store is one 4-byte descriptor per row
    # (simulate._hw DMA_CHUNK_OVERHEAD_BYTES each), so transpose it to [n, 128] on TensorE
    # (idle at low density; a move, exact for fp32 and -inf on gen3+) and store n rows of 512
    # contiguous bytes: at low density the DMA queues are the busiest (the resident K/V load,
    # Q^T, O), at high density TensorE and ScalarE
    tp = nl.ndarray((n, P), dtype=port.transpose_dtype(nl.float32), buffer=nl.psum)
    port.nc_transpose(tp, held.lse[:, 0:n, 0])
    rows = nl.ndarray((n, P), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(rows, tp, engine="scalar")
    lse_rows = f.lse.reshape((f.B, f.Hq, f.Nq // P, P))
    port.dma_copy(lse_rows[f.b, head, nl.ds(pos0, n), :], rows)


def _empty_tile(f, geo: Geometry, meta, h, q_frame: RowFrame, pos):
    """A query tile without active blocks: o = 0 and lse = -inf at its rows (with sinks lse =
    the head's sink at rows below q_len)."""
    head = f.head(h)
    hb = f.b if meta.shape[0] > 1 else 0
    hh = head if meta.shape[1] > 1 else 0
    row = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(row, meta[hb, hh, nl.ds(pos, 1), 0:1], legacy_isa=True)
    out_idx, pos = own_rows(geo, M.broadcast_row(row, 1), f.Nq, q_frame)
    zeros = nl.ndarray((P, f.D), dtype=f.o.dtype, buffer=nl.sbuf)
    port.memset(zeros, 0.0, engine="gpsimd")
    ninf = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(ninf, -math.inf, engine="gpsimd")
    if f.mods.sinks:
        # the sink is the only logit of these rows: lse = sink (padding rows keep -inf)
        sink = SM.HeadColumns.col(f.score.cols.sink, h, P)
        if f.spec.q_lens:
            keep = nl.ndarray((P, 1), dtype=nl.uint8, buffer=nl.sbuf)
            port.tensor_scalar(keep, pos, nl.less, geo.q_len, engine="gpsimd")
            port.tensor_copy_predicated(ninf, sink, keep)
        else:
            port.tensor_copy(ninf, sink, engine="gpsimd")
    store_tile(f, out_idx, head, zeros, ninf)


__all__ = ["block_sparse_attention_fwd", "Geometry", "Row", "RowFrame", "own_rows", "rows_at", "gather",
           "scatter", "unit_seeds", "store_unit_mask", "store_tile", "check_classes", "exact_indices",
           "check_natural", "keeps_order", "shares_at_runtime", "window_capacity"]
