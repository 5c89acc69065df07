"""Block-sparse flash attention forward (FlashAttention section 3.3, appendix Algorithm 5).

A pattern of 128 x 128 blocks says which key blocks each query tile attends to
(``host/block_sparse.py``); a missing block is skipped entirely -- no K/V load, no matmul, no
exponential -- so HBM traffic and work fall with the density s (Proposition 4: Theta(Nd +
N^2 d^2 M^-1 s)). Inside an active block the usual masks still apply (causal, window, valid
lengths), and GQA and attention dropout compose as in the dense forward.

The pattern is device data: ``meta (b, h, n, 2 + trip)`` float32, one row per query tile in
processing order, ``[first row, count, first key of block_0, ...]`` with
``tiles.BSP_PAD_FIRST`` in padding slots (``host.block_sparse.kernel_tables``).
The compile-time part is ``classes``: runs of order positions, each an NKI loop over its query
tiles with an inner ``sequential_range`` of ``trip`` slots (the carried online-softmax state),
at most ``tiles.BSP_MAX_CLASSES`` of them whatever N, so the program does not grow with N.

- **Compile-time pattern** (a dense bool block mask): the host sorts the query tiles by their
  count and cuts the runs tightly (``exact`` classes have no masked slot and no mask work).
- **Runtime pattern** (FlexAttention's ``(num_blocks, indices)``): one class of every query
  tile with ``trip = max_blocks``; one compilation serves every pattern of that bound. Slots
  past a tile's count are *padding slots*: their K/V gathers are skipped by ``oob_mode.skip``
  (the index is pushed out of bounds: no HBM read) and their scores are masked, so they cost
  on-chip work but no traffic. Legacy NKI has no data-dependent trip count (``dynamic_range``
  is an ``nki.*`` API on trn2/trn3 only; reference/nki-api-spec.md), so this is the NKI way.

Per query tile (a loop body)::

    load meta row -> fp32 on every partition (a K=1 ones matmul, exact for ints < 2^24)
    gather Q rows (indirect DMA; rows past Nq or q_len skipped), Q^T by TensorE
    for step in sequential_range(trip / 4) (+ a static tail step):
        gather K_j, V_j rows of the step's 4 blocks (indirect DMA, padding skipped)
        K^T by TensorE;  S = Q K^T over 512 keys (+ MASK_NEG x indicator: padding slot, keys
        past the length, causal/window band -- comparisons of iota tiles with per-slot
        columns)
        online-softmax update (forward.fold_block, shared with the dense kernel)
    O, LSE scattered to the tile's rows (rows past Nq skipped)

Masks here are computed at run time from the block's position (the dense kernel's band
predicates are affine in loop indices; here the key block is data). The alignment offset of
the band is ``Nk - Nq`` (bottom_right), 0 (top_left) or, with lengths, ``kv_len - q_len`` per
sequence; positions are those of the padded frame, the block pattern's own (no rotation).
"""
from __future__ import annotations

import numpy as np  # compile-time constants only (reduction ops)

from nki_kernels import tiles as T
from nki_kernels.attention import forward as F
from nki_kernels.attention import masks as M
from nki_kernels.nki import nisa, nki, nl

P = T.PMAX


def _check_classes(classes, n: int, trip_max: int):
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


class Geometry:
    """Compile-time facts of one launch shared by the forward and the backward: lengths, the
    band, and the constant iota tiles the runtime masks compare against."""

    def __init__(self, spec: M.MaskSpec, kv_lens, q_lens, b, Nq: int, Nk: int):
        self.spec, self.Nq, self.Nk = spec, Nq, Nk
        self.has_lens = kv_lens is not None or q_lens is not None
        _, self.lens_p = M.load_lengths(kv_lens, q_lens, b, Nk, Nq)
        self.kv_len = self.lens_p[:, 0:1]       # fp32 [128, 1]: kv_len (or Nk)
        self.q_len = self.lens_p[:, 1:2]        # q_len (or Nq)
        # the band's alignment offset: 0, Nk - Nq, or kv_len - q_len with lengths
        self.offset = None
        if spec.has_diag and not spec.top_left and self.has_lens:
            self.offset = nisa.tensor_tensor(self.kv_len, self.q_len, np.subtract,
                                             dtype=nl.float32)
        self.static_offset = 0 if spec.top_left else Nk - Nq
        self.diff = nisa.iota(nl.arange(P)[None, :] - nl.arange(P)[:, None],
                              dtype=nl.float32)                    # c - p
        self.part = nisa.iota(nl.arange(P)[:, None], dtype=nl.float32)   # p, [128, 1]
        self.col = nisa.tensor_scalar(self.diff, np.add, self.part, dtype=nl.float32)   # c

    def needs_key_mask(self, exact: bool) -> bool:
        """Whether scores need the key-side indicator: padding slots (not ``exact``), keys past
        kv_len, or the partial last key block."""
        return (not exact) or self.Nk % P != 0 or self.has_lens

    def band_columns(self, gap):
        """``(hi_thr, lo_thr)`` fp32 (None when unbounded), the shape of ``gap``: a score at
        row p, key column c of a block pair is outside the band when ``c - p > hi_thr`` or ``c
        - p < lo_thr``. ``gap``: fp32, first key minus first query row of each pair."""
        spec = self.spec
        if not spec.has_diag:
            return None, None
        # e = gap - off;  c - p + e in [lo, hi]
        e = gap
        if self.offset is not None:
            e = nisa.tensor_scalar(e, np.subtract, self.offset, dtype=nl.float32)
        else:
            e = nisa.tensor_scalar(e, np.subtract, float(self.static_offset), dtype=nl.float32)
        hi = lo = None
        if spec.hi is not None:
            hi = nisa.tensor_scalar(e, np.subtract, float(spec.hi), op1=np.multiply,
                                    operand1=-1.0, dtype=nl.float32)
        if spec.lo is not None:
            lo = nisa.tensor_scalar(e, np.subtract, float(spec.lo), op1=np.multiply,
                                    operand1=-1.0, dtype=nl.float32)
        return hi, lo

    def indicator(self, key_thr, hi_thr, lo_thr, rows: int = P, out=None):
        """``[rows, 128]`` (bf16, or ``out``'s dtype): 1 at the scores to mask -- key column ``c >= key_thr`` (a
        padding slot has ``key_thr <= 0``: every column), ``c - p > hi_thr``, ``c - p <
        lo_thr`` (each a ``[rows, 1]`` column, or None) -- else 0.0. GpSimd/VectorE. Written
        into ``out`` when given."""
        parts = []
        if key_thr is not None:
            parts.append(nisa.tensor_scalar(self.col[0:rows], nl.greater_equal, key_thr,
                                            dtype=nl.float32, engine=nisa.gpsimd_engine))
        if hi_thr is not None:
            parts.append(nisa.tensor_scalar(self.diff[0:rows], nl.greater, hi_thr,
                                            dtype=nl.float32, engine=nisa.gpsimd_engine))
        if lo_thr is not None:
            parts.append(nisa.tensor_scalar(self.diff[0:rows], nl.less, lo_thr,
                                            dtype=nl.float32, engine=nisa.vector_engine))
        if not parts:
            return None
        if out is None:
            out = nl.ndarray((rows, P), dtype=nl.bfloat16, buffer=nl.sbuf)
        if len(parts) == 1:
            out[...] = nisa.tensor_copy(parts[0], dtype=out.dtype, engine=nisa.vector_engine)
            return out
        ind = parts[0]
        for x in parts[1:-1]:
            ind = nisa.tensor_tensor(ind, x, nl.maximum, dtype=nl.float32)
        out[...] = nisa.tensor_tensor(ind, parts[-1], nl.maximum, dtype=out.dtype)
        return out


class Row:
    """The tables of one processing-order position (a *row*: a query tile, or a key block in
    the backward's dK/dV sweep) and its *entries* (the blocks of the other side it meets), on
    every partition (``host.block_sparse.KernelTables``): ``first`` (fp32 ``[128, 1]``), the
    row's first position; ``block_first`` (fp32 ``[128, trip]``), the entries' first positions
    (``tiles.BSP_PAD_FIRST`` for padding slots); ``bad`` (1.0 where position ``block_first + p``
    of a slot's entry is not read: at or past ``other_len``, which every padding slot is) and
    ``rows`` (int32 ``[128, trip]``: ``block_first + p``, pushed out of bounds where ``bad``:
    the gathers skip those rows). Four instructions after the broadcast."""

    def __init__(self, geo: Geometry, meta_row, trip: int, other_len, other_n: int):
        self.bc = M.broadcast_row(meta_row, 2 + trip)
        self.first = self.bc[:, 0:1]
        self.block_first = self.bc[:, 2:2 + trip]
        pos = nisa.tensor_scalar(self.block_first, np.add, geo.part, dtype=nl.float32)
        self.bad = nisa.tensor_scalar(pos, nl.greater_equal, other_len, dtype=nl.float32)
        # in range: pos exactly; out: pos + OOB (>= OOB > other_n, exact enough to stay out)
        self.rows = nisa.scalar_tensor_tensor(data=self.bad, op0=np.multiply,
                                              operand0=float(M.oob_offset(other_n)),
                                              op1=np.add, operand1=pos, dtype=nl.int32)


def own_rows(geo: Geometry, first, length, n: int):
    """``(idx, pos)``: int32 ``[128, 1]`` gather/scatter indices of the 128 positions from
    ``first`` (fp32 column) of a sequence of ``n`` positions, out of bounds at positions ``>=
    length`` (a ``[128, 1]`` column or a number), and the positions themselves (fp32)."""
    pos = nisa.tensor_scalar(first, np.add, geo.part, dtype=nl.float32)
    length = float(length) if isinstance(length, (int, float)) else length
    idx = nisa.tensor_scalar(pos, nl.greater_equal, length, op1=np.multiply,
                             operand1=float(M.oob_offset(n)), dtype=nl.float32)
    return nisa.tensor_tensor(idx, pos, np.add, dtype=nl.int32), pos


def gather(dst, src, bh, idx, col, width: int, skip: bool):
    """``dst[p] = src[b, h, idx[p, col]]`` for ``bh = (b, h)`` (``col`` an NKI expression); with
    ``skip`` the destination is zeroed first and out-of-bounds rows are not read."""
    if skip:
        dst[...] = nisa.memset(dst.shape, 0.0, dtype=dst.dtype, engine=nisa.gpsimd_engine)
    nisa.dma_copy(dst=dst, src=src[bh[0], bh[1], idx[nl.arange(P)[:, None], col],
                                   nl.arange(width)[None, :]],
                  oob_mode=nisa.oob_mode.skip if skip else nisa.oob_mode.error)


def unit_seeds(f, head, q_first, k_first):
    """int32 ``[1, n]``: the dropout seed ``seed + ((b Hq + head) nqu + i) nku + j`` of the
    128 x 128 units whose first query row / first key are the fp32 ``[1, n]`` (or ``[1, 1]``)
    ``q_first`` / ``k_first`` (``i = q_first / 128``, ``j = k_first / 128``; exact in fp32:
    nqu nku < 2^24) -- the dense kernels' numbering."""
    if q_first.shape[1] == 1:
        q_col = nisa.tensor_scalar(q_first, np.multiply, float(f.nku) / P, dtype=nl.float32)
        u = nisa.tensor_scalar(k_first, np.multiply, 1.0 / P, op1=np.add, operand1=q_col,
                               dtype=nl.int32)
    else:
        k_col = nisa.tensor_scalar(k_first, np.multiply, 1.0 / P, dtype=nl.float32)
        u = nisa.tensor_scalar(q_first, np.multiply, float(f.nku) / P, op1=np.add,
                               operand1=k_col, dtype=nl.int32)
    base = nisa.iota((f.b * f.Hq + head) * (f.nqu * f.nku) + nl.arange(1)[None, :],
                     dtype=nl.int32)
    base = nisa.tensor_tensor(base, f.seed, np.add, dtype=nl.int32)
    return _add_int_column(u, base)


def _add_int_column(u, base):
    """``u + base`` for int32 ``[1, n]`` and ``[1, 1]`` (GpSimd int32 adds, column by column
    when n > 1: an exact broadcast add)."""
    n = u.shape[1]
    if n == 1:
        return nisa.tensor_tensor(u, base, np.add, dtype=nl.int32)
    out = nl.ndarray((1, n), dtype=nl.int32, buffer=nl.sbuf)
    for c in nl.affine_range(n):
        out[0:1, nl.ds(c, 1)] = nisa.tensor_tensor(u[0:1, nl.ds(c, 1)], base, np.add,
                                                   dtype=nl.int32)
    return out


def _attend_tiles(f, geo: Geometry, meta, h, pos0, n_tiles: int, trip: int, exact: bool):
    """``n_tiles`` query tiles of one class (order positions ``pos0 ..``, member head h): the
    body of a class loop. Their ``trip`` slots are swept in steps of
    ``tiles.BSP_STEP_BLOCKS`` key blocks (a sequential loop of full steps and a static tail
    step), each one online-softmax update per tile; within a step the tiles follow each
    other, so every engine has another tile's independent work while one waits."""
    head = f.head(h)
    hb = f.b if meta.shape[0] > 1 else 0
    hh = head if meta.shape[1] > 1 else 0
    skip = geo.needs_key_mask(exact)
    W = min(T.BSP_STEP_BLOCKS, trip)
    st = F._GroupState(f, n_tiles, P)
    tiles = []
    for t in T.unrolled(n_tiles):
        row = nl.ndarray((1, 2 + trip), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=meta[hb, hh, nl.ds(pos0 + t, 1), 0:2 + trip])
        rw = Row(geo, row, trip, geo.kv_len, f.Nk)
        # valid key columns of slot s: c < kv_len - first_s (none in a padding slot)
        thr = (nisa.tensor_scalar(rw.block_first, np.subtract, geo.kv_len, op1=np.multiply,
                                  operand1=-1.0, dtype=nl.float32) if skip else None)
        hi_thr, lo_thr = geo.band_columns(
            nisa.tensor_scalar(rw.block_first, np.subtract, rw.first, dtype=nl.float32))
        # Q rows of the tile: skipped past q_len (they output 0), scattered back below Nq
        q_idx, q_pos = own_rows(geo, rw.first, geo.q_len, f.Nq)
        x = nl.ndarray((P, f.D), dtype=f.q.dtype, buffer=nl.sbuf)
        gather(x, f.q, (f.b, head), q_idx, 0, f.D, geo.has_lens or f.Nq % P != 0)
        for pi, (d0, rows) in enumerate(f.d_passes):
            tp = nl.ndarray((rows, P), dtype=f.transpose_psum_dtype(x.dtype), buffer=nl.psum)
            tp[...] = nisa.nc_transpose(x[:, d0:d0 + rows])
            st.qT[pi][:, t, :] = nisa.activation(nl.copy, tp, scale=f.q_scale, dtype=f.mm)
        seeds = (unit_seeds(f, head, rw.bc[0:1, 0:1], rw.bc[0:1, 2:2 + trip])
                 if f.dropout_p else None)
        # [V | 1] of a step's blocks (the ones column gives the row sums, forward module doc)
        v = nl.ndarray((P, W, f.vcols), dtype=f.mm, buffer=nl.sbuf)
        v[:, :, f.D:f.D + 1] = nisa.memset((P, W, 1), 1.0, dtype=f.mm,
                                           engine=nisa.gpsimd_engine)
        tiles.append((rw, v, dict(thr=thr, hi=hi_thr, lo=lo_thr), seeds, q_idx, q_pos))
    for s in nl.sequential_range(trip // W):
        for t, (rw, v, cols, seeds, _, _) in enumerate(tiles):
            _step(f, geo, st, t, rw, v, cols, seeds, head, s * W, W, skip)
    if trip % W:
        for t, (rw, v, cols, seeds, _, _) in enumerate(tiles):
            _step(f, geo, st, t, rw, v, cols, seeds, head, (trip // W) * W, trip % W, skip)
    for t, (rw, _, _, _, q_idx, q_pos) in enumerate(tiles):
        in_range = None
        if f.spec.q_lens:
            in_range = nisa.tensor_scalar(q_pos, nl.less, geo.q_len, dtype=nl.float32)
        o_out, lse_out = F.finalize(f, st, t, in_range)
        out_idx = q_idx if not geo.has_lens else own_rows(geo, rw.first, f.Nq, f.Nq)[0]
        store_tile(f, out_idx, head, o_out, lse_out)


def _step(f, geo: Geometry, st, slot, rw: Row, v, cols, seeds, head, s0, n: int,
          skip: bool):
    """Slots ``s0 .. s0 + n - 1`` (``s0`` an NKI expression, n static) of a query tile: gather
    their K and V blocks, ``S = Q K^T`` over ``128 n`` keys (one PSUM bank), the runtime masks,
    then one online-softmax update (``forward.fold_block``)."""
    D = f.D
    kx = nl.ndarray((P, n, D), dtype=f.k.dtype, buffer=nl.sbuf)
    same = f.v.dtype == f.mm
    vx = v if same else nl.ndarray((P, n, D), dtype=f.v.dtype, buffer=nl.sbuf)
    if skip:
        kx[...] = nisa.memset((P, n, D), 0.0, dtype=f.k.dtype, engine=nisa.gpsimd_engine)
        vx[:, 0:n, 0:D] = nisa.memset((P, n, D), 0.0, dtype=vx.dtype,
                                      engine=nisa.gpsimd_engine)
    mode = nisa.oob_mode.skip if skip else nisa.oob_mode.error
    ip, iD = nl.arange(P)[:, None], nl.arange(D)[None, :]
    for w in nl.static_range(n):
        nisa.dma_copy(dst=kx[:, w, :], src=f.k[f.b, f.g, rw.rows[ip, s0 + w], iD],
                      oob_mode=mode)
        nisa.dma_copy(dst=vx[:, w, 0:D], src=f.v[f.b, f.g, rw.rows[ip, s0 + w], iD],
                      oob_mode=mode)
    if not same:
        v[:, 0:n, 0:D] = nisa.tensor_copy(vx, dtype=f.mm, engine=nisa.gpsimd_engine)
    F.guard_values(f, v[:, 0:n, 0:D], v[:, 0:n, D + 1:D + 2], sum_on_scalar=True)
    kT = [nl.ndarray((rows, n * P), dtype=f.mm, buffer=nl.sbuf) for _, rows in f.d_passes]
    F.transpose_keys(f, kT, 0, [(w * P, P, kx[:, w, :]) for w in T.unrolled(n)], f.k.dtype)
    sc = F.contract([(st.qT[pi][:, slot, :], kT[pi]) for pi in T.unrolled(len(f.d_passes))],
                    (P, n * P))
    s_tile = sc
    if any(c is not None for c in cols.values()):
        # masks by selection: scores a row cannot see become MASK_NEG, whatever they were (a
        # NaN or inf in a hidden key never reaches the row); VectorE copies the scores out of
        # PSUM and overwrites the masked ones
        ind = nl.ndarray((P, n * P), dtype=nl.uint8, buffer=nl.sbuf)
        for w in nl.static_range(n):
            geo.indicator(*(None if cols[k] is None else cols[k][:, nl.ds(s0 + w, 1)]
                            for k in ("thr", "hi", "lo")), out=ind[:, w * P:(w + 1) * P])
        s_tile = nl.ndarray((P, n * P), dtype=nl.float32, buffer=nl.sbuf)
        s_tile[...] = nisa.tensor_copy(sc, dtype=nl.float32, engine=nisa.vector_engine)
        nisa.tensor_copy_predicated(src=T.FWD_MASK_NEG, dst=s_tile, predicate=ind)
    drop = None
    if f.dropout_p:
        def drop(p, r, width, pred):
            for w in nl.static_range(n):
                us = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
                us[...] = nisa.tensor_copy(seeds[0:1, nl.ds(s0 + w, 1)],
                                           engine=nisa.gpsimd_engine)
                nl.random_seed(seed=us)
                p[:, w * P:(w + 1) * P] = nisa.dropout(p[:, w * P:(w + 1) * P], f.dropout_p)
                if f.mask_out is not None:
                    nl.random_seed(seed=us)
                    keep = nisa.dropout(f.ones, f.dropout_p)
                    _store_mask(f, geo, rw, head, s0 + w, keep)
    F.fold_block(f, st, slot, [s_tile], [n * P], F._KV(None, kT, v), 0, None, drop)


def store_tile(f, out_idx, head, o_tile, lse_tile):
    """Scatter a query tile's o ``[128, D]`` and lse ``[128, 1]`` of query head ``head`` to the
    rows ``out_idx`` (int32 ``[128, 1]``; rows past Nq out of bounds, skipped)."""
    ip, iD = nl.arange(P)[:, None], nl.arange(f.D)[None, :]
    nisa.dma_copy(dst=f.o[f.b, head, out_idx[ip, 0], iD], src=o_tile,
                  oob_mode=nisa.oob_mode.skip)
    nisa.dma_copy(dst=f.lse_col[f.b, head, out_idx[ip, 0], nl.arange(1)[None, :]], src=lse_tile,
                  oob_mode=nisa.oob_mode.skip)


def _store_mask(f, geo: Geometry, rw: Row, head, sl, keep):
    """Debug: the keep mask of slot sl into ``mask_out``'s ``(B, Hq, Nq nku, 128)`` view at
    row ``i nku + key block`` (one 128-key unit per row; padding slots and rows past Nq are
    skipped). Exact in fp32 for debug shapes (Nq nku < 2^24)."""
    nku = f.nku
    pos = nisa.tensor_scalar(rw.first, np.add, geo.part, dtype=nl.float32)
    first = rw.block_first[:, nl.ds(sl, 1)]
    rel = nisa.scalar_tensor_tensor(data=pos, op0=np.multiply, operand0=float(nku), op1=np.add,
                                    operand1=nisa.tensor_scalar(first, np.multiply, 1.0 / P,
                                                                dtype=nl.float32),
                                    dtype=nl.float32)
    oob = float(M.oob_offset(f.Nq * nku))
    past = nisa.tensor_scalar(pos, nl.greater_equal, float(f.Nq), dtype=nl.float32)
    pad = nisa.tensor_scalar(first, nl.greater_equal, float(f.Nk), dtype=nl.float32)
    bad = nisa.tensor_tensor(past, pad, nl.maximum, dtype=nl.float32)
    idx = nisa.scalar_tensor_tensor(data=bad, op0=np.multiply, operand0=oob, op1=np.add,
                                    operand1=rel, dtype=nl.int32)
    nisa.dma_copy(dst=f.mask_rows[f.b, head, idx[nl.arange(P)[:, None], 0],
                                  nl.arange(P)[None, :]],
                  src=keep, oob_mode=nisa.oob_mode.skip)


@nki.jit
def block_sparse_attention_fwd(q, k, v, meta, kv_lens=None, q_lens=None, seed=None, *,
                               classes, scale=1.0, causal=None, window=None,
                               mm_dtype="bfloat16", dropout_p=0.0, dropout_mask=False):
    """Block-sparse flash attention forward: ``o, lse`` for q ``(B, Hq, Nq, D)``, k/v ``(B,
    Hkv, Nk, D)``, on the grid ``(B, Hkv)``.

    ``meta``: float32 ``(B or 1, Hq or 1, ceil(Nq/128), 2 + trip)`` HBM table of the pattern in
    processing order and ``classes`` its compile-time runs
    (``host.block_sparse.kernel_tables``). Other arguments as
    :func:`forward.flash_attention_fwd` (``mm_dtype``, ``scale``, ``causal``, ``window``,
    lengths, ``dropout_p`` with ``seed``, ``dropout_mask``: the mask is returned as ``(B, Hq,
    Nq, 128 ceil(Nk/128))`` float32, positions of blocks never drawn unspecified). The same
    outputs as the dense kernel restricted to the active blocks; rows that see no key get o =
    0 and lse = -inf.
    """
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    nqt = T.ceil_div(Nq, P)
    trip_max = meta.shape[3] - 2
    if tuple(meta.shape[2:3]) != (nqt,):
        raise ValueError(f"meta: expected {nqt} rows (one per query tile), got {meta.shape}")
    _check_classes(classes, nqt, trip_max)
    spec = M.MaskSpec(Nq, Nk, causal, window, q_lens is not None, kv_lens is not None)
    tiles = T.ForwardTiles(q_tile=P, kv_resident=False)
    o = nl.ndarray((B, Hq, Nq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, Hq, Nq), dtype=nl.float32, buffer=nl.shared_hbm)
    nku = T.ceil_div(Nk, P)
    mask_out = (nl.ndarray((B, Hq, Nq, nku * P), dtype=nl.float32, buffer=nl.shared_hbm)
                if dropout_p and dropout_mask else None)
    f = F._Instance(q, k, v, o, lse, mm_dtype, scale, tiles, spec, nl.program_id(0),
                    nl.program_id(1))
    f.act_share = 0.5
    f.guard = True         # non-finite values reach only the rows that see them
    f.nqu, f.nku = nqt, nku
    if dropout_p:
        if seed is None:
            raise ValueError("dropout_p > 0 needs the seed tensor (HBM (1,) int32)")
        f.dropout_p = float(dropout_p)
        f.seed = nl.load(seed.reshape((1, 1)))
        f.ones = nisa.memset((P, P), 1.0, dtype=f.mm, engine=nisa.gpsimd_engine)
        if mask_out is not None:
            f.mask_out = mask_out
            f.mask_rows = mask_out.reshape((B, Hq, Nq * nku, P))
    geo = Geometry(spec, kv_lens, q_lens, f.b, Nq, Nk)
    for h in nl.affine_range(f.G):
        for first, count, trip, exact in classes:
            if trip == 0:
                # rows without any active block: o = 0, lse = -inf (still one loop body)
                for c in nl.affine_range(count):
                    _empty_tile(f, geo, meta, h, first + c)
                continue
            g = min(T.BSP_GROUP_TILES, count)
            for c in nl.affine_range(count // g):
                _attend_tiles(f, geo, meta, h, first + c * g, g, trip, exact)
            if count % g:
                _attend_tiles(f, geo, meta, h, first + (count // g) * g, count % g, trip,
                              exact)
    if mask_out is not None:
        return o, lse, mask_out
    return o, lse


def _empty_tile(f, geo: Geometry, meta, h, pos):
    """A query tile without active blocks: o = 0 and lse = -inf at its rows."""
    head = f.head(h)
    hb = f.b if meta.shape[0] > 1 else 0
    hh = head if meta.shape[1] > 1 else 0
    row = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=meta[hb, hh, nl.ds(pos, 1), 0:1])
    out_idx, _ = own_rows(geo, M.broadcast_row(row, 1), f.Nq, f.Nq)
    zeros = nisa.memset((P, f.D), 0.0, dtype=f.o.dtype, engine=nisa.gpsimd_engine)
    ninf = nisa.memset((P, 1), -np.inf, dtype=nl.float32, engine=nisa.gpsimd_engine)
    store_tile(f, out_idx, head, zeros, ninf)


__all__ = ["block_sparse_attention_fwd", "Geometry", "Row", "own_rows",
           "gather", "unit_seeds", "store_tile"]
