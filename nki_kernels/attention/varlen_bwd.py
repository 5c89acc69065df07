"""Packed variable-length flash attention backward (the gradients of ``varlen.py``).

The forward's sweep, differentiated: per group of query tiles (``varlen.plan_sweep``: the
same row bounds, union of key ranges and runtime step count), for every (tile, query head)
slot and every 512-key step (FlashAttention-2's backward, query-major)::

    S  = Q K^T;  scores outside [first_i, end_i) -> fill       TensorE, VectorE
    P  = exp(c S - lse_i)                                       ScalarE (lse = -inf: P = 0)
    dP = dO V^T                                                 TensorE
    dS = P (dP - delta_i),  delta_i = rowsum(dO_i O_i)          VectorE
    dQ_i  += c dS K        (dS^T by TensorE transposes)         accumulated in SBUF
    dK_j  += c dS^T Q,  dV_j += P^T dO                          PSUM over the group's slots

and the step's dK/dV rows are added into fp32 HBM accumulators (gathered, added, scattered:
keys of one sequence are swept by several groups). A last pass casts them to k's dtype.
The accumulators' read-modify-writes follow each other in program order on one program's
rows (UNCONFIRMED: that the compiler orders these indirect HBM accesses as the simulator
does, by their data dependencies).

Score modifiers (``score_mods.py``): ALiBi's bias is the forward's (a constant of the
scores: nothing to differentiate); with soft-capping S is the forward's
``tanh`` tile (raw units of the cap, selected after it) and dS gains the factor ``1 - t^2``
(deselected where masked: a hidden non-finite score's tanh never reaches a row); with sinks
each slot adds its rows' shares of dsink, ``exp(sink - lse_i) delta_i``, to per-partition
sums carried through the groups, summed across partitions and negated at the end
(``block_sparse_bwd.add_sink_share``, ``store_dsinks``): ``dsinks (1, Hq)``.

Attention dropout (FlashAttention appendix Algorithm 4): each unit's keep mask Z is drawn
again from the seed as the forward drew it (``varlen.drop_units`` on ones), P Z / (1 - p)
feeds dV and dP Z / (1 - p) replaces dP (delta, from the dropped O, is unchanged).

Head dims up to 128 (PSUM: the step's dK and dV, one bank each, beside S, dP, dS^T and dQ).
"""
from __future__ import annotations

from nki_kernels import port
from nki_kernels import tiles as T
from nki_kernels.attention import block_sparse as BS
from nki_kernels.attention import block_sparse_bwd as BSB
from nki_kernels.attention import forward as F
from nki_kernels.attention import masks as M
from nki_kernels.attention import score_mods as SM
from nki_kernels.attention import varlen as VL
from nki_kernels.port import nl

P = T.PMAX
W = T.VARLEN_STEP_KEYS


@port.jit
def varlen_attention_bwd(q, k, v, o, do, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None,
                         sinks=None, seed=None, *, scale=1.0, causal=None, window=None,
                         mm_dtype="bfloat16", softcap=None, dropout_p=0.0):
    """``(dq, dk, dv)`` of :func:`varlen.varlen_attention_fwd` for its inputs, output ``o``,
    ``do`` (q's layout) and ``lse`` (``(1, Hq, total_q)`` float32); dq in q's dtype, dk and
    dv in k's, summed over each kv head's query heads; with ``sinks`` (HBM ``(Hq,)``) also
    ``dsinks`` ``(1, Hq)`` float32. ``softcap``, ``alibi_slopes``, ``dropout_p`` and ``seed``
    as the forward's.
    Instances and grid as the forward's (:func:`varlen.varlen_grid`). D <= 128."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if D > P:
        raise ValueError(f"q: the packed backward takes head dims up to {P}, got {D}")
    VL.check_shapes("varlen_attention_bwd", q, k, cu_seqlens_q, cu_seqlens_k)
    VL.check_dropout(dropout_p, seed, Hq, Nq, Nk, False)
    mods = VL.check_mods(softcap, alibi_slopes, sinks)
    spec = M.MaskSpec(Nq, Nk, causal, window, alibi=mods.alibi)
    tiles = T.ForwardTiles(q_tile=P, kv_resident=False)
    dq = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm)
    # fp32 accumulators of dK and dV (k's layout, so k's row frames address them)
    dk_acc = nl.ndarray(k.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    dv_acc = nl.ndarray(k.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    dsinks = nl.ndarray((1, Hq), dtype=nl.float32, buffer=nl.shared_hbm) if mods.sinks else None
    acc = (dk_acc, dv_acc)
    indices = VL.loop_indices(q, k)
    off = VL.load_offsets(cu_seqlens_q, cu_seqlens_k, spec)
    ident = VL.identity2()
    static_steps = T.ceil_div(Nk, W)
    Hc, R = VL.body_shape(Hkv, Hq // Hkv, Nq)

    def instance(b, g0):
        insts = VL.kv_heads(q, k, v, o, lse, mm_dtype, scale, tiles, spec, b, g0, Hc, indices,
                            mods, alibi_slopes, sinks, (dropout_p, seed, None))
        _each_key_tile(insts, off, lambda kh, idx: _zero_rows(kh, acc, idx))
        # per kv head, dsink's per-partition partial sums of its query heads (with sinks)
        sink_acc = []
        for kh in insts if mods.sinks else ():
            a = nl.ndarray((P, kh.f.G), dtype=nl.float32, buffer=nl.sbuf)
            port.memset(a, 0.0, engine="gpsimd")
            sink_acc.append(a)
        VL.group_loop(insts, off, ident, static_steps, R, Nq,
                      lambda plan, pos: _group(insts, off, ident, static_steps, plan, pos,
                                               (do, dq), acc, sink_acc))
        _each_key_tile(insts, off, lambda kh, idx: _cast_rows(kh, acc, (dk, dv), idx))
        for kh, a in zip(insts, sink_acc):
            BSB.store_dsinks(kh.f, a, dsinks)

    port.for_programs((B, Hkv // Hc), instance)
    if dsinks is not None:
        return dq, dk, dv, dsinks
    return dq, dk, dv


def _each_key_tile(insts, off, body):
    """``body(kv head, row indices)`` over the 128-key tiles of every kv head of the instance
    (a compiled loop; the indices of keys past total_k are out of bounds)."""
    Nk = insts[0].f.Nk
    pos = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(pos, off.part, engine="gpsimd")

    def tile(t):
        for kh in insts:
            body(kh, BS.rows_at(pos, Nk, kh.kv))
        port.tensor_scalar(pos, pos, nl.add, float(P), engine="gpsimd")

    port.loop(T.ceil_div(Nk, P), tile, carried=True)


def _zero_rows(kh, acc, idx):
    """Zero the accumulators' rows ``idx`` of kv head ``kh``."""
    zeros = nl.ndarray((P, kh.f.D), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(zeros, 0.0, engine="gpsimd")
    for a in acc:
        BS.scatter(a, (kh.f.b, kh.f.g), idx, zeros)


def _cast_rows(kh, acc, outs, idx):
    """The accumulators' rows ``idx`` of kv head ``kh``, cast into ``outs`` (dk, dv)."""
    for a, out in zip(acc, outs):
        x = nl.ndarray((P, kh.f.D), dtype=nl.float32, buffer=nl.sbuf)
        BS.gather(x, a, (kh.f.b, kh.f.g), idx, 0, True)
        y = nl.ndarray((P, kh.f.D), dtype=out.dtype, buffer=nl.sbuf)
        port.tensor_copy(y, x, engine="gpsimd")
        BS.scatter(out, (kh.f.b, kh.f.g), idx, y)


class _Slot:
    """On-chip state of one (tile, query head) slot: Q^T and dO^T per head-dim pass (matmul
    dtype), Q and dO in the matmul dtype, the exp bias ``-lse`` (finite for rows without a
    key), ``delta``, and the fp32 dQ accumulator."""

    def __init__(self, f, do, h, idx, skip: bool, sink_acc):
        head = f.head(h)
        D = f.D
        x = {}
        for name, src in (("q", f.q), ("do", do), ("o", f.o)):
            t = nl.ndarray((P, D), dtype=src.dtype, buffer=nl.sbuf)
            BS.gather(t, src, (f.b, head), idx, 0, skip)
            x[name] = t
        lse_t = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        BS.gather(lse_t, f.lse_col, (f.b, head), idx, 0, skip)
        # -lse, or a finite bias of a row without a visible key (backward._derive's rule)
        floor = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(floor, lse_t, nl.maximum, T.BWD_LSE_NO_KEY)
        no_key = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(no_key, lse_t, nl.less, T.BWD_LSE_NO_KEY)
        self.bias = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.scalar_tensor_tensor(self.bias, no_key, nl.multiply, T.BWD_EXP_BIAS_NO_KEY,
                                  nl.subtract, floor)
        prod = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(prod, x["do"], x["o"], nl.multiply)
        self.delta = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_reduce(self.delta, nl.add, prod, axis=(1,))
        if sink_acc is not None:
            # rows past total_q were zeroed by the gathers: lse = 0 and delta = 0, no share
            BSB.add_sink_share(f.score.cols, h, lse_t, self.delta, sink_acc)
        self.nat, self.T = {}, {}
        for name in ("q", "do"):
            nat = nl.ndarray((P, D), dtype=f.mm, buffer=nl.sbuf)
            port.tensor_copy(nat, x[name], engine="gpsimd")
            self.nat[name] = nat
            self.T[name] = []
            for d0, d in f.d_passes:
                tp = nl.ndarray((d, P), dtype=f.transpose_psum_dtype(nat.dtype), buffer=nl.psum)
                port.nc_transpose(tp, nat[:, d0:d0 + d])
                sb = nl.ndarray((d, P), dtype=f.mm, buffer=nl.sbuf)
                # Q^T carries the scale when the exp cannot (as the forward's)
                port.activation(sb, nl.copy, tp, scale=f.q_scale if name == "q" else 1.0)
                self.T[name].append(sb)
        self.dq = nl.ndarray((P, D), dtype=nl.float32, buffer=nl.sbuf)
        port.memset(self.dq, 0.0, engine="gpsimd")
        self.idx = idx


def _group(insts, off, ident, static_steps: int, plan, pos, grads, acc, sink_acc):
    """The backward of one group (``varlen._group``'s sweep): slots, steps, dQ written
    (``sink_acc``: per kv head dsink's partial sums, or empty without sinks)."""
    do, dq = grads
    G = insts[0].f.G
    R = plan.rows.shape[1]
    n, outs, keys, rel, rows_q = VL.open_group(insts, off, ident, plan, pos)
    slots = []
    for c, kh in enumerate(insts):
        for r in T.unrolled(R):
            for h in T.unrolled(G):
                sl = (c * R + r) * G + h
                slots.append(_Slot(kh.f, do, h, outs[sl], kh.f.Nq % P != 0,
                                   sink_acc[c] if sink_acc else None))

    def step(s):
        for c, kh in enumerate(insts):
            _step(kh, off, slots[c * R * G:(c + 1) * R * G], keys, rel, rows_q, R, acc)
        port.tensor_scalar(keys, keys, nl.add, float(W), engine="gpsimd")
        port.tensor_scalar(rel, rel, nl.subtract, float(W), engine="gpsimd")

    VL.run_steps(n, static_steps, step)
    for c, kh in enumerate(insts):
        for j in T.unrolled(R * G):
            sl = slots[c * R * G + j]
            out = nl.ndarray((P, kh.f.D), dtype=dq.dtype, buffer=nl.sbuf)
            port.tensor_scalar(out, sl.dq, nl.multiply, float(kh.f.scale), engine="gpsimd")
            BS.scatter(dq, (kh.f.b, kh.f.head(j % G)), sl.idx, out)


def _step(kh, off, slots, keys, rel, rows_q, R: int, acc):
    """One step of W keys of kv head ``kh`` for its slots: gather K, V; per slot the
    recomputed P (with dropout its keep mask, ``rows_q``: the tiles' rows), dS and dQ; dK and
    dV summed over the slots in PSUM, then added to the HBM accumulators at the step's key
    rows."""
    f, kv = kh.f, kh.kv
    D, nb = f.D, W // P
    rows = BS.rows_at(keys, f.Nk, kv)
    kx = nl.ndarray((P, nb, D), dtype=f.k.dtype, buffer=nl.sbuf)
    vx = nl.ndarray((P, nb, D), dtype=f.v.dtype, buffer=nl.sbuf)
    for x, src in ((kx, f.k), (vx, f.v)):
        port.memset(x, 0.0, engine="gpsimd")
        for w in T.unrolled(nb):
            port.dma_copy(x[:, w, :], port.lead_rows(src, (f.b, f.g), rows, w),
                          legacy_isa=True, oob_skip=True)
    k_mm = nl.ndarray((P, nb, D), dtype=f.mm, buffer=nl.sbuf)
    port.tensor_copy(k_mm, kx, engine="gpsimd")
    kT = [nl.ndarray((d, W), dtype=f.mm, buffer=nl.sbuf) for _, d in f.d_passes]
    F.transpose_keys(f, kT, 0, [(w * P, P, kx[:, w, :]) for w in T.unrolled(nb)], f.k.dtype)
    vT = [nl.ndarray((d, W), dtype=f.mm, buffer=nl.sbuf) for _, d in f.d_passes]
    F.transpose_keys(f, vT, 0, [(w * P, P, vx[:, w, :]) for w in T.unrolled(nb)], f.v.dtype)
    dk_ps = nl.ndarray((P, nb, D), dtype=nl.float32, buffer=nl.psum)
    dv_ps = nl.ndarray((P, nb, D), dtype=nl.float32, buffer=nl.psum)
    for j, sl in enumerate(slots):
        r = j // f.G
        bounds = rel[:, r, :]
        sc, t = VL.modified(f, off, F.contract([(sl.T["q"][pi], kT[pi])
                                                for pi in T.unrolled(len(f.d_passes))], (P, W)),
                            j % f.G, bounds)
        grad = None if t is None else SM.softcap_grad_factor(t, P, W)
        s_sel = _select(off, bounds, sc, T.BWD_MASK_FILL)
        p32 = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
        port.activation(p32, nl.exp, s_sel, bias=sl.bias, scale=f.unit)
        p_mm = nl.ndarray((P, W), dtype=f.mm, buffer=nl.sbuf)
        dp = F.contract([(sl.T["do"][pi], vT[pi]) for pi in T.unrolled(len(f.d_passes))],
                        (P, W))
        if f.dropout_p:
            # Z / (1 - p): the forward's draw of every unit, on ones
            z = nl.ndarray((P, W), dtype=f.mm, buffer=nl.sbuf)
            port.memset(z, 1.0, engine="gpsimd")
            VL.drop_units(f, off, z, keys, rows_q[:, r:r + 1], f.head(j % f.G), None)
            port.scalar_tensor_tensor(p_mm, p32, nl.multiply, 1.0 / (1.0 - f.dropout_p),
                                      nl.multiply, z)
            dpz = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
            port.scalar_tensor_tensor(dpz, dp, nl.multiply, 1.0 / (1.0 - f.dropout_p),
                                      nl.multiply, z)
            dp = dpz
        else:
            port.tensor_copy(p_mm, p32, engine="gpsimd")
        pg = p32
        if grad is not None:
            # P (1 - t^2), the factor selected to 0 outside [first, end) (P is 0 there)
            pg = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_tensor(pg, p32, _select(off, bounds, grad, 0.0), nl.multiply,
                               engine="gpsimd")
        ds = nl.ndarray((P, W), dtype=f.mm, buffer=nl.sbuf)
        port.scalar_tensor_tensor(ds, dp, nl.subtract, sl.delta, nl.multiply, pg)
        first = j == 0
        for w in T.unrolled(nb):
            blk = slice(w * P, (w + 1) * P)
            port.nc_matmul(dv_ps[:, w, :], p_mm[:, blk], sl.nat["do"], accumulate=not first)
            port.nc_matmul(dk_ps[:, w, :], ds[:, blk], sl.nat["q"], accumulate=not first)
        dsT = nl.ndarray((P, nb * P), dtype=f.mm, buffer=nl.sbuf)
        tp = nl.ndarray((P, nb * P), dtype=f.transpose_psum_dtype(f.mm), buffer=nl.psum)
        for w in T.unrolled(nb):
            port.nc_transpose(tp[:, w * P:(w + 1) * P], ds[:, w * P:(w + 1) * P])
        port.tensor_copy(dsT, tp, engine="vector")
        dq_ps = F.contract([(dsT[:, w * P:(w + 1) * P], k_mm[:, w, :]) for w in T.unrolled(nb)],
                           (P, D))
        port.tensor_tensor(sl.dq, sl.dq, dq_ps, nl.add)
    # the step's dK (times the scale) and dV into the accumulators
    for a, ps, c in ((acc[0], dk_ps, float(f.scale)), (acc[1], dv_ps, 1.0)):
        cur = nl.ndarray((P, nb, D), dtype=nl.float32, buffer=nl.sbuf)
        port.memset(cur, 0.0, engine="gpsimd")
        for w in T.unrolled(nb):
            port.dma_copy(cur[:, w, :], port.lead_rows(a, (f.b, f.g), rows, w),
                          legacy_isa=True, oob_skip=True)
        new = nl.ndarray((P, nb, D), dtype=nl.float32, buffer=nl.sbuf)
        port.scalar_tensor_tensor(new, ps, nl.multiply, c, nl.add, cur)
        for w in T.unrolled(nb):
            port.dma_copy(port.lead_rows(a, (f.b, f.g), rows, w), new[:, w, :], oob_skip=True)


def _select(off, bounds, x, fill: float):
    """fp32 ``[128, W]``: ``x`` (PSUM or SBUF) inside each row's ``[first, end)`` (``bounds``
    relative to the step's first key), outside it ``fill`` (legacy: an indicator and a
    predicated copy), or under nki.* fp32.min (one VectorE ``range_select``: a finite value
    either fill needs)."""
    out = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
    if port.api() == "nki":
        neg_max = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.range_select_max(out, x, [(bounds[:, 0:1], nl.greater_equal),
                                       (bounds[:, 1:2], nl.less)], neg_max)
    else:
        port.tensor_copy(out, x, engine="vector")
        port.tensor_copy_predicated(out, fill, VL.outside(off, bounds))
    return out


__all__ = ["varlen_attention_bwd"]
