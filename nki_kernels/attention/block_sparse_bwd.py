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
"""
from __future__ import annotations

import numpy as np  # compile-time constants only (reduction ops)

from nki_kernels import tiles as T
from nki_kernels.attention import forward as F
from nki_kernels.attention import masks as M
from nki_kernels.attention.block_sparse import (P, Geometry, Row, _check_classes, gather,
                                                own_rows, unit_seeds)
from nki_kernels.nki import nisa, nki, nl

#: -lse is clamped to this before the exp: a row without visible keys (lse = -inf) keeps
#: P = exp(S + MASK_NEG + LSE_CLAMP) = 0 at its masked scores (tiles.FWD_MASK_NEG << -clamp).
LSE_CLAMP = -T.FWD_M_FLOOR


class _Cfg:
    """Compile-time facts of one backward instance (the forward's ``_Instance`` supplies the
    matmul dtype, head-dim passes and transpose PSUM dtypes)."""

    def __init__(self, f: F._Instance, do, dq, dk, dv, delta, dropout_p: float):
        self.f, self.do, self.dq, self.dk, self.dv, self.delta = f, do, dq, dk, dv, delta
        self.dropout_p = dropout_p
        self.scale = f.scale

    def need_mask(self, geo: Geometry, exact: bool) -> bool:
        """Whether pairs need the runtime indicator (padding slots, lengths, partial tiles,
        the band)."""
        f = self.f
        return (not exact) or geo.has_lens or f.Nq % P != 0 or f.Nk % P != 0 \
            or f.spec.has_diag


def _transposed(f: F._Instance, x, scale: float = 1.0):
    """``x^T`` ``[d, 128]`` per head-dim pass of a ``[128, D]`` tile, at matmul dtype (TensorE
    transpose, ScalarE copy out of PSUM with ``scale``)."""
    out = []
    for d0, rows in f.d_passes:
        tp = nl.ndarray((rows, P), dtype=f.transpose_psum_dtype(x.dtype), buffer=nl.psum)
        tp[...] = nisa.nc_transpose(x[:, d0:d0 + rows])
        t = nl.ndarray((rows, P), dtype=f.mm, buffer=nl.sbuf)
        t[...] = nisa.activation(nl.copy, tp, scale=scale, dtype=f.mm)
        out.append(t)
    return out


def _as_mm(f: F._Instance, x):
    """``x`` at matmul dtype (a GpSimd cast when it differs)."""
    if x.dtype == f.mm:
        return x
    return nisa.tensor_copy(x, dtype=f.mm, engine=nisa.gpsimd_engine)


def _query_side(cfg: _Cfg, geo: Geometry, head, first, skip: bool):
    """Gather query tile rows from ``first`` of query head ``head``: Q, dO (natural, matmul
    dtype), ``(scale Q)^T``, ``dO^T``, the clamped ``-lse`` and delta columns. Rows past q_len
    (or Nq, or every row when ``first`` is pushed out) are not read and stay 0."""
    f = cfg.f
    idx, pos = own_rows(geo, first, geo.q_len, f.Nq)
    x = nl.ndarray((P, f.D), dtype=f.q.dtype, buffer=nl.sbuf)
    gather(x, f.q, (f.b, head), idx, 0, f.D, True)
    dx = nl.ndarray((P, f.D), dtype=cfg.do.dtype, buffer=nl.sbuf)
    gather(dx, cfg.do, (f.b, head), idx, 0, f.D, True)
    lse = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    gather(lse, f.lse_col, (f.b, head), idx, 0, 1, True)
    delta = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    gather(delta, cfg.delta, (0, head - f.g * f.G), idx, 0, 1, True)
    neg_lse = nisa.tensor_scalar(lse, np.multiply, -1.0, op1=nl.minimum, operand1=LSE_CLAMP,
                                 dtype=nl.float32)
    qT = _transposed(f, x, cfg.scale)
    doT = _transposed(f, dx)
    return _as_mm(f, x), _as_mm(f, dx), qT, doT, neg_lse, delta, pos


def _key_side(cfg: _Cfg, idx, skip: bool, natural_k: bool):
    """Gather a key block's rows (indices ``idx`` ``[128, 1]``): ``K^T``, ``V^T`` per pass
    (matmul dtype) and K natural at matmul dtype when ``natural_k``."""
    f = cfg.f
    kx = nl.ndarray((P, f.D), dtype=f.k.dtype, buffer=nl.sbuf)
    gather(kx, f.k, (f.b, f.g), idx, 0, f.D, skip)
    vx = nl.ndarray((P, f.D), dtype=f.v.dtype, buffer=nl.sbuf)
    gather(vx, f.v, (f.b, f.g), idx, 0, f.D, skip)
    # non-finite entries zeroed in the dP and dQ operands, not in K^T (backward.load_kv_tile)
    M.zero_non_finite(vx)
    kT = _transposed(f, kx)
    k_nat = None
    if natural_k:
        M.zero_non_finite(kx)
        k_nat = _as_mm(f, kx)
    return kT, _transposed(f, vx), k_nat


def _pair(cfg: _Cfg, geo: Geometry, qT, doT, kT, vT, neg_lse, delta, key_thr, hi, lo, seed):
    """One block pair: ``(p_dv, ds)`` at matmul dtype, ``[128 queries, 128 keys]``: ``P Z /
    (1 - p)`` (``P`` without dropout) and ``dS = P (dP Z / (1 - p) - delta)`` with ``P =
    exp(S - lse)`` on the masked scores (``key_thr``, ``hi``, ``lo``: the indicator's columns,
    or None) and ``dP = dO V^T``. ``seed``: the unit's int32 [1, 1] dropout seed or None."""
    f = cfg.f
    s = F.contract(list(zip(qT, kT)), (P, P))
    p = nisa.activation(nl.exp, s, bias=neg_lse, scale=1.0, dtype=nl.float32)
    # masked scores by selection (P = 0), so a non-finite hidden key never reaches a row
    ind = geo.indicator(key_thr, hi, lo,
                        out=nl.ndarray((P, P), dtype=nl.uint8, buffer=nl.sbuf))
    if ind is not None:
        nisa.tensor_copy_predicated(src=0.0, dst=p, predicate=ind)
    dp = F.contract(list(zip(doT, vT)), (P, P))
    if cfg.dropout_p:
        nl.random_seed(seed=seed)
        keep = nisa.dropout(f.ones, cfg.dropout_p)              # 0/1, the forward's draw
        z = nisa.tensor_scalar(keep, np.multiply, 1.0 / (1.0 - cfg.dropout_p),
                               dtype=nl.float32)
        p_dv = nisa.tensor_tensor(p, z, np.multiply, dtype=f.mm)
        dpz = nisa.tensor_tensor(dp, z, np.multiply, dtype=nl.float32)
    else:
        p_dv = nisa.tensor_copy(p, dtype=f.mm, engine=nisa.gpsimd_engine)
        dpz = dp
    ds = nisa.scalar_tensor_tensor(data=dpz, op0=np.subtract, operand0=delta,
                                   op1=np.multiply, operand1=p, dtype=f.mm)
    return p_dv, ds


def _slot(sl, seeds, thr, hi, lo):
    """The per-slot arguments of :func:`_pair` for slot sl (an NKI expression): the mask
    columns (None where absent) and the unit's dropout seed (an int32 [1, 1] copy, or None)."""
    seed = None
    if seeds is not None:
        seed = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        seed[...] = nisa.tensor_copy(seeds[0:1, nl.ds(sl, 1)], engine=nisa.gpsimd_engine)
    cols = tuple(None if c is None else c[:, nl.ds(sl, 1)] for c in (thr, hi, lo))
    return cols + (seed,)


def _accumulate(acc, psum_product):
    """``acc += product`` (fp32 SBUF += a fresh PSUM group) on VectorE."""
    acc[...] = nisa.tensor_tensor(acc, psum_product, np.add, dtype=nl.float32)


def _delta(cfg: _Cfg, h, t0, rows: int):
    """delta of ``rows`` query rows from ``t0`` (an NKI expression) of member head h."""
    f = cfg.f
    head = f.head(h)
    dx = nl.ndarray((rows, f.D), dtype=cfg.do.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=dx, src=cfg.do[f.b, head, nl.ds(t0, rows), :])
    ox = nl.ndarray((rows, f.D), dtype=f.o.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=ox, src=f.o[f.b, head, nl.ds(t0, rows), :])
    prod = nisa.tensor_tensor(dx, ox, np.multiply, dtype=nl.float32)
    d = nisa.tensor_reduce(np.add, prod, axis=(1,), keepdims=True, dtype=nl.float32)
    nisa.dma_copy(dst=cfg.delta[0, h, nl.ds(t0, rows), :], src=d)


def _key_block(cfg: _Cfg, geo: Geometry, meta_k, pos, trip: int, exact: bool):
    """dK, dV of the key block at order position ``pos`` (phase 2 of the module docstring)."""
    f = cfg.f
    hb = f.b if meta_k.shape[0] > 1 else 0
    per_head = meta_k.shape[1] > 1
    head0 = f.g * f.G if per_head else 0
    first_row = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=first_row, src=meta_k[hb, head0, nl.ds(pos, 1), 0:1])
    k_first = M.broadcast_row(first_row, 1)
    dk_acc = nisa.memset((P, f.D), 0.0, dtype=nl.float32, engine=nisa.gpsimd_engine)
    dv_acc = nisa.memset((P, f.D), 0.0, dtype=nl.float32, engine=nisa.gpsimd_engine)
    k_idx, _ = own_rows(geo, k_first, geo.kv_len, f.Nk)
    if trip:
        skip = cfg.need_mask(geo, exact)
        kT, vT, _ = _key_side(cfg, k_idx, True, False)
        key_thr0 = nisa.tensor_tensor(geo.kv_len, k_first, np.subtract, dtype=nl.float32)
        big = float(2 * P + f.Nk + f.Nq)
        for h in nl.sequential_range(f.G):
            head = f.head(h)
            row = nl.ndarray((1, 2 + trip), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=row, src=meta_k[hb, head if per_head else 0, nl.ds(pos, 1),
                                              0:2 + trip])
            rw = Row(geo, row, trip, geo.q_len, f.Nq)
            hi = lo = thr = None
            if skip:
                # a query row not read (padding slot, past q_len) masks every key
                thr = nisa.tensor_scalar(rw.bad, np.multiply, -big, op1=np.add,
                                         operand1=key_thr0, dtype=nl.float32)
                gap = nisa.tensor_scalar(rw.block_first, np.subtract, k_first, op1=np.multiply,
                                         operand1=-1.0, dtype=nl.float32)
                hi, lo = geo.band_columns(gap)
            seeds = (unit_seeds(f, head, rw.bc[0:1, 2:2 + trip], rw.bc[0:1, 0:1])
                     if cfg.dropout_p else None)
            for sl in nl.sequential_range(trip):
                # a padding slot's first row is past every sequence: nothing is read
                q_mm, do_mm, qT, doT, neg_lse, delta, _ = _query_side(
                    cfg, geo, head, rw.block_first[:, nl.ds(sl, 1)], True)
                p_dv, ds = _pair(cfg, geo, qT, doT, kT, vT, neg_lse, delta,
                                 *_slot(sl, seeds, thr, hi, lo))
                dv_ps = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.psum)
                dv_ps[...] = nisa.nc_matmul(p_dv, do_mm)
                _accumulate(dv_acc, dv_ps)
                dk_ps = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.psum)
                dk_ps[...] = nisa.nc_matmul(ds, q_mm)
                _accumulate(dk_acc, dk_ps)
    out_idx, _ = own_rows(geo, k_first, f.Nk, f.Nk)
    ip, iD = nl.arange(P)[:, None], nl.arange(f.D)[None, :]
    dk_out = nisa.tensor_scalar(dk_acc, np.multiply, cfg.scale, dtype=cfg.dk.dtype)
    dv_out = nisa.tensor_copy(dv_acc, dtype=cfg.dv.dtype)
    nisa.dma_copy(dst=cfg.dk[f.b, f.g, out_idx[ip, 0], iD], src=dk_out,
                  oob_mode=nisa.oob_mode.skip)
    nisa.dma_copy(dst=cfg.dv[f.b, f.g, out_idx[ip, 0], iD], src=dv_out,
                  oob_mode=nisa.oob_mode.skip)


def _query_tile(cfg: _Cfg, geo: Geometry, meta_q, h, pos, trip: int, exact: bool):
    """dQ of the query tile at order position ``pos`` of member head h (phase 3)."""
    f = cfg.f
    head = f.head(h)
    hb = f.b if meta_q.shape[0] > 1 else 0
    hh = head if meta_q.shape[1] > 1 else 0
    row = nl.ndarray((1, 2 + trip), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=meta_q[hb, hh, nl.ds(pos, 1), 0:2 + trip])
    rw = Row(geo, row, trip, geo.kv_len, f.Nk)
    dq_acc = nisa.memset((P, f.D), 0.0, dtype=nl.float32, engine=nisa.gpsimd_engine)
    if trip:
        skip = cfg.need_mask(geo, exact)
        _, _, qT, doT, neg_lse, delta, q_pos = _query_side(cfg, geo, head, rw.first, True)
        hi = lo = thr = None
        if skip:
            big = float(2 * P + f.Nk + f.Nq)
            row_bad = nisa.tensor_scalar(q_pos, nl.greater_equal, geo.q_len, op1=np.multiply,
                                         operand1=big, dtype=nl.float32)
            # valid key columns c < kv_len - first (none in a padding slot), none for rows
            # past q_len
            thr = nisa.tensor_scalar(rw.block_first, np.subtract, geo.kv_len, op1=np.add,
                                     operand1=row_bad, dtype=nl.float32)
            thr = nisa.tensor_scalar(thr, np.multiply, -1.0, dtype=nl.float32)
            hi, lo = geo.band_columns(nisa.tensor_scalar(rw.block_first, np.subtract,
                                                         rw.first, dtype=nl.float32))
        seeds = (unit_seeds(f, head, rw.bc[0:1, 0:1], rw.bc[0:1, 2:2 + trip])
                 if cfg.dropout_p else None)
        for sl in nl.sequential_range(trip):
            kT, vT, k_mm = _key_side(cfg, rw.rows[:, nl.ds(sl, 1)], skip, True)
            _, ds = _pair(cfg, geo, qT, doT, kT, vT, neg_lse, delta,
                          *_slot(sl, seeds, thr, hi, lo))
            tp = nl.ndarray((P, P), dtype=f.transpose_psum_dtype(f.mm), buffer=nl.psum)
            tp[...] = nisa.nc_transpose(ds)
            dsT = nisa.tensor_copy(tp, dtype=f.mm, engine=nisa.vector_engine)
            dq_ps = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.psum)
            dq_ps[...] = nisa.nc_matmul(dsT, k_mm)
            _accumulate(dq_acc, dq_ps)
    out_idx, _ = own_rows(geo, rw.first, f.Nq, f.Nq)
    dq_out = nisa.tensor_scalar(dq_acc, np.multiply, cfg.scale, dtype=cfg.dq.dtype)
    nisa.dma_copy(dst=cfg.dq[f.b, head, out_idx[nl.arange(P)[:, None], 0],
                             nl.arange(f.D)[None, :]],
                  src=dq_out, oob_mode=nisa.oob_mode.skip)


@nki.jit
def block_sparse_attention_bwd(q, k, v, o, do, lse, meta_q, meta_k, kv_lens=None, q_lens=None,
                               seed=None, *, classes_q, classes_k, scale=1.0, causal=None,
                               window=None, mm_dtype="bfloat16", dropout_p=0.0):
    """Gradients ``(dq, dk, dv)`` of the block-sparse forward, on the grid ``(B, Hkv)``.

    ``meta_q``/``classes_q``: the forward's tables (query tiles and their key blocks);
    ``meta_k``/``classes_k``: the transposed pattern's (key blocks and their query tiles,
    ``(B or 1, Hq or 1, ceil(Nk/128), 2 + trip)``, in one order per kv group:
    ``host.block_sparse.kernel_tables(..., group=G)``). Other arguments as the forward; o and
    lse are the forward's outputs, do the gradient of o.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    nqt, nkt = T.ceil_div(Nq, P), T.ceil_div(Nk, P)
    if meta_q.shape[2] != nqt or meta_k.shape[2] != nkt:
        raise ValueError(f"meta_q/meta_k: expected {nqt}/{nkt} rows, got {meta_q.shape} and "
                         f"{meta_k.shape}")
    _check_classes(classes_q, nqt, meta_q.shape[3] - 2)
    _check_classes(classes_k, nkt, meta_k.shape[3] - 2)
    spec = M.MaskSpec(Nq, Nk, causal, window, q_lens is not None, kv_lens is not None)
    dq = nl.ndarray((B, Hq, Nq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray((B, Hkv, Nk, D), dtype=q.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray((B, Hkv, Nk, D), dtype=q.dtype, buffer=nl.shared_hbm)
    delta = nl.ndarray((1, G, Nq, 1), dtype=nl.float32, buffer=nl.hbm)
    tiles = T.ForwardTiles(q_tile=P, kv_resident=False)
    f = F._Instance(q, k, v, o, lse, mm_dtype, scale, tiles, spec, nl.program_id(0),
                    nl.program_id(1))
    f.nqu, f.nku = nqt, nkt
    cfg = _Cfg(f, do, dq, dk, dv, delta, float(dropout_p))
    if dropout_p:
        if seed is None:
            raise ValueError("dropout_p > 0 needs the seed tensor (HBM (1,) int32)")
        f.seed = nl.load(seed.reshape((1, 1)))
        f.ones = nisa.memset((P, P), 1.0, dtype=nl.float32, engine=nisa.gpsimd_engine)
    geo = Geometry(spec, kv_lens, q_lens, f.b, Nq, Nk)

    # 1. delta = rowsum(dO * O)
    full, tail = Nq // P, Nq % P
    for h in nl.affine_range(G):
        for t in nl.affine_range(full):
            _delta(cfg, h, t * P, P)
        if tail:
            _delta(cfg, h, full * P, tail)
    # 2. dK, dV, key-major
    for first, count, trip, exact in classes_k:
        for c in nl.affine_range(count):
            _key_block(cfg, geo, meta_k, first + c, trip, exact)
    # 3. dQ, query-major
    for h in nl.affine_range(G):
        for first, count, trip, exact in classes_q:
            for c in nl.affine_range(count):
                _query_tile(cfg, geo, meta_q, h, first + c, trip, exact)
    return dq, dk, dv


__all__ = ["block_sparse_attention_bwd", "LSE_CLAMP"]
