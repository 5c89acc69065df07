"""Split-KV flash decoding over a KV cache (FlashDecoding), GQA-packed, with tree masks.

Two kernels, launched in order by ``host.flash_decode`` (the merge in ``decode_merge.py``,
written against ``nki_kernels.port``). The split kernel traces through the legacy namespace
only so far (under nki.* the host refuses it: ``host.api.run_decode``); it is being moved onto
``nki_kernels.port`` with its legacy instruction stream unchanged: its indirect DMAs
(``port.rows``), loads, stores and fills and part of its helpers already are. Still legacy:
``nl.arange`` index expressions (iotas at a runtime offset, strided 3-D copies), the other
helpers' tile-returning instructions, and the grid (``nl.program_id`` branch, ``nl.spmd_dim``)::

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
  zero-filled and masked as below;
* the tail program of sequence b gathers the ``Lp mod n`` committed positions of the last,
  partial key row and the T new tokens, one position per partition (same mechanism); the new
  tokens' mask (causal or ``tree_mask``) is a static (T, T) bias, the same layout every step,

so every valid K/V byte is read exactly once and nothing at or past ``L_b``. Skipped rows are
zeroed first (a zero-tile copy on trn2, memsets on trn1): a NaN left in SBUF would otherwise
survive ``0 * NaN`` in the PV matmul (and smear through a TensorE transpose on trn1). Invalid
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
1 per 128 positions and head-dim row (K^T PSUM -> SBUF); VectorE/GpSimd a few per packed
score column plus the zero-fill (a 16-bit copy at 4 elements/cycle on trn2) -- all below the
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
was 2.14x the HBM bound that way and is 1.27x this way (benchmarks/decode.py).

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
"""
import numpy as np

from nki_kernels import port, tiles
from nki_kernels.attention import masks as M
from nki_kernels.attention import score_mods as SM
from nki_kernels.nki import nisa, nki, nl

PMAX = tiles.PMAX
_DTYPES = {"float32": nl.float32, "bfloat16": nl.bfloat16, "float16": nl.float16}
#: dtype of the mask matmul operands (0/1 and DECODE_MASK_BIAS are exact enough in bf16 and
#: -1e30 is representable there, unlike fp16).
_MASK_DTYPE = nl.bfloat16
NEG = tiles.DECODE_MASK_BIAS


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
def _length_column(cache_lens, b, parts):
    """``cache_lens[b]`` as an fp32 column ``(parts, 1)`` in SBUF (the same on every partition).

    One 4-byte DMA, then a K=1 matmul ``ones(1, parts)^T @ L`` broadcasts it down the
    partitions (exact: integers < 2^24 in fp32).
    """
    len_i = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.dma_copy(len_i, cache_lens.reshape((cache_lens.shape[0], 1))[nl.ds(b, 1), 0:1])
    len_f = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(len_f, len_i, engine="vector")
    ones = nl.ones((1, parts), dtype=nl.float32, buffer=nl.sbuf)
    col_ps = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.psum)
    port.nc_matmul(col_ps, ones, len_f)
    col = nl.ndarray((parts, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(col, col_ps, engine="vector")
    return col


def _committed_split(len_col, T, n):
    """``(Lp, rem)`` columns: committed positions ``Lp = L - T`` and ``Lp mod n``."""
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
    i_j = nl.arange(ipp)[:, None]
    items = nl.ndarray((ipp, 2), dtype=nl.int32, buffer=nl.sbuf)
    port.dma_copy(items, work[nl.ds(c * ipp, ipp), 0:2])
    length = nl.ndarray((ipp, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.memset(length, 0, engine="gpsimd")
    port.dma_copy(length, port.rows(cache_lens.reshape((B, 1)), items, 0), oob_skip=True)
    vals = nl.ndarray((ipp, 3), dtype=nl.float32, buffer=nl.sbuf)
    vals[0:ipp, 0:2] = nisa.tensor_copy(items, dtype=nl.float32, engine=nisa.vector_engine)
    vals[0:ipp, 2:3] = nisa.tensor_copy(length, dtype=nl.float32, engine=nisa.vector_engine)
    ident = nisa.tensor_scalar(nisa.iota(nl.arange(ipp)[None, :] - i_j, dtype=nl.float32),
                               op0=nl.equal, operand0=0.0, dtype=nl.float32)
    diag = nl.ndarray((ipp, 3 * ipp), dtype=nl.float32, buffer=nl.sbuf)
    for v in nl.static_range(3):
        diag[0:ipp, v * ipp:(v + 1) * ipp] = nisa.tensor_scalar(
            ident, op0=np.multiply, operand0=vals[0:ipp, v:v + 1], dtype=nl.float32)
    ones = nl.ones((ipp, PMAX), dtype=nl.float32, buffer=nl.sbuf)
    cols_ps = nl.ndarray((PMAX, 3 * ipp), dtype=nl.float32, buffer=nl.psum)
    cols_ps[...] = nisa.nc_matmul(ones, diag)
    return nisa.tensor_copy(cols_ps, dtype=nl.float32, engine=nisa.vector_engine)


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


def _int_tile(terms, parts, width, acc=None):
    """int32 ``(parts, width)`` tile ``acc + sum(c * x)`` over ``(x, c)`` pairs of int32 tiles:
    int32 multiply and add (exact; fp32 engine arithmetic would round above 2^24)."""
    for x, c in terms:
        if c == 0:
            continue
        if c != 1:
            c_tile = nl.ndarray((parts, width), dtype=nl.int32, buffer=nl.sbuf)
            port.memset(c_tile, c, engine="gpsimd")
            prod = nl.ndarray((parts, width), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_tensor(prod, x, c_tile, op=nl.multiply)
            x = prod
        if acc is None:
            acc = x
        else:
            total = nl.ndarray((parts, width), dtype=nl.int32, buffer=nl.sbuf)
            port.tensor_tensor(total, acc, x, op=nl.add)
            acc = total
    return acc


def _split_row_indices(valid, bs, g, ipp, hpp, h_row0, h_stride, b_stride, oob, idx):
    """Row indices of a chunk's K/V gathers: column ``(hh ipp + j) n_kv + k`` of the int32
    tile ``idx`` is the absolute key row gathered into partition p of K/V tile k of item j for
    head ``hh`` of the group (``b_j b_stride + s_j rs + h_row0 + hh h_stride + 128 k + p``),
    pushed out of bounds (``+ oob``) when the local row ``128 k + p`` is not below
    ``valid[:, j]``. ``bs``: int32 ``b | s`` columns."""
    kr = g.kv_rows
    i_p = nl.arange(kr)[:, None]
    i_j = nl.arange(ipp)[None, :]
    base = _int_tile([(bs[0:kr, 0:ipp], b_stride), (bs[0:kr, ipp:2 * ipp], g.rs)], kr, ipp)
    for k in nl.affine_range(g.n_kv):
        local = nisa.iota(k * PMAX + i_p + 0 * i_j, dtype=nl.float32)
        beyond = nisa.tensor_tensor(local, valid[0:kr, 0:ipp], op=nl.greater_equal,
                                    dtype=nl.float32)
        beyond = nisa.tensor_scalar(beyond, op0=np.multiply, operand0=float(oob),
                                    dtype=nl.int32)
        rows = _int_tile([(beyond, 1), (base, 1)], kr, ipp)
        for hh in nl.affine_range(hpp):
            idx[i_p, (hh * ipp + i_j) * g.n_kv + k] = nisa.tensor_tensor(
                nisa.iota(h_row0 + hh * h_stride + k * PMAX + i_p + 0 * i_j, dtype=nl.int32),
                rows, op=np.add, dtype=nl.int32)


def _paged_split_row_indices(table, valid, cols, bs, g, ipp, hpp, h0, Hkv, num_blocks, ppr,
                             idx):
    """Row indices of a chunk's K/V gathers from a paged cache: column ``(hh ipp + j) n_kv +
    k`` of ``idx`` is the row of the page pools' ``(num_blocks Hkv ppr, n D)`` view gathered
    into partition p of K/V tile k of item j for kv head ``h = h0 + hh`` (``ppr = page_size /
    n`` key rows per page). The page numbers are gathered once for the group's heads.

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
    i_p = nl.arange(kr)[:, None]
    i_j = nl.arange(ipp)[None, :]
    oob = float(_oob_offset(B * MB))
    b_mb = _int_tile([(bs[0:kr, 0:ipp], MB)], kr, ipp)
    first = nisa.tensor_scalar(cols[0:kr, ipp:2 * ipp], op0=np.multiply, operand0=float(g.rs),
                               dtype=nl.float32)                          # s rs
    table_flat = table.reshape((B * MB, 1))
    for k in nl.affine_range(g.n_kv):
        local = nisa.iota(k * PMAX + i_p + 0 * i_j, dtype=nl.float32)
        beyond = nisa.tensor_tensor(local, valid[0:kr, 0:ipp], op=nl.greater_equal,
                                    dtype=nl.float32)
        beyond = nisa.tensor_scalar(beyond, op0=np.multiply, operand0=oob, dtype=nl.int32)
        r = nisa.tensor_tensor(local, first, op=np.add, dtype=nl.float32)
        within = M.int_mod(r, ppr)                      # r mod ppr
        block = nisa.tensor_scalar(nisa.tensor_tensor(r, within, op=np.subtract,
                                                      dtype=nl.float32),
                                   op0=np.multiply, operand0=1.0 / ppr, dtype=nl.int32)
        entry = _int_tile([(beyond, 1), (b_mb, 1)], kr, ipp, acc=block)
        page = nl.ndarray((kr, ipp), dtype=nl.int32, buffer=nl.sbuf)
        port.memset(page, num_blocks, engine="gpsimd")
        for j in nl.affine_range(ipp):
            port.dma_copy(page[0:kr, nl.ds(j, 1)], port.rows(table_flat, entry, j),
                          oob_skip=True)
        # page Hkv ppr + r mod ppr, then + h ppr per head
        rows = _int_tile([(page, Hkv * ppr), (nisa.tensor_copy(within, dtype=nl.int32), 1)],
                         kr, ipp)
        for hh in nl.affine_range(hpp):
            idx[i_p, (hh * ipp + i_j) * g.n_kv + k] = nisa.tensor_tensor(
                nisa.iota((h0 + hh) * ppr + 0 * i_p + 0 * i_j, dtype=nl.int32), rows,
                op=np.add, dtype=nl.int32)


def _zero_source(g, mm, items):
    """The zero tile the K/V fills copy from, made once per program, or None (memsets).

    Skipped rows must hold zeros, never a stale or uninitialized NaN. On trn2 VectorE copies
    16-bit data SBUF->SBUF at 4 elements/cycle, so copying one zero tile is 4x cheaper than a
    memset (1 element/cycle) once a program fills two or more K/V tiles; trn1 memsets, split
    between VectorE (K) and GpSimd (V).
    """
    if (nisa.get_nc_version() >= nisa.nc_version.gen3 and mm != nl.float32
            and g.n_kv * items >= 2):
        zeros = nl.ndarray((g.kv_rows, g.n * g.D), dtype=mm, buffer=nl.sbuf)
        port.memset(zeros, 0, engine="gpsimd")
        return zeros
    return None


def _gather_rows(rows_view, idx, c0, g, zeros, dst, engine):
    """Zero ``dst (kv_rows, n_kv * n * D)``, then gather into it the committed key rows of one
    split of ``rows_view`` (K or V rows), named by columns ``c0 .. c0 + n_kv`` of the row-index
    tile ``idx`` (out-of-bounds rows are skipped and stay 0). ``zeros``: :func:`_zero_source`
    (else a memset on ``engine``, "vector" or "gpsimd")."""
    n, D, kv_rows = g.n, g.D, g.kv_rows
    for k in nl.affine_range(g.n_kv):
        if zeros is not None:
            dst[0:kv_rows, nl.ds(k * n * D, n * D)] = nisa.tensor_copy(
                zeros, engine=nisa.vector_engine)
        else:
            port.memset(dst[0:kv_rows, nl.ds(k * n * D, n * D)], 0, engine=engine)
        port.dma_copy(dst[0:kv_rows, nl.ds(k * n * D, n * D)], port.rows(rows_view, idx, c0 + k),
                      oob_skip=True)


def _transpose_keys(k_nat, kT, g):
    """``kT (128, n_dt * n * rs)`` -- head-dim tile ``dt``, position ``j`` of key row ``row``
    at column ``(dt * n + j) * rs + row`` -- from the gathered key rows ``k_nat (kv_rows,
    n_kv * n * D)``: TensorE transposes through PSUM staging banks, copied out by ScalarE."""
    n, D, rs, kv_rows = g.n, g.D, g.rs, g.kv_rows
    per_bank = max(1, min(n, tiles.PSUM_FMAX // kv_rows))   # transposes per PSUM staging bank
    for k in nl.affine_range(g.n_kv):
        for dt, d0, dsz in g.d_tiles():
            for jg in nl.static_range(tiles.ceil_div(n, per_bank)):
                j0 = jg * per_bank
                cnt = min(per_bank, n - j0)
                kt_ps = nl.ndarray((PMAX, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.psum)
                for jb in nl.static_range(cnt):
                    c0 = (k * n + j0 + jb) * D + d0
                    kt_ps[0:dsz, jb * kv_rows:(jb + 1) * kv_rows] = nisa.nc_transpose(
                        k_nat[0:kv_rows, nl.ds(c0, dsz)])
                i_d = nl.arange(dsz)[:, None, None]
                i_j = nl.arange(cnt)[None, :, None]
                i_r = nl.arange(kv_rows)[None, None, :]
                col0 = (dt * n + j0) * rs
                kT[i_d, col0 + i_j * rs + k * PMAX + i_r] = nisa.tensor_copy(
                    kt_ps[i_d, i_j * kv_rows + i_r], dtype=kT.dtype, engine=nisa.scalar_engine)


def _split_mask_row(valid, g):
    """``(1, rs)`` bias of the split's key rows: 0 when committed, DECODE_MASK_BIAS past it."""
    local = nisa.iota(nl.arange(g.rs)[None, :], dtype=nl.float32)
    return nisa.tensor_scalar(local, op0=nl.greater_equal, operand0=valid[0:1],
                              op1=np.multiply, operand1=NEG, dtype=_MASK_DTYPE)



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
        i_g = nl.arange(G)[:, None]
        i_r = nl.arange(rows)[None, :]
        diff = nisa.iota(rt0 + i_r - T * i_g, dtype=nl.float32)            # (G, rows)
        ge = nisa.tensor_scalar(diff, op0=nl.greater_equal, operand0=0.0, dtype=nl.float32)
        sel = nisa.scalar_tensor_tensor(data=diff, op0=nl.less, operand0=float(T),
                                        op1=np.multiply, operand1=ge, dtype=nl.float32)
        for name, col in (("slope", slope_g), ("sink", sink_g)):
            if col is not None:
                ps = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.psum)
                ps[...] = nisa.nc_matmul(sel, col)
                setattr(self, name, nisa.tensor_copy(ps, dtype=nl.float32,
                                                     engine=nisa.vector_engine))
        self.t = M.int_mod(nisa.iota(rt0 + nl.arange(rows)[:, None], dtype=nl.float32), T)


def _member_values(values):
    """``(Hq, per_batch, flat)`` of an HBM ``(Hq,)`` or ``(1 or B, Hq)`` fp32 tensor: its
    head count, whether it has a row per sequence, and its ``(total, 1)`` view."""
    total = 1
    for d in values.shape:
        total *= d
    return (values.shape[-1], len(values.shape) == 2 and values.shape[0] > 1,
            values.reshape((total, 1)))


def _member_column(values, b, h, G):
    """fp32 ``(G, 1)``: ``values[b, h G + g]`` of an HBM ``(Hq,)`` or ``(1 or B, Hq)`` fp32
    tensor (``b`` an NKI expression), by an indirect DMA."""
    Hq, per_batch, flat = _member_values(values)
    i_g = nl.arange(G)[:, None]
    idx = nisa.iota((b * Hq if per_batch else 0) + h * G + i_g, dtype=nl.int32)
    out = nl.ndarray((G, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(out, 0.0, engine="gpsimd")
    port.dma_copy(out, port.rows(flat, idx), oob_skip=True)
    return out


def _member_columns(values, bs, h, G, ipp, out, col0):
    """Columns ``col0 + j`` of the fp32 ``(G, ...)`` tile ``out`` (zeroed by the caller):
    ``values[b_j, h G + g]`` of an HBM ``(Hq,)`` or ``(1 or B, Hq)`` fp32 tensor, by indirect
    DMAs (``bs``: int32 ``b | s`` columns; a padding item's b = B reads out of bounds,
    skipped: 0)."""
    Hq, per_batch, flat = _member_values(values)
    i_g = nl.arange(G)[:, None]
    idx = nisa.iota(h * G + i_g + 0 * nl.arange(ipp)[None, :], dtype=nl.int32)
    if per_batch:
        idx = _int_tile([(bs[0:G, 0:ipp], Hq)], G, ipp, acc=idx)
    for j in nl.affine_range(ipp):
        port.dma_copy(out[0:G, nl.ds(col0 + j, 1)], port.rows(flat, idx, j), oob_skip=True)


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


def _with_sink(o_sb, lse, sink, rows):
    """Fold a sink logit (an extra key with value 0) into a partial: ``lse' = log(e^lse +
    e^sink)``, ``o' = o e^(lse - lse')``."""
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
    lse2 = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(lse2, mx, log_den, op=nl.add)
    inv = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.reciprocal(inv, den)
    w = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(w, a, inv, op=nl.multiply)
    o2 = nl.ndarray(tuple(o_sb.shape), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(o2, o_sb, op0=nl.multiply, operand0=w)
    return o2, lse2


# ============================================================================================
# Split kernel: one row tile
# ============================================================================================
def _scaled_query_t(q_nat, rows, D, n_dt, scale, mm):
    """``scale * q`` of the loaded rows ``q_nat (rows, D)`` transposed: ``(128, n_dt * rows)``.

    The scale is folded into Q before the matmul (one rounding of ``scale * q`` to the operand
    dtype), so scores, masks, max and LSE are all in scaled units: that keeps the additive mask
    valid for any scale, including 0 and negative ones.
    """
    qT = nl.ndarray((PMAX, n_dt * rows), dtype=mm, buffer=nl.sbuf)
    for dt in tiles.unrolled(n_dt):
        d0 = dt * PMAX
        dsz = min(PMAX, D - d0)
        t_ps = nl.ndarray((PMAX, PMAX), dtype=port.transpose_dtype(q_nat.dtype), buffer=nl.psum)
        port.nc_transpose(t_ps[0:dsz, 0:rows], q_nat[0:rows, d0:d0 + dsz])
        port.activation(qT[0:dsz, dt * rows:(dt + 1) * rows], nl.copy, t_ps[0:dsz, 0:rows],
                        scale=float(scale))
    return qT


def _packed_queries(qT, rows, g, mm):
    """Block-diagonal stationaries ``Qbd (128, n_dt * pack * P)``, ``P = pack * rows``: the
    ``(dt, c)`` block (columns ``(dt * pack + c) * P ...``) is zero except Q^T in its columns
    ``c * rows .. c * rows + rows``. With pack 1 this is Q^T itself."""
    if g.pack == 1:
        return qT
    P = g.pack * rows
    qbd = nl.ndarray((PMAX, g.n_dt * g.pack * P), dtype=mm, buffer=nl.sbuf)
    port.memset(qbd, 0, engine="gpsimd")
    for dt, d0, dsz in g.d_tiles():
        # the pack diagonal blocks at column (dt pack + c) P + c rows = dt pack P + c (P + rows)
        # in one copy: a stride-(P + rows) destination, the source broadcast over c
        i_d = nl.arange(dsz)[:, None, None]
        i_c = nl.arange(g.pack)[None, :, None]
        i_r = nl.arange(rows)[None, None, :]
        qbd[i_d, dt * g.pack * P + i_c * (P + rows) + i_r] = nisa.tensor_copy(
            qT[i_d, dt * rows + i_r], engine=nisa.gpsimd_engine)
    return qbd


def _split_scores(qbd, kT, mask_row, g, P, mask_apart=False):
    """Scores of the split in PSUM: ``(banks, mask_banks)``, ``n_banks`` tiles ``(P, 512)``
    fp32 each.

    Partition ``c * rows + r`` column ``w = jj * rs + row`` is ``scale q_r . k`` for position
    ``j = jj * pack + c`` of key row ``row``, plus DECODE_MASK_BIAS when that row is not
    committed (``ones(1, P)^T @ mask_row``, accumulated into the same PSUM group; a full split
    has no ``mask_row``). With ``mask_apart`` (soft-capping: the tanh would flatten it) the
    mask goes to its own PSUM tiles ``mask_banks`` instead (else None).
    """
    n, rs = g.n, g.rs
    # each piece's first matmul writes (=), the rest accumulate (+=): no PSUM zero-fill
    banks = [nl.ndarray((P, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.psum)
             for _ in tiles.unrolled(g.n_banks)]
    mask_banks = None
    if mask_row is not None:
        ones = nl.ones((1, P), dtype=_MASK_DTYPE, buffer=nl.sbuf)
        if mask_apart:
            mask_banks = [nl.ndarray((P, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.psum)
                          for _ in tiles.unrolled(g.n_banks)]

    def copy_c(acc, col, jj, r0, ln, c, first):
        for dt, d0, dsz in g.d_tiles():
            port.nc_matmul(acc[0:P, col:col + ln], qbd[0:dsz, nl.ds((dt * g.pack + c) * P, P)],
                           kT[0:dsz, nl.ds((dt * n + jj * g.pack + c) * rs + r0, ln)],
                           accumulate=not (first and dt == 0))

    for bank, col, jj, r0, ln in g.pieces:
        acc = banks[bank]
        copy_c(acc, col, jj, r0, ln, 0, True)

        def other_copy(c):
            copy_c(acc, col, jj, r0, ln, c, False)

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


def _row_max(banks, g, rows, P, e):
    """Max of every query row over the split (all copies): ``(M_r (rows, 1), -M (P, 1))``.

    Per partition first (VectorE over the PSUM banks), then across the ``pack`` copies of each
    row: transpose the column to a row, reduce ``(1, rows, pack)`` on its last axis, transpose
    back, and ``E^T``-broadcast it to every copy with a K=rows matmul.
    """
    m_cols = nl.ndarray((P, g.n_banks), dtype=nl.float32, buffer=nl.sbuf)
    for bank in nl.static_range(g.n_banks):
        m_cols[0:P, bank:bank + 1] = nisa.tensor_reduce(
            np.max, banks[bank][0:P, 0:g.bank_cols[bank]], axis=(1,), keepdims=True)
    if g.n_banks > 1:
        m_p = nisa.tensor_reduce(np.max, m_cols, axis=(1,), keepdims=True)
    else:
        m_p = m_cols
    if g.pack == 1:
        neg = nisa.tensor_scalar(m_p, op0=np.multiply, operand0=-1.0, dtype=nl.float32)
        return m_p, neg
    mt_ps = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.psum)
    mt_ps[0:1, 0:P] = nisa.nc_transpose(m_p[0:P, 0:1])
    i_0 = nl.arange(1)[:, None, None]
    i_r = nl.arange(rows)[None, :, None]
    i_c = nl.arange(g.pack)[None, None, :]
    m_row = nisa.tensor_reduce(np.max, mt_ps[i_0, i_c * rows + i_r], axis=(2,),
                               dtype=nl.float32)                               # (1, rows)
    mc_ps = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.psum)
    mc_ps[0:rows, 0:1] = nisa.nc_transpose(m_row[0:1, 0:rows])
    m_col = nisa.tensor_copy(mc_ps, dtype=nl.float32, engine=nisa.vector_engine)
    bc_ps = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.psum)
    bc_ps[0:P, 0:1] = nisa.nc_matmul(e, m_col)
    neg = nisa.tensor_scalar(bc_ps, op0=np.multiply, operand0=-1.0, dtype=nl.float32)
    return m_col, neg


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


def _normalize_rows(acc, l_col, rows, g):
    """``O (rows, D)`` fp32 = transpose of ``O^T`` divided by the row sums."""
    inv_l = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.reciprocal(inv_l, l_col)
    o_sb = nl.ndarray((rows, g.D), dtype=nl.float32, buffer=nl.sbuf)
    for dt, d0, dsz in g.d_tiles():
        oT = nl.ndarray((dsz, rows), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(oT, acc[dt][0:dsz, 0:rows], engine="vector")
        t_ps = nl.ndarray((PMAX, PMAX), dtype=port.transpose_dtype(nl.float32), buffer=nl.psum)
        port.nc_transpose(t_ps[0:rows, 0:dsz], oT[0:dsz, 0:rows])
        port.tensor_scalar(o_sb[0:rows, d0:d0 + dsz], t_ps[0:rows, 0:dsz], op0=nl.multiply,
                           operand0=inv_l)
    return o_sb


def _lse_column(m_col, l_col):
    """``m + log l``, or -inf when the max says no key was valid (a dead split)."""
    col = tuple(m_col.shape)
    log_l = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.activation(log_l, nl.log, l_col)
    lse = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(lse, m_col, log_l, op=nl.add)
    live = nl.ndarray(col, dtype=nl.uint8, buffer=nl.sbuf)
    port.tensor_scalar(live, m_col, op0=nl.greater, operand0=tiles.DECODE_DEAD_MAX)
    port.keep_where(lse, live, -np.inf)
    return lse


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
            ps[...] = nisa.nc_matmul(e, rm.slope)
            slope = nisa.tensor_copy(ps, dtype=nl.float32, engine=nisa.vector_engine)
            # copy index c = #{k in 1 .. pack - 1 : p >= k rows}
            above = nisa.tensor_scalar(
                nisa.iota(nl.arange(P)[:, None] - rows * (nl.arange(g.pack - 1)[None, :] + 1),
                          dtype=nl.float32), op0=nl.greater_equal, operand0=0.0,
                dtype=nl.float32)
            c_col = nisa.tensor_reduce(np.add, above, axis=(1,), keepdims=True,
                                       dtype=nl.float32)
    out = [nl.ndarray((P, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.sbuf)
           for _ in tiles.unrolled(g.n_banks)]
    if not mods.alibi:
        for bank in nl.static_range(g.n_banks):
            w = g.bank_cols[bank]
            out[bank][0:P, 0:w] = _modified(
                mods, banks[bank][0:P, 0:w],
                None if mask_banks is None else mask_banks[bank][0:P, 0:w], None, None, cap)
        return out
    for bank, col, jj, r0, ln in g.pieces:
        pos = nisa.iota(g.n * (r0 + nl.arange(ln)[None, :]) + jj * g.pack
                        + 0 * nl.arange(P)[:, None], dtype=nl.float32)
        if c_col is not None:
            pos = nisa.tensor_scalar(pos, op0=np.add, operand0=c_col, dtype=nl.float32,
                                     engine=nisa.gpsimd_engine)
        out[bank][0:P, col:col + ln] = _modified(
            mods, banks[bank][0:P, col:col + ln],
            None if mask_banks is None else mask_banks[bank][0:P, col:col + ln], pos, slope,
            cap)
    return out


def _alibi_lse_shift(lse, rm, s_i, length, T, split_keys, rows):
    """ALiBi's per-row part of a split's scores, added to its LSE: ``slope (s split_keys -
    (L - T + t))`` (split start minus the query position; all keys of a split are at or
    before it)."""
    col = (rows, 1)
    s_f = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(s_f, s_i[0:rows], engine="vector")
    start = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(start, s_f, op0=nl.multiply, operand0=float(split_keys),
                              op1=nl.subtract, operand1=length[0:rows])
    dist = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(dist, start, op0=nl.add, operand0=float(T), op1=nl.subtract,
                              operand1=rm.t)
    shifted = nl.ndarray(col, dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(shifted, dist, op0=nl.multiply, operand0=rm.slope, op1=nl.add,
                              operand1=lse)
    return shifted


def _split_front(q_nat, kT, mask_row, g, rows, scale, mm, rm=None, cap=None):
    """First half of one row tile's partial over a work item (query rows ``rows`` of the
    item, gathered as ``q_nat (rows, D)``): scores against ``kT``, the modifiers (``rm``:
    :class:`_RowMods`, None without), the row max and the exponentials. Returns the state
    :func:`_split_back` finishes: ``(p_sb, l_col, m_col)``."""
    P = g.pack * rows
    qT = _scaled_query_t(q_nat, rows, g.D, g.n_dt, scale, mm)
    qbd = _packed_queries(qT, rows, g, mm)
    transforms = rm is not None and rm.mods.transforms
    banks, mask_banks = _split_scores(qbd, kT, mask_row, g, P,
                                      mask_apart=transforms and cap is not None)
    if g.pack > 1:
        e, e_t = _group_matrices(rows, P)
    else:
        e = e_t = None
    if transforms:
        banks = _split_mods(banks, mask_banks, g, rows, P, rm, e, cap)
    m_col, neg_m = _row_max(banks, g, rows, P, e)
    p_sb, l_p = _exp_scores(banks, neg_m, g, P, mm)
    del banks
    if g.pack > 1:
        l_ps = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.psum)
        port.nc_matmul(l_ps[0:rows, 0:1], e_t, l_p)
        l_col = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(l_col, l_ps, engine="vector")
    else:
        l_col = l_p
    return p_sb, l_col, m_col


def _split_back(state, v_all, o_flat, lse_flat, o_base, g, h, R, S, rt0, rows, mm, rm=None,
                item=None):
    """Second half (:func:`_split_front`): ``P V``, the normalization and the scatter of the
    partial (o, lse). ``item``: ``(s_i, L)`` columns of the work item (ALiBi).

    The item's sequence is runtime data, so the partial rows are scattered (flat row
    ``o_base + (h R + rt0 + p) S`` of the ``((B + 1) Hq T S, D)`` view: row, then slot) by
    indirect DMA. A padding item (``b = B``) writes into the trash block.
    """
    p_sb, l_col, m_col = state
    P = g.pack * rows
    i_p = nl.arange(rows)[:, None]
    pT = _transpose_probs(p_sb, g, P, mm)
    acc = _split_pv(v_all, pT, g, rows, P)
    o_sb = _normalize_rows(acc, l_col, rows, g)
    o_idx = nisa.tensor_tensor(nisa.iota((h * R + rt0 + i_p) * S, dtype=nl.int32),
                               o_base[0:rows], op=np.add, dtype=nl.int32)
    port.dma_copy(port.rows(o_flat, o_idx), o_sb, legacy_isa=True)
    lse = _lse_column(m_col, l_col)
    if rm is not None and rm.mods.alibi:
        lse = _alibi_lse_shift(lse, rm, item[0], item[1], rm.T, g.rs * g.n, rows)
    port.dma_copy(port.rows(lse_flat, o_idx), lse, legacy_isa=True)


# ============================================================================================
# The tail: the partial key row and the T new tokens
# ============================================================================================
def _new_token_bias(tree_mask, T):
    """``(T, T)`` bias among the new tokens (bf16): 0 where token t sees token u, else
    DECODE_MASK_BIAS. Causal (``u <= t``) from an affine iota when ``tree_mask`` is None."""
    bias = nl.ndarray((T, T), dtype=_MASK_DTYPE, buffer=nl.sbuf)
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
    sel = nl.ndarray((T, rows), dtype=_MASK_DTYPE, buffer=nl.sbuf)
    port.tensor_scalar(sel, M.int_mod(diff, T), op0=nl.equal, operand0=0.0)
    return sel


def _paged_tail_rows(paged, k_cache, lp, c, count, skip):
    """int32 ``(count, 1)``: the row of the page pools' ``(num_blocks Hkv page_size, D)`` view
    holding logical position ``Lp + c + q`` of sequence b, kv head h, for partition q.

    Position p is offset ``p mod page_size`` of page ``block_table[b, p // page_size]`` (one
    int32 gathered per partition by indirect DMA), i.e. pool row
    ``(page Hkv + h) page_size + p mod page_size``. ``skip`` (int32, 0 or a power of two above
    the table, or None) pushes a partition's table index out of bounds: it reads no entry and
    keeps the page number ``num_blocks``, so its K/V gather is skipped as well. Negative
    positions (only ever skipped ones) are clamped to 0 first.
    """
    table, b, h = paged
    B, MB = table.shape
    num_blocks, Hkv, ps = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    i_q = nl.arange(count)[:, None]
    pos = nisa.tensor_scalar(nisa.iota(c + i_q, dtype=nl.float32), op0=np.add,
                             operand0=lp[0:count], op1=np.maximum, operand1=0.0,
                             dtype=nl.float32)
    within = M.int_mod(pos, ps)
    q_f = nisa.iota(i_q, dtype=nl.float32)
    # b MB + p // page_size = iota(b MB + q) + ((p - p mod page_size) / page_size - q)
    block0 = nisa.tensor_tensor(pos, within, op=np.subtract, dtype=nl.float32)
    block_q = nisa.scalar_tensor_tensor(data=block0, op0=np.multiply, operand0=1.0 / ps,
                                        op1=np.subtract, operand1=q_f, dtype=nl.int32)
    entry = nisa.tensor_tensor(nisa.iota(b * MB + i_q, dtype=nl.int32), block_q, op=np.add,
                               dtype=nl.int32)
    if skip is not None:
        entry = nisa.tensor_tensor(entry, skip, op=np.add, dtype=nl.int32)
    page = nl.ndarray((count, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.memset(page, num_blocks, engine="gpsimd")
    table_flat = table.reshape((B * MB, 1))
    port.dma_copy(page, port.rows(table_flat, entry), oob_skip=True)
    # h page_size + p mod page_size = iota(h page_size + q) + (p mod page_size - q)
    offset = nisa.tensor_tensor(nisa.iota(h * ps + i_q, dtype=nl.int32),
                                nisa.tensor_tensor(within, q_f, op=np.subtract, dtype=nl.int32),
                                op=np.add, dtype=nl.int32)
    stride = nl.ndarray((count, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.memset(stride, Hkv * ps, engine="gpsimd")
    rows = nisa.tensor_tensor(page, stride, op=np.multiply, dtype=nl.int32)
    return nisa.tensor_tensor(rows, offset, op=np.add, dtype=nl.int32)


def _tail_partial(q_rows, k_cache, v_cache, tree_mask, lp, rem, o_part, lse_part, bh, slot,
                  T, R, D, n, row_tile, scale, mm, paged=None, mods=None):
    """Partial (o, lse) over the last positions of one (sequence, kv head), into ``slot``.

    Keys: the ``Lp mod n`` committed positions of the last, partial key row (gathered into
    ``n - 1`` slots, position ``Lp - (n - 1) + q`` in slot q; slots before the row start are
    skipped and masked) and the T new tokens (positions ``Lp .. L - 1``), masked causally or by
    ``tree_mask``. One position per partition, so the read is exact at any length. Every row
    sees at least its own token, so this partial is never empty.

    ``paged``: None for a contiguous cache ``(B, Hkv, S_max, D)``, else ``(block_table, b, h)``
    with page pools ``(num_blocks, Hkv, page_size, D)``: positions are then looked up in the
    block table (:func:`_paged_tail_rows`).

    ``mods``: None, or ``(Mods, slope_g, sink_g, G, cap)`` -- score modifiers: key column
    ``col`` sits ``col - (n - 1) - t`` positions from new token t (ALiBi, two-sided with a tree
    mask), the masks are kept apart from a soft-cap's tanh, and the sink (once per row, here)
    joins this partial.
    """
    B, Hkv, S_max = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]  # paged: pool, page
    ns = n - 1                      # slots of the partial key row
    C = ns + T                      # score columns: [partial row | new tokens]
    n_dt = tiles.ceil_div(D, PMAX)
    k_pos = k_cache.reshape((B * Hkv * S_max, D))
    v_pos = v_cache.reshape((B * Hkv * S_max, D))
    if paged is None:
        oob = _oob_offset(B * Hkv * S_max)
        lp_i = nisa.tensor_copy(lp, dtype=nl.int32, engine=nisa.vector_engine)
    else:
        oob = _oob_offset(paged[0].shape[0] * paged[0].shape[1])     # past the block table

    # ---- new tokens at Lp + u (all valid) ----
    i_u = nl.arange(T)[:, None]
    if paged is None:
        new_idx = nisa.tensor_tensor(nisa.iota(bh * S_max + i_u, dtype=nl.int32), lp_i[0:T],
                                     op=np.add, dtype=nl.int32)
    else:
        new_idx = _paged_tail_rows(paged, k_cache, lp, 0, T, None)
    k_new = nl.ndarray((T, D), dtype=mm, buffer=nl.sbuf)
    # [V | flag]: a new token's value may be hidden from some rows (causal or tree mask), so
    # its non-finite entries are zeroed and flagged (forward.guard_values): a row that gives
    # it weight gets NaN, the others never compute 0 * inf
    v_new = nl.ndarray((T, D + 1), dtype=mm, buffer=nl.sbuf)
    port.dma_copy(k_new, port.rows(k_pos, new_idx), oob_skip=True)
    port.dma_copy(v_new[:, 0:D], port.rows(v_pos, new_idx), oob_skip=True)
    v_new[:, D:D + 1] = nisa.tensor_reduce(np.max, M.zero_non_finite(v_new[:, 0:D])[0],
                                           axis=(1,), keepdims=True, dtype=mm)
    if ns > 0:
        # slot q is committed and in the partial row iff q >= (n - 1) - (Lp mod n)
        i_q = nl.arange(ns)[:, None]
        first = nisa.tensor_scalar(rem, op0=np.subtract, operand0=float(ns), reverse0=True,
                                   dtype=nl.float32)                 # (n - 1) - rem
        slot_col = nisa.iota(i_q, dtype=nl.float32)
        before = nisa.tensor_scalar(slot_col, op0=nl.less, operand0=first[0:ns],
                                    op1=np.multiply, operand1=float(oob), dtype=nl.int32)
        if paged is None:
            pos = nisa.tensor_tensor(nisa.iota(bh * S_max - ns + i_q, dtype=nl.int32),
                                     lp_i[0:ns], op=np.add, dtype=nl.int32)
            part_idx = nisa.tensor_tensor(pos, before, op=np.add, dtype=nl.int32)
        else:
            part_idx = _paged_tail_rows(paged, k_cache, lp, -ns, ns, before)
        k_part = nl.ndarray((ns, D), dtype=mm, buffer=nl.sbuf)
        port.memset(k_part, 0, engine="gpsimd")
        v_part = nl.ndarray((ns, D), dtype=mm, buffer=nl.sbuf)
        port.memset(v_part, 0, engine="gpsimd")
        port.dma_copy(k_part, port.rows(k_pos, part_idx), oob_skip=True)
        port.dma_copy(v_part, port.rows(v_pos, part_idx), oob_skip=True)
        slot_row = nisa.iota(nl.arange(ns)[None, :], dtype=nl.float32)
        part_bias = nisa.tensor_scalar(slot_row, op0=nl.less, operand0=first[0:1],
                                       op1=np.multiply, operand1=NEG, dtype=_MASK_DTYPE)

    # ---- K^T of all C keys ----
    kT = nl.ndarray((PMAX, n_dt * C), dtype=mm, buffer=nl.sbuf)
    for dt in nl.static_range(n_dt):
        d0 = dt * PMAX
        dsz = min(PMAX, D - d0)
        t_ps = nl.ndarray((PMAX, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.psum)
        if ns > 0:
            t_ps[0:dsz, 0:ns] = nisa.nc_transpose(k_part[0:ns, d0:d0 + dsz])
        t_ps[0:dsz, ns:C] = nisa.nc_transpose(k_new[0:T, d0:d0 + dsz])
        kT[0:dsz, dt * C:(dt + 1) * C] = nisa.tensor_copy(t_ps[0:dsz, 0:C], dtype=mm,
                                                          engine=nisa.scalar_engine)
    new_bias = _new_token_bias(tree_mask, T)

    for _, rt0, rows in _row_tiles(R, row_tile):
        q_nat = nl.ndarray((rows, D), dtype=q_rows.dtype, buffer=nl.sbuf)
        port.dma_copy(q_nat, q_rows[nl.ds(bh * R + rt0, rows), 0:D])
        qT = _scaled_query_t(q_nat, rows, D, n_dt, scale, mm)
        s_ps = nl.ndarray((rows, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.psum)
        s_ps[0:rows, 0:C] = nisa.nc_matmul(qT[0:min(PMAX, D), 0:rows], kT[0:min(PMAX, D), 0:C])
        for dt in nl.static_range(1, n_dt):
            dsz = min(PMAX, D - dt * PMAX)
            s_ps[0:rows, 0:C] += nisa.nc_matmul(qT[0:dsz, dt * rows:(dt + 1) * rows],
                                                kT[0:dsz, dt * C:(dt + 1) * C])
        rm = None if mods is None else _RowMods(mods[0], mods[1], mods[2], mods[3], T, rt0,
                                                rows)
        # the masks in their own PSUM tile, applied by selection after the modifiers: a
        # non-finite key a row cannot see (a later new token) never reaches it, and a tanh
        # cannot flatten them
        mk_ps = nl.ndarray((rows, tiles.PSUM_FMAX), dtype=nl.float32, buffer=nl.psum)
        if ns > 0:
            ones = nl.ones((1, rows), dtype=_MASK_DTYPE, buffer=nl.sbuf)
            mk_ps[0:rows, 0:ns] = nisa.nc_matmul(ones, part_bias)
        mk_ps[0:rows, ns:C] = nisa.nc_matmul(_token_selector(T, rt0, rows), new_bias)
        scores = None
        if rm is not None and rm.mods.transforms:
            d = slope = None
            if rm.mods.alibi:
                d = nisa.tensor_scalar(
                    nisa.iota(nl.arange(C)[None, :] - ns + 0 * nl.arange(rows)[:, None],
                              dtype=nl.float32),
                    op0=np.subtract, operand0=rm.t, dtype=nl.float32)
                slope = rm.slope
                if tree_mask is not None:      # a tree may let a token see a later one
                    d = nisa.activation(op=nl.abs, data=d, dtype=nl.float32)
                    slope = nisa.tensor_scalar(rm.slope, op0=np.multiply, operand0=-1.0,
                                               dtype=nl.float32)
            scores = _modified(rm.mods, s_ps[0:rows, 0:C], None, d, slope, mods[4])
        if scores is None:
            scores = nisa.tensor_copy(s_ps[0:rows, 0:C], dtype=nl.float32,
                                      engine=nisa.vector_engine)
        hidden = nisa.tensor_scalar(mk_ps[0:rows, 0:C], op0=nl.less, operand0=0.0,
                                    dtype=nl.uint8)
        nisa.tensor_copy_predicated(src=NEG, dst=scores, predicate=hidden)

        m = nisa.tensor_reduce(np.max, scores, axis=(1,), keepdims=True)
        neg_m = nisa.activation(op=nl.copy, data=m, scale=-1.0, dtype=nl.float32)
        l_col = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        p_sb = nisa.activation_reduce(op=np.exp, data=scores, reduce_op=np.add,
                                      reduce_res=l_col, bias=neg_m, scale=1.0, dtype=mm)
        pt_ps = nl.ndarray((PMAX, 2 * PMAX), dtype=nl.float32, buffer=nl.psum)
        if ns > 0:
            pt_ps[0:ns, 0:rows] = nisa.nc_transpose(p_sb[0:rows, 0:ns])
        pt_ps[0:T, PMAX:PMAX + rows] = nisa.nc_transpose(p_sb[0:rows, ns:C])
        o_ps = nl.ndarray((rows, D + 1), dtype=nl.float32, buffer=nl.psum)
        pt_new = nisa.activation(op=nl.copy, data=pt_ps[0:T, PMAX:PMAX + rows], dtype=mm)
        o_ps[0:rows, 0:D + 1] = nisa.nc_matmul(pt_new, v_new)
        if ns > 0:
            pt_part = nisa.activation(op=nl.copy, data=pt_ps[0:ns, 0:rows], dtype=mm)
            o_ps[0:rows, 0:D] += nisa.nc_matmul(pt_part, v_part)

        inv_l = nisa.reciprocal(l_col)
        # rows that weighed a flagged value: times NaN
        poison = nisa.tensor_scalar(o_ps[0:rows, D:D + 1], op0=nl.greater, operand0=0.0,
                                    dtype=nl.uint8)
        nisa.tensor_copy_predicated(src=float("nan"), dst=inv_l, predicate=poison)
        o_sb = nisa.activation(op=nl.copy, data=o_ps[0:rows, 0:D], scale=inv_l,
                               dtype=nl.float32)
        row0 = bh * R + rt0
        log_l = nisa.activation(op=nl.log, data=l_col, dtype=nl.float32)
        lse = nisa.tensor_tensor(m, log_l, op=np.add, dtype=nl.float32)
        if rm is not None and rm.sink is not None:
            o_sb, lse = _with_sink(o_sb, lse, rm.sink, rows)
        port.dma_copy(o_part[nl.ds(row0, rows), slot, 0:D], o_sb)
        port.dma_copy(lse_part[nl.ds(row0, rows), nl.ds(slot, 1)], lse)


# ============================================================================================
# Phase 1 kernel
# ============================================================================================
def _split_chunk(q_rows, k_cache, v_cache, cache_lens, work, block_table, alibi_slopes, o_part,
                 lse_part, mods, hg, c, B, Hkv, R, S, T, G, n, split_rows, pack, row_tile, ipp,
                 hpp, scale, mm):
    """Chunk program ``(hg, c)`` of the split kernel: work items ``c ipp .. c ipp + ipp - 1``
    for kv heads ``hg hpp .. hg hpp + hpp - 1``, i.e. ``hpp ipp`` steps ``t = hh ipp + j``
    (head ``hh`` of the group, item j).

    1. Headers, for all steps at once (one item per column): ``(b, s)``, the sequence
       lengths, the row indices of the K/V gathers, the mask rows, the query rows (and ALiBi
       slopes). Every runtime-indexed read of the program is issued here, before any split is
       computed, so none of them waits behind the engines, and the chain of small DMAs and
       index arithmetic is paid once per program, not once per step.
    2. Splits (``sequential_range`` loops over the heads and item pairs, software-pipelined:
       the loops carry two buffers of gathered keys, transposed keys and values): step t + 1's
       keys are transposed while step t's softmax runs, step t + 2's gathers are issued while
       steps t and t + 1 are computed, and each step scatters its partial (o, lse) when done.
       The last two gathers are of dead steps (all rows out of bounds: nothing is read), which
       keeps the loop body uniform.

    Every item is treated as possibly holding uncommitted rows (zero-filled buffers, mask
    row): whether it does is runtime data.
    """
    Hq = G * Hkv
    S_max = k_cache.shape[2]
    g = _SplitGeometry(q_rows.shape[1], n, split_rows, pack)
    D, rs, kr = g.D, g.rs, g.kv_rows
    steps = hpp * ipp
    alibi = mods.alibi
    h0 = hg * hpp                                       # first kv head of the group
    if block_table is None:
        rows_bh = S_max // n
        k_rows = k_cache.reshape((B * Hkv * rows_bh, n * D))
        v_rows = v_cache.reshape((B * Hkv * rows_bh, n * D))
        oob = _oob_offset(B * Hkv * rows_bh)
    else:
        num_blocks, ppr = k_cache.shape[0], S_max // n      # S_max is the page size here
        k_rows = k_cache.reshape((num_blocks * Hkv * ppr, n * D))
        v_rows = v_cache.reshape((num_blocks * Hkv * ppr, n * D))
        oob = _oob_offset(num_blocks * Hkv * ppr)
    row_tiles = _row_tiles(R, row_tile)

    # -- 1. headers ------------------------------------------------------------------------
    cols = _item_columns(work, cache_lens, c, ipp)           # (128, 3 ipp): b | s | L
    valid = _valid_rows(cols, ipp, T, n, split_rows)         # (128, ipp)
    bs = nisa.tensor_copy(cols[0:PMAX, 0:2 * ipp], dtype=nl.int32, engine=nisa.vector_engine)
    idx = nl.ndarray((kr, (steps + 2) * g.n_kv), dtype=nl.int32, buffer=nl.sbuf)
    # the two dead steps the pipeline gathers last: every row out of bounds
    port.memset(idx[0:kr, steps * g.n_kv:(steps + 2) * g.n_kv], oob, engine="gpsimd")
    if block_table is None:
        _split_row_indices(valid, bs, g, ipp, hpp, h0 * rows_bh, rows_bh, Hkv * rows_bh, oob,
                           idx)
    else:
        _paged_split_row_indices(block_table, valid, cols, bs, g, ipp, hpp, h0, Hkv,
                                 num_blocks, ppr, idx)
    mask = nl.ndarray((1, ipp * rs), dtype=_MASK_DTYPE, buffer=nl.sbuf)
    local = nisa.iota(nl.arange(rs)[None, :], dtype=nl.float32)
    for j in nl.affine_range(ipp):
        mask[0:1, nl.ds(j * rs, rs)] = nisa.tensor_scalar(
            local, op0=nl.greater_equal, operand0=valid[0:1, nl.ds(j, 1)], op1=np.multiply,
            operand1=NEG, dtype=_MASK_DTYPE)
    slopes = None
    if alibi:
        slopes = nl.ndarray((G, steps), dtype=nl.float32, buffer=nl.sbuf)
        port.memset(slopes, 0.0, engine="gpsimd")
        for hh in nl.affine_range(hpp):
            _member_columns(alibi_slopes, bs, h0 + hh, G, ipp, slopes, hh * ipp)
    # the query rows of every step (padding items gather none: their rows stay 0)
    qs = []
    for _, rt0, rows in row_tiles:
        i_p = nl.arange(rows)[:, None]
        q_keep = nl.ndarray((rows, steps * D), dtype=q_rows.dtype, buffer=nl.sbuf)
        port.memset(q_keep, 0, engine="gpsimd")
        for hh in nl.affine_range(hpp):
            q_idx = _int_tile([(bs[0:rows, 0:ipp], Hkv * R)], rows, ipp,
                              nisa.iota((h0 + hh) * R + rt0 + i_p + 0 * nl.arange(ipp)[None, :],
                                        dtype=nl.int32))
            for j in nl.affine_range(ipp):
                port.dma_copy(q_keep[0:rows, nl.ds((hh * ipp + j) * D, D)],
                              port.rows(q_rows, q_idx, j), oob_skip=True)
        qs.append(q_keep)

    # -- 2. splits ------------------------------------------------------------------------
    o_flat = o_part.reshape(((B + 1) * Hq * T * S, D))
    lse_flat = lse_part.reshape(((B + 1) * Hq * T * S, 1))
    zeros = _zero_source(g, mm, steps + 2)
    kv_cols = g.n_kv * n * D
    k_nat = [nl.ndarray((kr, kv_cols), dtype=mm, buffer=nl.sbuf) for _ in tiles.unrolled(2)]
    v_all = [nl.ndarray((kr, kv_cols), dtype=mm, buffer=nl.sbuf) for _ in tiles.unrolled(2)]
    kT = [nl.ndarray((PMAX, g.n_dt * n * rs), dtype=mm, buffer=nl.sbuf) for _ in tiles.unrolled(2)]

    def gather_k(t, b):
        _gather_rows(k_rows, idx, t * g.n_kv, g, zeros, k_nat[b], "vector")

    def gather_v(t, b):
        _gather_rows(v_rows, idx, t * g.n_kv, g, zeros, v_all[b], "gpsimd")

    def front(hh, j, b):
        """Step (hh, j)'s headers and the first half of each row tile (on ``kT[b]``)."""
        t = hh * ipp + j
        b_i = nisa.tensor_copy(bs[0:PMAX, nl.ds(j, 1)], engine=nisa.gpsimd_engine)
        s_i = nisa.tensor_copy(bs[0:PMAX, nl.ds(ipp + j, 1)], engine=nisa.gpsimd_engine)
        mask_row = nisa.tensor_copy(mask[0:1, nl.ds(j * rs, rs)], engine=nisa.gpsimd_engine)
        slope_g = item = None
        if alibi:
            slope_g = nisa.tensor_copy(slopes[0:G, nl.ds(t, 1)], engine=nisa.gpsimd_engine)
            item = (s_i, nisa.tensor_copy(cols[0:PMAX, nl.ds(2 * ipp + j, 1)],
                                          engine=nisa.gpsimd_engine))
        states = []
        for (_, rt0, rows), q_keep in zip(row_tiles, qs):
            q_nat = nisa.tensor_copy(q_keep[0:rows, nl.ds(t * D, D)],
                                     engine=nisa.gpsimd_engine)
            rm = (_RowMods(mods, slope_g, None, G, T, rt0, rows) if mods.transforms
                  else None)
            states.append((rm, _split_front(q_nat, kT[b], mask_row, g, rows, scale, mm, rm,
                                            mods.softcap)))
        return b_i, s_i, item, states

    def back(hh, b, head):
        """The second half of each row tile of the step ``front`` began (on ``v_all[b]``)."""
        b_i, s_i, item, states = head
        o_base = _int_tile([(b_i, Hkv * R * S), (s_i, 1)], PMAX, 1)
        for (_, rt0, rows), (rm, state) in zip(row_tiles, states):
            _split_back(state, v_all[b], o_flat, lse_flat, o_base, g, h0 + hh, R, S, rt0, rows,
                        mm, rm, item)

    def step(hh, j, b):
        t = hh * ipp + j
        gather_k(t + 2, b)                      # k_nat[b] is free: step t's keys are in kT[b]
        head = front(hh, j, b)
        _transpose_keys(k_nat[1 - b], kT[1 - b], g)
        back(hh, b, head)
        gather_v(t + 2, b)                      # after step t's P V

    # Buffer b is the parity of the step: steps come in pairs (ipp even: item pairs of one
    # head; ipp = 1: pairs of heads).
    gather_k(0, 0)
    gather_v(0, 0)
    gather_k(1, 1)
    gather_v(1, 1)
    _transpose_keys(k_nat[0], kT[0], g)
    if steps == 1:
        step(0, 0, 0)
    elif ipp % 2 == 0:
        for hh in nl.sequential_range(hpp):
            for jj in nl.sequential_range(ipp // 2):
                step(hh, 2 * jj, 0)
                step(hh, 2 * jj + 1, 1)
    else:
        for hp in nl.sequential_range(hpp // 2):
            step(2 * hp, 0, 0)
            step(2 * hp + 1, 0, 1)


def decode_grid(groups: int, programs: int, core_axis=None):
    """The split kernel's launch grid ``(head groups, programs)``, with axis ``core_axis``
    (None, 0 or 1; its size even) spread over the two NeuronCores of a trn2 logical core
    (``nl.spmd_dim(n / 2, nl.nc(2))``: program ids stay the logical ones, so the kernel is
    unchanged)."""
    dims = [groups, programs]
    if core_axis is not None:
        dims[core_axis] = nl.spmd_dim(dims[core_axis] // 2, nl.nc(2))
    return tuple(dims)


@nki.jit
def flash_decode_split_kernel(q, k_cache, v_cache, cache_lens, work=None, tree_mask=None,
                              block_table=None, alibi_slopes=None, sinks=None, scale=1.0,
                              mm_dtype="bfloat16", key_row=1, split_rows=1, num_splits=1,
                              row_tile=1, pack=1, items_per_program=1, heads_per_program=1,
                              softcap=None):
    """Phase 1: one partial (o, lse) per work item -- a split of the committed prefix of one
    sequence -- or tail of one sequence, for one kv head.

    Parameters
    ----------
    q : (B, Hq, T, D) float32 / bfloat16 / float16, D <= 256, T <= 128
    k_cache, v_cache : (B, Hkv, S_max, D), q's dtype; S_max a multiple of ``key_row``
        With ``block_table``: page pools ``(num_blocks, Hkv, page_size, D)``, page_size a power
        of two and a multiple of ``key_row``.
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
    softcap, alibi_slopes, sinks :
        Score modifiers (``score_mods.py``; HBM float32 ``(1 or B, Hq)`` slopes and ``(Hq,)``
        sinks): soft-capping and ALiBi in every partial (new token t at position ``L - T +
        t``), the sink in the tail's partial only (so the merge counts it once).

    Grid ``(Hkv / heads_per_program, C + B)``, ``C = W / items_per_program``: program
    ``(hg, c)`` with ``c < C`` runs work items ``c items_per_program ..`` for kv heads ``hg
    heads_per_program ..``; item ``(b, s)`` is key rows ``s * split_rows .. (s + 1) *
    split_rows`` of sequence b (positions ``n`` times that), reading only the rows entirely
    below ``Lp = cache_lens[b] - T``, into partial slot s. Program ``(hg, C + b)`` runs the
    tails of sequence b for those heads -- the ``Lp mod n`` positions of the last partial key
    row and the T new tokens -- into slot ``num_splits``.

    Returns
    -------
    o_part : ((B + 1) * Hq * T, num_splits + 1, D) float32
        Normalized partial outputs; row ``(b * Hq + h) * T + t``. Slots of splits a sequence
        does not have are never written (the merge masks them); the last ``Hq * T`` rows are
        the padding items' trash.
    lse_part : ((B + 1) * Hq * T, num_splits + 1) float32
        Partial LSE (natural log of scaled scores); -inf for a split with no valid position.
    """
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    R = (Hq // Hkv) * T
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
    n = key_row
    mm = _DTYPES[mm_dtype]
    # rows of "sequence B" are a trash block for padding work items
    o_part = nl.ndarray(((B + 1) * Hq * T, S, D), dtype=nl.float32, buffer=nl.shared_hbm)
    lse_part = nl.ndarray(((B + 1) * Hq * T, S), dtype=nl.float32, buffer=nl.shared_hbm)

    hg = nl.program_id(0)
    w = nl.program_id(1)
    q_rows = q.reshape((B * Hkv * R, D))
    mods = SM.check_mods(softcap, alibi_slopes, sinks)
    G = Hq // Hkv

    if w >= C:
        b = w - C
        len_col = _length_column(cache_lens, b, PMAX)
        lp, rem = _committed_split(len_col, T, n)
        for hh in nl.affine_range(heads_per_program):
            h = hg * heads_per_program + hh
            tail_mods = None
            if mods != SM.Mods():
                tail_mods = (mods, _member_column(alibi_slopes, b, h, G) if mods.alibi
                             else None,
                             _member_column(sinks, b, h, G) if mods.sinks else None, G,
                             mods.softcap)
            _tail_partial(q_rows, k_cache, v_cache, tree_mask, lp, rem, o_part, lse_part,
                          b * Hkv + h, num_splits, T, R, D, n, row_tile, scale, mm,
                          paged=None if block_table is None else (block_table, b, h),
                          mods=tail_mods)
    else:
        _split_chunk(q_rows, k_cache, v_cache, cache_lens, work, block_table, alibi_slopes,
                     o_part, lse_part, mods, hg, w, B, Hkv, R, S, T, G, n, split_rows, pack,
                     row_tile, items_per_program, heads_per_program, scale, mm)
    return o_part, lse_part
