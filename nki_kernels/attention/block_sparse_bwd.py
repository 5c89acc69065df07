"""Block-sparse flash attention backward (FlashAttention appendix Algorithm 5's backward: the
dense backward, Algorithm 4, restricted to the active blocks).

Gradients of :func:`block_sparse.block_sparse_attention_fwd` from its saved o and lse. Every
active 128 x 128 block pair (query tile i, key block j) is visited twice, never an inactive
one, and nothing of size N x N is stored:

1. **delta** ``D_i = rowsum(dO_i * O_i)`` for every query row, into an fp32 HBM scratch
   (O(N) memory; an affine loop over query tiles).
2. **dK, dV, key-major**: for every key block j (rows of the *transposed* pattern, sorted
   into compile-time classes like the forward's query tiles), K_j and V_j are gathered once;
   a sequential loop over the query heads of the kv group and the query tiles i active with
   j recomputes ``P_ij = exp(scale Q_i K_j^T - LSE_i)`` and ``dS_ij = P_ij * (dO_i V_j^T -
   D_i)`` and accumulates ``dV_j += P_ij^T dO_i`` and ``dK_j += dS_ij^T Q_i`` on chip
   (fp32 SBUF; each pair's products are fresh PSUM accumulation groups).
3. **dQ, query-major**: for every query tile i (the forward's tables), the key blocks active
   with it are gathered again and ``dQ_i += dS_ij K_j`` accumulates on chip.

Recomputing P and dS in pass 3 (instead of a read-modify-write of dQ in HBM per pair, whose
ordering between DMA queues the documentation does not define) costs two more matmuls and an
exp per pair and moves fewer bytes: K_j, V_j (2 x 128 d) per pair instead of dQ_i's fp32 read
and write (2 x 128 d x 4 bytes). HBM traffic is Theta(N d + nnz d): linear in the density.

Masks, lengths, GQA and dropout as in the forward kernel (module ``block_sparse``): the masks
are computed at run time from each pair's positions; dropout regenerates each unit's mask
from ``seed + unit`` (the dense kernels' numbering), so ``dP`` and ``dV`` see exactly the
forward's ``Z / (1 - p)``.

Namespaces as the forward's (module ``block_sparse``): a compiled loop over the instances in
0.7, gathers through the flattened tensors; delta's scratch is each legacy program's own ``(1,
G, Nq, 1)``, and under 0.7, whose one program runs every instance, ``(B, Hq, Nq, 1)`` (the same
bytes in all), addressed like Q. Each row's slot loop (a key block's query tiles, a query
tile's key blocks) runs the row's count of slots under nki.* (a register bound,
:meth:`block_sparse.Row.slot_loop`), all ``trip`` in legacy (padding slots masked).
"""
from __future__ import annotations

from nki_kernels import port
from nki_kernels import tiles as T
from nki_kernels.attention import forward as F
from nki_kernels.attention import masks as M
from nki_kernels.attention import score_mods as SM
from nki_kernels.attention.block_sparse import (P, Geometry, Row, RowFrame, check_classes,
                                                exact_indices, gather, own_rows, scatter,
                                                unit_seeds)
from nki_kernels.port import nl

#: -lse is clamped to this before the exp: a row without visible keys (lse = -inf) keeps
#: P = exp(S + MASK_NEG + LSE_CLAMP) = 0 at its masked scores (tiles.FWD_MASK_NEG << -clamp).
LSE_CLAMP = -T.FWD_M_FLOOR


class _Cfg:
    """Compile-time facts of one backward instance (the forward's ``Instance`` supplies the
    matmul dtype, head-dim passes, transpose PSUM dtypes and the dropout record).

    Score modifiers: Q^T carries the scale, so the exp's scale is 1 (``unit``: the cap with
    soft-capping); ``cols`` the HeadColumns of the instance's query heads (``score``:
    :class:`forward.ScoreMods`, None without modifiers); ``dsink_acc`` dsink's partial sums
    (``[128, G]`` fp32, with sinks)."""

    def __init__(self, f: F.Instance, do, dq, dk, dv, delta, every_head: bool,
                 score, dsink_acc):
        self.f, self.do, self.dq, self.dk, self.dv, self.delta = f, do, dq, dk, dv, delta
        self.every_head = every_head
        self.dropout_p = f.dropout_p
        self.scale = f.scale
        self.mods = score.mods if score is not None else SM.Mods()
        self.unit = score.unit if score is not None else 1.0
        self.cols = score.cols if score is not None else None
        self.dsink_acc = dsink_acc

    def need_mask(self, geo: Geometry, exact: bool) -> bool:
        """Whether pairs need the runtime indicator (padding slots, lengths, partial tiles,
        the band)."""
        f = self.f
        return (not exact) or geo.has_lens or f.Nq % P != 0 or f.Nk % P != 0 \
            or f.spec.has_diag

    def delta_lead(self, h):
        """Leading indices of member head h's rows in the delta scratch: ``(0, h)`` of a
        program's own ``(1, G, Nq, 1)`` (legacy), or with ``every_head`` (0.7, where one
        program runs every instance) ``(b, head)`` of a ``(B, Hq, Nq, 1)`` one, addressed like
        q (q's row frame serves its gathers too)."""
        if self.every_head:
            return (self.f.b, self.f.head(h))
        return (0, h)


def _transposed(f: F.Instance, x, scale: float = 1.0):
    """``x^T`` ``[d, 128]`` per head-dim pass of a ``[128, D]`` tile, at matmul dtype (TensorE
    transpose, ScalarE copy out of PSUM with ``scale``)."""
    out = []
    for d0, rows in f.d_passes:
        tp = nl.ndarray((rows, P), dtype=f.transpose_psum_dtype(x.dtype), buffer=nl.psum)
        port.nc_transpose(tp, x[:, d0:d0 + rows])
        t = nl.ndarray((rows, P), dtype=f.mm, buffer=nl.sbuf)
        port.activation(t, nl.copy, tp, scale=scale)
        out.append(t)
    return out


def _as_mm(f: F.Instance, x):
    """``x`` at matmul dtype (a GpSimd cast when it differs)."""
    if x.dtype == f.mm:
        return x
    y = nl.ndarray(tuple(x.shape), dtype=f.mm, buffer=nl.sbuf)
    port.tensor_copy(y, x, engine="gpsimd")
    return y


def _query_side(cfg: _Cfg, geo: Geometry, h, first, q_frame: RowFrame):
    """Gather query tile rows from ``first`` of member head h (rows of ``q_frame``): Q, dO
    (natural, matmul dtype), ``(scale Q)^T``, ``dO^T``, the clamped ``-lse`` and delta
    columns. Rows past q_len (or Nq, or every row when ``first`` is pushed out) are not read
    and stay 0."""
    f = cfg.f
    head = f.head(h)
    idx, pos = own_rows(geo, first, geo.q_len, q_frame)
    x = nl.ndarray((P, f.D), dtype=f.q.dtype, buffer=nl.sbuf)
    gather(x, f.q, (f.b, head), idx, 0, True)
    dx = nl.ndarray((P, f.D), dtype=cfg.do.dtype, buffer=nl.sbuf)
    gather(dx, cfg.do, (f.b, head), idx, 0, True)
    lse = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    gather(lse, f.lse_col, (f.b, head), idx, 0, True)
    delta = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    gather(delta, cfg.delta, cfg.delta_lead(h), idx, 0, True)
    neg_lse = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(neg_lse, lse, nl.multiply, -1.0, op1=nl.minimum, operand1=LSE_CLAMP)
    qT = _transposed(f, x, cfg.scale)
    doT = _transposed(f, dx)
    return _as_mm(f, x), _as_mm(f, dx), qT, doT, neg_lse, delta, pos


def _key_side(cfg: _Cfg, idx, skip: bool, natural_k: bool):
    """Gather a key block's rows (indices ``idx`` ``[128, 1]``, rows of ``k[b, g]``'s frame):
    ``K^T``, ``V^T`` per pass (matmul dtype) and K natural at matmul dtype when
    ``natural_k``."""
    f = cfg.f
    kx = nl.ndarray((P, f.D), dtype=f.k.dtype, buffer=nl.sbuf)
    gather(kx, f.k, (f.b, f.g), idx, 0, skip)
    vx = nl.ndarray((P, f.D), dtype=f.v.dtype, buffer=nl.sbuf)
    gather(vx, f.v, (f.b, f.g), idx, 0, skip)
    # non-finite entries zeroed in the dP and dQ operands, not in K^T (backward.load_kv_tile)
    M.zero_non_finite(vx)
    kT = _transposed(f, kx)
    k_nat = None
    if natural_k:
        M.zero_non_finite(kx)
        k_nat = _as_mm(f, kx)
    return kT, _transposed(f, vx), k_nat


def _pair(cfg: _Cfg, geo: Geometry, qT, doT, kT, vT, neg_lse, delta, key_thr, hi, lo, seed,
          h=None, dist=None):
    """One block pair: ``(p_dv, ds)`` at matmul dtype, ``[128 queries, 128 keys]``: ``P Z /
    (1 - p)`` (``P`` without dropout) and ``dS = P (dP Z / (1 - p) - delta)`` with ``P =
    exp(S - lse)`` on the masked scores (``key_thr``, ``hi``, ``lo``: the indicator's columns,
    or None) and ``dP = dO V^T``. ``seed``: the unit's int32 [1, 1] dropout seed or None.
    Score modifiers (``score_mods.modify_scores``, member head ``h``; ``dist``: ALiBi's
    distance tile, :meth:`Geometry.distance_tile`): ``S`` modified first, and with
    soft-capping ``dS`` times ``1 - tanh^2``."""
    f = cfg.f
    s = F.contract(list(zip(qT, kT)), (P, P))
    y, g = s, None
    if cfg.mods.transforms:
        y, t = SM.modify_scores(cfg.mods, cfg.cols, s, P, P, h, None, 1.0 / cfg.unit,
                                not SM.one_sided(f.spec), dist=dist)
        if t is not None:
            g = SM.softcap_grad_factor(t, P, P)
    p = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
    port.activation(p, nl.exp, y, bias=neg_lse, scale=cfg.unit)
    # masked scores by selection (P = 0), so a non-finite hidden key never reaches a row
    ind = nl.ndarray((P, P), dtype=nl.uint8, buffer=nl.sbuf)
    masked = geo.indicator(key_thr, hi, lo, out=ind)
    if masked:
        port.tensor_copy_predicated(p, 0.0, ind)
    dp = F.contract(list(zip(doT, vT)), (P, P))
    p_dv = nl.ndarray((P, P), dtype=f.mm, buffer=nl.sbuf)
    if cfg.dropout_p:
        port.random_seed(seed)
        keep = nl.ndarray((P, P), dtype=f.drop.ones.dtype, buffer=nl.sbuf)
        port.dropout(keep, f.drop.ones, cfg.dropout_p)              # 0/1, the forward's draw
        z = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(z, keep, nl.multiply, 1.0 / (1.0 - cfg.dropout_p))
        port.tensor_tensor(p_dv, p, z, nl.multiply)
        dpz = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(dpz, dp, z, nl.multiply)
    else:
        port.tensor_copy(p_dv, p, engine="gpsimd")
        dpz = dp
    pg = p
    if g is not None:
        # P (1 - t^2), deselected where masked (a hidden non-finite score's tanh is NaN)
        pg = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(pg, p, g, nl.multiply, engine="gpsimd")
        if masked:
            port.tensor_copy_predicated(pg, 0.0, ind)
    ds = nl.ndarray((P, P), dtype=f.mm, buffer=nl.sbuf)
    port.scalar_tensor_tensor(ds, dpz, nl.subtract, delta, nl.multiply, pg)
    return p_dv, ds


def _slot(sl, seeds, thr, hi, lo):
    """The per-slot arguments of :func:`_pair` for slot sl (an index expression): the mask
    columns (None where absent) and the unit's dropout seed (an int32 [1, 1] copy, or None)."""
    seed = None
    if seeds is not None:
        seed = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_copy(seed, seeds[0:1, nl.ds(sl, 1)], engine="gpsimd")
    cols = tuple(None if c is None else c[:, nl.ds(sl, 1)] for c in (thr, hi, lo))
    return cols + (seed,)


def _accumulate(acc, psum_product):
    """``acc += product`` (fp32 SBUF += a fresh PSUM group) on VectorE."""
    port.tensor_tensor(acc, acc, psum_product, nl.add)


def _delta(cfg: _Cfg, h, t0, rows: int):
    """delta of ``rows`` query rows from ``t0`` (an index expression) of member head h."""
    f = cfg.f
    head = f.head(h)
    dx = nl.ndarray((rows, f.D), dtype=cfg.do.dtype, buffer=nl.sbuf)
    port.dma_copy(dx, cfg.do[f.b, head, nl.ds(t0, rows), :], legacy_isa=True)
    ox = nl.ndarray((rows, f.D), dtype=f.o.dtype, buffer=nl.sbuf)
    port.dma_copy(ox, f.o[f.b, head, nl.ds(t0, rows), :], legacy_isa=True)
    prod = nl.ndarray((rows, f.D), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(prod, dx, ox, nl.multiply)
    d = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_reduce(d, nl.add, prod, axis=(1,))
    port.dma_copy(cfg.delta[(*cfg.delta_lead(h), nl.ds(t0, rows), slice(None))], d,
                  legacy_isa=True)
    if cfg.dsink_acc is not None:
        lse = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.dma_copy(lse, f.lse_col[f.b, head, nl.ds(t0, rows), :], legacy_isa=True)
        add_sink_share(cfg.cols, h, lse, d, cfg.dsink_acc)


def add_sink_share(cols: SM.HeadColumns, h, lse, d, acc):
    """Add the rows' shares of dsink of member head h, ``exp(sink - lse) D`` (negated by
    :func:`store_dsinks`), to column h of ``acc`` (fp32 ``[128, G]`` partial sums; ``lse``,
    ``d``: fp32 ``[rows, 1]``). lse >= sink at every real row, so max(lse, sink) changes none
    and makes a padding row's (lse = -inf, D = 0) exp 1, not inf."""
    rows = lse.shape[0]
    sink = SM.HeadColumns.col(cols.sink, h, rows)
    lse_c = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(lse_c, lse, sink, nl.maximum)
    p_sink = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.activation(p_sink, nl.exp, lse_c, bias=sink, scale=-1.0)
    col = acc[0:rows, nl.ds(h, 1)]
    port.scalar_tensor_tensor(col, p_sink, nl.multiply, d, nl.add, col)


def _key_block(cfg: _Cfg, geo: Geometry, meta_k, pos, trip: int, exact: bool):
    """dK, dV of the key block at order position ``pos`` (phase 2 of the module docstring)."""
    f = cfg.f
    hb = f.b if meta_k.shape[0] > 1 else 0
    per_head = meta_k.shape[1] > 1
    head0 = f.g * f.G if per_head else 0
    first_row = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(first_row, meta_k[hb, head0, nl.ds(pos, 1), 0:1], legacy_isa=True)
    k_first = M.broadcast_row(first_row, 1)
    dk_acc = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(dk_acc, 0.0, engine="gpsimd")
    dv_acc = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(dv_acc, 0.0, engine="gpsimd")
    k_idx, _ = own_rows(geo, k_first, geo.kv_len, geo.kv)
    if trip:
        skip = cfg.need_mask(geo, exact)
        kT, vT, _ = _key_side(cfg, k_idx, True, False)
        key_thr0 = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(key_thr0, geo.kv_len, k_first, nl.subtract)
        big = float(2 * P + f.Nk + f.Nq)

        def head(h):
            q_frame = RowFrame.of(f.q, (f.b, f.head(h)), geo.indices)
            row = nl.ndarray((1, 2 + trip), dtype=nl.float32, buffer=nl.sbuf)
            port.dma_copy(row, meta_k[hb, f.head(h) if per_head else 0, nl.ds(pos, 1),
                                      0:2 + trip], legacy_isa=True)
            rw = Row(row, trip, q_frame.shift(geo.part), q_frame.shift(geo.q_len), q_frame)
            hi = lo = thr = gap = None
            if skip or cfg.mods.alibi:
                gap = nl.ndarray((P, trip), dtype=nl.float32, buffer=nl.sbuf)
                port.tensor_scalar(gap, rw.block_first, nl.subtract, k_first, op1=nl.multiply,
                                   operand1=-1.0)
            if skip:
                # a query row not read (padding slot, past q_len) masks every key
                thr = nl.ndarray((P, trip), dtype=nl.float32, buffer=nl.sbuf)
                port.tensor_scalar(thr, rw.bad, nl.multiply, -big, op1=nl.add,
                                   operand1=key_thr0)
                hi, lo = geo.band_columns(gap)
            dist = geo.distance_columns(gap) if cfg.mods.alibi else None
            seeds = (unit_seeds(f, f.head(h), rw.bc[0:1, 2:2 + trip], rw.bc[0:1, 0:1])
                     if cfg.dropout_p else None)

            def slot(sl):
                # a padding slot's first row is past every sequence: nothing is read
                q_mm, do_mm, qT, doT, neg_lse, delta, _ = _query_side(
                    cfg, geo, h, rw.block_first[:, nl.ds(sl, 1)], q_frame)
                p_dv, ds = _pair(cfg, geo, qT, doT, kT, vT, neg_lse, delta,
                                 *_slot(sl, seeds, thr, hi, lo), h=h,
                                 dist=None if dist is None else geo.distance_tile(dist, sl, 1))
                dv_ps = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.psum)
                port.nc_matmul(dv_ps, p_dv, do_mm)
                _accumulate(dv_acc, dv_ps)
                dk_ps = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.psum)
                port.nc_matmul(dk_ps, ds, q_mm)
                _accumulate(dk_acc, dk_ps)

            rw.slot_loop(exact, slot)

        port.loop(f.G, head, carried=True)
    out_idx, _ = own_rows(geo, k_first, f.Nk, geo.kv)
    dk_out = nl.ndarray((P, f.D), dtype=cfg.dk.dtype, buffer=nl.sbuf)
    port.tensor_scalar(dk_out, dk_acc, nl.multiply, cfg.scale)
    dv_out = nl.ndarray((P, f.D), dtype=cfg.dv.dtype, buffer=nl.sbuf)
    port.tensor_copy(dv_out, dv_acc)
    scatter(cfg.dk, (f.b, f.g), out_idx, dk_out)
    scatter(cfg.dv, (f.b, f.g), out_idx, dv_out)


def _query_tile(cfg: _Cfg, geo: Geometry, meta_q, h, q_frame: RowFrame, pos, trip: int,
                exact: bool):
    """dQ of the query tile at order position ``pos`` of member head h (phase 3)."""
    f = cfg.f
    head = f.head(h)
    hb = f.b if meta_q.shape[0] > 1 else 0
    hh = head if meta_q.shape[1] > 1 else 0
    row = nl.ndarray((1, 2 + trip), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(row, meta_q[hb, hh, nl.ds(pos, 1), 0:2 + trip], legacy_isa=True)
    rw = Row(row, trip, geo.k_part, geo.k_len, geo.kv)
    dq_acc = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(dq_acc, 0.0, engine="gpsimd")
    if trip:
        skip = cfg.need_mask(geo, exact)
        _, _, qT, doT, neg_lse, delta, q_pos = _query_side(cfg, geo, h, rw.first, q_frame)
        hi = lo = thr = gap = None
        if skip or cfg.mods.alibi:
            gap = nl.ndarray((P, trip), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(gap, rw.block_first, nl.subtract, rw.first)
        if skip:
            big = float(2 * P + f.Nk + f.Nq)
            row_bad = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(row_bad, q_pos, nl.greater_equal, geo.q_len, op1=nl.multiply,
                               operand1=big)
            # valid key columns c < kv_len - first (none in a padding slot), none for rows
            # past q_len
            thr0 = nl.ndarray((P, trip), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(thr0, rw.block_first, nl.subtract, geo.kv_len, op1=nl.add,
                               operand1=row_bad)
            thr = nl.ndarray((P, trip), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(thr, thr0, nl.multiply, -1.0)
            hi, lo = geo.band_columns(gap)
        dist = geo.distance_columns(gap) if cfg.mods.alibi else None
        seeds = (unit_seeds(f, head, rw.bc[0:1, 0:1], rw.bc[0:1, 2:2 + trip])
                 if cfg.dropout_p else None)

        def slot(sl):
            kT, vT, k_mm = _key_side(cfg, rw.rows[:, nl.ds(sl, 1)], skip, True)
            _, ds = _pair(cfg, geo, qT, doT, kT, vT, neg_lse, delta,
                          *_slot(sl, seeds, thr, hi, lo), h=h,
                          dist=None if dist is None else geo.distance_tile(dist, sl, 1))
            tp = nl.ndarray((P, P), dtype=f.transpose_psum_dtype(f.mm), buffer=nl.psum)
            port.nc_transpose(tp, ds)
            dsT = nl.ndarray((P, P), dtype=f.mm, buffer=nl.sbuf)
            port.tensor_copy(dsT, tp, engine="vector")
            dq_ps = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.psum)
            port.nc_matmul(dq_ps, dsT, k_mm)
            _accumulate(dq_acc, dq_ps)

        rw.slot_loop(exact, slot)
    out_idx, _ = own_rows(geo, rw.first, f.Nq, q_frame)
    dq_out = nl.ndarray((P, f.D), dtype=cfg.dq.dtype, buffer=nl.sbuf)
    port.tensor_scalar(dq_out, dq_acc, nl.multiply, cfg.scale)
    scatter(cfg.dq, (f.b, head), out_idx, dq_out)


@port.jit
def block_sparse_attention_bwd(q, k, v, o, do, lse, meta_q, meta_k, kv_lens=None, q_lens=None,
                               seed=None, alibi_slopes=None, sinks=None, *, classes_q,
                               classes_k, scale=1.0, causal=None, window=None,
                               mm_dtype="bfloat16", dropout_p=0.0, softcap=None):
    """Gradients ``(dq, dk, dv)`` of the block-sparse forward, over the instances ``(B, Hkv)``
    (as the forward: :func:`port.for_programs`).

    ``meta_q``/``classes_q``: the forward's tables (query tiles and their key blocks);
    ``meta_k``/``classes_k``: the transposed pattern's (key blocks and their query tiles,
    ``(B or 1, Hq or 1, ceil(Nk/128), 2 + trip)``, in one order per kv group:
    ``host.block_sparse.kernel_tables(..., group=G)``). Other arguments as the forward; o and
    lse are the forward's outputs, do the gradient of o. Score modifiers as the forward's
    (``softcap``, ``alibi_slopes``, ``sinks``; ``score_mods.py``): with sinks also ``dsinks``
    ``(B, Hq)`` float32, each sequence's ``-sum_i exp(sink - lse_i) D_i``. Rows or dropout
    units that may reach 2^24 are numbered in int32 under nki.*, as the forward.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    nqt, nkt = T.ceil_div(Nq, P), T.ceil_div(Nk, P)
    if meta_q.shape[2] != nqt or meta_k.shape[2] != nkt:
        raise ValueError(f"meta_q/meta_k: expected {nqt}/{nkt} rows, got {meta_q.shape} and "
                         f"{meta_k.shape}")
    check_classes(classes_q, nqt, meta_q.shape[3] - 2)
    check_classes(classes_k, nkt, meta_k.shape[3] - 2)
    int_rows = exact_indices(max(B * Hq * Nq, B * Hkv * Nk),
                             B * Hq * nqt * nkt if dropout_p else 0)
    if dropout_p and seed is None:
        raise ValueError("dropout_p > 0 needs the seed tensor (HBM (1,) int32)")
    mods = SM.check_mods(softcap, alibi_slopes, sinks)
    spec = M.MaskSpec(Nq, Nk, causal, window, q_lens is not None, kv_lens is not None,
                      mods.alibi)
    dq = nl.ndarray((B, Hq, Nq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    dsinks = (nl.ndarray((B, Hq), dtype=nl.float32, buffer=nl.shared_hbm) if mods.sinks
              else None)
    dk = nl.ndarray((B, Hkv, Nk, D), dtype=q.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray((B, Hkv, Nk, D), dtype=q.dtype, buffer=nl.shared_hbm)
    # rowsum(dO * O) scratch: each legacy program's own (its G heads); in 0.7 one program
    # runs every instance and keeps every head's (the same bytes in all)
    every_head = port.launch_grid((B, Hkv), port.api()) == (1,)
    delta = nl.ndarray((B, Hq, Nq, 1) if every_head else (1, G, Nq, 1), dtype=nl.float32,
                       buffer=nl.hbm)
    tiles = T.ForwardTiles(q_tile=P, kv_resident=False)
    indices = port.OffsetColumns(0, max(B, Hq), 1, exact=int_rows)

    def instance(b, g):
        c = F.Config(q, k, v, o, lse, mm_dtype, scale, tiles, spec, b, g, None, indices,
                     guard=False, act_share=None)
        # Q^T carries the scale, so the exp's scale is 1
        score = F.score_mods(c, mods, alibi_slopes, sinks, 1.0)
        dsink_acc = None
        if mods.sinks:
            dsink_acc = nl.ndarray((P, G), dtype=nl.float32, buffer=nl.sbuf)
            port.memset(dsink_acc, 0.0, engine="gpsimd")
        drop = F.load_dropout(dropout_p, seed, nl.float32) if dropout_p else None
        f = F.Instance.of(c, drop=drop)
        cfg = _Cfg(f, do, dq, dk, dv, delta, every_head, score, dsink_acc)
        geo = Geometry(spec, kv_lens, q_lens, k, b, g, Nq, Nk, indices)

        # 1. delta = rowsum(dO * O)
        full, tail = Nq // P, Nq % P

        def delta_head(h):
            port.loop(full, lambda t: _delta(cfg, h, t * P, P), carried=mods.sinks)
            if tail:
                _delta(cfg, h, full * P, tail)

        port.loop(G, delta_head, carried=mods.sinks)
        if mods.sinks:
            store_dsinks(f, cfg.dsink_acc, dsinks)
        # 2. dK, dV, key-major
        for first, count, trip, exact in classes_k:
            port.loop(count, lambda c, first=first, trip=trip, exact=exact:
                      _key_block(cfg, geo, meta_k, first + c, trip, exact))

        # 3. dQ, query-major
        def dq_head(h):
            q_frame = RowFrame.of(q, (b, f.head(h)), indices)
            for first, count, trip, exact in classes_q:
                port.loop(count, lambda c, first=first, trip=trip, exact=exact:
                          _query_tile(cfg, geo, meta_q, h, q_frame, first + c, trip, exact))

        port.loop(G, dq_head)

    port.for_programs((B, Hkv), instance)
    if dsinks is not None:
        return dq, dk, dv, dsinks
    return dq, dk, dv


def store_dsinks(f, acc, dsinks):
    """``dsinks[b, heads of g] = -(the partition sums of acc)`` (instance ``f``): a ones
    column against the ``[128, G]`` partials (TensorE, as the dense backward), negated on the
    way out."""
    ones = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(ones, 1.0, engine="gpsimd")
    tot = nl.ndarray((1, f.G), dtype=nl.float32, buffer=nl.psum)
    port.nc_matmul(tot, ones, acc)
    out = nl.ndarray((1, f.G), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(out, tot, nl.multiply, -1.0)
    port.dma_copy(dsinks[nl.ds(f.b, 1), nl.ds(f.head(0), f.G)], out, legacy_isa=True)


__all__ = ["block_sparse_attention_bwd", "LSE_CLAMP", "add_sink_share", "store_dsinks"]
