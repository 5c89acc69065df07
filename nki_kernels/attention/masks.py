"""Attention masks of the forward kernel (shared with the backward): which tiles to compute, the
in-kernel mask tiles, and what runtime lengths mean on chip.

Visibility rule (docs/semantics.md): key j is visible to query i of sequence b iff

    i < nq_b,  j < nk_b,  and  lo <= j - i - off_b <= hi

where ``nq_b``/``nk_b`` are ``q_lens[b]``/``kv_lens[b]`` (or Nq/Nk), ``off_b`` is the alignment
offset (0 for top_left; ``nk_b - nq_b`` for bottom_right and for a window without causal), and the
relative diagonal bounds are ``hi = 0`` for causal (capped by a window's ``right``) and
``lo = -left`` for a window (``None`` = unbounded).

The band is always static (compile time). The host-side plan skips score tiles that are fully
masked, trims each query tile's key range to the union of its rows' windows, and masks only
*boundary* tiles, by selecting ``MASK_NEG`` outside the band (``forward.scores``: an
``affine_select`` of the key-minus-row distance; the backward selects on loop-index predicates
too). With runtime lengths (kernel inputs, so one compiled kernel
serves every set of lengths; :class:`RuntimeLengths`):

- the rows and keys are *gathered* by indirect DMAs that skip padding (never read, so a NaN there
  cannot leak) into pre-filled tiles (zeros; the forward's key tiles: its edge key);
- when lengths would move the band (bottom_right alignment: ``off_b = nk_b - nq_b``), the gathers
  *rotate* each sequence: on-chip row i' holds HBM row ``(i' + nq_b) mod Nq`` and key j' HBM key
  ``(j' + nk_b) mod Nk``. The valid rows and keys then end at Nq and Nk, ``j' - i' - (Nk - Nq) =
  j - i - off_b``, and the band is the static bottom_right band of the padded shapes; stores
  scatter the results back through the same bijection. top_left needs no rotation: its band does
  not depend on lengths and its valid rows and keys already start at 0;
- keys past ``kv_len`` (before ``Nk - kv_len`` when rotated): the backward adds a per-key mask,
  rank 1: ``NEG * 1 (x) key_row`` (:meth:`RuntimeLengths.key_mask_row`); the forward instead
  zeroes their V and their share of the row sums and fills their K with the valid key next to
  the padding (``forward.edge_key_fill``, :meth:`RuntimeLengths.edge_key_index`). Query rows
  past ``q_len`` are zeroed when the output is written. A kernel cannot branch on tensor
  values, so these apply to every tile the band allows.

Masked scores become ``MASK_NEG`` (finite, see ``tiles.FWD_MASK_NEG``). The helpers the forward
uses (:func:`broadcast_row`, :func:`zero_non_finite`, :func:`load_lengths`,
:func:`position_table`, :func:`gather_rows`, :func:`store_rows`, :func:`neg_row`,
:func:`key_length_row`, :class:`RuntimeLengths`) are written against :mod:`nki_kernels.port`
and trace through either namespace (the gathers and scatters: :func:`port.rows`; the key row's
loop-index start: a :class:`port.OffsetColumns` under nki.*).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np  # compile-time constants only

from nki_kernels import port
from nki_kernels import tiles as T

#: Score-tile classes of the static plan.
FULL, BOUNDARY = "full", "boundary"


# ============================================================================================
# Compile-time description (plain Python)
# ============================================================================================


@dataclass(frozen=True)
class MaskSpec:
    """The mask options of one forward call, normalised (compile-time, hashable).

    Attributes
    ----------
    nq, nk : int
        Padded query and key lengths.
    causal : None, "top_left" or "bottom_right"
    window : None or (left, right) with -1 = unbounded
    q_lens, kv_lens : bool
        Whether the corresponding length array is given.
    alibi : bool
        ALiBi bias on the scores (``score_mods``): its distance ``|i + off - j|`` must be static
        in the kernel's frame, so with lengths the sequences rotate as for a band.
    """

    nq: int
    nk: int
    causal: Optional[str] = None
    window: Optional[Tuple[int, int]] = None
    q_lens: bool = False
    kv_lens: bool = False
    alibi: bool = False

    # -- diagonal bounds relative to the alignment offset ------------------------------------
    @property
    def hi(self) -> Optional[int]:
        """Upper bound of ``j - i - off`` (None = unbounded)."""
        hi = 0 if self.causal is not None else None
        if self.window is not None and self.window[1] >= 0:
            hi = self.window[1] if hi is None else min(hi, self.window[1])
        return hi

    @property
    def lo(self) -> Optional[int]:
        """Lower bound of ``j - i - off`` (None = unbounded)."""
        if self.window is not None and self.window[0] >= 0:
            return -self.window[0]
        return None

    @property
    def has_diag(self) -> bool:
        return self.hi is not None or self.lo is not None

    @property
    def top_left(self) -> bool:
        return self.causal == "top_left"

    @property
    def rotates(self) -> bool:
        """Runtime lengths would move the band (bottom_right alignment, also a window without
        causal), so kernels with lengths rotate each sequence by them (module docstring). So
        does ALiBi's distance, bottom_right aligned without a band too."""
        return (self.has_diag or self.alibi) and not self.top_left

    @property
    def rotate_q(self) -> bool:
        """Query rows are gathered rotated by ``q_len``."""
        return self.rotates and self.q_lens

    @property
    def rotate_k(self) -> bool:
        """Keys are gathered rotated by ``kv_len``."""
        return self.rotates and self.kv_lens

    @property
    def static_offset(self) -> int:
        """Alignment offset of the band in the kernel's frame: 0 for top_left, ``nk - nq``
        otherwise (with lengths: in the rotated frame)."""
        return 0 if self.top_left else self.nk - self.nq

    @property
    def any(self) -> bool:
        return self.has_diag or self.q_lens or self.kv_lens

    # -- static plan -----------------------------------------------------------------------
    def key_range(self, i0: int, rows: int) -> Tuple[int, int]:
        """Keys ``[k_lo, k_hi)`` that query rows ``i0 .. i0+rows-1`` may see, ``k_lo`` a multiple
        of 128 (V chunks are 128-key blocks). Empty (``k_lo >= k_hi``) when every row is masked
        statically."""
        if not self.has_diag:
            return 0, self.nk
        off = self.static_offset
        k_lo = 0 if self.lo is None else max(0, i0 + off + self.lo)
        k_hi = self.nk if self.hi is None else min(self.nk, i0 + rows - 1 + off + self.hi + 1)
        k_lo = (k_lo // T.FWD_V_CHUNK) * T.FWD_V_CHUNK
        return k_lo, k_hi

    def classify(self, i0: int, rows: int, j0: int, width: int) -> Optional[str]:
        """Class of the score tile rows ``[i0, i0+rows)`` x keys ``[j0, j0+width)``.

        Returns None (fully masked: skip), :data:`FULL` (no diagonal mask) or :data:`BOUNDARY`
        (static diagonal mask needed).
        """
        if not self.has_diag:
            return FULL
        off = self.static_offset
        d_min = j0 - (i0 + rows - 1) - off
        d_max = (j0 + width - 1) - i0 - off
        if (self.hi is not None and d_min > self.hi) or (self.lo is not None and d_max < self.lo):
            return None
        if (self.hi is None or d_max <= self.hi) and (self.lo is None or d_min >= self.lo):
            return FULL
        return BOUNDARY


# ============================================================================================
# In-kernel mask tiles (NKI)
# ============================================================================================


def int_mod(x, n: int, dtype=None):
    """``x mod n`` of an fp32 tile of non-negative integers (``x n < 2^22``), without ``nl.mod``
    (issue "kernels that compile and run": an op to avoid on hardware): ``x - n q`` with ``q =
    RNE((x + 0.5) / n - 0.5)``, which is ``floor(x / n)`` because the argument stays within
    ``0.5 - 0.5 / n`` of it. Three VectorE instructions, into a new tile of ``dtype`` (default
    fp32). Written against :mod:`nki_kernels.port` (either namespace)."""
    pl = port.nl
    shape = tuple(x.shape)
    qf = pl.ndarray(shape, dtype=pl.float32, buffer=pl.sbuf)
    port.tensor_scalar(qf, x, pl.add, 0.5, op1=pl.multiply, operand1=1.0 / n)
    q = pl.ndarray(shape, dtype=pl.int32, buffer=pl.sbuf)
    port.tensor_scalar(q, qf, pl.subtract, 0.5)
    out = pl.ndarray(shape, dtype=pl.float32 if dtype is None else dtype, buffer=pl.sbuf)
    port.scalar_tensor_tensor(out, q, pl.multiply, -float(n), pl.add, x)
    return out


def neg_row(n: int):
    """``MASK_NEG`` in bf16 [1, n]: stationary operand of the rank-1 key-length mask. Written
    against :mod:`nki_kernels.port` (either namespace)."""
    pl = port.nl
    row = pl.ndarray((1, n), dtype=pl.bfloat16, buffer=pl.sbuf)
    port.memset(row, T.FWD_MASK_NEG)
    return row


def broadcast_row(row, width: int):
    """fp32 ``[128, width]``: an fp32 ``[1, width]`` row on every partition (a K=1 matmul of
    a ones row, one PSUM bank per 512 columns; exact for integers below 2^24, as
    ``masks.load_lengths`` uses it, and for any fp32 value if the fp32 matmul keeps full
    products -- 1.0 x v needs no rounding; score_mods relies on it for per-head floats).
    Written against :mod:`nki_kernels.port` (either namespace)."""
    pl = port.nl
    ones = pl.ndarray((1, T.PMAX), dtype=pl.float32, buffer=pl.sbuf)
    port.memset(ones, 1.0, engine="gpsimd")
    out = pl.ndarray((T.PMAX, width), dtype=pl.float32, buffer=pl.sbuf)

    def bank(c0, w: int):
        ps = pl.ndarray((T.PMAX, w), dtype=pl.float32, buffer=pl.psum)
        port.nc_matmul(ps, ones, row[0:1, pl.ds(c0, w)])
        port.tensor_copy(out[:, pl.ds(c0, w)], ps, engine="vector")

    # a compiled loop over full banks (a block-sparse table row grows with N), a static tail
    full, tail = divmod(width, T.PSUM_FMAX)
    port.loop(full, lambda c: bank(c * T.PSUM_FMAX, T.PSUM_FMAX))
    if tail:
        bank(full * T.PSUM_FMAX, tail)
    return out


def zero_non_finite(vals, want_z: bool = True):
    """Zero the inf/NaN entries of an SBUF tile ``vals`` in place; returns ``(bad, z)``: the
    uint8 tile that marks them and ``vals * 0`` in fp32 (NaN exactly there, 0 elsewhere). GpSimd
    (otherwise mostly idle) multiplies by 0 and compares; VectorE selects. Used where a value
    multiplies a zero weight in a matmul (``0 * inf`` would reach rows that cannot see the
    value). ``want_z`` False: ``bad`` in one GpSimd instruction (``(vals * 0) != 0``, the same
    bits) and ``z`` None. Written against :mod:`nki_kernels.port` (either namespace)."""
    pl = port.nl
    shape = tuple(vals.shape)
    bad = pl.ndarray(shape, dtype=pl.uint8, buffer=pl.sbuf)
    z = None
    if want_z:
        z = pl.ndarray(shape, dtype=pl.float32, buffer=pl.sbuf)
        port.tensor_scalar(z, vals, pl.multiply, 0.0, engine="gpsimd")
        port.tensor_scalar(bad, z, pl.not_equal, 0.0, engine="gpsimd")
    else:
        port.tensor_scalar(bad, vals, pl.multiply, 0.0, op1=pl.not_equal, operand1=0.0,
                           engine="gpsimd")
    port.tensor_copy_predicated(vals, 0.0, bad)
    return bad, z


def load_lengths(kv_lens, q_lens, b, nk: int, nq: int):
    """Per-sequence lengths of sequence ``b`` as fp32: ``kv_len`` on partition 0 ([1, 1], for the
    key-mask row) and ``[128, 2]`` = (kv_len, q_len) on every partition (for per-row thresholds).
    A missing length (None) is its padded size (``nk`` or ``nq``). The partition broadcast is a
    K=1 matmul of a ones row (exact for integers in fp32). Returns ``(raw [1, 2], lens_p)``.
    The SBUF-only steps run on GpSimd, which attention kernels leave mostly idle. Written
    against :mod:`nki_kernels.port` (either namespace; ``b`` an int or a loop index)."""
    pl = port.nl
    raw = pl.ndarray((1, 2), dtype=pl.float32, buffer=pl.sbuf)
    for col, arr, full in ((0, kv_lens, nk), (1, q_lens, nq)):
        if arr is None:
            port.memset(raw[0:1, col:col + 1], float(full), engine="gpsimd")
        else:
            length = pl.ndarray((1, 1), dtype=pl.int32, buffer=pl.sbuf)
            port.dma_copy(length, arr.reshape((arr.shape[0], 1))[pl.ds(b, 1), 0:1])
            port.tensor_copy(raw[0:1, col:col + 1], length, engine="gpsimd")
    ones = pl.ndarray((1, T.PMAX), dtype=pl.float32, buffer=pl.sbuf)
    port.memset(ones, 1.0, engine="gpsimd")
    bcast = pl.ndarray((T.PMAX, 2), dtype=pl.float32, buffer=pl.psum)
    port.nc_matmul(bcast, ones, raw)
    lens_p = pl.ndarray((T.PMAX, 2), dtype=pl.float32, buffer=pl.sbuf)
    port.tensor_copy(lens_p, bcast)
    return raw, lens_p


def key_length_row(kv_len_1, j0, n: int, *, below: bool = False, offsets=None):
    """bf16 [1, n] row: 1.0 for keys ``j0 + jj >= kv_len`` (masked), else 0.0; with ``below``,
    1.0 for keys ``j0 + jj < kv_len`` instead (valid keys at the end of the padded length).

    ``kv_len_1`` is the sequence's key length (or first valid key) as an fp32 [1, 1] tile
    (partition 0). ``j0``: an int or an index expression; under nki.* a loop-index ``j0`` is
    read from ``offsets`` (a :class:`port.OffsetColumns` holding it: a multiple of its step,
    as ``j0`` plus each piece's start must be). Built in pieces of at most
    :data:`tiles.FWD_ROW_FMAX` keys, each one GpSimd iota and one VectorE compare
    (:func:`port.iota_compare`). Written against :mod:`nki_kernels.port` (either namespace).
    """
    pl = port.nl
    row = pl.ndarray((1, n), dtype=pl.bfloat16, buffer=pl.sbuf)
    op = pl.less if below else pl.greater_equal
    full, tail = divmod(n, T.FWD_ROW_FMAX)

    def piece(c0, w):
        port.iota_compare(row[0:1, pl.ds(c0, w)], [[1, w]], op, kv_len_1, runtime=j0 + c0,
                          offsets=offsets)

    # the row's length may grow with N: a compiled loop
    port.loop(full, lambda i: piece(i * T.FWD_ROW_FMAX, T.FWD_ROW_FMAX))
    if tail:
        piece(full * T.FWD_ROW_FMAX, tail)
    return row


# ============================================================================================
# Runtime lengths: gathers that skip padding, the rotation, the length masks (NKI)
# ============================================================================================


def oob_offset(n_rows: int) -> int:
    """Added to a row index to push it out of bounds of an ``n_rows``-row HBM view: a power of
    two (exact in fp32) above ``n_rows + 128``; index + offset must stay below 2^31 (int32)."""
    off = 1 << int(n_rows + T.PMAX).bit_length()
    if off >= 1 << 31:
        raise ValueError(f"attention kernels with lengths address at most 2^30 - 128 rows per "
                         f"tensor (int32 gather indices); got {n_rows}")
    return off


def position_table(runs, n: int, stride: int = T.PMAX, offsets=None):
    """int32 flat HBM rows and fp32 frame positions ``[128, n]`` of n tiles of ``stride``
    positions (at most 128): ``runs`` lists ``(first column, tiles, first flat row, first
    position)`` of stretches whose tiles follow each other in HBM (column c + t holds flat row
    ``first + stride t + p`` and position ``pos0 + stride t + p`` on partition p). One GpSimd
    iota pair per run. ``first`` depends on the program's indices: an index expression or a
    linear form of them (:func:`port.iota`'s ``runtime``), which 0.7 reads from ``offsets``
    (a :class:`port.OffsetColumns` of the indices: fp32, exact below 2^24, and with ``exact``
    an int32 copy that the integer rows take their runtime part from).
    ``pos0`` is an int, or a linear form read likewise (a loop-dependent first position).
    Written against :mod:`nki_kernels.port` (either namespace)."""
    pl = port.nl
    rows = pl.ndarray((T.PMAX, n), dtype=pl.int32, buffer=pl.sbuf)
    pos = pl.ndarray((T.PMAX, n), dtype=pl.float32, buffer=pl.sbuf)
    for c0, count, first, pos0 in runs:
        port.iota(rows[:, c0:c0 + count], [[stride, count]], channel_multiplier=1,
                  runtime=first, offsets=offsets)
        if isinstance(pos0, list):
            port.iota(pos[:, c0:c0 + count], [[stride, count]], channel_multiplier=1,
                      runtime=pos0, offsets=offsets)
        else:
            port.iota(pos[:, c0:c0 + count], [[stride, count]], offset=pos0,
                      channel_multiplier=1)
    return rows, pos


def gather_rows(dst, rows_view, idx, col, n: int, width: int):
    """``dst[p, :] = rows_view[idx[p, col], :]`` for ``p < n``, skipping out-of-bounds indices
    (dst keeps what it held: the caller fills it first). ``width``: rows_view's columns.
    :func:`port.rows` (either namespace)."""
    assert width == rows_view.shape[1], (width, rows_view.shape)
    port.dma_copy(dst, port.rows(rows_view, idx, col, n=n), oob_skip=True)


def store_rows(out, b, head, i0, n, tile, store, col, pred=None):
    """``out[b, head, i0 : i0 + n, :] = tile``; with ``store`` (int32 ``[128, k]`` of flat rows,
    column ``col``), scattered to those rows of out's ``(B H N, D)`` view instead
    (:func:`port.rows`). ``pred``: None, or a loop-index predicate the store is masked on
    (legacy)."""
    if store is None:
        port.dma_copy(out[b, head, port.nl.ds(i0, n), :], tile, mask=pred)
        return
    B, H, N, D = out.shape
    rows = out.reshape((B * H * N, D))
    port.dma_copy(port.rows(rows, store, col, n=n), tile, mask=pred, legacy_isa=True)


class RuntimeLengths:
    """What the runtime ``kv_lens``/``q_lens`` of a program's sequence b mean on chip (built once
    per program; every tile shape stays a compile-time constant). Shared by the forward and the
    backward.

    * ``lens_p`` fp32 ``[128, 2]`` = (kv_len, q_len) on every partition (:func:`load_lengths`; a
      missing length is Nk or Nq), and with ``key_rows`` ``key_start`` fp32 ``[1, 1]`` on
      partition 0: kv_len, or with rotated keys the first valid key ``Nk - kv_len`` (for
      :meth:`key_mask_row`).
    * **Padding never enters SBUF.** Rows past q_len and keys past kv_len are skipped by
      indirect DMAs (:meth:`index_table`: the index is pushed out of bounds and
      ``oob_mode.skip`` leaves the destination as it was, so the caller zero-fills it first).
    * **The band stays static.** When :attr:`MaskSpec.rotates` (bottom_right alignment, or a
      window without causal) the gathers rotate the sequence (``rotate_q``/``rotate_k``): frame
      row i' holds HBM row ``(i' + q_len) mod Nq`` and key j' HBM key ``(j' + kv_len) mod Nk``,
      so the valid rows and keys end at Nq and Nk and ``j' - i' - (Nk - Nq) = j - i - (kv_len -
      q_len)``: the band is the static bottom_right band of the padded shapes. Padding is then at
      the start (rows ``i' < Nq - q_len``, keys ``j' < Nk - kv_len``), and stores scatter the
      results back through the same bijection (every HBM row written once, padding included).
    * :meth:`valid` marks the valid positions of the frame, :meth:`key_mask_row` the padding
      keys (for ``MASK_NEG * 1 (x) row``), :meth:`edge_key_index` locates the valid key next to
      the padding (the forward's key mask).
    """

    def __init__(self, spec: MaskSpec, kv_lens, q_lens, b, Nq: int, Nk: int, *,
                 key_rows: bool = True):
        raw, self.lens_p = load_lengths(kv_lens, q_lens, b, Nk, Nq)
        self.kv_len_1 = raw[0:1, 0:1]
        self.kv_len_p = self.lens_p[:, 0:1]
        self.q_len_p = self.lens_p[:, 1:2]
        self.has_q, self.has_k = q_lens is not None, kv_lens is not None
        self.rotate_q = spec.rotates and self.has_q
        self.rotate_k = spec.rotates and self.has_k
        self.Nq, self.Nk = Nq, Nk
        self.key_start = None
        if self.has_k and key_rows:
            # the key row compares with kv_len, or with the first valid key Nk - kv_len
            self.key_start = self.kv_len_1
            if self.rotate_k:
                pl = port.nl
                self.key_start = pl.ndarray((1, 1), dtype=pl.float32, buffer=pl.sbuf)
                port.tensor_scalar(self.key_start, self.kv_len_1, pl.subtract, float(Nk),
                                   reverse0=True)

    def rotated(self, keys: bool) -> bool:
        """Whether the keys (``keys``) or the query rows are gathered rotated."""
        return self.rotate_k if keys else self.rotate_q

    def key_mask_row(self, j0, n: int, offsets=None):
        """bf16 ``[1, n]``: 1.0 at the padding keys among frame keys ``[j0, j0 + n)`` (None
        without kv_lens; needs ``key_rows=True``; ``offsets``: :func:`key_length_row`'s)."""
        if not self.has_k:
            return None
        return key_length_row(self.key_start, j0, n, below=self.rotate_k, offsets=offsets)

    def valid(self, pos, keys: bool, dtype=None, dst=None):
        """1.0 where the frame positions ``pos`` (an fp32 tile of query rows, or keys when
        ``keys``; any free shape) are valid -- ``pos < len``, or ``pos + len >= N`` when rotated
        -- else 0.0, into ``dst`` (a new tile of ``dtype``, default fp32, unless given). One
        VectorE instruction (either namespace)."""
        pl = port.nl
        if dst is None:
            dst = pl.ndarray(tuple(pos.shape), dtype=pl.float32 if dtype is None else dtype,
                             buffer=pl.sbuf)
        length_p = self.kv_len_p if keys else self.q_len_p
        if self.rotated(keys):
            port.tensor_scalar(dst, pos, pl.add, length_p, op1=pl.greater_equal,
                               operand1=float(self.Nk if keys else self.Nq))
        else:
            port.tensor_scalar(dst, pos, pl.less, length_p)
        return dst

    def edge_key_index(self, first_row, n_rows: int, offsets=None):
        """int32 ``[1, 1]``: the flat row, in an ``(n_rows, D)`` HBM view where this sequence's
        key 0 is row ``first_row``, of the valid key next to the padding -- the first one (HBM
        key 0, frame position ``Nk - kv_len``) when the keys are rotated, else the last one
        (``kv_len - 1``) -- pushed out of bounds when ``kv_len = 0`` (a gather then skips it).
        ``first_row``/``offsets``: as :func:`position_table`'s ``first``/``offsets``. Either
        namespace.
        """
        pl = port.nl
        base = pl.ndarray((1, 1), dtype=pl.int32, buffer=pl.sbuf)
        port.iota(base, [[1, 1]], channel_multiplier=1, runtime=first_row, offsets=offsets)
        lack = pl.ndarray((1, 1), dtype=pl.float32, buffer=pl.sbuf)
        port.tensor_scalar(lack, self.kv_len_1, pl.less, 1.0, op1=pl.multiply,
                           operand1=float(oob_offset(n_rows)))
        shift = pl.ndarray((1, 1), dtype=pl.int32, buffer=pl.sbuf)
        if self.rotate_k:
            port.tensor_copy(shift, lack, engine="gpsimd")
        else:
            port.scalar_tensor_tensor(shift, self.kv_len_1, pl.subtract, 1.0, pl.add, lack)
        index = pl.ndarray((1, 1), dtype=pl.int32, buffer=pl.sbuf)
        port.tensor_tensor(index, base, shift, pl.add)
        return index

    def index_table(self, rows, pos, n_rows: int, keys: bool, valid=None):
        """Gather/scatter indices of a set of positions of the kernel's frame (query rows, or
        keys when ``keys``): ``rows`` int32 ``[128, n]`` are their unrotated rows in an
        ``(n_rows, D)`` HBM view (:func:`position_table`), ``pos`` fp32 ``[128, n]`` the
        positions themselves. Returns ``(load, store)`` int32 ``[128, n]``: ``load`` is pushed
        out of bounds for padding positions, which ``oob_mode.skip`` DMAs then never read;
        ``store`` is None without rotation (plain stores write the tiles in place), else the
        rotation's HBM row of every position, padding included. A few VectorE/GpSimd
        instructions for all n columns at once; ``valid`` (:meth:`valid` of ``pos``) may be
        passed in when the caller needs it too."""
        pl = port.nl
        shape = tuple(rows.shape)
        length_p = self.kv_len_p if keys else self.q_len_p
        N = self.Nk if keys else self.Nq
        store = None
        valid = self.valid(pos, keys) if valid is None else valid
        if self.rotated(keys):
            # valid iff pos + len >= N, at HBM position pos + len - N; a padding position goes
            # to pos + len (the rotation by len, mod N: both in range)
            shift = pl.ndarray(shape, dtype=pl.int32, buffer=pl.sbuf)
            port.tensor_scalar(shift, valid, pl.multiply, -float(N), op1=pl.add,
                               operand1=length_p)
            store = pl.ndarray(shape, dtype=pl.int32, buffer=pl.sbuf)
            port.tensor_tensor(store, rows, shift, pl.add)
            rows = store
        beyond = pl.ndarray(shape, dtype=pl.int32, buffer=pl.sbuf)
        port.tensor_scalar(beyond, valid, pl.subtract, 1.0, op1=pl.multiply,
                           operand1=-float(oob_offset(n_rows)))
        load = pl.ndarray(shape, dtype=pl.int32, buffer=pl.sbuf)
        port.tensor_tensor(load, rows, beyond, pl.add)
        return load, store


__all__ = ["MaskSpec", "broadcast_row", "zero_non_finite", "FULL", "BOUNDARY",
           "int_mod", "neg_row", "load_lengths", "key_length_row", "oob_offset",
           "position_table", "gather_rows", "store_rows", "RuntimeLengths", "np"]
