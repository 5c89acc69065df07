"""Attention masks of the forward kernel: which tiles to compute, and in-kernel mask tiles.

Visibility rule (docs/semantics.md): key j is visible to query i of sequence b iff

    i < nq_b,  j < nk_b,  and  lo <= j - i - off_b <= hi

where ``nq_b``/``nk_b`` are ``q_lens[b]``/``kv_lens[b]`` (or Nq/Nk), ``off_b`` is the alignment
offset (0 for top_left; ``nk_b - nq_b`` for bottom_right and for a window without causal), and the
relative diagonal bounds are ``hi = 0`` for causal (capped by a window's ``right``) and
``lo = -left`` for a window (``None`` = unbounded).

Two kinds of masks, by when their parameters are known:

- **static** (compile time): causal/window with an offset that does not depend on lengths. The
  host-side plan skips score tiles that are fully masked, trims each query tile's key range to the
  union of its rows' windows, and masks only *boundary* tiles. Their indicator tiles depend only
  on ``j0 - i0`` (the tile's diagonal offset) and are built once and cached.
- **runtime** (kernel inputs): ``kv_lens`` (a per-key mask, rank 1: ``NEG * 1 (x) [j >= nk_b]``)
  and, when lengths move the bottom_right diagonal, the diagonal mask itself (built per tile from
  an iota pattern compared with per-partition thresholds). ``q_lens`` rows are zeroed at the end.
  A kernel cannot branch on tensor values, so runtime masks apply to every tile they could touch.

Every mask reaches the scores the same way: a matmul ``(MASK_NEG * I)^T @ indicator`` (or the
rank-1 ``(MASK_NEG * 1)^T @ key_row``) accumulated into the score tile's PSUM bank, where the
indicator is 1.0 at masked positions and 0.0 elsewhere. TensorE does the add for free of VectorE
time, and masked scores become ``s + MASK_NEG`` (finite, see ``tiles.FWD_MASK_NEG``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np  # compile-time constants only

from nki_kernels import tiles as T
from nki_kernels.nki import nisa, nl

#: Score-tile classes of the static plan.
FULL, BOUNDARY, RUNTIME = "full", "boundary", "runtime"


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
    """

    nq: int
    nk: int
    causal: Optional[str] = None
    window: Optional[Tuple[int, int]] = None
    q_lens: bool = False
    kv_lens: bool = False

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
    def runtime_offset(self) -> bool:
        """The alignment offset depends on lengths (bottom_right with q_lens or kv_lens)."""
        return (not self.top_left) and (self.q_lens or self.kv_lens)

    @property
    def runtime_diag(self) -> bool:
        """The diagonal mask must be built per tile from runtime thresholds."""
        return self.has_diag and self.runtime_offset

    @property
    def static_offset(self) -> int:
        """Compile-time alignment offset (meaningful when not :attr:`runtime_offset`)."""
        return 0 if self.top_left else self.nk - self.nq

    @property
    def any(self) -> bool:
        return self.has_diag or self.q_lens or self.kv_lens

    # -- static plan -----------------------------------------------------------------------
    def key_range(self, i0: int, rows: int) -> Tuple[int, int]:
        """Keys ``[k_lo, k_hi)`` that query rows ``i0 .. i0+rows-1`` may see, ``k_lo`` a multiple
        of 128 (V chunks are 128-key blocks). Empty (``k_lo >= k_hi``) when every row is masked
        statically. Runtime diagonals cannot be trimmed: ``(0, Nk)``."""
        if not self.has_diag or self.runtime_diag:
            return 0, self.nk
        off = self.static_offset
        k_lo = 0 if self.lo is None else max(0, i0 + off + self.lo)
        k_hi = self.nk if self.hi is None else min(self.nk, i0 + rows - 1 + off + self.hi + 1)
        k_lo = (k_lo // T.FWD_V_CHUNK) * T.FWD_V_CHUNK
        return k_lo, k_hi

    def classify(self, i0: int, rows: int, j0: int, width: int) -> Optional[str]:
        """Class of the score tile rows ``[i0, i0+rows)`` x keys ``[j0, j0+width)``.

        Returns None (fully masked: skip), :data:`FULL` (no diagonal mask), :data:`BOUNDARY`
        (static diagonal mask needed) or :data:`RUNTIME` (runtime diagonal mask).
        """
        if not self.has_diag:
            return FULL
        if self.runtime_diag:
            return RUNTIME
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


def neg_identity(n: int):
    """``MASK_NEG * I_n`` in bf16 [n, n]: the stationary operand that adds ``MASK_NEG *
    indicator`` into a score tile (row i of the result gets row i of the indicator)."""
    diff = nisa.iota(nl.arange(n)[None, :] - nl.arange(n)[:, None], dtype=nl.float32)
    return nisa.tensor_scalar(diff, nl.equal, 0.0, op1=nl.multiply, operand1=T.FWD_MASK_NEG,
                              dtype=nl.bfloat16)


def neg_row(n: int):
    """``MASK_NEG`` in bf16 [1, n]: stationary operand of the rank-1 key-length mask."""
    return nisa.memset((1, n), T.FWD_MASK_NEG, dtype=nl.bfloat16)


def diag_pattern(i0: int, rows: int, j0: int, width: int):
    """fp32 [rows, width] tile of ``(j0 + jj) - (i0 + ii)``, the key-minus-query distance
    (exact integers; GpSimd iota)."""
    return nisa.iota((j0 - i0) + nl.arange(width)[None, :] - nl.arange(rows)[:, None],
                     dtype=nl.float32)


def diag_indicator(pattern, hi, lo):
    """bf16 tile: 1.0 where ``pattern > hi`` or ``pattern < lo``, else 0.0.

    ``hi``/``lo`` are Python numbers (static masks: relative bound plus the compile-time offset)
    or per-partition fp32 ``(P, 1)`` tiles (runtime offsets), or None for an unbounded side. At
    most one of the two conditions holds (lo <= hi), so the sum is an indicator.
    """
    if lo is None:
        return nisa.tensor_scalar(pattern, nl.greater, hi, dtype=nl.bfloat16)
    if hi is None:
        return nisa.tensor_scalar(pattern, nl.less, lo, dtype=nl.bfloat16)
    above = nisa.tensor_scalar(pattern, nl.greater, hi, dtype=nl.float32)
    return nisa.scalar_tensor_tensor(data=pattern, op0=nl.less, operand0=lo, op1=nl.add,
                                     operand1=above, dtype=nl.bfloat16)


class StaticDiagMasks:
    """The static boundary-tile indicators of a kernel, built once up front.

    An indicator depends only on the key-minus-query distance pattern and the static bounds, so
    every boundary tile with the same ``j0 - i0`` shares one (its top-left ``[rows, width]``
    corner). ``offsets`` (from the schedule) lists the distinct ``j0 - i0`` of boundary tiles: a
    causal or window bound has a handful (the tile diagonal crosses a 128 x 512 tile at ~5
    offsets). All live in one bf16 tensor ``[rows, len(offsets), width]`` filled at the top of
    the kernel.
    """

    def __init__(self, spec: MaskSpec, rows: int, width: int, offsets):
        off = spec.static_offset
        hi = None if spec.hi is None else float(spec.hi + off)
        lo = None if spec.lo is None else float(spec.lo + off)
        self.index = {key: n for n, key in enumerate(sorted(offsets))}
        self.tiles = nl.ndarray((rows, max(1, len(self.index)), width), dtype=nl.bfloat16,
                                buffer=nl.sbuf)
        for key, n in self.index.items():
            self.tiles[:, n, :] = diag_indicator(diag_pattern(0, rows, key, width), hi, lo)

    def get(self, i0: int, j0: int):
        """Indicator of the boundary tile at rows ``i0``, keys ``j0`` (``[rows, width]``)."""
        return self.tiles[:, self.index[j0 - i0], :]


def load_lengths(kv_lens, q_lens, b, nk: int, nq: int):
    """Per-sequence lengths of sequence ``b`` as fp32: ``kv_len`` on partition 0 ([1, 1], for the
    key-mask row) and ``[128, 2]`` = (kv_len, q_len) on every partition (for per-row thresholds).
    A missing length (None) is its padded size (``nk`` or ``nq``). The partition broadcast is a
    K=1 matmul of a ones row (exact for integers in fp32). Returns ``(raw [1, 2], lens_p)``."""
    raw = nl.ndarray((1, 2), dtype=nl.float32, buffer=nl.sbuf)
    for col, arr, full in ((0, kv_lens, nk), (1, q_lens, nq)):
        if arr is None:
            raw[0:1, col:col + 1] = nisa.memset((1, 1), float(full), dtype=nl.float32)
        else:
            raw[0:1, col:col + 1] = nisa.tensor_copy(nl.load(arr[nl.ds(b, 1)]),
                                                     dtype=nl.float32)
    ones = nisa.memset((1, T.PMAX), 1.0, dtype=nl.float32)
    bcast = nl.ndarray((T.PMAX, 2), dtype=nl.float32, buffer=nl.psum)
    bcast[...] = nisa.nc_matmul(ones, raw)
    lens_p = nisa.tensor_copy(bcast, dtype=nl.float32)
    return raw, lens_p


def key_length_row(kv_len_1, j0: int, n: int, *, below: bool = False):
    """bf16 [1, n] row: 1.0 for keys ``j0 + jj >= kv_len`` (masked), else 0.0; with ``below``,
    1.0 for keys ``j0 + jj < kv_len`` instead (valid keys at the end of the padded length).

    ``kv_len_1`` is the sequence's key length (or first valid key) as an fp32 [1, 1] tile
    (partition 0). Built in pieces of at most :data:`tiles.FWD_ROW_FMAX` keys.
    """
    row = nl.ndarray((1, n), dtype=nl.bfloat16, buffer=nl.sbuf)
    for c0 in nl.static_range(0, n, T.FWD_ROW_FMAX):
        w = min(T.FWD_ROW_FMAX, n - c0)
        pos = nisa.iota((j0 + c0) + nl.arange(w)[None, :], dtype=nl.float32)
        row[0:1, c0:c0 + w] = nisa.tensor_scalar(pos, nl.less if below else nl.greater_equal,
                                                 kv_len_1, dtype=nl.bfloat16)
    return row


def row_valid(q_len_p, i0: int, rows: int):
    """fp32 [rows, 1]: 1.0 for query rows ``i0 + ii < q_len`` else 0.0 (``q_len_p`` is the
    query length broadcast to every partition, fp32 [128, 1])."""
    pos = nisa.iota(i0 + nl.arange(rows)[:, None], dtype=nl.float32)
    return nisa.tensor_scalar(pos, nl.less, q_len_p[0:rows, 0:1], dtype=nl.float32)


__all__ = ["MaskSpec", "FULL", "BOUNDARY", "RUNTIME", "neg_identity", "neg_row", "diag_pattern",
           "diag_indicator", "StaticDiagMasks", "load_lengths", "key_length_row", "row_valid",
           "np"]
