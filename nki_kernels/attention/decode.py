"""Split-KV flash decoding over a KV cache (FlashDecoding), GQA-packed, with tree masks.

Two kernels, launched in order by ``host.flash_decode`` (the merge in ``decode_merge.py``),
one source each through ``nki.*`` (NKI 0.7) and the legacy namespace
(:mod:`nki_kernels.port`). Where the namespaces differ: the legacy split kernel runs on an SPMD
grid whose programs are work-item chunks then tails; 0.7 launches ``kernel[lnc]`` and walks
the chunks in a compiled loop (:func:`port.for_program_parts`), the cores of LNC=2 sharing
it, each chunk program running the tails of ``K`` sequences beside its first ``K`` steps
(``tiles.decode_tails_per_program``: a batch, without a tree mask; a tail
is a short, latency-bound chain on the engines, a split is bound by its K/V gathers, so side
by side each fills the other's idle time; at B = 64, S = 2048, Hq = 32, Hkv = 8 on trn2 the
512 tails run first took 885 us of the 3276 us, VectorE-bound with the DMA queues 40% busy),
and the other tails in a loop of their own before it (their chains then overlap the chunks'
headers instead of trailing the last split). The program indices (head group, chunk, sequence) and the heads of a
group enter iota offsets as index expressions in legacy and, in 0.7 (compile-time offsets),
as columns of a small table (:class:`port.OffsetColumns`) added on VectorE; strided 3-D
copies are ``nl.arange`` expressions in legacy and ``.ap`` views in 0.7 (:func:`port.view`);
loops over a few K/V tiles unroll in 0.7 (:func:`port.unroll`), every loop whose count follows
the work (items, heads, steps, programs) is compiled in both, so the program does not grow
with the cache length. The legacy instruction stream, estimates and outputs are those of the
legacy kernel before the port; 0.7's outputs equal them bit for bit. Through 0.7 the flat
cache rows ``(b Hkv + h) S_max + position`` of a contiguous cache (paged: block-table entries
``b MB + block``) take their program-index part from the table, summed in fp32 below 2^24 and,
for a cache of ``B Hkv S_max >= 2^24`` rows (a table of ``B MB >= 2^24`` entries), in int32
on GpSimd (the table's ``exact`` form: exact at any size)::

    flash_decode_split_kernel   grid (Hkv / H, W / I + B)    phase 1: one partial (o, lse) per
                                                             work item and kv head -- W work
                                                             items (splits of committed
                                                             prefixes), I per program, for H kv
                                                             heads per program; then B tails
                                                             (last < n committed positions and
                                                             the T new tokens of a sequence)
    flash_decode_merge_kernel   grid (ceil(B Hq T / 128),)   phase 2: LSE merge, in fp32

Semantics (docs/semantics.md, "Decode"): q ``(B, Hq, T, D)``, caches ``(B, Hkv, S_max, D)``,
``cache_lens (B,)`` int32 with ``T <= L_b = cache_lens[b] <= S_max``. The new tokens' keys and
values already sit at positions ``L_b - T .. L_b - 1``; new token t sees every committed
position ``j < L_b - T`` and new token u when ``u <= t`` (default) or ``tree_mask[t, u]``.
Query head ``h`` reads kv head ``h // G``, ``G = Hq // Hkv``. Output o ``(B, Hq, T, D)`` and the
natural-log LSE ``(B, Hq, T)`` fp32.

Phase 1 (seed 003): every key set X of a split yields, per query row i, the normalized partial
output and log-sum-exp

    m_i = max_{j in X} s_ij,  l_i = sum_{j in X} exp(s_ij - m_i),
    o_i^X = sum_j exp(s_ij - m_i) v_j / l_i,   lse_i^X = m_i + log l_i      (s = scale q k^T)

(a split with no valid key has lse = -inf and o = 0). Phase 2 merges any set of partials:

    M_i = max_X lse_i^X,  w_X = exp(lse_i^X - M_i),
    o_i = sum_X w_X o_i^X / sum_X w_X,   lse_i = M_i + log sum_X w_X

which is associative, so the result does not depend on how the keys were split.

Runtime lengths. ``cache_lens`` is device data (it changes every step); only sizes are
compile-time: the split size and the most splits a sequence may use (from the longest
sequence, ``tiles.decode_tiles``), and the work-list length -- all in buckets, so the kernels
are recompiled only when a length crosses one, not every token. A *key row* is ``n``
consecutive positions (``n`` = the largest power of two <= 32 dividing S_max): one partition's
contiguous ``n * D`` slice of a K/V DMA (8 KiB at n=32, D=128, bf16). With ``Lp = L_b - T``
committed positions:

* the host's *work list* (``host.api.decode_work_list``, scheduler metadata like
  FlashAttention-3's) names the splits ``(b, s)`` that hold committed key rows, so the work is
  proportional to each sequence's own length, not to B times the longest. A program reads its
  item at run time; its sequence index b then drives indirect DMAs (Q rows, K/V rows, the
  partial's destination). Split s covers key rows ``s * split_rows ...``; the rows entirely
  below Lp (``row < floor(Lp / n)``) are gathered by an indirect DMA whose int32 row-index tile
  is built on chip (``nisa.iota`` + the item and the gathered length): rows past it get an
  index beyond the tensor and ``oob_mode.skip`` leaves them unread. Only a sequence's *last*
  split can hold such rows, but which item that is is runtime data, so every item is
  zero-filled where it skips and masked as below;
* the tail program of sequence b gathers the ``Lp mod n`` committed positions of the last,
  partial key row and the T new tokens, one position per partition (same mechanism); the new
  tokens' mask (causal or ``tree_mask``) is a static (T, T) bias, the same layout every step,

so every valid K/V byte is read exactly once and nothing at or past ``L_b``. Skipped rows are
zeroed -- for splits of at most ``tiles.DECODE_DMA_ZERO_FILL_MAX_ROWS`` key rows by a second
indirect DMA that reads a one-row zero tensor into the partitions holding them (``zero_row``),
else by a zero-tile copy (trn2) or memsets (trn1) over the whole K/V tiles first
(:func:`_gather_rows`): a stale or uninitialized NaN left in SBUF would otherwise survive
``0 * NaN`` in the PV matmul (and smear through a TensorE transpose on trn1). Invalid
keys are masked by adding ``DECODE_MASK_BIAS`` to their scores *in PSUM*, by one extra matmul
(ones x bias row), since validity is runtime data and ``mask=`` only takes compile-time affine
predicates.

Layouts (split kernel). Scores contract over D, so K is transposed on TensorE into
``kT[d, (dt, j, row)]`` (``j`` = position within the key row). The ``R = G T`` query rows of a
kv head (GQA packing: rows ``(g, t)`` share the partition dimension, so each K/V tile is loaded
once for all of them) are replicated ``pack`` times down the partitions of the score tile: copy
``c`` scores only the positions ``j = c (mod pack)``. It does so with a zero-padded stationary
``Qbd_c^T`` ``(D, pack * R)`` (Q^T in columns ``c R .. c R + R``), all copies accumulating into
one PSUM bank. TensorE work is the same (it is set by the keys), but the max / exp / sum passes
run on ``pack * R`` lanes instead of R: with T=1 and G=4, up to 128 lanes instead of 4 (the
failure mode of PR133 in hardware-and-limits.md is a Vector-bound decode kernel). The copies
share one shift per query row (``M_r = max_c m_(c, r)``, a cross-partition max via two tiny
transposes), so the PV products of all copies accumulate into one ``O^T (D, R)`` PSUM group:
``O^T += V_j^T P^T``, with V used as stored ``(positions on partitions, D)`` as the stationary
operand (64 TensorE cycles per 128 positions). A split's scores (<= 2 PSUM banks) are all in
PSUM before its softmax, so no online rescaling is needed; a long cache uses more splits.

Per position (D=128, bf16): TensorE 1 cycle (K transpose) + 1 (Q K^T) + 0.5 (P V); ScalarE
and VectorE 1 per 128 positions and head-dim row between them (K^T PSUM -> SBUF,
``tiles.DECODE_KT_ACT_SHARE``); VectorE/GpSimd a few per packed
score column plus, for splits zeroed on the engines, the zero-fill (a 16-bit copy at 4
elements/cycle on trn2) -- all below the
DMA time of the 512 bytes per position (hardware-and-limits.md §5, decode rows;
benchmarks/decode.py).

Program structure (split kernel). A program runs several *steps* -- work items x kv heads
(``tiles.decode_work_items``, ``tiles.decode_heads_per_program``) -- so that the K/V gathers
stream: it first builds the headers of all its steps (row indices, mask rows, query rows; every
runtime-indexed read issued before any compute, so none waits behind the in-order engines),
then runs a software pipeline with two buffers of gathered keys, transposed keys and values:
step t + 2 is gathered and step t + 1's keys transposed while step t's softmax and P V run.
One program per split instead (the layout before 2026-11-25) leaves each program's gathers
waiting for the previous program's chain: the scheduled estimate of the default decode case
was 2.14x the HBM bound that way and is 1.27x this way (benchmarks/decode.py; through nki.*,
where one program walks every chunk and no program boundary drains the pipeline, 1.23x).

Paged cache (``block_table``, FlashAttention's ``flash_attn_with_kvcache(block_table=...)``).
The caches are page pools ``(num_blocks, Hkv, page_size, D)`` and ``block_table (B, MB)`` int32
maps logical block i of sequence b to a page: position p lives at offset ``p mod page_size`` of
page ``block_table[b, p // page_size]``. Everything above is unchanged except where a key row
or a tail position is found. page_size is a power of two, so the key row
``n = min(page_size, 32)`` divides it: a key row never straddles two pages and is still one
contiguous ``n * D`` slice of HBM per partition (in this layout a page of one kv head is
contiguous; vLLM's ``(num_blocks, page_size, Hkv, D)`` would cut it into n separate D-element
pieces, 256 bytes at D=128 bf16). On chip, the row-index tile of each gather goes through the
block table: the logical block of every partition's key row (or position) is computed from
the work item, the table entry ``b * MB + block`` is gathered by a small indirect DMA (one
int32 per partition) into SBUF, and the pool row ``(page * Hkv + h) * rows_per_page + offset``
is formed with int32 GpSimd arithmetic before the K/V gather. Partitions that must not be read
skip the table entry too (index pushed out of bounds) and keep the page number
``num_blocks`` -- one past the pool -- so their K/V gather is skipped as well. The table and
the lengths are device data: a new table every step needs no recompile; only its shape and
the page size are compile-time.

HBM traffic (exact, ``host.api.flash_decode_hbm_bytes``): K and V ``2 s Hkv D sum_b L_b``
(each valid byte once), plus q once per work item and tail, the work items and lengths, the
tree mask, the partials (written by phase 1, read back by the merge) and o, lse; paged, also
one int32 table entry per gathered key row and tail position.

K^T cache (``k_layout="bhds"``, contiguous only). k_cache ``(B, Hkv, D, S_max)``, the layout
nki-library's ``attention_tkg`` takes its K in (``[B, 1, d, S]``): a split's keys are one
window of ``W = n rs`` positions per head-dim row, a row of the ``(B Hkv D S_max / W, W)``
view (W divides S_max, ``tiles.decode_transposed_split``), gathered by one indirect DMA per
head-dim tile and step straight into ``kT`` in position order (:class:`_KeyWindows`), which
the score matmuls read with a stride of ``n`` per packed copy: no TensorE transposes and no
PSUM copies of K (at B = 1, S = 131072, Hq = 32, Hkv = 8 on trn2 TensorE 1176 -> 710 us,
VectorE 1022 -> 550, ScalarE 520 -> 79). The window runs to the end of the split, past the
sequence's length in its last one, so the scores of uncommitted rows are *replaced* by
DECODE_MASK_BIAS (a selection on VectorE in PSUM, the key rows' predicate built on GpSimd)
rather than biased: whatever lies there, NaN included, never reaches a result. The tail's
keys come from key-row windows too, shifted into its slots by a 0/1 matmul
(:func:`_tail_keys_from_window`). V is gathered as in the default layout; with the K
transposes gone, a key row may hold 64 positions when the longest prefix fills a split
(``tiles.decode_transposed_key_row``: 16 KiB V rows) and splits aim at
``tiles.DECODE_KT_SPLIT_KEYS``.

FP8 cache (``kv_scale``). The caches may hold an 8-bit float format (``s = 1`` in the K/V
term): the gathers cast to the matmul dtype on the way into SBUF (a DMA casts when its source
and destination dtypes differ, through fp32: AWS's DMA guide, nki-dma-overview.rst), so every
tile after them is the bf16 kernel's and nothing else changes but two folds of the
per-kv-head scales, read once per head of a program into ``(rows, 2)`` columns: K's into the
query scaling (:func:`_scaled_query_t`), V's into the normalization of each partial.
"""
from typing import NamedTuple

import numpy as np  # compile-time constants only (-inf)

from nki_kernels import port, tiles
from nki_kernels.attention import masks as M
from nki_kernels.attention import score_mods as SM
from nki_kernels.port import nl

PMAX = tiles.PMAX
_DTYPES = ("float32", "bfloat16", "float16")
NEG = tiles.DECODE_MASK_BIAS


def _mask_dtype():
    """dtype of the mask matmul operands (0/1 and DECODE_MASK_BIAS are exact enough in bf16 and
    -1e30 is representable there, unlike fp16), in the namespace being traced."""
    return nl.bfloat16


# ============================================================================================
# Static geometry
# ============================================================================================
class _SplitGeometry:
    """Compile-time sizes of the split kernel (plain Python ints).

    ``n`` key row; ``rs`` key rows per split; ``kv_rows`` partitions per K/V tile
    (``min(rs, 128)``); ``n_kv`` K/V tiles per split; ``n_dt`` head-dim tiles of <= 128;
    ``pack`` packed copies of a row tile; ``n_sub = n // pack`` positions per key row scored by
    one copy; ``width = n_sub * rs`` score columns per partition (column ``w = jj * rs + row``
    holds position ``j = jj * pack + c`` of key row ``row`` for copy ``c``).
    """

    def __init__(self, D, n, rs, pack):
        self.D, self.n, self.rs, self.pack = D, n, rs, pack
        self.kv_rows = min(rs, PMAX)
        self.n_kv = tiles.ceil_div(rs, PMAX)
        self.n_dt = tiles.ceil_div(D, PMAX)
        self.n_sub = n // pack
        self.width = self.n_sub * rs
        self.n_banks = tiles.ceil_div(self.width, tiles.PSUM_FMAX)
        # score pieces: (bank, column in bank, jj, first row, length), never crossing a bank
        # or a jj boundary
        self.pieces = []
        for jj in tiles.unrolled(self.n_sub):
            r = 0
            while r < rs:
                w = jj * rs + r
                bank, col = divmod(w, tiles.PSUM_FMAX)
                ln = min(rs - r, tiles.PSUM_FMAX - col)
                self.pieces.append((bank, col, jj, r, ln))
                r += ln
        self.bank_cols = [min(tiles.PSUM_FMAX, self.width - bk * tiles.PSUM_FMAX)
                          for bk in tiles.unrolled(self.n_banks)]
        # P^T blocks of kv_rows columns: block x is rows (x mod n_kv) * 128 .. of sub-key jj
        self.n_blocks = self.width // self.kv_rows

    def d_tiles(self):
        """(dt, first column, size) of the head-dim tiles."""
        return [(dt, dt * PMAX, min(PMAX, self.D - dt * PMAX)) for dt in tiles.unrolled(self.n_dt)]


def _row_tiles(rows, row_tile):
    """(index, first row, size) of the query row tiles."""
    return [(i, i * row_tile, min(row_tile, rows - i * row_tile))
            for i in tiles.unrolled(tiles.ceil_div(rows, row_tile))]


# ============================================================================================
# Runtime lengths on chip
# ============================================================================================
def _length_columns(cache_lens, b0, count, parts):
    """``cache_lens[b0 + j]`` in column j of an fp32 ``(parts, count)`` SBUF tile (the same on
    every partition; ``b0`` an index expression).

    One ``4 count``-byte DMA, then a K=1 matmul ``ones(1, parts)^T @ L`` broadcasts the row
    down the partitions (exact: integers < 2^24 in fp32).
    """
    len_i = nl.ndarray((1, count), dtype=nl.int32, buffer=nl.sbuf)
    port.dma_copy(len_i, cache_lens.reshape((1, cache_lens.shape[0]))[0:1, nl.ds(b0, count)])
    len_f = nl.ndarray((1, count), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(len_f, len_i, engine="vector")
    ones = nl.ones((1, parts), dtype=nl.float32, buffer=nl.sbuf)
    col_ps = nl.ndarray((parts, count), dtype=nl.float32, buffer=nl.psum)
    port.nc_matmul(col_ps, ones, len_f)
    col = nl.ndarray((parts, count), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(col, col_ps, engine="vector")
    return col


def _committed_split(len_col, T, n):
    """``(Lp, rem)`` tiles shaped like ``len_col``: committed positions ``Lp = L - T`` and
    ``Lp mod n``."""
    lp = nl.ndarray(tuple(len_col.shape), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(lp, len_col, op0=nl.subtract, operand0=float(T))
    return lp, M.int_mod(lp, n)


def _oob_offset(n_rows_total):
    """Added to a row index to push it out of bounds: a power of two (exact in fp32) >=
    ``n_rows_total + 128`` (indices may start up to 127 below 0 in the tail)."""
    return 1 << int(n_rows_total + PMAX).bit_length()


# ============================================================================================
# Split kernel: loading K^T and V of one split
# ============================================================================================
def _item_columns(work, cache_lens, c, ipp):
    """fp32 ``(128, 3 ipp)``: ``b_j | s_j | L_j`` of work items ``c ipp + j`` (the same on
    every partition), ``L_j = cache_lens[b_j]``.

    One DMA reads the ``(ipp, 2)`` items (one per partition), one indirect DMA gathers their
    lengths (b is runtime data; a padding item has ``b = B``: skipped, its length reads as 0,
    i.e. nothing valid), and one matmul ``ones(ipp, 128)^T @ [diag(b) | diag(s) | diag(L)]``
    lays each item's values down a column (exact: integers < 2^24, one non-zero term each).
    """
    B = cache_lens.shape[0]
    items = nl.ndarray((ipp, 2), dtype=nl.int32, buffer=nl.sbuf)
    port.dma_copy(items, work[nl.ds(c * ipp, ipp), 0:2])
    length = nl.ndarray((ipp, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.memset(length, 0, engine="gpsimd")
    port.dma_copy(length, port.rows(cache_lens.reshape((B, 1)), items, 0), oob_skip=True)
    vals = nl.ndarray((ipp, 3), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(vals[0:ipp, 0:2], items, engine="vector")
    port.tensor_copy(vals[0:ipp, 2:3], length, engine="vector")
    j_minus_p = nl.ndarray((ipp, ipp), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(j_minus_p, [[1, ipp]], channel_multiplier=-1)
    ident = nl.ndarray((ipp, ipp), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(ident, j_minus_p, op0=nl.equal, operand0=0.0)
    diag = nl.ndarray((ipp, 3 * ipp), dtype=nl.float32, buffer=nl.sbuf)
    for v in tiles.unrolled(3):
        port.tensor_scalar(diag[0:ipp, v * ipp:(v + 1) * ipp], ident, op0=nl.multiply,
                           operand0=vals[0:ipp, v:v + 1])
    ones = nl.ones((ipp, PMAX), dtype=nl.float32, buffer=nl.sbuf)
    cols_ps = nl.ndarray((PMAX, 3 * ipp), dtype=nl.float32, buffer=nl.psum)
    port.nc_matmul(cols_ps, ones, diag)
    cols = nl.ndarray((PMAX, 3 * ipp), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(cols, cols_ps, engine="vector")
    return cols


def _valid_rows(cols, ipp, T, n, rs):
    """fp32 ``(128, ipp)``: key rows of each item's split that are entirely committed,
    ``floor((L - T) / n) - s rs`` (<= 0 for none; exact: n is a power of two, all values
    < 2^24)."""
    lp = nl.ndarray((PMAX, ipp), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(lp, cols[0:PMAX, 2 * ipp:3 * ipp], op0=nl.subtract, operand0=float(T))
    full = nl.ndarray((PMAX, ipp), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(full, lp, M.int_mod(lp, n), op=nl.subtract)
    valid = nl.ndarray((PMAX, ipp), dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(valid, cols[0:PMAX, ipp:2 * ipp], op0=nl.multiply,
                              operand0=float(-rs * n), op1=nl.add, operand1=full)
    rows = nl.ndarray((PMAX, ipp), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(rows, valid, op0=nl.multiply, operand0=1.0 / n)
    return rows


def _int_tile(terms, parts, width, acc=None, out=None):
    """int32 ``(parts, width)`` tile ``acc + sum(c * x)`` over ``(x, c)`` pairs of int32 tiles:
    int32 multiply and add (exact; fp32 engine arithmetic would round above 2^24). ``out``: the
    tile (or view) the last add writes, else a new tile."""
    terms = [(x, c) for x, c in terms if c != 0]
    for k, (x, c) in enumerate(terms):
        if c != 1:
            c_tile = nl.ndarray((parts, width), dtype=nl.int32, buffer=nl.sbuf)
            port.memset(c_tile, c, engine="gpsimd")
            prod = nl.ndarray((parts, width), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_tensor(prod, x, c_tile, op=nl.multiply)
            x = prod
        if acc is None:
            acc = x
        else:
            total = (out if out is not None and k == len(terms) - 1 else
                     nl.ndarray((parts, width), dtype=nl.int32, buffer=nl.sbuf))
            port.tensor_tensor(total, acc, x, op=nl.add)
            acc = total
    return acc


def _idx_col(k, t, steps):
    """Column of the row-index tile of K/V tile ``k`` of step ``t`` (a program's ``steps``
    steps and its pipeline's two dead ones, per K/V tile): one K/V tile's steps are adjacent, so
    the columns a head's items write are one contiguous run for a runtime head index."""
    return k * (steps + 2) + t


def _terms(terms, c):
    """The linear form ``terms`` (``[(index expression, int coefficient), ...]``: runtime
    offsets for :func:`port.iota`) times the int ``c``."""
    return [(e, k * c) for e, k in terms]


def _beyond(valid, kr: int, ipp: int, k: int):
    """``(local, beyond_f)`` of K/V tile k of a chunk's items (fp32, ``[kr, ipp]``): the local
    key row ``128 k + p`` of partition p and 1 where that row is not below ``valid[:, j]``
    (not gathered), else 0."""
    local = nl.ndarray((kr, ipp), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(local, [[0, ipp]], offset=k * PMAX, channel_multiplier=1)
    beyond_f = nl.ndarray((kr, ipp), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(beyond_f, local, valid[0:kr, 0:ipp], op=nl.greater_equal)
    return local, beyond_f


def _local_rows(valid, kr: int, ipp: int, k: int, oob):
    """``(local, beyond)`` of K/V tile k of a chunk's items: the local key row ``128 k + p`` of
    partition p (fp32, ``[kr, ipp]``) and ``oob`` (int32) where that row is not below
    ``valid[:, j]``, else 0 -- the push out of bounds of a gather index."""
    local, beyond_f = _beyond(valid, kr, ipp, k)
    beyond = nl.ndarray((kr, ipp), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_scalar(beyond, beyond_f, op0=nl.multiply, operand0=float(oob))
    return local, beyond


def _zero_rows_index(valid, live, g, ipp, hpp, zidx):
    """Columns ``0 .. hpp ipp - 1`` of the int32 ``zidx``: the index into the one-row zero
    tensor of each step's K/V zero fill (:func:`_gather_rows`; step ``hh ipp + j``, item j):
    0 (read the zeros) on partition p when the gather skips the row of a real item in the last
    K/V tile there (rows past the committed prefix are a suffix of the split, so then in no
    earlier tile either, or it skips them too), else 1 or 2 (out of bounds: skipped). ``live``:
    fp32 ``[kr, ipp]``, 1 for a real item, 2 for a padding one."""
    kr = g.kv_rows
    _, beyond_f = _beyond(valid, kr, ipp, g.n_kv - 1)
    zero = nl.ndarray((kr, ipp), dtype=nl.int32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(zero, beyond_f, op0=nl.multiply, operand0=-1.0, op1=nl.add,
                              operand1=live[0:kr, 0:ipp])                 # live - beyond

    def head(hh):
        port.tensor_copy(zidx[0:kr, nl.ds(hh * ipp, ipp)], zero, engine="gpsimd")

    port.loop(hpp, head)


def _split_row_indices(valid, bs, g, ipp, hpp, h_row0, h_stride, b_stride, oob, idx, offsets):
    """Row indices of a chunk's K/V gathers: column ``k (hpp ipp + 2) + hh ipp + j`` of the
    int32 tile ``idx`` (:func:`_idx_col`) is the absolute key row gathered into partition p of
    K/V tile k of item j for head ``hh`` of the group (``b_j b_stride + s_j rs + h_row0 + hh
    h_stride + 128 k + p``), pushed out of bounds (``+ oob``) when the local row ``128 k + p``
    is not below ``valid[:, j]``. ``bs``: int32 ``b | s`` columns; ``h_row0``: a linear form
    of the program's indices (nki.*: read from ``offsets``, :class:`port.OffsetColumns`)."""
    kr = g.kv_rows
    base = _int_tile([(bs[0:kr, 0:ipp], b_stride), (bs[0:kr, ipp:2 * ipp], g.rs)], kr, ipp)

    def key_tile(k):
        _, beyond = _local_rows(valid, kr, ipp, k, oob)
        rows = _int_tile([(beyond, 1), (base, 1)], kr, ipp)

        def head(hh):
            first = nl.ndarray((kr, ipp), dtype=nl.int32, buffer=nl.sbuf)
            port.iota(first, [[0, ipp]], offset=k * PMAX, channel_multiplier=1,
                      runtime=h_row0 + [(hh, h_stride)], offsets=offsets)
            port.tensor_tensor(idx[0:kr, nl.ds(_idx_col(k, hh * ipp, hpp * ipp), ipp)], first,
                               rows, op=nl.add)

        port.loop(hpp, head)

    port.unroll(g.n_kv, key_tile)


def _paged_split_row_indices(table, valid, cols, bs, g, ipp, hpp, h0, Hkv, num_blocks, ppr,
                             idx, offsets):
    """Row indices of a chunk's K/V gathers from a paged cache: column ``k (hpp ipp + 2) + hh
    ipp + j`` of ``idx`` is the row of the page pools' ``(num_blocks Hkv ppr, n D)`` view gathered
    into partition p of K/V tile k of item j for kv head ``h = h0 + hh`` (``ppr = page_size /
    n`` key rows per page; ``h0`` a linear form of the program's indices, as in
    :func:`_split_row_indices`). The page numbers are gathered once for the group's heads.

    Local key row ``128 k + p`` of the split is logical key row ``r = s rs + 128 k + p`` of
    sequence b: key row ``r mod ppr`` of logical block ``r // ppr``, whose page is
    ``block_table[b, r // ppr]``, so its pool row is ``(page Hkv + h) ppr + r mod ppr``. The
    page numbers come from the block table by indirect DMA, one int32 per partition (entry
    ``b MB + r // ppr`` of the flattened table). A row not below ``valid`` (past the committed
    prefix; every row of a padding item, b = B) reads no entry -- its table index is pushed out
    of bounds -- and keeps the page number ``num_blocks``, one past the pool, so its K/V gather
    is skipped too. Block/row arithmetic runs in fp32 on values < 2^24 (exact: ppr is a power
    of two); page numbers and pool rows in int32.
    """
    B, MB = table.shape
    kr = g.kv_rows
    oob = float(_oob_offset(B * MB))
    b_mb = _int_tile([(bs[0:kr, 0:ipp], MB)], kr, ipp)
    first = nl.ndarray((kr, ipp), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(first, cols[0:kr, ipp:2 * ipp], op0=nl.multiply,
                       operand0=float(g.rs))                              # s rs
    table_flat = table.reshape((B * MB, 1))

    def key_tile(k):
        local, beyond = _local_rows(valid, kr, ipp, k, oob)
        r = nl.ndarray((kr, ipp), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(r, local, first, op=nl.add)
        within = M.int_mod(r, ppr)                      # r mod ppr
        block_f = nl.ndarray((kr, ipp), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(block_f, r, within, op=nl.subtract)
        block = nl.ndarray((kr, ipp), dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_scalar(block, block_f, op0=nl.multiply, operand0=1.0 / ppr)
        entry = _int_tile([(beyond, 1), (b_mb, 1)], kr, ipp, acc=block)
        page = nl.ndarray((kr, ipp), dtype=nl.int32, buffer=nl.sbuf)
        port.memset(page, num_blocks, engine="gpsimd")

        def table_entry(j):
            port.dma_copy(page[0:kr, nl.ds(j, 1)], port.rows(table_flat, entry, j),
                          oob_skip=True)

        port.loop(ipp, table_entry)
        # page Hkv ppr + r mod ppr, then + h ppr per head
        within_i = nl.ndarray((kr, ipp), dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_copy(within_i, within)
        rows = _int_tile([(page, Hkv * ppr), (within_i, 1)], kr, ipp)

        def head(hh):
            h_rows = nl.ndarray((kr, ipp), dtype=nl.int32, buffer=nl.sbuf)
            port.iota(h_rows, [[0, ipp]], runtime=_terms(h0, ppr) + [(hh, ppr)],
                      offsets=offsets)
            port.tensor_tensor(idx[0:kr, nl.ds(_idx_col(k, hh * ipp, hpp * ipp), ipp)], h_rows,
                               rows, op=nl.add)

        port.loop(hpp, head)

    port.unroll(g.n_kv, key_tile)


def _zero_source(g, mm, items):
    """The zero tile the engine K/V fills copy from, made once per program, or None (memsets).

    On trn2 VectorE copies 16-bit data SBUF->SBUF at 4 elements/cycle, so copying one zero tile
    is 4x cheaper than a memset (1 element/cycle) once a program fills two or more K/V tiles;
    trn1 memsets, split between VectorE (K) and GpSimd (V).
    """
    if port.gen3() and mm != nl.float32 and g.n_kv * items >= 2:
        zeros = nl.ndarray((g.kv_rows, g.n * g.D), dtype=mm, buffer=nl.sbuf)
        port.memset(zeros, 0, engine="gpsimd")
        return zeros
    return None


class _ZeroFill(NamedTuple):
    """How a program zeroes the K/V rows its gathers skip (:func:`_gather_rows`): by DMA
    (``zero_row``, ``zidx``: :func:`_zero_rows_index`; ``tiles.decode_zero_by_dma``) or, with
    those None, on the engines (``zeros``: :func:`_zero_source`, else memsets)."""

    zero_row: object
    zidx: object
    zeros: object


def _gather_rows(rows_view, idx, fill, t, steps, g, dst, engine):
    """Gather into ``dst (kv_rows, n_kv * n * D)`` the committed key rows of one split of
    ``rows_view`` (K or V rows), named by the columns of step ``t`` (of ``steps``) of the
    row-index tile ``idx`` (:func:`_idx_col`), and zeros into the rows that gather skips.

    A skipped row must hold zeros, never a stale or uninitialized NaN (``0 * NaN`` in P V).
    ``fill`` (:class:`_ZeroFill`) says how. By DMA: first, from the one-row HBM tensor
    ``zero_row (1, n_kv n D)``, column t of ``zidx`` reads its row 0 into every partition
    holding a skipped row of a real item (all its K/V tiles; the gathers then overwrite those
    of its rows that are valid), so the fill moves only those partitions' bytes, in one
    instruction per step (padding items fill nothing: their partials are trash). Else the
    whole of ``dst`` is zeroed first on the engines (a copy of ``fill.zeros`` on VectorE, or a
    memset on ``engine``, "vector" or "gpsimd")."""
    n, D, kv_rows = g.n, g.D, g.kv_rows
    if fill.zero_row is not None:
        port.dma_copy(dst, port.rows(fill.zero_row, fill.zidx, t), oob_skip=True)

    def key_tile(k):
        dst_k = dst[0:kv_rows, nl.ds(k * n * D, n * D)]
        if fill.zero_row is None:
            if fill.zeros is not None:
                port.tensor_copy(dst_k, fill.zeros, engine="vector")
            else:
                port.memset(dst_k, 0, engine=engine)
        port.dma_copy(dst_k, port.rows(rows_view, idx, _idx_col(k, t, steps)), oob_skip=True)

    port.unroll(g.n_kv, key_tile)


def _transpose_keys(k_nat, kT, g):
    """``kT (128, n_dt * n * rs)`` -- head-dim tile ``dt``, position ``j`` of key row ``row``
    at column ``(dt * n + j) * rs + row`` -- from the gathered key rows ``k_nat (kv_rows,
    n_kv * n * D)``: TensorE transposes through PSUM staging banks, copied out by ScalarE and
    VectorE (``tiles.DECODE_KT_ACT_SHARE`` of the staging banks of a K/V tile on ScalarE: on
    NeuronCore-v3+ VectorE copies 16-bit PSUM data at 2 elements per cycle, and in a
    batch of short sequences these copies were ScalarE's largest load)."""
    n, D, rs, kv_rows = g.n, g.D, g.rs, g.kv_rows
    per_bank = max(1, min(n, tiles.PSUM_FMAX // kv_rows))   # transposes per PSUM staging bank
    groups = tiles.ceil_div(n, per_bank)
    share = tiles.DECODE_KT_ACT_SHARE[port.target()]

    def key_tile(k):
        for dt, d0, dsz in g.d_tiles():
            for jg in tiles.unrolled(groups):
                i = dt * groups + jg        # the staging bank's rank in the K/V tile
                j0 = jg * per_bank
                cnt = min(per_bank, n - j0)
                kt_ps = nl.ndarray((PMAX, tiles.PSUM_FMAX), dtype=port.transpose_dtype(kT.dtype),
                                   buffer=nl.psum)
                for jb in tiles.unrolled(cnt):
                    c0 = (k * n + j0 + jb) * D + d0
                    port.nc_transpose(kt_ps[0:dsz, jb * kv_rows:(jb + 1) * kv_rows],
                                      k_nat[0:kv_rows, nl.ds(c0, dsz)])
                # position j0 + jj of key row k 128 + r: column (dt n + j0 + jj) rs + k 128 + r
                port.tensor_copy(
                    port.view(kT, 0, dsz, (dt * n + j0) * rs + k * PMAX, [[rs, cnt], [1, kv_rows]]),
                    port.view(kt_ps, 0, dsz, 0, [[kv_rows, cnt], [1, kv_rows]]),
                    engine="scalar" if int((i + 1) * share) > int(i * share) else "vector")

    port.unroll(g.n_kv, key_tile)



# ============================================================================================
# Score modifiers (score_mods.py): soft-capping, ALiBi, sinks
# ============================================================================================
class _RowMods:
    """Per-row modifier columns of one row tile (rows ``rt0 ..`` of a kv head, row ``g T +
    t``): ``slope`` ``(rows, 1)`` (ALiBi), ``sink`` ``(rows, 1)`` and ``t`` (the row's new
    token, fp32). Built from ``(G, 1)`` per-member columns by a selection matmul (row r belongs
    to member ``(rt0 + r) // T``)."""

    def __init__(self, mods, slope_g, sink_g, G, T, rt0, rows):
        self.mods, self.G, self.T = mods, G, T
        self.slope = self.sink = None
        diff = nl.ndarray((G, rows), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(diff, [[1, rows]], offset=rt0, channel_multiplier=-T)    # rt0 + r - T g
        ge = nl.ndarray((G, rows), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(ge, diff, op0=nl.greater_equal, operand0=0.0)
        sel = nl.ndarray((G, rows), dtype=nl.float32, buffer=nl.sbuf)
        port.scalar_tensor_tensor(sel, diff, op0=nl.less, operand0=float(T), op1=nl.multiply,
                                  operand1=ge)
        for name, col in (("slope", slope_g), ("sink", sink_g)):
            if col is not None:
                ps = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.psum)
                port.nc_matmul(ps, sel, col)
                val = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
                port.tensor_copy(val, ps, engine="vector")
                setattr(self, name, val)
        row = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(row, [[0, 1]], offset=rt0, channel_multiplier=1)
        self.t = M.int_mod(row, T)


def _member_values(values):
    """``(Hq, per_batch, flat)`` of an HBM ``(Hq,)`` or ``(1 or B, Hq)`` fp32 tensor: its
    head count, whether it has a row per sequence, and its ``(total, 1)`` view."""
    total = 1
    for d in values.shape:
        total *= d
    return (values.shape[-1], len(values.shape) == 2 and values.shape[0] > 1,
            values.reshape((total, 1)))


def _member_column(values, b, h, G, offsets):
    """fp32 ``(G, 1)``: ``values[b, h G + g]`` of an HBM ``(Hq,)`` or ``(1 or B, Hq)`` fp32
    tensor (``b``, ``h``: linear forms of the program's indices, read from ``offsets`` under
    nki.*), by an indirect DMA."""
    Hq, per_batch, flat = _member_values(values)
    idx = nl.ndarray((G, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.iota(idx, [[0, 1]], channel_multiplier=1,
              runtime=(_terms(b, Hq) if per_batch else []) + _terms(h, G), offsets=offsets)
    out = nl.ndarray((G, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(out, 0.0, engine="gpsimd")
    port.dma_copy(out, port.rows(flat, idx), oob_skip=True)
    return out


def _member_columns(values, bs, h, G, ipp, out, col0, offsets):
    """Columns ``col0 + j`` of the fp32 ``(G, ...)`` tile ``out`` (zeroed by the caller):
    ``values[b_j, h G + g]`` of an HBM ``(Hq,)`` or ``(1 or B, Hq)`` fp32 tensor, by indirect
    DMAs (``bs``: int32 ``b | s`` columns; a padding item's b = B reads out of bounds,
    skipped: 0; ``h`` as in :func:`_member_column`)."""
    Hq, per_batch, flat = _member_values(values)
    idx = nl.ndarray((G, ipp), dtype=nl.int32, buffer=nl.sbuf)
    port.iota(idx, [[0, ipp]], channel_multiplier=1, runtime=_terms(h, G), offsets=offsets)
    if per_batch:
        idx = _int_tile([(bs[0:G, 0:ipp], Hq)], G, ipp, acc=idx)

    def item(j):
        port.dma_copy(out[0:G, nl.ds(col0 + j, 1)], port.rows(flat, idx, j), oob_skip=True)

    port.loop(ipp, item)


def _head_scales(kv_scale, h, rows, offsets, out=None, col=0):
    """fp32 ``(rows, 2)``: ``kv_scale[h]`` = ``(k_scale, v_scale)`` of kv head ``h`` (a linear
    form of the program's indices, read from ``offsets`` under nki.*) on every partition, by an
    indirect DMA of the HBM ``(Hkv, 2)`` float32 scales of an FP8 cache; into columns ``col ..
    col + 1`` of ``out`` when given."""
    idx = nl.ndarray((rows, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.iota(idx, [[0, 1]], runtime=h, offsets=offsets)          # h on every partition
    if out is None:
        out = nl.ndarray((rows, 2), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(out[0:rows, nl.ds(col, 2)], port.rows(kv_scale, idx))
    return out


def _modified(mods, src, mask_ps, pos, slope, cap):
    """Scaled scores after the modifiers, fp32 SBUF: ``cap tanh(src / cap)`` (with
    ``softcap``), plus ``slope * pos`` (``pos`` an fp32 distance tile, ALiBi), plus the mask
    ``mask_ps`` (a PSUM tile, only with soft-capping: otherwise it is already in ``src``)."""
    y = src
    shape = tuple(src.shape)
    if mods.softcap is not None:
        t = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        port.activation(t, nl.tanh, src, scale=1.0 / cap)
        y = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        if mask_ps is not None:
            port.scalar_tensor_tensor(y, t, op0=nl.multiply, operand0=cap, op1=nl.add,
                                      operand1=mask_ps)
        else:
            port.tensor_scalar(y, t, op0=nl.multiply, operand0=cap, engine="gpsimd")
    if mods.alibi:
        biased = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
        port.scalar_tensor_tensor(biased, pos, op0=nl.multiply, operand0=slope, op1=nl.add,
                                  operand1=y)
        y = biased
    return y


def _with_sink(o_sb, lse, sink, rows, out):
    """Fold a sink logit (an extra key with value 0) into a partial: ``lse' = log(e^lse +
    e^sink)``, ``o' = o e^(lse - lse')``, written to ``out`` ``(rows, D + 1)`` as ``o' |
    lse'``."""
    col = (rows, 1)
    mx = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(mx, lse, sink, op=nl.maximum)
    neg_mx = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.activation(neg_mx, nl.copy, mx, scale=-1.0)
    a = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.activation(a, nl.exp, lse, bias=neg_mx)
    c = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.activation(c, nl.exp, sink, bias=neg_mx)
    den = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(den, a, c, op=nl.add)
    log_den = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.activation(log_den, nl.log, den)
    D = o_sb.shape[1]
    port.tensor_tensor(out[0:rows, D:D + 1], mx, log_den, op=nl.add)
    inv = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.reciprocal(inv, den)
    w = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(w, a, inv, op=nl.multiply)
    port.tensor_scalar(out[0:rows, 0:D], o_sb, op0=nl.multiply, operand0=w)


# ============================================================================================
# Split kernel: one row tile
# ============================================================================================
def _scaled_query_t(q_nat, rows, D, n_dt, scale, mm, k_col=None):
    """``scale * q`` of the loaded rows ``q_nat (rows, D)`` transposed: ``(128, n_dt * rows)``.

    The scale is folded into Q before the matmul (one rounding of ``scale * q`` to the operand
    dtype), so scores, masks, max and LSE are all in scaled units: that keeps the additive mask
    valid for any scale, including 0 and negative ones. ``k_col`` (an FP8 cache): the fp32
    ``(rows, 1)`` K scale of the rows' kv head, folded in as well (``q k_scale`` in fp32 on
    ScalarE, whose per-partition scale operand takes the column and which has slack in decode
    while VectorE is the busiest engine; transposed in fp32, so ``scale k_scale q`` is still
    rounded once): the scores of the stored keys are then those of the dequantized ones.
    """
    if k_col is not None:
        q_k = nl.ndarray((rows, D), dtype=nl.float32, buffer=nl.sbuf)
        port.activation(q_k, nl.copy, q_nat[0:rows, 0:D], scale=k_col)
        q_nat = q_k
    qT = nl.ndarray((PMAX, n_dt * rows), dtype=mm, buffer=nl.sbuf)
    for dt in tiles.unrolled(n_dt):
        d0 = dt * PMAX
        dsz = min(PMAX, D - d0)
        t_ps = nl.ndarray((PMAX, PMAX), dtype=port.transpose_dtype(q_nat.dtype), buffer=nl.psum)
        port.nc_transpose(t_ps[0:dsz, 0:rows], q_nat[0:rows, d0:d0 + dsz])
        port.activation(qT[0:dsz, dt * rows:(dt + 1) * rows], nl.copy, t_ps[0:dsz, 0:rows],
                        scale=float(scale))
    return qT


class _TileConstants(NamedTuple):
    """What every step of a program shares for one row tile of ``rows`` query rows
    (:func:`_tile_constants`): the group matrices ``e``, ``e_t`` (:func:`_group_matrices`;
    None at pack 1), the ``(1, P)`` ones of the mask matmul, a ``(1, 1)`` fp32 one
    (:func:`_row_max`; None at pack 1) and two zeroed block-diagonal
    stationaries (:func:`_packed_queries`; None at pack 1), one per pipeline buffer: a step
    writes only their diagonal blocks."""

    e: object
    e_t: object
    ones: object
    unit: object
    qbd: list


def _tile_constants(g, rows, mm):
    """:class:`_TileConstants` of a row tile, made once per program (per step, at B = 64,
    S = 2048, Hq = 32, Hkv = 8 on trn2 they were about 300 us of VectorE and 250 us of
    GpSimd)."""
    P = g.pack * rows
    ones = nl.ones((1, P), dtype=_mask_dtype(), buffer=nl.sbuf)
    if g.pack == 1:
        return _TileConstants(None, None, ones, None, None)
    qbd = [nl.ndarray((PMAX, g.n_dt * g.pack * P), dtype=mm, buffer=nl.sbuf)
           for _ in tiles.unrolled(2)]
    for buf in qbd:
        port.memset(buf, 0, engine="gpsimd")
    e, e_t = _group_matrices(rows, P)
    return _TileConstants(e, e_t, ones, nl.ones((1, 1), dtype=nl.float32, buffer=nl.sbuf), qbd)


def _packed_queries(qT, rows, g, qbd):
    """Block-diagonal stationaries ``Qbd (128, n_dt * pack * P)``, ``P = pack * rows``: the
    ``(dt, c)`` block (columns ``(dt * pack + c) * P ...``) is zero except Q^T in its columns
    ``c * rows .. c * rows + rows``, written into ``qbd`` (zero off those blocks,
    :func:`_tile_constants`). With pack 1 this is Q^T itself."""
    if g.pack == 1:
        return qT
    P = g.pack * rows
    for dt, d0, dsz in g.d_tiles():
        # the pack diagonal blocks at column (dt pack + c) P + c rows = dt pack P + c (P + rows)
        # in one copy: a stride-(P + rows) destination, the source broadcast over c
        port.tensor_copy(port.view(qbd, 0, dsz, dt * g.pack * P, [[P + rows, g.pack], [1, rows]]),
                         port.view(qT, 0, dsz, dt * rows, [[0, g.pack], [1, rows]]),
                         engine="gpsimd")
    return qbd


def _split_scores(qbd, kT, mask_row, ones, g, P, mask_apart=False, window=False):
    """Scores of the split in PSUM: ``(banks, mask_banks)``, ``n_banks`` tiles ``(P, 512)``
    fp32 each. ``window``: ``kT`` holds the split's keys in position order, head-dim tile
    ``dt``, position ``p`` at column ``dt * n * rs + p`` (a K^T cache's window,
    :func:`_gather_key_window`), read with a stride of ``n`` per copy instead.

    Partition ``c * rows + r`` column ``w = jj * rs + row`` is ``scale q_r . k`` for position
    ``j = jj * pack + c`` of key row ``row``, plus DECODE_MASK_BIAS when that row is not
    committed (``ones (1, P)``: ``ones^T @ mask_row``, accumulated into the same PSUM group; a full split
    has no ``mask_row``). With ``mask_apart`` (soft-capping: the tanh would flatten it) the
    mask goes to its own PSUM tiles ``mask_banks`` instead (else None).
    """
    n, rs = g.n, g.rs
    # each piece's first matmul writes (=), the rest accumulate (+=): no PSUM zero-fill
    banks = [nl.ndarray((P, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.psum)
             for _ in tiles.unrolled(g.n_banks)]
    mask_banks = None
    if mask_row is not None:
        if mask_apart:
            mask_banks = [nl.ndarray((P, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.psum)
                          for _ in tiles.unrolled(g.n_banks)]

    def keys(dt, dsz, jj, c, r0, ln):
        if window:      # position (r0 + i) n + jj pack + c of the window, i < ln
            return port.view(kT, 0, dsz, dt * n * rs + r0 * n + jj * g.pack + c, [[n, ln]])
        return kT[0:dsz, nl.ds((dt * n + jj * g.pack + c) * rs + r0, ln)]

    def copy_c(acc, col, jj, r0, ln, c, first):
        for dt, d0, dsz in g.d_tiles():
            port.nc_matmul(acc[0:P, col:col + ln], qbd[0:dsz, nl.ds((dt * g.pack + c) * P, P)],
                           keys(dt, dsz, jj, c, r0, ln), accumulate=not (first and dt == 0))

    for bank, col, jj, r0, ln in g.pieces:
        acc = banks[bank]
        copy_c(acc, col, jj, r0, ln, 0, True)

        def other_copy(c):
            copy_c(acc, col, jj, r0, ln, c, False)

        if window:      # a strided view's start is static under nki.*: the copies unrolled
            port.unroll(g.pack - 1, lambda i: other_copy(i + 1))
        else:
            port.loop(g.pack, other_copy, start=1)
        if mask_row is not None and mask_banks is not None:
            port.nc_matmul(mask_banks[bank][0:P, col:col + ln], ones, mask_row[0:1, r0:r0 + ln])
        elif mask_row is not None:
            port.nc_matmul(acc[0:P, col:col + ln], ones, mask_row[0:1, r0:r0 + ln],
                           accumulate=True)
    return banks, mask_banks


def _group_matrices(rows, P):
    """fp32 ``E (rows, P)`` and ``E^T (P, rows)`` with ``E[r, p] = 1`` iff ``p = c rows + r``:
    ``E^T`` sums the packed copies of each query row, ``E`` copies a row value to every copy."""
    # p - r + P >= 0; divisible by rows exactly when p is a copy of row r
    diff = nl.ndarray((rows, P), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(diff, [[1, P]], offset=P, channel_multiplier=-1)
    e = nl.ndarray((rows, P), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(e, M.int_mod(diff, rows), op0=nl.equal, operand0=0.0)
    diff_t = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(diff_t, [[-1, rows]], offset=P, channel_multiplier=1)
    e_t = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(e_t, M.int_mod(diff_t, rows), op0=nl.equal, operand0=0.0)
    return e, e_t


def _row_max(banks, g, rows, P, unit):
    """Minus the max of every query row over the split (all copies), on every copy's partition:
    ``-M (P, 1)`` (partition ``c rows + r`` holds ``-M_r``).

    Per partition first (VectorE over the PSUM banks), then across the ``pack`` copies of each
    row: transpose the column to a row, reduce ``(1, rows, pack)`` on its last axis, tile the
    negated row ``pack`` times (GpSimd) and turn it back into a column with a K=1 matmul
    against ``unit`` (a ``(1, 1)`` fp32 one; exact).
    """
    m_cols = nl.ndarray((P, g.n_banks), dtype=nl.float32, buffer=nl.sbuf)
    for bank in tiles.unrolled(g.n_banks):
        port.tensor_reduce(m_cols[0:P, bank:bank + 1], nl.maximum,
                           banks[bank][0:P, 0:g.bank_cols[bank]], axis=(1,))
    if g.n_banks > 1:
        m_p = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_reduce(m_p, nl.maximum, m_cols, axis=(1,))
    else:
        m_p = m_cols
    neg = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    if g.pack == 1:
        port.tensor_scalar(neg, m_p, op0=nl.multiply, operand0=-1.0)
        return neg
    mt_ps = nl.ndarray((1, P), dtype=port.transpose_dtype(nl.float32), buffer=nl.psum)
    port.nc_transpose(mt_ps[0:1, 0:P], m_p[0:P, 0:1])
    m_row = nl.ndarray((1, rows), dtype=nl.float32, buffer=nl.sbuf)
    # (1, rows, pack): element [0, r, c] is copy c of row r, column c rows + r
    port.tensor_reduce(m_row, nl.maximum, port.view(mt_ps, 0, 1, 0, [[1, rows], [rows, g.pack]]),
                       axis=(2,))
    neg_row = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(port.view(neg_row, 0, 1, 0, [[rows, g.pack], [1, rows]]),
                       port.view(m_row, 0, 1, 0, [[0, g.pack], [1, rows]]), op0=nl.multiply,
                       operand0=-1.0, engine="gpsimd")
    bc_ps = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.psum)
    port.nc_matmul(bc_ps[0:P, 0:1], neg_row, unit)
    port.tensor_copy(neg, bc_ps, engine="vector")
    return neg


def _exp_scores(banks, neg_m, g, P, mm):
    """``P = exp(s - M)`` into SBUF ``(P, width)`` in mm, and the per-partition sums ``(P, 1)``
    (of the fp32 exponentials, ScalarE's reduction)."""
    p_sb = nl.ndarray((P, g.width), dtype=mm, buffer=nl.sbuf)
    l_cols = nl.ndarray((P, g.n_banks), dtype=nl.float32, buffer=nl.sbuf)
    for bank in tiles.unrolled(g.n_banks):
        w = g.bank_cols[bank]
        port.activation_reduce(p_sb[0:P, bank * tiles.PSUM_FMAX:bank * tiles.PSUM_FMAX + w],
                               nl.exp, banks[bank][0:P, 0:w], reduce_op=nl.add,
                               reduce_res=l_cols[0:P, bank:bank + 1], bias=neg_m)
    if g.n_banks > 1:
        l_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_reduce(l_sum, nl.add, l_cols, axis=(1,))
        return p_sb, l_sum
    return p_sb, l_cols


def _transpose_probs(p_sb, g, P, mm):
    """``pT (kv_rows, n_blocks * P)``: block x (score columns ``x kv_rows ...``) transposed,
    positions on partitions, ready as the moving operand of P V."""
    kr = g.kv_rows
    pT = nl.ndarray((kr, g.n_blocks * P), dtype=mm, buffer=nl.sbuf)
    per_bank = max(1, tiles.PSUM_FMAX // P)
    for xg in tiles.unrolled(tiles.ceil_div(g.n_blocks, per_bank)):
        x0 = xg * per_bank
        cnt = min(per_bank, g.n_blocks - x0)
        t_ps = nl.ndarray((PMAX, tiles.PSUM_FMAX), dtype=port.transpose_dtype(mm),
                          buffer=nl.psum)
        for xb in tiles.unrolled(cnt):
            x = x0 + xb
            port.nc_transpose(t_ps[0:kr, xb * P:(xb + 1) * P], p_sb[0:P, x * kr:(x + 1) * kr])
        port.tensor_copy(pT[0:kr, x0 * P:(x0 + cnt) * P], t_ps[0:kr, 0:cnt * P],
                         engine="vector")
    return pT


def _split_pv(v_all, pT, g, rows, P):
    """``O^T (D, rows)`` per head-dim tile: ``sum_x sum_c V(x, c)^T P^T(x, c)`` in one PSUM
    group each (all copies share the row max, so their products add)."""
    kr, n, D = g.kv_rows, g.n, g.D
    acc = [nl.ndarray((PMAX, rows), dtype=nl.float32, buffer=nl.psum)
           for _ in tiles.unrolled(g.n_dt)]

    def block_c(x, k, jj, c, first):
        for dt, d0, dsz in g.d_tiles():
            # the group's first product writes, the others accumulate
            port.nc_matmul(acc[dt][0:dsz, 0:rows],
                           v_all[0:kr, nl.ds((k * n + jj * g.pack + c) * D + d0, dsz)],
                           pT[0:kr, nl.ds(x * P + c * rows, rows)], accumulate=not first)

    for x in tiles.unrolled(g.n_blocks):
        jj, rem = divmod(x * kr, g.rs)
        k = rem // PMAX

        def other_copy(c):
            block_c(x, k, jj, c, False)

        block_c(x, k, jj, 0, x == 0)
        port.loop(g.pack, other_copy, start=1)
    return acc


def _normalize_rows(acc, l_col, rows, g, v_col, o_sb):
    """``o_sb`` ``(rows, D)`` fp32 = transpose of ``O^T`` divided by the row sums (and times
    the V scale ``v_col`` ``(rows, 1)`` of an FP8 cache, or None, in the same instruction: the
    output of the dequantized values)."""
    inv_l = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.reciprocal(inv_l, l_col)
    by_v = {} if v_col is None else dict(op1=nl.multiply, operand1=v_col)
    for dt, d0, dsz in g.d_tiles():
        oT = nl.ndarray((dsz, rows), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(oT, acc[dt][0:dsz, 0:rows], engine="vector")
        t_ps = nl.ndarray((PMAX, PMAX), dtype=port.transpose_dtype(nl.float32), buffer=nl.psum)
        port.nc_transpose(t_ps[0:rows, 0:dsz], oT[0:dsz, 0:rows])
        port.tensor_scalar(o_sb[0:rows, d0:d0 + dsz], t_ps[0:rows, 0:dsz], op0=nl.multiply,
                           operand0=inv_l, **by_v)


def _lse_column(neg_m, l_col, lse):
    """``lse`` = ``m + log l`` (``neg_m``: ``-m``, :func:`_row_max`), or -inf when the max
    says no key was valid (a dead split)."""
    col = tuple(l_col.shape)
    log_l = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.activation(log_l, nl.log, l_col)
    port.tensor_tensor(lse, log_l, neg_m, op=nl.subtract)
    live = nl.ndarray(col, dtype=nl.uint8, buffer=nl.sbuf)
    port.tensor_scalar(live, neg_m, op0=nl.less, operand0=-tiles.DECODE_DEAD_MAX)
    port.keep_where(lse, live, -np.inf)


def _split_mods(banks, mask_banks, g, rows, P, rm, e, cap):
    """The split's scores after soft-capping and ALiBi (:class:`_RowMods` ``rm``): SBUF fp32
    tiles shaped like ``banks``. ALiBi adds ``slope * (position within the split)`` (position
    ``n row + jj pack + c`` of copy c; the split's offset from the query position is added to
    its LSE instead, :func:`_alibi_lse_shift`)."""
    mods = rm.mods
    slope = None
    c_col = None
    if mods.alibi:
        slope = rm.slope
        if g.pack > 1:
            ps = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.psum)
            port.nc_matmul(ps, e, rm.slope)
            slope = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_copy(slope, ps, engine="vector")
            # copy index c = #{k in 1 .. pack - 1 : p >= k rows}
            p_minus = nl.ndarray((P, g.pack - 1), dtype=nl.float32, buffer=nl.sbuf)
            port.iota(p_minus, [[-rows, g.pack - 1]], offset=-rows, channel_multiplier=1)
            above = nl.ndarray((P, g.pack - 1), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(above, p_minus, op0=nl.greater_equal, operand0=0.0)
            c_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_reduce(c_col, nl.add, above, axis=(1,))
    out = [nl.ndarray((P, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.sbuf)
           for _ in tiles.unrolled(g.n_banks)]
    # each piece is modified into its own tile, then copied into place (VectorE)
    if not mods.alibi:
        for bank in tiles.unrolled(g.n_banks):
            w = g.bank_cols[bank]
            port.tensor_copy(out[bank][0:P, 0:w], _modified(
                mods, banks[bank][0:P, 0:w],
                None if mask_banks is None else mask_banks[bank][0:P, 0:w], None, None, cap),
                engine="vector")
        return out
    for bank, col, jj, r0, ln in g.pieces:
        pos = nl.ndarray((P, ln), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(pos, [[g.n, ln]], offset=g.n * r0 + jj * g.pack)
        if c_col is not None:
            pos_c = nl.ndarray((P, ln), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(pos_c, pos, op0=nl.add, operand0=c_col, engine="gpsimd")
            pos = pos_c
        port.tensor_copy(out[bank][0:P, col:col + ln], _modified(
            mods, banks[bank][0:P, col:col + ln],
            None if mask_banks is None else mask_banks[bank][0:P, col:col + ln], pos, slope,
            cap), engine="vector")
    return out


def _alibi_lse_shift(lse, rm, s_i, length, T, split_keys, rows, shifted):
    """ALiBi's per-row part of a split's scores, added to its LSE into ``shifted``: ``slope
    (s split_keys - (L - T + t))`` (split start minus the query position; all keys of a split
    are at or before it)."""
    col = (rows, 1)
    s_f = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(s_f, s_i[0:rows], engine="vector")
    start = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(start, s_f, op0=nl.multiply, operand0=float(split_keys),
                              op1=nl.subtract, operand1=length[0:rows])
    dist = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(dist, start, op0=nl.add, operand0=float(T), op1=nl.subtract,
                              operand1=rm.t)
    port.scalar_tensor_tensor(shifted, dist, op0=nl.multiply, operand0=rm.slope, op1=nl.add,
                              operand1=lse)


def _split_front(q_nat, kT, mask_row, g, rows, scale, mm, consts, buf, rm=None, cap=None,
                 k_col=None, keep=None):
    """First half of one row tile's partial over a work item (query rows ``rows`` of the
    item, gathered as ``q_nat (rows, D)``): scores against ``kT``, the modifiers (``rm``:
    :class:`_RowMods`, None without), the row max and the exponentials (``k_col``: an FP8
    cache's K scale, :func:`_scaled_query_t`). ``consts``: the row tile's
    :class:`_TileConstants`, ``buf`` the step's pipeline buffer. Returns the state :func:`_split_back`
    finishes: ``(p_sb, l_col, -m)`` (``-m`` on every copy's partition, :func:`_row_max`).

    ``keep`` (a K^T cache's window, :func:`_gather_key_window`): uint8 ``(P, n_banks 512)``,
    1 on the score columns of committed key rows. The window may hold anything past the
    sequence's length (even NaN), so the other columns are *replaced* (selection on VectorE,
    in PSUM) rather than biased: by DECODE_MASK_BIAS, or by 0 with a soft-cap, whose mask
    stays apart and is added after the tanh."""
    P = g.pack * rows
    qT = _scaled_query_t(q_nat, rows, g.D, g.n_dt, scale, mm, k_col)
    qbd = _packed_queries(qT, rows, g, None if consts.qbd is None else consts.qbd[buf])
    transforms = rm is not None and rm.mods.transforms
    apart = transforms and cap is not None
    banks, mask_banks = _split_scores(qbd, kT, None if keep is not None and not apart
                                      else mask_row, consts.ones, g, P, mask_apart=apart,
                                      window=keep is not None)
    if keep is not None:
        for bank in tiles.unrolled(g.n_banks):
            w = g.bank_cols[bank]
            c0 = bank * tiles.PSUM_FMAX
            port.keep_where(banks[bank][0:P, 0:w], keep[0:P, c0:c0 + w],
                            0.0 if apart else NEG)
    e, e_t = consts.e, consts.e_t
    if transforms:
        banks = _split_mods(banks, mask_banks, g, rows, P, rm, e, cap)
    neg_m = _row_max(banks, g, rows, P, consts.unit)
    p_sb, l_p = _exp_scores(banks, neg_m, g, P, mm)
    del banks
    if g.pack > 1:
        l_ps = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.psum)
        port.nc_matmul(l_ps[0:rows, 0:1], e_t, l_p)
        l_col = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(l_col, l_ps, engine="vector")
    else:
        l_col = l_p
    return p_sb, l_col, neg_m


def _split_back(state, v_all, part_flat, o_idx, t, g, rows, mm, rm=None, item=None,
                v_col=None, after_pv=None):
    """Second half (:func:`_split_front`): ``P V``, the normalization and the scatter of the
    partial ``o | lse`` (one ``(rows, D + 1)`` tile, one DMA). ``item``: ``(s_i, L)`` columns
    of the work item (ALiBi); ``v_col``: an FP8 cache's V scale (:func:`_normalize_rows`);
    ``after_pv``: called once ``P V`` has read ``v_all`` (before the normalization and the
    store), or None.

    The item's sequence is runtime data, so the partial rows are scattered by indirect DMA to
    the flat rows in column ``t`` (the step) of the int32 ``o_idx`` (rows of the ``((B + 1)
    Hq T S, D + 1)`` view, row then slot: made for all steps in the program's headers). A
    padding item (``b = B``) writes into the trash block.
    """
    p_sb, l_col, neg_m = state
    P = g.pack * rows
    pT = _transpose_probs(p_sb, g, P, mm)
    acc = _split_pv(v_all, pT, g, rows, P)
    if after_pv is not None:
        after_pv()
    part = nl.ndarray((rows, g.D + 1), dtype=nl.float32, buffer=nl.sbuf)
    _normalize_rows(acc, l_col, rows, g, v_col, part[0:rows, 0:g.D])
    lse_out = part[0:rows, g.D:g.D + 1]
    if rm is not None and rm.mods.alibi:
        lse = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        _lse_column(neg_m[0:rows], l_col, lse)
        _alibi_lse_shift(lse, rm, item[0], item[1], rm.T, g.rs * g.n, rows, lse_out)
    else:
        _lse_column(neg_m[0:rows], l_col, lse_out)
    port.dma_copy(port.rows(part_flat, o_idx, t), part, legacy_isa=True)


# ============================================================================================
# The tail: the partial key row and the T new tokens
# ============================================================================================
def _new_token_bias(tree_mask, T):
    """``(T, T)`` bias among the new tokens (bf16): 0 where token t sees token u, else
    DECODE_MASK_BIAS. Causal (``u <= t``) from an affine iota when ``tree_mask`` is None."""
    bias = nl.ndarray((T, T), dtype=_mask_dtype(), buffer=nl.sbuf)
    if tree_mask is None:
        ahead = nl.ndarray((T, T), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(ahead, [[1, T]], channel_multiplier=-1)                   # u - t
        port.tensor_scalar(bias, ahead, op0=nl.greater, operand0=0.0, op1=nl.multiply,
                           operand1=NEG)
        return bias
    seen = nl.ndarray((T, T), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(seen, tree_mask[0:T, 0:T])
    # (seen - 1) * (-NEG): 0 where seen, NEG where hidden
    port.tensor_scalar(bias, seen, op0=nl.subtract, operand0=1.0, op1=nl.multiply,
                       operand1=-NEG)
    return bias


def _token_selector(T, rt0, rows):
    """``Sel (T, rows)`` bf16: ``Sel[t, p] = 1`` iff query row ``rt0 + p`` is new token t
    (rows are ``(g, t)`` pairs, row = g T + t): ``Sel^T @ bias`` gives each row its token's mask
    row."""
    diff = nl.ndarray((T, rows), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(diff, [[1, rows]], offset=rt0 + T, channel_multiplier=-1)    # rt0 + p - t + T
    sel = nl.ndarray((T, rows), dtype=_mask_dtype(), buffer=nl.sbuf)
    port.tensor_scalar(sel, M.int_mod(diff, T), op0=nl.equal, operand0=0.0)
    return sel


def _paged_tail_rows(cfg, io, tail, c, count, skip):
    """int32 ``(count, 1)``: the row of the page pools' ``(num_blocks Hkv page_size, D)`` view
    holding logical position ``Lp + c + q`` of the tail's sequence b and kv head h, for
    partition q.

    Position p is offset ``p mod page_size`` of page ``block_table[b, p // page_size]`` (one
    int32 gathered per partition by indirect DMA), i.e. pool row
    ``(page Hkv + h) page_size + p mod page_size``. ``skip`` (int32, 0 or a power of two above
    the table, or None) pushes a partition's table index out of bounds: it reads no entry and
    keeps the page number ``num_blocks``, so its K/V gather is skipped as well. Negative
    positions (only ever skipped ones) are clamped to 0 first.
    """
    table = io.block_table
    B, MB = table.shape
    num_blocks, Hkv, ps = io.k_cache.shape[0], io.k_cache.shape[1], io.k_cache.shape[2]
    col = (count, 1)
    pos0 = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.iota(pos0, [[0, 1]], offset=c, channel_multiplier=1)
    pos = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(pos, pos0, op0=nl.add, operand0=tail.seq.lp[0:count, nl.ds(tail.j, 1)],
                       op1=nl.maximum, operand1=0.0)
    within = M.int_mod(pos, ps)
    q_f = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.iota(q_f, [[0, 1]], channel_multiplier=1)
    # b MB + p // page_size = iota(b MB + q) + ((p - p mod page_size) / page_size - q)
    block0 = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(block0, pos, within, op=nl.subtract)
    block_q = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(block_q, block0, op0=nl.multiply, operand0=1.0 / ps,
                              op1=nl.subtract, operand1=q_f)
    first = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
    port.iota(first, [[0, 1]], channel_multiplier=1, runtime=_terms(tail.b, MB),
              offsets=io.offsets)
    entry = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(entry, first, block_q, op=nl.add)
    if skip is not None:
        skipped = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_tensor(skipped, entry, skip, op=nl.add)
        entry = skipped
    page = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
    port.memset(page, num_blocks, engine="gpsimd")
    table_flat = table.reshape((B * MB, 1))
    port.dma_copy(page, port.rows(table_flat, entry), oob_skip=True)
    # h page_size + p mod page_size = iota(h page_size + q) + (p mod page_size - q)
    h_q = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
    port.iota(h_q, [[0, 1]], channel_multiplier=1, runtime=_terms(tail.h, ps),
              offsets=io.offsets)
    within_q = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(within_q, within, q_f, op=nl.subtract)
    offset = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(offset, h_q, within_q, op=nl.add)
    stride = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
    port.memset(stride, Hkv * ps, engine="gpsimd")
    rows = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(rows, page, stride, op=nl.multiply)
    out = nl.ndarray(col, dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(out, rows, offset, op=nl.add)
    return out


def _guards_new_values(T):
    """Whether a tail guards its new tokens' values (a ``[V | flag]`` column, NaN for rows
    that weigh a non-finite one): only when some row may not see some new token (T > 1)."""
    return int(T > 1)


def _tail_groups(ns, T):
    """The tail's gather groups ``(first slot, end)`` over its ``C = ns + T`` slots (``ns =
    n - 1`` of the partial key row, then the T new tokens; slot q is position ``Lp - ns +
    q``), one K and one V gather (and transpose, and P V) each, on partitions from 0: the
    partial row and the new tokens apart when the new tokens' values are guarded (T > 1:
    ``C`` may also exceed the 128 partitions), else all ``n`` slots in one."""
    if _guards_new_values(T):
        return ([(0, ns)] if ns else []) + [(ns, ns + T)]
    return [(0, ns + T)]


def _tail_partial(cfg, io, tail):
    """Partial (o, lse) of ``tail`` (:class:`_Tail`: one sequence and kv head) over its last
    positions, into the last slot.

    Keys: the ``Lp mod n`` committed positions of the last, partial key row (gathered into
    ``n - 1`` slots, position ``Lp - (n - 1) + q`` in slot q; slots before the row start are
    skipped and masked) and the T new tokens (positions ``Lp .. L - 1``), masked causally or by
    ``tree_mask``. One position per partition, so the read is exact at any length. Every row
    sees at least its own token, so this partial is never empty.

    Contiguous caches ``(B, Hkv, S_max, D)``, or page pools ``(num_blocks, Hkv, page_size, D)``
    with ``io.block_table``: positions are then looked up in the block table
    (:func:`_paged_tail_rows`).

    Score modifiers (``cfg.mods``): key column ``col`` sits ``col - (n - 1) - t`` positions
    from new token t (ALiBi, two-sided with a tree mask), the masks are kept apart from a
    soft-cap's tanh, and the sink (once per row, here) joins this partial.
    """
    k_cache, v_cache = io.k_cache, io.v_cache
    T, D, n, R, mm = cfg.T, cfg.D, cfg.n, cfg.R, cfg.mm
    B, Hkv, S_max = v_cache.shape[0], v_cache.shape[1], v_cache.shape[2]  # paged: pool, page
    paged = io.block_table is not None
    seq, j = tail.seq, tail.j
    ns = n - 1                      # slots of the partial key row
    C = ns + T                      # score columns: [partial row | new tokens]
    n_dt = tiles.ceil_div(D, PMAX)
    k_pos = None if cfg.k_t else k_cache.reshape((B * Hkv * S_max, D))
    v_pos = v_cache.reshape((B * Hkv * S_max, D))
    bh = _terms(tail.b, cfg.Hkv) + tail.h                   # b Hkv + h, a linear form

    # ---- the C positions Lp - (n - 1) + q, in gather groups (_tail_groups) ----
    # [V | flag] for the new tokens when T > 1: a new token's value may be hidden from some
    # rows (causal or tree mask), so its non-finite entries are zeroed and flagged
    # (forward.guard_values): a row that gives it weight gets NaN, the others never compute
    # 0 * inf. One new token is seen by every row (the tree mask's diagonal is set), like the
    # splits' values: no guard, and one group for the partial row and the token
    guard = _guards_new_values(T)
    groups = []
    for gi, (g0, g1) in enumerate(_tail_groups(ns, T)):
        size = g1 - g0
        if not paged:
            # the head's column h S_max + q plus the group's offsets (sequence, Lp, skips)
            idx = nl.ndarray((size, 1), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_tensor(idx, seq.head_rows[0:size, nl.ds(tail.hh, 1)],
                               seq.offsets[gi][0:size, nl.ds(j, 1)], op=nl.add)
        else:
            idx = _paged_tail_rows(cfg, io, tail, g0 - ns, size,
                                   seq.before[0:size, nl.ds(j, 1)] if g0 < ns else None)
        flag = guard if g0 >= ns else 0             # the new tokens' group
        k_g = None if cfg.k_t else nl.ndarray((size, D), dtype=mm, buffer=nl.sbuf)
        v_g = nl.ndarray((size, D + flag), dtype=mm, buffer=nl.sbuf)
        if g0 < ns:                                 # slots before the row start: skipped
            if k_g is not None:
                port.memset(k_g, 0, engine="gpsimd")
            port.memset(v_g, 0, engine="gpsimd")
        if k_g is not None:
            port.dma_copy(k_g, port.rows(k_pos, idx), oob_skip=True)
        port.dma_copy(v_g[0:size, 0:D], port.rows(v_pos, idx), oob_skip=True)
        if flag:
            port.tensor_reduce(v_g[0:size, D:D + 1], nl.maximum,
                               M.zero_non_finite(v_g[0:size, 0:D])[0], axis=(1,))
        groups.append((g0, g1, k_g, v_g, flag))

    # ---- K^T of all C keys ----
    kT = (_tail_keys_from_window(cfg, io, tail, C) if cfg.k_t else
          nl.ndarray((PMAX, n_dt * C), dtype=mm, buffer=nl.sbuf))
    for dt in tiles.unrolled(0 if cfg.k_t else n_dt):
        d0 = dt * PMAX
        dsz = min(PMAX, D - d0)
        t_ps = nl.ndarray((PMAX, tiles.PSUM_FMAX), dtype=port.transpose_dtype(mm),
                          buffer=nl.psum)
        for g0, g1, k_g, _, _ in groups:
            port.nc_transpose(t_ps[0:dsz, g0:g1], k_g[0:g1 - g0, d0:d0 + dsz])
        port.tensor_copy(kT[0:dsz, dt * C:(dt + 1) * C], t_ps[0:dsz, 0:C], engine="scalar")

    # the flagged group first: its P V writes the flag column the others do not accumulate
    values = sorted([(g0, g1, v_g, flag) for g0, g1, _, v_g, flag in groups],
                    key=lambda v: -v[3])
    for i, rt0, rows in _row_tiles(R, cfg.row_tile):
        _tail_rows(cfg, io, tail, bh, kT, values, (seq.selectors[i], seq.ones[i]), rt0, rows)


def _tail_keys_from_window(cfg, io, tail, C):
    """K^T ``(128, n_dt C)`` of the tail's ``C = n - 1 + T`` slots (slot q: position ``Lp - (n
    - 1) + q``, :func:`_tail_partial`) from a K^T cache ``(B, Hkv, D, S_max)``
    (``k_layout="bhds"``).

    The slots span at most ``nr = ceil((2 n - 2 + T) / n)`` key rows from row ``r0 =
    floor((Lp + 1) / n) - 1``; each is one indirect DMA of ``n`` positions per head-dim row
    (row ``((b Hkv + h) D + d) S_max / n + r0 + i`` of the view ``(B Hkv D S_max / n, n)``),
    skipped when it starts before position 0 or at or after ``L = Lp + T``. The window's
    positions outside ``[0, L)`` are replaced by zeros (selection: they may hold anything),
    so every key the scores see is finite (the slots before 0 are masked by the tail's bias).
    Slot q is window column ``q + (Lp + 1) mod n``, a runtime shift: each window tile of
    <= 128 columns is transposed on TensorE (positions on partitions) and multiplied by the
    0/1 shift matrix ``Sh[c, q] = [c = q + shift]``, which selects exactly (one non-zero term
    per output, so the keys come out bit for bit)."""
    n, D, T, mm = cfg.n, cfg.D, cfg.T, cfg.mm
    B, Hkv, _, S_max = io.k_cache.shape
    line = S_max // n                                   # key rows per (b, h, d) line
    total = B * Hkv * D * line
    rows_view = io.k_cache.reshape((total, n))
    oob = float(_oob_offset(total))
    nr = tiles.ceil_div(2 * n - 2 + T, n)
    span = nr * n
    n_dt = tiles.ceil_div(D, PMAX)
    col = (PMAX, 1)
    lp = tail.seq.lp[0:PMAX, nl.ds(tail.j, 1)]
    lp1 = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(lp1, lp, op0=nl.add, operand0=1.0)
    shift = M.int_mod(lp1, n)                           # slot 0's window column
    start = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(start, lp1, op0=nl.subtract, operand0=float(n), op1=nl.subtract,
                              operand1=shift)           # r0 n
    end = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(end, lp, op0=nl.add, operand0=float(T))          # L
    # keep[c] = 0 <= start + c < L
    pos = nl.ndarray((PMAX, span), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(pos, [[1, span]])
    port.tensor_scalar(pos, pos, op0=nl.add, operand0=start)
    above = nl.ndarray((PMAX, span), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(above, pos, op0=nl.greater_equal, operand0=0.0)
    keep_f = nl.ndarray((PMAX, span), dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(keep_f, pos, op0=nl.less, operand0=end, op1=nl.multiply,
                              operand1=above)
    keep = nl.ndarray((PMAX, span), dtype=nl.uint8, buffer=nl.sbuf)
    port.tensor_copy(keep, keep_f, engine="gpsimd")
    win = nl.ndarray((PMAX, n_dt * span), dtype=mm, buffer=nl.sbuf)
    bh = _terms(tail.b, cfg.Hkv) + tail.h
    for dt, d0, dsz in [(dt, dt * PMAX, min(PMAX, D - dt * PMAX)) for dt in tiles.unrolled(n_dt)]:
        first = nl.ndarray((dsz, 1), dtype=nl.int32, buffer=nl.sbuf)
        port.iota(first, [[0, 1]], offset=d0 * line, channel_multiplier=line,
                  runtime=_terms(bh, D * line), offsets=io.offsets)
        for i in tiles.unrolled(nr):
            # r0 + i, pushed past the view when row i is not kept (its first column)
            r_i = nl.ndarray((dsz, 1), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_scalar(r_i, start[0:dsz], op0=nl.multiply, operand0=1.0 / n,
                               op1=nl.add, operand1=float(i))
            skip = nl.ndarray((dsz, 1), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_scalar(skip, keep_f[0:dsz, i * n:i * n + 1], op0=nl.subtract,
                               operand0=1.0, reverse0=True, op1=nl.multiply, operand1=oob)
            idx = _int_tile([(first, 1), (r_i, 1), (skip, 1)], dsz, 1)
            port.dma_copy(win[0:dsz, nl.ds(dt * span + i * n, n)], port.rows(rows_view, idx),
                          oob_skip=True)
        port.keep_where(win[0:dsz, nl.ds(dt * span, span)], keep[0:dsz, 0:span], 0.0)
    kT = nl.ndarray((PMAX, n_dt * C), dtype=mm, buffer=nl.sbuf)
    groups = [(c0, min(PMAX, span - c0)) for c0 in tiles.unrolled(0, span, PMAX)]
    shifts = []
    for c0, cs in groups:
        diff = nl.ndarray((cs, C), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(diff, [[-1, C]], offset=c0, channel_multiplier=1)        # c0 + c - q
        sh = nl.ndarray((cs, C), dtype=mm, buffer=nl.sbuf)
        port.tensor_scalar(sh, diff, op0=nl.equal, operand0=shift[0:cs])
        shifts.append(sh)
    for dt in tiles.unrolled(n_dt):
        d0 = dt * PMAX
        dsz = min(PMAX, D - d0)
        kt_ps = nl.ndarray((PMAX, C), dtype=nl.float32, buffer=nl.psum)
        for gi, (c0, cs) in enumerate(groups):
            t_ps = nl.ndarray((PMAX, PMAX), dtype=port.transpose_dtype(mm), buffer=nl.psum)
            port.nc_transpose(t_ps[0:cs, 0:dsz], win[0:dsz, nl.ds(dt * span + c0, cs)])
            k_nat = nl.ndarray((cs, dsz), dtype=mm, buffer=nl.sbuf)
            port.tensor_copy(k_nat, t_ps[0:cs, 0:dsz], engine="vector")
            port.nc_matmul(kt_ps[0:dsz, 0:C], k_nat, shifts[gi], accumulate=gi > 0)
        port.tensor_copy(kT[0:dsz, dt * C:(dt + 1) * C], kt_ps[0:dsz, 0:C], engine="scalar")
    return kT


def _tail_rows(cfg, io, tail, bh, kT, values, tile, rt0, rows):
    """One row tile of :func:`_tail_partial`: query rows ``rt0 .. rt0 + rows`` of the kv head
    against the tail's ``C = n - 1 + T`` keys (``kT``, ``values``: ``(first slot, end, V
    [| flag], flag)`` of each gather group, the flagged one first; ``tile``: the tile's
    :func:`_token_selector` and ``(1, rows)`` ones)."""
    T, D, n, R, mm = cfg.T, cfg.D, cfg.n, cfg.R, cfg.mm
    ns = n - 1
    C = ns + T
    n_dt = tiles.ceil_div(D, PMAX)
    new_bias = tail.seq.new_bias
    part_bias = (None if ns == 0 else
                 tail.seq.part_bias[0:1, nl.ds(tail.j * ns, ns)])   # the sequence's mask row
    selector, ones = tile
    row0 = _expr(bh) * R + rt0
    q_nat = nl.ndarray((rows, D), dtype=io.q_rows.dtype, buffer=nl.sbuf)
    port.dma_copy(q_nat, io.q_rows[nl.ds(row0, rows), 0:D])
    kv = tail.scales
    qT = _scaled_query_t(q_nat, rows, D, n_dt, cfg.scale, mm,
                         None if kv is None else kv[0:rows, 0:1])
    s_ps = nl.ndarray((rows, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.psum)
    port.nc_matmul(s_ps[0:rows, 0:C], qT[0:min(PMAX, D), 0:rows], kT[0:min(PMAX, D), 0:C])
    for dt in tiles.unrolled(1, n_dt):
        dsz = min(PMAX, D - dt * PMAX)
        port.nc_matmul(s_ps[0:rows, 0:C], qT[0:dsz, dt * rows:(dt + 1) * rows],
                       kT[0:dsz, dt * C:(dt + 1) * C], accumulate=True)
    rm = (None if cfg.mods == SM.Mods() else
          _RowMods(cfg.mods, tail.slope_g, tail.sink_g, cfg.G, T, rt0, rows))
    transforms = rm is not None and rm.mods.transforms
    guard = _guards_new_values(T)
    scores = mk_ps = None
    if not (guard or transforms):
        # one new token, seen by every row, and no tanh to flatten a mask: only the partial
        # row's slots before its start are hidden, and they hold zero keys (finite scores),
        # so their bias accumulates onto the scores in PSUM, which max and exp read there
        if ns > 0:
            port.nc_matmul(s_ps[0:rows, 0:ns], ones, part_bias, accumulate=True)
        scores = s_ps[0:rows, 0:C]
    else:
        # the masks in their own PSUM tile, applied by selection after the modifiers: a
        # non-finite key a row cannot see (a later new token) never reaches it, and a tanh
        # cannot flatten them
        mk_ps = nl.ndarray((rows, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.psum)
        if ns > 0:
            port.nc_matmul(mk_ps[0:rows, 0:ns], ones, part_bias)
        port.nc_matmul(mk_ps[0:rows, ns:C], selector, new_bias)
    if transforms:
        d = slope = None
        if rm.mods.alibi:
            col = nl.ndarray((rows, C), dtype=nl.float32, buffer=nl.sbuf)
            port.iota(col, [[1, C]], offset=-ns)
            d = nl.ndarray((rows, C), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(d, col, op0=nl.subtract, operand0=rm.t)
            slope = rm.slope
            if io.tree_mask is not None:      # a tree may let a token see a later one
                d_abs = nl.ndarray((rows, C), dtype=nl.float32, buffer=nl.sbuf)
                port.activation(d_abs, nl.abs, d)
                d = d_abs
                slope = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
                port.tensor_scalar(slope, rm.slope, op0=nl.multiply, operand0=-1.0)
        scores = _modified(rm.mods, s_ps[0:rows, 0:C], None, d, slope, cfg.mods.softcap)
    if scores is None:
        scores = nl.ndarray((rows, C), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(scores, s_ps[0:rows, 0:C], engine="vector")
    if mk_ps is not None:
        hidden = nl.ndarray((rows, C), dtype=nl.uint8, buffer=nl.sbuf)
        port.tensor_scalar(hidden, mk_ps[0:rows, 0:C], op0=nl.less, operand0=0.0)
        port.tensor_copy_predicated(scores, NEG, hidden)

    m = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_reduce(m, nl.maximum, scores, axis=(1,))
    neg_m = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.activation(neg_m, nl.copy, m, scale=-1.0)
    l_col = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    p_sb = nl.ndarray((rows, C), dtype=mm, buffer=nl.sbuf)
    port.activation_reduce(p_sb, nl.exp, scores, reduce_op=nl.add, reduce_res=l_col,
                           bias=neg_m)
    pt_ps = nl.ndarray((PMAX, 2 * PMAX), dtype=port.transpose_dtype(mm), buffer=nl.psum)
    for i, (g0, g1, _, _) in enumerate(values):
        port.nc_transpose(pt_ps[0:g1 - g0, i * PMAX:i * PMAX + rows], p_sb[0:rows, g0:g1])
    o_ps = nl.ndarray((rows, D + 1), dtype=nl.float32, buffer=nl.psum)
    for i, (g0, g1, v_g, flag) in enumerate(values):
        pt_g = nl.ndarray((g1 - g0, rows), dtype=mm, buffer=nl.sbuf)
        port.activation(pt_g, nl.copy, pt_ps[0:g1 - g0, i * PMAX:i * PMAX + rows])
        port.nc_matmul(o_ps[0:rows, 0:D + flag], pt_g, v_g, accumulate=i > 0)

    inv_l = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.reciprocal(inv_l, l_col)
    if kv is not None:              # an FP8 cache: the output of the dequantized values
        port.tensor_tensor(inv_l, inv_l, kv[0:rows, 1:2], op=nl.multiply)
    if guard:                       # rows that weighed a flagged value: times NaN
        poison = nl.ndarray((rows, 1), dtype=nl.uint8, buffer=nl.sbuf)
        port.tensor_scalar(poison, o_ps[0:rows, D:D + 1], op0=nl.greater, operand0=0.0)
        port.tensor_copy_predicated(inv_l, float("nan"), poison)
    part = nl.ndarray((rows, D + 1), dtype=nl.float32, buffer=nl.sbuf)
    sink = rm is not None and rm.sink is not None
    o_sb = nl.ndarray((rows, D), dtype=nl.float32, buffer=nl.sbuf) if sink else part[0:rows, 0:D]
    port.activation(o_sb, nl.copy, o_ps[0:rows, 0:D], scale=inv_l)
    log_l = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.activation(log_l, nl.log, l_col)
    lse = (nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf) if sink
           else part[0:rows, D:D + 1])
    port.tensor_tensor(lse, m, log_l, op=nl.add)
    if sink:
        _with_sink(o_sb, lse, rm.sink, rows, part)
    port.dma_copy(io.part[nl.ds(row0, rows), cfg.S - 1, 0:D + 1], part)


# ============================================================================================
# Phase 1 kernel
# ============================================================================================
class _Config(NamedTuple):
    """Compile-time facts of one split-kernel launch (plain Python values)."""

    B: int
    Hq: int
    Hkv: int
    G: int              # query heads per kv head
    T: int              # new tokens per sequence
    D: int
    R: int              # query rows per kv head, G T
    S: int              # partial slots per query row, num_splits + 1 (the last: the tail)
    n: int              # key row
    split_rows: int     # key rows per split
    pack: int
    row_tile: int
    ipp: int            # work items per chunk program
    hpp: int            # kv heads per program
    scale: float
    mm: object          # matmul operand dtype (of the namespace being traced)
    mods: object        # score_mods.Mods
    k_t: bool = False   # K cache transposed, (B, Hkv, D, S_max) (k_layout "bhds")


class _Tensors(NamedTuple):
    """The kernel's HBM tensors (inputs as given, q as ``(B Hkv R, D)`` rows; optional ones
    None) and the runtime-offset table of the program indices (:class:`port.OffsetColumns`;
    it holds nothing in legacy, where the indices are index expressions)."""

    q_rows: object
    k_cache: object
    v_cache: object
    cache_lens: object
    work: object
    tree_mask: object
    block_table: object
    alibi_slopes: object
    sinks: object
    kv_scale: object    # an FP8 cache's (Hkv, 2) float32 (k_scale, v_scale), else None
    zero_row: object    # (1, n_kv n D) zeros in the cache dtype (the K/V zero fills), or None
    part: object        # ((B + 1) Hq T, S, D + 1) float32: the partials, o | lse
    offsets: object


class _TailSequence(NamedTuple):
    """What the tails of ``count`` consecutive sequences share across their kv heads
    (:func:`_tail_sequence`, made once per tail program, or once per chunk program for the
    tails it runs beside its splits), column j for sequence ``b0 + j``: the committed lengths
    ``lp = L - T`` (fp32 ``(128, count)``); for a contiguous cache, per gather group
    ``(g0, g1)`` of :func:`_tail_groups`, the int32 ``(g1 - g0, count)`` offsets ``b Hkv S_max
    + Lp - (n - 1) + g0 (+ before)`` of partition p's flat row (slot ``g0 + p``) from ``h
    S_max + p`` (``offsets``, else None); with ``n > 1`` the int32 ``(size, count)`` push out
    of bounds of the slots before the partial row's start (``before``, over the first group's
    ``size`` partitions) and their ``(1, count (n - 1))`` mask rows (``part_bias``, sequence j
    at columns ``j (n - 1) ..``; both None at n = 1); the ``(T, T)`` new-token bias, the token
    selector and the ``(1, rows)`` ones of each row tile (:func:`_token_selector`); for a
    contiguous cache the int32 ``(largest group, hpp)`` ``head_rows``, column ``hh`` the row
    ``h S_max + p`` of partition p for head ``h = hg hpp + hh`` (else None)."""

    lp: object
    offsets: list
    before: object
    part_bias: object
    new_bias: object
    selectors: list
    ones: list
    head_rows: object


class _Tail(NamedTuple):
    """One tail: sequence ``b`` and kv head ``h`` (linear forms ``[(index, coefficient), ...]``
    of the program's indices), the sequences' shared state ``seq`` (:class:`_TailSequence`)
    and the sequence's column ``j`` in it, the head's ALiBi slopes / sinks ``(G, 1)`` and an
    FP8 cache's ``(k_scale, v_scale)`` on the query rows' partitions ``(rows, 2)`` (each or
    None)."""

    b: list
    h: list
    hh: object          # the head's index within the program's group (a loop index)
    seq: _TailSequence
    j: object           # the sequence's column in seq (an int or a loop index expression)
    slope_g: object
    sink_g: object
    scales: object


def _expr(terms):
    """The index expression ``sum c e`` of a linear form (for ``nl.ds`` starts)."""
    out = None
    for e, c in terms:
        term = e if c == 1 else e * c
        out = term if out is None else out + term
    return 0 if out is None else out


def _tail_sequence(cfg, io, hg, b0, count):
    """:class:`_TailSequence` of the ``count`` sequences ``b0 ..`` (``b0`` a linear form of the
    program's indices) for the heads of group ``hg``: the index arithmetic, masks and
    selectors their tails share, made once for the kv heads (and sequences) of a program
    rather than once per tail (at B = 64, S = 2048, Hq = 32, Hkv = 8 on trn2 they were about
    340 us of VectorE and 260 us of GpSimd, per head); every instruction serves all
    ``count`` sequences at once (one column each)."""
    T, n = cfg.T, cfg.n
    ns = n - 1
    groups = _tail_groups(ns, T)
    lead = groups[0][1] - groups[0][0]          # the first group's slots (from slot 0)
    widest = max(g1 - g0 for g0, g1 in groups)
    len_col = _length_columns(io.cache_lens, _expr(b0), count, PMAX)
    lp, rem = _committed_split(len_col, T, n)
    paged = io.block_table is not None
    offsets = before = part_bias = head_rows = None
    if not paged:
        S_max = io.v_cache.shape[2]
        oob = _oob_offset(io.v_cache.shape[0] * io.v_cache.shape[1] * S_max)
        head_rows = nl.ndarray((widest, cfg.hpp), dtype=nl.int32, buffer=nl.sbuf)
        port.iota(head_rows, [[S_max, cfg.hpp]], channel_multiplier=1,
                  runtime=[(hg, cfg.hpp * S_max)], offsets=io.offsets)
    else:
        oob = _oob_offset(io.block_table.shape[0] * io.block_table.shape[1])  # past the table
    if ns > 0:
        # slot q is committed and in the partial row iff q >= (n - 1) - (Lp mod n)
        first = nl.ndarray(tuple(rem.shape), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(first, rem, op0=nl.subtract, operand0=float(ns),
                           reverse0=True)                                # (n - 1) - rem
        slot_col = nl.ndarray((lead, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(slot_col, [[0, 1]], channel_multiplier=1)
        before = nl.ndarray((lead, count), dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_scalar(before, first[0:lead], op0=nl.greater, operand0=slot_col,
                           op1=nl.multiply, operand1=float(oob))
    if not paged:
        # b Hkv S_max of each sequence (int32: exact at any cache size)
        seq_rows = nl.ndarray((widest, count), dtype=nl.int32, buffer=nl.sbuf)
        port.iota(seq_rows, [[cfg.Hkv * S_max, count]], runtime=_terms(b0, cfg.Hkv * S_max),
                  offsets=io.offsets)
        offsets = []
        for g0, g1 in groups:
            size = g1 - g0
            start = nl.ndarray((size, count), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_scalar(start, lp[0:size], op0=nl.subtract, operand0=float(ns - g0))
            if g0 < ns:
                skipped = nl.ndarray((size, count), dtype=nl.int32, buffer=nl.sbuf)
                port.tensor_tensor(skipped, start, before, op=nl.add)
                start = skipped
            off = nl.ndarray((size, count), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_tensor(off, start, seq_rows[0:size], op=nl.add)
            offsets.append(off)
    if ns > 0:
        slot_row = nl.ndarray((1, ns), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(slot_row, [[1, ns]])
        part_bias = nl.ndarray((1, count * ns), dtype=_mask_dtype(), buffer=nl.sbuf)

        def mask_row(j):            # slot u of sequence j is hidden when u < first_j
            port.tensor_scalar(part_bias[0:1, nl.ds(j * ns, ns)], slot_row, op0=nl.less,
                               operand0=first[0:1, nl.ds(j, 1)], op1=nl.multiply, operand1=NEG)

        port.loop(count, mask_row)
    row_tiles = _row_tiles(cfg.R, cfg.row_tile)
    selectors = [_token_selector(T, rt0, rows) for _, rt0, rows in row_tiles]
    ones = [nl.ones((1, rows), dtype=_mask_dtype(), buffer=nl.sbuf) for _, _, rows in row_tiles]
    return _TailSequence(lp, offsets, before, part_bias,
                         _new_token_bias(io.tree_mask, T), selectors, ones, head_rows)


def _tail_heads(cfg, io, seq, hg, b, j, hh):
    """The tail of sequence ``b`` (a linear form; column ``j`` of ``seq``) for kv head ``hg
    hpp + hh`` (:func:`_tail_partial`)."""
    h = [(hg, cfg.hpp), (hh, 1)]
    slope_g = sink_g = None
    if cfg.mods.alibi:
        slope_g = _member_column(io.alibi_slopes, b, h, cfg.G, io.offsets)
    if cfg.mods.sinks:
        sink_g = _member_column(io.sinks, b, h, cfg.G, io.offsets)
    scales = (None if io.kv_scale is None else
              _head_scales(io.kv_scale, h, min(cfg.R, cfg.row_tile), io.offsets))
    _tail_partial(cfg, io, _Tail(b, h, hh, seq, j, slope_g, sink_g, scales))


def _tails(cfg, io, hg, b):
    """Tail program ``(hg, b)``: the tails of sequence ``b`` (a linear form of the program's
    indices) for the kv heads ``hg hpp .. hg hpp + hpp - 1`` (:func:`_tail_partial`)."""
    seq = _tail_sequence(cfg, io, hg, b, 1)

    def head(hh):
        _tail_heads(cfg, io, seq, hg, b, 0, hh)

    port.loop(cfg.hpp, head)


class _KeyWindows:
    """The keys of a chunk program's steps from a K^T cache ``(B, Hkv, D, S_max)``
    (``k_layout="bhds"``, contiguous): split s of sequence b for kv head h is, on head-dim row
    d, the ``W = rs n`` positions ``s W ..`` -- row ``((b Hkv + h) D + d) S_max / W + s`` of
    the view ``(B Hkv D S_max / W, W)`` (W divides S_max: ``tiles.decode_transposed_split``)
    -- one indirect DMA per head-dim tile and step, each partition one contiguous run of
    ``2 W`` bytes (bf16), landing in position order in ``kT`` (:func:`_split_scores`'s
    ``window``): no TensorE transposes and no PSUM copies. The whole window is read, also
    past the sequence's length in its last split; :meth:`keep` marks the committed key rows
    and :func:`_split_front` replaces the other scores. Padding items (b = B) and the
    pipeline's dead steps index past the view: nothing is read."""

    def __init__(self, cfg, io, g, bs, h0, steps):
        B, Hkv, D = cfg.B, cfg.Hkv, cfg.D
        S_max = io.k_cache.shape[3]
        self.W = g.n * g.rs
        per_line = S_max // self.W
        total = B * Hkv * D * per_line
        self.rows = io.k_cache.reshape((total, self.W))
        self.g, self.steps = g, steps
        kd = min(D, PMAX)
        ipp, hpp = cfg.ipp, cfg.hpp
        self.idx = nl.ndarray((kd, g.n_dt * (steps + 2)), dtype=nl.int32, buffer=nl.sbuf)
        dead = port.view(self.idx, 0, kd, steps, [[steps + 2, g.n_dt], [1, 2]])
        port.memset(dead, _oob_offset(total), engine="gpsimd")
        # b Hkv D per_line + s of each item (a padding item's b = B: past the view)
        base = _int_tile([(bs[0:kd, 0:ipp], Hkv * D * per_line), (bs[0:kd, ipp:2 * ipp], 1)],
                         kd, ipp)
        for dt, d0, dsz in g.d_tiles():
            def head(hh, dt=dt, d0=d0, dsz=dsz):
                first = nl.ndarray((dsz, ipp), dtype=nl.int32, buffer=nl.sbuf)
                port.iota(first, [[0, ipp]], offset=d0 * per_line, channel_multiplier=per_line,
                          runtime=_terms(h0, D * per_line) + [(hh, D * per_line)],
                          offsets=io.offsets)
                port.tensor_tensor(
                    self.idx[0:dsz, nl.ds(dt * (steps + 2) + hh * ipp, ipp)], first,
                    base[0:dsz, 0:ipp], op=nl.add)

            port.loop(hpp, head)
        # the key row of every score column (column jj rs + row, :class:`_SplitGeometry`)
        self.row_of = nl.ndarray((PMAX, g.width), dtype=nl.float32, buffer=nl.sbuf)
        for bank, col, jj, r0, ln in g.pieces:
            c0 = bank * tiles.PSUM_FMAX + col
            port.iota(self.row_of[0:PMAX, c0:c0 + ln], [[1, ln]], offset=r0)

    def gather(self, t, dst):
        """Step t's window into ``dst`` ``(128, n_dt W)`` (head-dim tile dt at ``dt W``)."""
        for dt, d0, dsz in self.g.d_tiles():
            port.dma_copy(dst[0:dsz, dt * self.W:(dt + 1) * self.W],
                          port.rows(self.rows, self.idx, dt * (self.steps + 2) + t, n=dsz),
                          oob_skip=True)

    def keep(self, valid, j):
        """uint8 ``(128, width)``: 1 on the score columns of item j's committed key rows
        (``valid``: :func:`_valid_rows`), on GpSimd (idle in a DMA-bound split)."""
        keep = nl.ndarray((PMAX, self.g.width), dtype=nl.uint8, buffer=nl.sbuf)
        port.tensor_scalar(keep, self.row_of, op0=nl.less, operand0=valid[0:PMAX, nl.ds(j, 1)],
                           engine="gpsimd")
        return keep


def _split_chunk(cfg, io, hg, c, tails=0):
    """Chunk program ``(hg, c)`` of the split kernel: work items ``c ipp .. c ipp + ipp - 1``
    for kv heads ``hg hpp .. hg hpp + hpp - 1``, i.e. ``hpp ipp`` steps ``t = hh ipp + j``
    (head ``hh`` of the group, item j). With ``tails`` (``tiles.decode_tails_per_program``),
    step ``(hh, j)`` with ``j < tails`` then also runs the tail
    of sequence ``c tails + j`` for its kv head (:func:`_tail_partial`; the sequences'
    shared tail state is made once with the headers): a tail is short, latency-bound work
    on the engines, the splits are bound by their K/V gathers, so run side by side each
    fills the other's idle time.

    1. Headers, for all steps at once (one item per column): ``(b, s)``, the sequence
       lengths, the row indices of the K/V gathers and of the query rows, the mask rows (and
       ALiBi slopes). Every runtime-indexed read of the program but the query rows of steps
       2 .. is issued here, before any split is computed, so none of them waits behind the
       engines, and the chain of small DMAs and index arithmetic is paid once per program,
       not once per step.
    2. Splits (compiled sequential loops over the heads and item pairs, software-pipelined:
       the loops carry two buffers of gathered keys, transposed keys and values): step t + 1's
       keys are transposed while step t's softmax runs, step t + 2's gathers (and query rows)
       are issued while steps t and t + 1 are computed, and each step scatters its partial
       (o, lse) when done.
       The last two gathers are of dead steps (all rows out of bounds: nothing is read), which
       keeps the loop body uniform.

    Every item is treated as possibly holding uncommitted rows (zero-filled buffers, mask
    row): whether it does is runtime data.
    """
    q_rows, k_cache, v_cache = io.q_rows, io.k_cache, io.v_cache
    B, Hkv, R, S, T, G, n = cfg.B, cfg.Hkv, cfg.R, cfg.S, cfg.T, cfg.G, cfg.n
    ipp, hpp, mm = cfg.ipp, cfg.hpp, cfg.mm
    Hq = G * Hkv
    S_max = v_cache.shape[2]
    g = _SplitGeometry(cfg.D, n, cfg.split_rows, cfg.pack)
    D, rs, kr = g.D, g.rs, g.kv_rows
    steps = hpp * ipp
    alibi = cfg.mods.alibi
    h0 = [(hg, hpp)]                                     # first kv head of the group
    if io.block_table is None:
        rows_bh = S_max // n
        k_rows = None if cfg.k_t else k_cache.reshape((B * Hkv * rows_bh, n * D))
        v_rows = v_cache.reshape((B * Hkv * rows_bh, n * D))
        oob = _oob_offset(B * Hkv * rows_bh)
    else:
        num_blocks, ppr = k_cache.shape[0], S_max // n      # S_max is the page size here
        k_rows = k_cache.reshape((num_blocks * Hkv * ppr, n * D))
        v_rows = v_cache.reshape((num_blocks * Hkv * ppr, n * D))
        oob = _oob_offset(num_blocks * Hkv * ppr)
    row_tiles = _row_tiles(R, cfg.row_tile)

    # -- 1. headers ------------------------------------------------------------------------
    cols = _item_columns(io.work, io.cache_lens, c, ipp)     # (128, 3 ipp): b | s | L
    valid = _valid_rows(cols, ipp, T, n, rs)                 # (128, ipp)
    bs = nl.ndarray((PMAX, 2 * ipp), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_copy(bs, cols[0:PMAX, 0:2 * ipp], engine="vector")
    kT = [nl.ndarray((PMAX, g.n_dt * n * rs), dtype=mm, buffer=nl.sbuf) for _ in tiles.unrolled(2)]
    if cfg.k_t:
        # a K^T cache's first two windows need only (b, s): they go out before the V row
        # indices and the zero fills are made
        window = _KeyWindows(cfg, io, g, bs, h0, steps)
        window.gather(0, kT[0])
        window.gather(1, kT[1])
    idx = nl.ndarray((kr, g.n_kv * (steps + 2)), dtype=nl.int32, buffer=nl.sbuf)
    # the two dead steps the pipeline gathers last: every row out of bounds
    dead = (idx[0:kr, steps:steps + 2] if g.n_kv == 1 else
            port.view(idx, 0, kr, steps, [[steps + 2, g.n_kv], [1, 2]]))
    port.memset(dead, oob, engine="gpsimd")
    # the zero fills' row indices (_gather_rows): the dead steps fill nothing either
    if tiles.decode_zero_by_dma(rs):
        zidx = nl.ndarray((kr, steps + 2), dtype=nl.int32, buffer=nl.sbuf)
        port.memset(zidx[0:kr, steps:steps + 2], 1, engine="gpsimd")     # the dead steps
        live = nl.ndarray((kr, ipp), dtype=nl.float32, buffer=nl.sbuf)  # 1 real, 2 padding
        port.tensor_scalar(live, cols[0:kr, 0:ipp], op0=nl.greater_equal, operand0=float(B),
                           op1=nl.add, operand1=1.0)
        _zero_rows_index(valid, live, g, ipp, hpp, zidx)
        fill = _ZeroFill(io.zero_row, zidx, None)
    else:
        fill = _ZeroFill(None, None, _zero_source(g, mm, steps + 2))
    if io.block_table is None:
        _split_row_indices(valid, bs, g, ipp, hpp, _terms(h0, rows_bh), rows_bh, Hkv * rows_bh,
                           oob, idx, io.offsets)
    else:
        _paged_split_row_indices(io.block_table, valid, cols, bs, g, ipp, hpp, h0, Hkv,
                                 num_blocks, ppr, idx, io.offsets)
    kv_cols = g.n_kv * n * D
    v_all = [nl.ndarray((kr, kv_cols), dtype=mm, buffer=nl.sbuf) for _ in tiles.unrolled(2)]
    if cfg.k_t:
        def gather_k(t, b):
            window.gather(t, kT[b])
    else:
        k_nat = [nl.ndarray((kr, kv_cols), dtype=mm, buffer=nl.sbuf)
                 for _ in tiles.unrolled(2)]

        def gather_k(t, b):
            _gather_rows(k_rows, idx, fill, t, steps, g, k_nat[b], "vector")

    def gather_v(t, b):
        _gather_rows(v_rows, idx, fill, t, steps, g, v_all[b], "gpsimd")

    # the first two steps' K/V gathers go out as soon as their row indices exist: the masks,
    # slopes, scales and query loads below then overlap them instead of delaying them
    for t in tiles.unrolled(2):
        if not cfg.k_t:
            gather_k(t, t)
        gather_v(t, t)
    mask = nl.ndarray((1, ipp * rs), dtype=_mask_dtype(), buffer=nl.sbuf)
    local = nl.ndarray((1, rs), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(local, [[1, rs]])

    def mask_item(j):
        port.tensor_scalar(mask[0:1, nl.ds(j * rs, rs)], local, op0=nl.greater_equal,
                           operand0=valid[0:1, nl.ds(j, 1)], op1=nl.multiply, operand1=NEG)

    port.loop(ipp, mask_item)
    slopes = None
    if alibi:
        slopes = nl.ndarray((G, steps), dtype=nl.float32, buffer=nl.sbuf)
        port.memset(slopes, 0.0, engine="gpsimd")

        def head_slopes(hh):
            _member_columns(io.alibi_slopes, bs, h0 + [(hh, 1)], G, ipp, slopes, hh * ipp,
                            io.offsets)

        port.loop(hpp, head_slopes)
    scl = None
    if io.kv_scale is not None:
        # an FP8 cache's (k_scale, v_scale) of every head of the group, on the rows' partitions
        rmax = row_tiles[0][2]
        scl = nl.ndarray((rmax, 2 * hpp), dtype=nl.float32, buffer=nl.sbuf)

        def head_scales(hh):
            _head_scales(io.kv_scale, h0 + [(hh, 1)], rmax, io.offsets, out=scl, col=2 * hh)

        port.loop(hpp, head_scales)
    # the query rows of every step and the flat partial rows its stores scatter to: query
    # row x S + s. Padding items (and the two dead steps) gather no query rows: their partials
    # go to the trash block. For a batch the rows are gathered two steps ahead, like K and V,
    # into slots never zeroed: gathered all here (the slots zeroed first), a hundred small DMAs
    # held the first steps' bandwidth while the pipeline waited on step 0's query (trn2,
    # Hq=32 Hkv=8: B=64 S=2048 2509.4 -> 2436.5 us, B=8 S=16384 1754.5 -> 1744.3, with a K^T
    # cache 1662.3 -> 1653.3). A single sequence's tails run first and its query loads go
    # under them: there gathering them all here models less (B=1 S=32768, ``python
    # benchmarks/decode.py --lnc 1``: 431.4 against 432.8 us; S=131072 with a K^T cache
    # 1579.8 against 1580.3)
    ahead = B > 1
    qs, o_rows = [], []
    for _, rt0, rows in row_tiles:
        q_keep = nl.ndarray((rows, (steps + 2) * D), dtype=q_rows.dtype, buffer=nl.sbuf)
        if not ahead:
            port.memset(q_keep, 0, engine="gpsimd")
        # every head's row indices in one tile: a compiled head loop then reuses no buffer a
        # previous head's gathers still read
        q_idx = nl.ndarray((rows, steps + 2), dtype=nl.int32, buffer=nl.sbuf)
        port.memset(q_idx[0:rows, steps:steps + 2], _oob_offset(B * Hkv * R),
                    engine="gpsimd")
        o_idx = nl.ndarray((rows, steps), dtype=nl.int32, buffer=nl.sbuf)

        def head_queries(hh, rt0=rt0, rows=rows, q_keep=q_keep, q_idx=q_idx, o_idx=o_idx):
            first = nl.ndarray((rows, ipp), dtype=nl.int32, buffer=nl.sbuf)
            port.iota(first, [[0, ipp]], offset=rt0, channel_multiplier=1,
                      runtime=_terms(h0, R) + [(hh, R)], offsets=io.offsets)
            cols_h = nl.ds(hh * ipp, ipp)
            _int_tile([(bs[0:rows, 0:ipp], Hkv * R)], rows, ipp, first,
                      out=q_idx[0:rows, cols_h])
            _int_tile([(q_idx[0:rows, cols_h], S), (bs[0:rows, ipp:2 * ipp], 1)], rows, ipp,
                      out=o_idx[0:rows, cols_h])
            if not ahead:
                def item(j):
                    port.dma_copy(q_keep[0:rows, nl.ds((hh * ipp + j) * D, D)],
                                  port.rows(q_rows, q_idx, hh * ipp + j), oob_skip=True)

                port.loop(ipp, item)

        port.loop(hpp, head_queries)
        qs.append((q_keep, q_idx))
        o_rows.append(o_idx)

    def load_queries(t):
        """Step t's query rows into its slot of each row tile's ``q_keep``."""
        for (_, _, rows), (q_keep, q_idx) in zip(row_tiles, qs):
            port.dma_copy(q_keep[0:rows, nl.ds(t * D, D)], port.rows(q_rows, q_idx, t),
                          oob_skip=True)

    if ahead:
        for t in tiles.unrolled(min(2, steps)):
            load_queries(t)
    consts = [_tile_constants(g, rows, mm) for _, _, rows in row_tiles]

    # -- 2. splits ------------------------------------------------------------------------
    part_flat = io.part.reshape(((B + 1) * Hq * T * S, D + 1))

    def front(hh, j, b):
        """Step (hh, j)'s headers and the first half of each row tile (on ``kT[b]``)."""
        t = hh * ipp + j
        keep = None if not cfg.k_t else window.keep(valid, j)
        mask_row = nl.ndarray((1, rs), dtype=_mask_dtype(), buffer=nl.sbuf)
        port.tensor_copy(mask_row, mask[0:1, nl.ds(j * rs, rs)], engine="gpsimd")
        slope_g = item = None
        if alibi:
            s_i = nl.ndarray((PMAX, 1), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_copy(s_i, bs[0:PMAX, nl.ds(ipp + j, 1)], engine="gpsimd")
            slope_g = nl.ndarray((G, 1), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_copy(slope_g, slopes[0:G, nl.ds(t, 1)], engine="gpsimd")
            length = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_copy(length, cols[0:PMAX, nl.ds(2 * ipp + j, 1)], engine="gpsimd")
            item = (s_i, length)
        kv = None
        if scl is not None:
            kv = nl.ndarray((rmax, 2), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_copy(kv, scl[0:rmax, nl.ds(2 * hh, 2)], engine="gpsimd")
        states = []
        for (_, rt0, rows), (q_keep, _), cst in zip(row_tiles, qs, consts):
            q_nat = nl.ndarray((rows, D), dtype=q_rows.dtype, buffer=nl.sbuf)
            port.tensor_copy(q_nat, q_keep[0:rows, nl.ds(t * D, D)], engine="gpsimd")
            rm = (_RowMods(cfg.mods, slope_g, None, G, T, rt0, rows) if cfg.mods.transforms
                  else None)
            states.append((rm, _split_front(q_nat, kT[b], mask_row, g, rows, cfg.scale, mm,
                                            cst, b, rm, cfg.mods.softcap,
                                            None if kv is None else kv[0:rows, 0:1], keep)))
        return item, kv, states

    def back(t, b, head, after_pv):
        """The second half of each row tile of step ``t`` (``front`` began it, on
        ``v_all[b]``); ``after_pv`` runs once the last row tile's ``P V`` has read
        ``v_all[b]``, before that tile's store."""
        item, kv, states = head
        last = len(row_tiles) - 1
        for r, ((_, _, rows), (rm, state), o_idx) in enumerate(zip(row_tiles, states, o_rows)):
            _split_back(state, v_all[b], part_flat, o_idx, t, g, rows, mm, rm, item,
                        None if kv is None else kv[0:rows, 1:2],
                        after_pv if r == last else None)

    seq = (None if not tails else
           _tail_sequence(cfg, io, hg, [(c, tails)], tails))      # sequences c tails + j

    def step(hh, j, b, tail=False):
        """Step ``(hh, j)`` (head hh of the group, item j) on buffer ``b``, and with ``tail``
        the tail of sequence ``c tails + j`` for the same kv head."""
        t = hh * ipp + j
        if ahead:
            load_queries(t + 2)
        if cfg.k_t:
            head = front(hh, j, b)
            gather_k(t + 2, b)                  # once step t's scores have read kT[b]
        else:
            gather_k(t + 2, b)                  # k_nat[b] is free: step t's keys are in kT[b]
            head = front(hh, j, b)
            _transpose_keys(k_nat[1 - b], kT[1 - b], g)
        # K^T cache: the tail between step t + 2's K and V gathers. Its small DMAs become
        # ready one after another as its short chain runs, and a transfer issued after them
        # cannot start in the idle bandwidth between them: after the K gather none of them
        # holds it back, before the V gather they do not wait behind it (trn2, Hq=32 Hkv=8,
        # ``python benchmarks/nkilib_side_by_side.py /tmp/nkilib-c2 --kernel tkg --decode
        # 8x16384 64x2048``: B=8 S=16384 1653.3 -> 1648.9 us, B=64 S=2048 2477.3 -> 2406.3
        # against the tail after step t's stores). A (B, Hkv, S_max, D) cache keeps it after
        # the stores: there the move models B=8 S=16384 1744.3 -> 1722.3 but B=64 S=2048
        # 2436.5 -> 2437.0 and a small LNC=2 launch no faster than LNC=1 (Hkv=1, lengths
        # [2, 300, 512]: 19.76 against 19.62 us)
        tail_first = tail and cfg.k_t
        if tail_first:
            _tail_heads(cfg, io, seq, hg, [(c, tails), (j, 1)], j, hh)
        # step t + 2's V gather right after step t's P V, ahead of step t's partial stores
        back(t, b, head, lambda: gather_v(t + 2, b))
        if tail and not tail_first:
            _tail_heads(cfg, io, seq, hg, [(c, tails), (j, 1)], j, hh)

    # Buffer b is the parity of the step: steps come in pairs (ipp even: item pairs of one
    # head; ipp = 1: pairs of heads); the first two steps' gathers are issued above.
    if not cfg.k_t:
        _transpose_keys(k_nat[0], kT[0], g)
    if steps == 1:
        step(0, 0, 0, tails > 0)
    elif ipp % 2 == 0:
        def head_items(hh):
            def pairs(first, second):
                def item_pair(jj):
                    step(hh, 2 * jj, 0, first)
                    step(hh, 2 * jj + 1, 1, second)
                return item_pair

            # the item pairs with two tails, with one (an odd count), then with none
            # (compile-time bounds)
            for lo, hi, with_tails in ((0, tails // 2, (True, True)),
                                       (tails // 2, (tails + 1) // 2, (True, False)),
                                       ((tails + 1) // 2, ipp // 2, (False, False))):
                if hi > lo:
                    port.loop(hi, pairs(*with_tails), carried=True, start=lo)

        port.loop(hpp, head_items, carried=True)
    else:
        def head_pair(hp):
            step(2 * hp, 0, 0, tails > 0)
            step(2 * hp + 1, 0, 1, tails > 0)

        port.loop(hpp // 2, head_pair, carried=True)


def decode_grid(groups: int, programs: int, core_axis=None, api: str = "legacy", lnc: int = 1):
    """The split kernel's launch grid for the namespace ``api``. Legacy: ``(head groups,
    programs)``, with axis ``core_axis`` (None, 0 or 1; its size even) spread over the two
    NeuronCores of a trn2 logical core (``nl.spmd_dim(n / 2, nl.nc(2))``: program ids stay the
    logical ones, so the kernel is unchanged). nki.*: ``(lnc,)`` (``kernel[lnc]``; the kernel
    walks the programs itself, the cores taking halves of them, :func:`port.for_programs`)."""
    if api == "nki":
        return (lnc,)
    dims = [groups, programs]
    if core_axis is not None:
        dims[core_axis] = nl.spmd_dim(dims[core_axis] // 2, nl.nc(2))
    return tuple(dims)


@port.jit
def flash_decode_split_kernel(q, k_cache, v_cache, cache_lens, work=None, tree_mask=None,
                              block_table=None, alibi_slopes=None, sinks=None, kv_scale=None,
                              zero_row=None, scale=1.0,
                              mm_dtype="bfloat16", key_row=1, split_rows=1, num_splits=1,
                              row_tile=1, pack=1, items_per_program=1, heads_per_program=1,
                              softcap=None, k_layout="bhsd"):
    """Phase 1: one partial (o, lse) per work item -- a split of the committed prefix of one
    sequence -- or tail of one sequence, for one kv head.

    Parameters
    ----------
    q : (B, Hq, T, D) float32 / bfloat16 / float16, D <= 256, T <= 128
    k_cache, v_cache : (B, Hkv, S_max, D), q's dtype; S_max a multiple of ``key_row``
        With ``block_table``: page pools ``(num_blocks, Hkv, page_size, D)``, page_size a power
        of two and a multiple of ``key_row``. Or an FP8 cache (both one 8-bit float format
        of the target, with ``kv_scale``): the K/V gathers cast it to ``mm_dtype`` on the way
        into SBUF (the DMA casts to the destination's dtype, as AWS's ``attention_tkg`` loads
        its FP8 K into a bf16 tile), so HBM moves 1 byte per element and everything after
        the gathers is unchanged.
    k_layout : "bhsd" | "bhds"
        ``"bhds"``: k_cache is contiguous and transposed, ``(B, Hkv, D, S_max)`` (v_cache
        unchanged), as nki-library's ``attention_tkg`` takes its K prior, ``[B, 1, d, S]``:
        a split's keys are read as one window per head-dim row (:class:`_KeyWindows`, S_max a
        multiple of ``key_row * split_rows``) and used untransposed, the tail's through
        :func:`_tail_keys_from_window`. The windows run to the end of the split (and key row)
        holding position ``cache_lens[b] - 1``: whatever lies past the length there is read
        but never reaches a result (selection, not an additive mask).
    cache_lens : (B,) int32, ``T <= cache_lens[b] <= S_max`` (device data; paged:
        ``<= max_blocks * page_size``)
    work : (W, 2) int32 or None
        The split work list (scheduler metadata, ``host.api.decode_work_list``): item
        ``(b, s)`` is split s of sequence b; padding items ``(B, 0)`` read nothing and write a
        trash block. Runtime data, so it may change every step; only its length W (a multiple
        of ``items_per_program``) is compile-time. None: no sequence has a full key row.
    tree_mask : (T, T) uint8 0/1, or None
        ``tree_mask[t, u] = 1``: new token t sees new token u. None: causal (``u <= t``).
    block_table : (B, max_blocks) int32, or None
        Paged cache (device data, may change every step): logical position p of sequence b is
        offset ``p mod page_size`` of page ``block_table[b, p // page_size]``. Only the entries
        of blocks holding positions below ``cache_lens[b]`` are read, one per gathered key row
        (splits) or position (tail); they must lie in ``[0, num_blocks)``.
    scale : float
        Softmax scale (any finite value).
    mm_dtype : "bfloat16" | "float16" | "float32"
        Matmul operand dtype: q's, or bfloat16 for float32 q with mixed precision.
    key_row, split_rows, num_splits, row_tile, pack : int
        ``tiles.decode_tiles``: n, key rows per split, partial slots per query row for splits
        (the most splits any sequence may have), query rows per row tile, packed copies.
    items_per_program, heads_per_program : int
        A chunk program runs ``items_per_program`` work items for ``heads_per_program`` kv
        heads (``tiles.decode_program_shape``; their product is 1 or even). It first reads the
        headers of all its steps (work items, lengths, row indices, query rows) and then
        streams the splits through two buffers of each kind: step t + 2 is gathered and step
        t + 1's keys transposed while step t is computed, so the DMA queues stay busy while
        the engines work.
    kv_scale : (Hkv, 2) float32, or None
        An FP8 cache's dequantization scales ``(k_scale, v_scale)`` per kv head (device data):
        the keys' are folded into the softmax scale of the head's query rows
        (:func:`_scaled_query_t`), the values' into its partial outputs
        (:func:`_normalize_rows`), so no dequantized cache is ever formed.
    zero_row : (1, ceil(split_rows / 128) * key_row * D) zeros in the caches' dtype (HBM)
        Required with ``work`` when ``tiles.decode_zero_by_dma(split_rows)`` (else None): the
        source of the K/V zero fills, a gathered split's rows past the committed prefix (of a
        real work item) are read from it so that they hold zeros (:func:`_gather_rows`).
    softcap, alibi_slopes, sinks :
        Score modifiers (``score_mods.py``; HBM float32 ``(1 or B, Hq)`` slopes and ``(Hq,)``
        sinks): soft-capping and ALiBi in every partial (new token t at position ``L - T +
        t``), the sink in the tail's partial only (so the merge counts it once).

    Legacy grid ``(Hkv / heads_per_program, C + B)`` (:func:`decode_grid`; nki.*:
    ``kernel[lnc]``, looping over the same programs, the chunk programs running the tails
    of the first ``C K`` sequences beside their splits, ``K =
    tiles.decode_tails_per_program(B, C, items_per_program)`` without a tree mask, the
    other tails first), ``C = W / items_per_program``: program
    ``(hg, c)`` with ``c < C`` runs work items ``c items_per_program ..`` for kv heads ``hg
    heads_per_program ..``; item ``(b, s)`` is key rows ``s * split_rows .. (s + 1) *
    split_rows`` of sequence b (positions ``n`` times that), reading only the rows entirely
    below ``Lp = cache_lens[b] - T``, into partial slot s. Program ``(hg, C + b)`` runs the
    tails of sequence b for those heads -- the ``Lp mod n`` positions of the last partial key
    row and the T new tokens -- into slot ``num_splits``.

    Returns
    -------
    part : ((B + 1) * Hq * T, num_splits + 1, D + 1) float32
        Per row ``(b * Hq + h) * T + t`` and slot, ``o | lse``: the normalized partial output
        ``[..., 0:D]`` and its LSE ``[..., D]`` (natural log of scaled scores; -inf for a
        split with no valid position), stored together (one DMA per partial row block).
        Slots of splits a sequence does not have are never written (the merge masks them);
        the last ``Hq * T`` rows are the padding items' trash.
    """
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    R = (Hq // Hkv) * T
    if k_layout not in ("bhsd", "bhds"):
        raise ValueError(f"k_layout: expected 'bhsd' or 'bhds', got {k_layout!r}")
    k_t = k_layout == "bhds"
    S_max = v_cache.shape[2]
    if k_t and (block_table is not None or tuple(k_cache.shape) != (B, Hkv, D, S_max)
                or (work is not None and S_max % (key_row * split_rows))):
        raise ValueError(
            f"k_layout='bhds': k_cache must be a contiguous (B, Hkv, D, S_max) = "
            f"{(B, Hkv, D, S_max)} cache (no block_table) whose S_max is a multiple of the "
            f"split's key_row * split_rows = {key_row * split_rows}; got k_cache "
            f"{tuple(k_cache.shape)}, block_table "
            f"{'given' if block_table is not None else 'None'}")
    S = num_splits + 1
    W = 0 if work is None else work.shape[0]
    ipp, hpp = items_per_program, heads_per_program
    if (ipp < 1 or hpp < 1 or W % ipp or Hkv % hpp or (ipp > 1 and ipp % 2)
            or (ipp == 1 and hpp > 1 and hpp % 2)):
        raise ValueError(
            f"items_per_program={ipp}, heads_per_program={hpp}: they must divide the work "
            f"items ({W}) and the kv heads ({Hkv}), and a program's steps come in pairs "
            f"(an even number of items, or 1 item and 1 or an even number of heads)")
    C = W // ipp                   # chunk programs
    zero_cols = tiles.decode_zero_row_cols(split_rows, key_row, D)
    by_dma = work is not None and tiles.decode_zero_by_dma(split_rows)
    if (zero_row is not None) != by_dma or (by_dma and tuple(zero_row.shape) != (1, zero_cols)):
        raise ValueError(
            f"zero_row: a (1, ceil(split_rows / 128) * key_row * D) = (1, {zero_cols}) tensor "
            f"of zeros is required with a work list of splits of at most "
            f"{tiles.DECODE_DMA_ZERO_FILL_MAX_ROWS} key rows, None otherwise; got "
            f"{None if zero_row is None else tuple(zero_row.shape)} (split_rows={split_rows}, "
            f"work {'given' if work is not None else 'None'})")
    if mm_dtype not in _DTYPES:
        raise ValueError(f"mm_dtype: expected one of {_DTYPES}, got {mm_dtype!r}")
    # nki.*: flat rows of a contiguous cache (or block-table entries) that may reach 2^24 take
    # the program indices' part in int32 (port.OffsetColumns(exact=True)); below that the fp32
    # sums on VectorE are exact and cheaper
    flat = (B * Hkv * S_max if block_table is None
            else block_table.shape[0] * block_table.shape[1])
    if k_t:                         # the tail's key rows of a K^T cache
        flat = B * Hkv * D * (S_max // key_row)
    # rows of "sequence B" are a trash block for padding work items
    part = nl.ndarray(((B + 1) * Hq * T, S, D + 1), dtype=nl.float32, buffer=nl.shared_hbm)
    cfg = _Config(B, Hq, Hkv, Hq // Hkv, T, D, R, S, key_row, split_rows, pack, row_tile, ipp,
                  hpp, float(scale), getattr(nl, mm_dtype),
                  SM.check_mods(softcap, alibi_slopes, sinks), k_t)
    # the program indices (head group, chunk, sequence, heads of a group) as data for nki.*'s
    # compile-time iota offsets
    io = _Tensors(q.reshape((B * Hkv * R, D)), k_cache, v_cache, cache_lens, work, tree_mask,
                  block_table, alibi_slopes, sinks, kv_scale, zero_row, part,
                  port.OffsetColumns(0, max(Hkv, B), 1,
                                     exact=flat >= tiles.FP32_EXACT_INT))

    # nki.*: the chunk programs run the tails of the first C K sequences beside their splits
    K = tiles.decode_tails_per_program(B, C, ipp, api=port.api(),
                                       tree_mask=tree_mask is not None)

    def chunk(hg, c):
        _split_chunk(cfg, io, hg, c, K)

    def tail(hg, i):
        _tails(cfg, io, hg, [(i, 1), (C * K, 1)])

    # nki.*: the other tails first, their short latency-bound chains under the chunks' headers
    port.for_program_parts((Hkv // hpp,), [(C, chunk), (B - C * K, tail)], order=(1, 0))
    return part
