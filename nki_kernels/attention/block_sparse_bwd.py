"""Block-sparse flash attention backward (FlashAttention appendix Algorithm 5's backward: the
dense backward, Algorithm 4, restricted to the active blocks).

Gradients of :func:`block_sparse.block_sparse_attention_fwd` from its saved o and lse. Every
active 128 x 128 block pair (query tile i, key block j) is visited once, never an inactive
one, and nothing of size N x N is stored. The query side is staged in SBUF a *chunk* at a
time (the dense backward's passes, ``backward.py``): ``tiles.bsp_bwd_chunks`` splits the
query tiles of a kv group into chunks of consecutive tiles that fit 90 % of SBUF beside the
working set -- one chunk up to 16K rows at D = 128 on trn2 (the resident schedule), more past
it, or sooner with score modifiers, dropout or lengths, whose working set is larger. With
several chunks under nki.* the host may *reorder* the query tiles of each kv group
(``host.block_sparse.chunk_order``, where its plan moves fewer bytes): a chunk is then
``chunk_tiles`` consecutive tiles of that order (``order_q``), chosen so that the chunks
meet few key blocks and few blocks are met by several chunks -- the evenly spread pattern
at s = 1/8 gives every eighth tile the same blocks, so a chunk of them meets an eighth of
the blocks, not all. Per chunk:

1. **Stage** the chunk's query tiles of the G heads (compiled loops, four tiles per body): Q,
   dO, O, lse read once (direct DMAs; gathers with q_lens, and at the rows of the order's
   tiles, read from ``order_q`` once per chunk), ``delta_i = rowsum(dO_i * O_i)``,
   and into SBUF (``_Resident``, the dense kernel's slot bytes per tile) ``(scale Q)^T``,
   ``dO^T``, Q, dO, ``-lse`` (clamped), ``-delta`` and a zeroed fp32 dQ accumulator.
2. **Key-major sweep**: for every key block j (rows of the *transposed* pattern restricted
   to the chunk's query tiles, in one order per kv group common to every chunk, sorted into
   compile-time classes like the forward's query tiles), K_j, V_j are gathered once;
   a sequential loop over the query heads of the kv group and the chunk's query tiles i
   active with j reads tile i's staged state at a runtime block (the table's entry, or with
   the tiles reordered its place in the chunk, ``slots_k``: :func:`port.dynamic_block`),
   recomputes ``P_ij = exp(scale Q_i K_j^T - LSE_i)`` and
   ``dS_ij = P_ij * (dO_i V_j^T - D_i)``, accumulates ``dV_j += P_ij^T dO_i`` and ``dK_j +=
   dS_ij^T Q_i`` in PSUM and adds ``dS_ij K_j`` to dQ_i's accumulator (six TensorE passes
   per pair, the dense kernel's). One chunk: dK_j, dV_j are stored. Several: the partial
   sums go through an fp32 scratch in HBM at the block's order position (an address in the loop index, not an indirect access:
   the read-add-writes of different blocks are independent DMAs, where an indirect one would
   order every access to the tensor after the previous one). Legacy: written by the first
   chunk, read, added and written back by the middle ones, read by the last, which stores
   dK_j, dV_j (as the dense backward's passes, without its zeroing and final pass). nki.*:
   only the chunks that meet block j touch its sums (the host's ``acc_k``: runtime loops of
   trip 0 or 1, :func:`_accumulate`) -- the last of them adds the earlier ones' sums, if
   any, and stores dK_j, dV_j (the last chunk those of a block no chunk meets), the first
   writes its sums for a later one, the middle ones read, add on GpSimd and write them
   back: a block one chunk meets never goes
   through HBM. Before the last chunk a row no head of the group meets in the chunk names
   no block (the host pushes it past every sequence): its K and V are not read, and under
   nki.* its whole sweep is skipped (:func:`_when_met`); under nki.* with a table shared by
   the group's heads the last chunk skips their K and V too.
3. **dQ out**: every tile's accumulator of the chunk, scaled and cast, stored once (a tile of
   the host's order at its runtime row: a plain DMA under nki.*, :func:`port.flat_rows`, a
   scatter in legacy; the order keeps the last, partial, tile last, at static rows).

HBM traffic: Q, dO, O, lse once, dQ, dK, dV once, K and V once per key block a chunk meets
(legacy, and nki.* with per-head tables of a GQA group, in the last chunk every listed
block -- under a bool mask every block some chunk meets, in the index form every key block);
with c > 1 chunks also the scratch, in legacy ``2 (2 c - 2)`` fp32 ``[128, d]`` tiles per
listed block, under nki.* ``2 (2 m - 2)`` per block that m >= 1 chunks meet (dK, dV:
written once, read and written m - 2 times, read once; none for m = 1) plus ``acc_k``, 16
bytes per listed block and chunk: Theta(N d + nnz d) for one chunk; for
c, Theta(c N d + nnz d) in legacy, under nki.* Theta(N d + sum over chunks of the blocks
each meets, d) -- in proportion to the density where the dense backward re-reads K/V; with
the tiles reordered plus ``order_q`` and ``slots_k`` (4 bytes per tile, and per entry
slot), the plan the host chose by these bytes (``host.block_sparse.backward_plan_bytes``).

Masks, lengths, GQA and dropout as in the forward kernel (module ``block_sparse``): the masks
are computed at run time from each pair's positions; dropout regenerates each unit's mask
from ``seed + unit`` (the dense kernels' numbering), so ``dP`` and ``dV`` see exactly the
forward's ``Z / (1 - p)``.

Namespaces as the forward's (module ``block_sparse``): a compiled loop over the instances in
0.7, gathers through the flattened tensors; the dK/dV scratch is each program's own pair
(0.7's one program runs the instances one after another, each writing a block's rows
before it reads them: in its first chunk, or the first that meets the block). The first and the last chunk (the rest of the tiles, the partial one) are static
copies and the middle ones a compiled loop, so the program does not grow with N.
Each key block's slot loop runs the row's count of slots under nki.* (a register bound,
:meth:`block_sparse.Row.slot_loop`; the counts read once per class), all ``trip`` in legacy
(padding slots masked, pointed at a zero tile). The staged
tiles are read at runtime blocks through views under nki.* (``NkiTensor.ap(scalar_offset=)``)
and through ``tensor_copy_dynamic_src``/``_dst`` copies in legacy (VectorE, 600 cycles each in
the simulator): the same values, so the same gradients bit for bit; the legacy trace is the
slower one.
"""
from __future__ import annotations

from nki_kernels import port
from nki_kernels import tiles as T
from nki_kernels.attention import forward as F
from nki_kernels.attention import masks as M
from nki_kernels.attention import score_mods as SM
from nki_kernels.attention.block_sparse import (P, Geometry, Row, RowFrame, check_classes,
                                                exact_indices, gather, rows_at, scatter,
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
    (``[128, G]`` fp32, with sinks); ``scratch`` the program's fp32 ``(dK, dV)`` partial
    sums in HBM with several chunks (else None), ``(ceil(Nk / 128) 128, D)`` each, rows
    ``128 r ..`` those of the key block at order position r; ``acc_k`` under nki.* with
    several chunks the host's steps of each block's sums per chunk (``LaunchTables.acc_k``:
    write, add, finish with or without the earlier sums), else None; ``slots_k`` with the
    query tiles reordered the host's places of the entries in their chunks
    (``LaunchTables.slots_k``), else None."""

    def __init__(self, f: F.Instance, do, dq, dk, dv, scratch, score, dsink_acc, acc_k=None,
                 slots_k=None):
        self.f, self.do, self.dq, self.dk, self.dv = f, do, dq, dk, dv
        self.scratch = scratch
        self.acc_k = acc_k
        self.slots_k = slots_k
        self.dropout_p = f.dropout_p
        self.scale = f.scale
        self.mods = score.mods if score is not None else SM.Mods()
        self.unit = score.unit if score is not None else 1.0
        self.cols = score.cols if score is not None else None
        self.dsink_acc = dsink_acc
        # the zero row that opens each key block's dK/dV groups (nki.*; legacy None)
        self.zero_row = port.group_zero_row(max(P, f.D))

    def need_mask(self, geo: Geometry, exact: bool) -> bool:
        """Whether pairs need the runtime indicator: padding slots (legacy runs them; under
        nki.* a row's slot loop stops at its count, :meth:`block_sparse.Row.slot_loop`),
        lengths, partial tiles, the band."""
        f = self.f
        padding = not exact and port.api() != "nki"
        return padding or geo.has_lens or f.Nq % P != 0 or f.Nk % P != 0 or f.spec.has_diag


class _Resident:
    """The query side of one chunk's query tiles (``slots`` per head) of the instance's G
    heads, staged in SBUF once per chunk (the dense backward's resident pass, ``backward.py``)
    and read by the key-major sweep at each pair's tile (:func:`port.dynamic_block`: the tile
    is data, a table entry), with dQ accumulated beside it. Block ``n = h (slots + 1) + i``
    holds the chunk's i-th query tile of member head h; block ``h (slots + 1) + slots`` is the
    head's zero tile, which padding slots (legacy: every slot of a row runs) read and add
    nothing to. Per block, per partition:

    - ``T[pass]`` ``[rows, 2 x 128]`` (matmul dtype): ``(scale Q)^T`` then ``dO^T``;
    - ``nat`` ``[128, 2 D]`` (matmul dtype): Q then dO (the moving operands of dK and dV);
    - ``stat`` ``[128, 2]`` fp32: the clamped ``-lse``, ``-delta``;
    - ``dq`` ``[128, D]`` fp32: the dQ accumulator, the only one written by the sweep (VectorE,
      in program order): a compiler that cannot tell runtime blocks apart orders the dQ adds
      only, not the other engines' reads of the staged state.

    ``tiles.bwd_slot_bytes`` per block, as the dense backward's slot
    (``tiles.bsp_bwd_chunks`` sizes the chunk to fit)."""

    def __init__(self, f: F.Instance, slots: int, reordered: bool = False):
        self.slots, self.per_head = slots, slots + 1
        self.reordered = reordered
        n = f.G * self.per_head
        self.T = [nl.ndarray((rows, n, 2 * P), dtype=f.mm, buffer=nl.sbuf)
                  for _, rows in f.d_passes]
        self.nat = nl.ndarray((P, n, 2 * f.D), dtype=f.mm, buffer=nl.sbuf)
        self.stat = nl.ndarray((P, n, 2), dtype=nl.float32, buffer=nl.sbuf)
        self.dq = nl.ndarray((P, n, f.D), dtype=nl.float32, buffer=nl.sbuf)

        def zero_tile(h):
            z = h * self.per_head + slots
            for t in self.T:
                port.memset(t[:, z, :], 0.0, engine="gpsimd")
            port.memset(self.nat[:, z, :], 0.0, engine="gpsimd")
            port.memset(self.stat[:, z, :], 0.0, engine="gpsimd")
            port.memset(self.dq[:, z, :], 0.0, engine="gpsimd")

        port.loop(f.G, zero_tile)

    def blocks(self, f: F.Instance, geo: Geometry, rw: Row, h, chunk, places=None):
        """int32 ``[1, trip]``: the blocks of ``rw``'s entries (query tile ``block_first /
        128`` less the chunk's first, ``chunk slots``; a padding slot's the zero tile) of
        member head h; with the tiles reordered, ``places`` (fp32 ``[1, trip]``, the host's
        ``slots_k`` row: each entry's place in the chunk, ``slots`` for padding) instead of
        the tiles. GpSimd, one ``[1, trip]`` instruction (one more past the first chunk in
        natural order, two more with GQA)."""
        trip = rw.trip
        first = None
        if places is None:
            first = rw.bc[0:1, 2:2 + trip]
            if not isinstance(chunk, int) or chunk:
                shift = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
                port.iota(shift, [[0, 1]], runtime=[(chunk, -self.slots * P)],
                          offsets=geo.indices)
                first = nl.ndarray((1, trip), dtype=nl.float32, buffer=nl.sbuf)
                port.tensor_scalar(first, rw.bc[0:1, 2:2 + trip], nl.add, shift,
                                   engine="gpsimd")

        def tiles_of(dst):
            # the query tile less the chunk's first; a padding slot's the zero tile
            if first is None:
                port.tensor_copy(dst, places, engine="gpsimd")
            else:
                port.tensor_scalar(dst, first, nl.multiply, 1.0 / P, op1=nl.minimum,
                                   operand1=float(self.slots), engine="gpsimd")

        out = nl.ndarray((1, trip), dtype=nl.int32, buffer=nl.sbuf)
        if f.G == 1:
            tiles_of(out)
            return out
        head0 = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(head0, [[0, 1]], runtime=[(h, self.per_head)], offsets=geo.indices)
        tile = places
        if first is not None:
            tile = nl.ndarray((1, trip), dtype=nl.float32, buffer=nl.sbuf)
            tiles_of(tile)
        port.tensor_scalar(out, tile, nl.add, head0, engine="gpsimd")
        return out

    def tile(self, f: F.Instance, blocks, sl):
        """Slot sl's block (``blocks``: :meth:`blocks`): ``(q_mm, do_mm, qT, doT, neg_lse,
        neg_delta, acc)``, views or (legacy) copies; ``acc`` for :meth:`add_dq`."""
        n, D = blocks[0:1, nl.ds(sl, 1)], f.D
        ts = [port.dynamic_block(t, n, ((0, P), (P, P))) for t in self.T]
        q_mm, do_mm = port.dynamic_block(self.nat, n, ((0, D), (D, D)))
        neg_lse, neg_delta = port.dynamic_block(self.stat, n, ((0, 1), (1, 1)))
        dq = port.dynamic_block(self.dq, n, ((0, D),))[0]
        return (q_mm, do_mm, [t[0] for t in ts], [t[1] for t in ts], neg_lse, neg_delta,
                (n, dq))

    def add_dq(self, acc, dq_ps):
        """dQ of the slot's query tile ``+= dq_ps`` (``acc`` from :meth:`tile`)."""
        port.dynamic_block_add(self.dq, acc[0], acc[1], dq_ps)

    def positions(self, geo: Geometry, t, ordered: bool):
        """fp32 ``[128, 1]``: the positions of query tile t's rows, ``128 t + p`` (an iota
        of the loop indices), or where t is ``ordered`` (a tile of the host's order,
        :meth:`run`) ``t + p`` (``t``: the tile's first row, an fp32 ``[128, 1]`` column of
        the order, data; GpSimd)."""
        pos = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        if ordered:
            port.tensor_tensor(pos, t, geo.part, nl.add, engine="gpsimd")
        else:
            port.iota(pos, [[0, 1]], channel_multiplier=1, runtime=[(t, P)],
                      offsets=geo.indices)
        return pos

    def stage(self, cfg: "_Cfg", geo: Geometry, h, q_frame, t, local, rows: int,
              ordered: bool):
        """Query tile t (``rows`` rows: 128, or the partial last tile's; ``ordered``: of the
        host's order, :meth:`run`) of member head h into its block (``local``: t's place in
        its chunk): Q, dO, O, lse (rows past Nq zero; with
        q_lens gathered through ``q_frame``, rows past q_len skipped, zero), ``-delta =
        -rowsum(dO O)``, the clamped -lse, the transposes, a zeroed dQ accumulator; with
        sinks the rows' shares of dsink."""
        f = cfg.f
        head = f.head(h)
        srcs = (f.q, cfg.do, f.o, f.lse_col)
        x, dx, ox, lse = (nl.ndarray((P, src.shape[-1]), dtype=src.dtype, buffer=nl.sbuf)
                          for src in srcs)
        if q_frame is not None:
            idx = rows_at(self.positions(geo, t, ordered), geo.q_len, q_frame)
            for dst, src in zip((x, dx, ox, lse), srcs):
                gather(dst, src, (f.b, head), idx, 0, True)
        else:
            for dst, src in zip((x, dx, ox, lse), srcs):
                if rows < P:
                    port.memset(dst, 0.0, engine="gpsimd")
                port.dma_copy(dst[0:rows], src[f.b, head, nl.ds(t * P, rows), :],
                              legacy_isa=True)
        n, D = h * self.per_head + local, f.D
        port.memset(self.dq[:, n, :], 0.0, engine="gpsimd")
        port.tensor_scalar(self.stat[:, n, 0:1], lse, nl.multiply, -1.0, op1=nl.minimum,
                           operand1=LSE_CLAMP, engine="gpsimd")
        d = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        _rowsum(dx, ox, d)
        port.tensor_scalar(self.stat[:, n, 1:2], d, nl.multiply, -1.0, engine="gpsimd")
        if cfg.dsink_acc is not None:
            add_sink_share(cfg.cols, h, lse, d, cfg.dsink_acc)
        _transposed(f, x, cfg.scale, into=[t_[:, n, 0:P] for t_ in self.T])
        _transposed(f, dx, into=[t_[:, n, P:2 * P] for t_ in self.T])
        port.tensor_copy(self.nat[:, n, 0:D], x, engine="gpsimd")
        port.tensor_copy(self.nat[:, n, D:2 * D], dx, engine="gpsimd")

    def write_dq(self, cfg: "_Cfg", geo: Geometry, h, q_frame, t, local, rows: int,
                 ordered: bool):
        """dQ of query tile t (``rows`` rows; ``local`` its place in the chunk) of member head
        h: ``scale`` times its accumulator, cast and stored (rows at or past q_len hold zeros:
        no pair added to them). A tile of the host's order (``ordered``, a whole one) is
        stored at its rows of ``q_frame``: under nki.* by a plain DMA at its first row
        (:func:`port.flat_rows`: independent of the other tiles' stores; the row number of
        partition 0 only), in legacy scattered (an indirect write, which the scheduler orders
        after every earlier one to dq)."""
        f = cfg.f
        dq_out = nl.ndarray((P, f.D), dtype=cfg.dq.dtype, buffer=nl.sbuf)
        port.activation(dq_out, nl.copy, self.dq[:, h * self.per_head + local, :],
                        scale=cfg.scale)
        if ordered and port.api() == "nki":
            # the tile's first row: partition 0 of t (its positions t + p, p = 0)
            port.dma_copy(port.flat_rows(cfg.dq, rows_at(t[0:1, 0:1], f.Nq, q_frame), P),
                          dq_out)
            return
        if ordered:
            scatter(cfg.dq, (f.b, f.head(h)), rows_at(self.positions(geo, t, True), f.Nq,
                                                      q_frame), dq_out)
            return
        port.dma_copy(cfg.dq[f.b, f.head(h), nl.ds(t * P, rows), :], dq_out[0:rows],
                      legacy_isa=True)

    def run(self, cfg: "_Cfg", geo: Geometry, body, frames: bool, chunk, n_tiles: int,
            tail: int = 0, carried: bool = False, order=None):
        """``body(h, q_frame, t, local, rows, ordered)`` over the ``n_tiles`` query tiles t =
        ``chunk slots + local`` of a chunk (``rows`` rows; the last one ``tail`` rows when ``tail``:
        the partial last tile) of every member head h: compiled loops (``carried``: see
        :func:`port.loop`) over ``tiles.BSP_BWD_STAGE_TILES`` full tiles at a time (unrolled
        in the body: each has its own buffers, so their DMA latencies overlap), a static
        remainder and the partial tile. ``frames``: pass the head's :class:`RowFrame` (else
        None). With the tiles reordered, t is column ``local`` of ``order`` (fp32 ``[128,
        n_tiles]``: the chunk's row of the host's order on every partition), the tile's first
        row (data), and ``ordered`` True, but for the partial last tile, which the order
        keeps last (t its index, as in natural order)."""
        f = cfg.f
        full = n_tiles - (1 if tail else 0)
        u = max(1, min(T.BSP_BWD_STAGE_TILES, full))
        t0 = chunk * self.slots

        def tile(local):
            return order[:, nl.ds(local, 1)] if self.reordered else t0 + local

        def head(h):
            q_frame = RowFrame.of(f.q, (f.b, f.head(h)), geo.indices) if frames else None

            def group(c):
                for j in T.unrolled(u):
                    body(h, q_frame, tile(c * u + j), c * u + j, P, self.reordered)

            port.loop(full // u, group, carried=carried)
            for j in T.unrolled(full % u):
                local = (full // u) * u + j
                body(h, q_frame, tile(local), local, P, self.reordered)
            if tail:
                body(h, q_frame, t0 + full, full, tail, False)

        port.loop(f.G, head, carried=carried)


def _dq_product(f: F.Instance, ds, k_mm):
    """``dS K`` ``[128 queries, D]`` in a fresh PSUM group: dS^T by a TensorE transpose (dQ
    contracts over the keys), copied out of PSUM by ScalarE (VectorE has the pair's dS
    multiply and dQ add)."""
    tp = nl.ndarray((P, P), dtype=f.transpose_psum_dtype(f.mm), buffer=nl.psum)
    port.nc_transpose(tp, ds)
    dsT = nl.ndarray((P, P), dtype=f.mm, buffer=nl.sbuf)
    port.activation(dsT, nl.copy, tp)
    dq_ps = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.psum)
    port.nc_matmul(dq_ps, dsT, k_mm)
    return dq_ps


def _transposed(f: F.Instance, x, scale: float = 1.0, into=None):
    """``x^T`` ``[d, 128]`` per head-dim pass of a ``[128, D]`` tile, at matmul dtype (TensorE
    transpose, ScalarE copy out of PSUM with ``scale``), into new tiles or the views ``into``
    (one per pass)."""
    out = []
    for pi, (d0, rows) in enumerate(f.d_passes):
        tp = nl.ndarray((rows, P), dtype=f.transpose_psum_dtype(x.dtype), buffer=nl.psum)
        port.nc_transpose(tp, x[:, d0:d0 + rows])
        t = nl.ndarray((rows, P), dtype=f.mm, buffer=nl.sbuf) if into is None else into[pi]
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


def _key_side(cfg: _Cfg, idx, skip: bool):
    """Gather a key block's rows (indices ``idx`` ``[128, 1]``, rows of ``k[b, g]``'s frame):
    ``K^T``, ``V^T`` per pass and K natural (matmul dtype)."""
    f = cfg.f
    kx = nl.ndarray((P, f.D), dtype=f.k.dtype, buffer=nl.sbuf)
    gather(kx, f.k, (f.b, f.g), idx, 0, skip)
    vx = nl.ndarray((P, f.D), dtype=f.v.dtype, buffer=nl.sbuf)
    gather(vx, f.v, (f.b, f.g), idx, 0, skip)
    # non-finite entries zeroed in the dP and dQ operands, not in K^T (backward.load_kv_tile)
    M.zero_non_finite(vx)
    kT = _transposed(f, kx)
    M.zero_non_finite(kx)
    return kT, _transposed(f, vx), _as_mm(f, kx)


def _pair(cfg: _Cfg, geo: Geometry, qT, doT, kT, vT, neg_lse, neg_delta, key_thr, hi, lo,
          seed, h=None, dist=None):
    """One block pair: ``(p_dv, ds)`` at matmul dtype, ``[128 queries, 128 keys]``: ``P Z /
    (1 - p)`` (``P`` without dropout) and ``dS = P (dP Z / (1 - p) - delta)`` with ``P =
    exp(S - lse)`` on the masked scores (``key_thr``, ``hi``, ``lo``: the indicator's columns,
    or None) and ``dP = dO V^T`` (``neg_lse``, ``neg_delta``: the rows' ``-lse``, clamped, and
    ``-delta``). ``seed``: the unit's int32 [1, 1] dropout seed or None.
    Score modifiers (``score_mods.modify_scores``, member head ``h``; ``dist``: ALiBi's
    distance tile, :meth:`Geometry.distance_tile`): ``S`` modified first, and with
    soft-capping ``dS`` times ``1 - tanh^2``.

    P leaves the exp at matmul dtype (the dV operand as it is, without dropout). Without
    dropout and soft-capping ``dP - delta`` is formed by ScalarE as it copies dP out of PSUM
    (a per-row bias) and VectorE does one multiply of two matmul-dtype tiles, as the dense
    backward (``backward.softmax_backward``); otherwise one VectorE pass over fp32 operands."""
    f = cfg.f
    s = F.contract(list(zip(qT, kT)), (P, P))
    y, g = s, None
    if cfg.mods.transforms:
        y, t = SM.modify_scores(cfg.mods, cfg.cols, s, P, P, h, None, 1.0 / cfg.unit,
                                not SM.one_sided(f.spec), dist=dist)
        if t is not None:
            g = SM.softcap_grad_factor(t, P, P)
    p = nl.ndarray((P, P), dtype=f.mm, buffer=nl.sbuf)
    port.activation(p, nl.exp, y, bias=neg_lse, scale=cfg.unit)
    # masked scores by selection (P = 0), so a non-finite hidden key never reaches a row
    ind = nl.ndarray((P, P), dtype=nl.uint8, buffer=nl.sbuf)
    masked = geo.indicator(key_thr, hi, lo, out=ind)
    if masked:
        port.tensor_copy_predicated(p, 0.0, ind)
    dp = F.contract(list(zip(doT, vT)), (P, P))
    ds = nl.ndarray((P, P), dtype=f.mm, buffer=nl.sbuf)
    if not cfg.dropout_p and g is None:
        dpd = nl.ndarray((P, P), dtype=f.mm, buffer=nl.sbuf)
        port.activation(dpd, nl.copy, dp, bias=neg_delta)
        port.tensor_tensor(ds, dpd, p, nl.multiply)
        return p, ds
    p_dv, dpz = p, dp
    if cfg.dropout_p:
        port.random_seed(seed)
        keep = nl.ndarray((P, P), dtype=f.drop.ones.dtype, buffer=nl.sbuf)
        port.dropout(keep, f.drop.ones, cfg.dropout_p)              # 0/1, the forward's draw
        z = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(z, keep, nl.multiply, 1.0 / (1.0 - cfg.dropout_p))
        p_dv = nl.ndarray((P, P), dtype=f.mm, buffer=nl.sbuf)
        port.tensor_tensor(p_dv, p, z, nl.multiply)
        dpz = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(dpz, dp, z, nl.multiply)
    pg = p
    if g is not None:
        # P (1 - t^2), deselected where masked (a hidden non-finite score's tanh is NaN)
        pg = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(pg, p, g, nl.multiply, engine="gpsimd")
        if masked:
            port.tensor_copy_predicated(pg, 0.0, ind)
    port.scalar_tensor_tensor(ds, dpz, nl.add, neg_delta, nl.multiply, pg)
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


def _rowsum(dx, ox, d):
    """``d = rowsum(dO * O)`` (fp32 ``[rows, 1]``) of the ``[rows, D]`` tiles dO and O
    (VectorE)."""
    prod = nl.ndarray(tuple(dx.shape), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(prod, dx, ox, nl.multiply)
    port.tensor_reduce(d, nl.add, prod, axis=(1,))


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


def _row_counts(f: F.Instance, meta_k, first, count: int):
    """nki.*: int32 ``[1, (G or 1) count]``, the counts of the key blocks at table rows
    ``first .. first + count - 1`` (``first`` an index expression: a class of a chunk; of each
    member head with a per-head table, ``count`` columns each), read once for a class: a
    block's register trip count (:meth:`block_sparse.Row.slot_loop`) then waits for a value
    written long before, not for the block's own table row (each register load holds every
    engine until its value is written, ``simulate._sched.register_wait``). The DMA casts the
    fp32 table (exact)."""
    hb = f.b if meta_k.shape[0] > 1 else 0
    per_head = meta_k.shape[1] > 1
    heads = f.G if per_head else 1
    out = nl.ndarray((1, heads * count), dtype=nl.int32, buffer=nl.sbuf)
    port.loop(heads, lambda h: port.dma_copy(
        out[0:1, nl.ds(h * count, count)],
        meta_k[hb, f.head(h) if per_head else 0, nl.ds(first, count), 1:2].permute((1, 0))))
    return out


def _places(cfg: _Cfg, hb, head, pos, trip: int):
    """With the query tiles reordered, fp32 ``[1, trip]``: row ``pos`` of head ``head``'s
    ``slots_k`` (the entries' places in their chunk, :meth:`_Resident.blocks`); else None."""
    if cfg.slots_k is None:
        return None
    out = nl.ndarray((1, trip), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(out, cfg.slots_k[hb, head, nl.ds(pos, 1), 0:trip], legacy_isa=True)
    return out


def _key_block(cfg: _Cfg, geo: Geometry, meta_k, res: "_Resident", chunk, step: str, r,
               trip: int, exact: bool, counts=None, flags=None):
    """dK, dV of the key block at order position ``r`` of chunk ``chunk`` (table row ``chunk
    nkt + r``; phase 2 of the module docstring; ``step``: ``"first"``, ``"mid"`` or
    ``"last"`` chunk, one chunk being the last) over its pairs with
    the chunk's staged query tiles (``res``), accumulated in PSUM, and each pair's ``dS K``
    into its query tile's dQ accumulator; the block's dK, dV stored, with several chunks
    through the fp32 scratch (legacy :func:`_add_partial`, nki.* :func:`_accumulate`).
    ``counts``: ``(table, column of r)`` of :func:`_row_counts` (nki.*, rows with padding
    slots), else None; ``flags``: ``(table, column of r)`` of :func:`_acc_flags` (nki.*,
    several chunks), else None."""
    f = cfg.f
    pos = chunk * T.ceil_div(f.Nk, P) + r
    hb = f.b if meta_k.shape[0] > 1 else 0
    per_head = meta_k.shape[1] > 1
    # the first member head's row (every head of the group has the block at pos); it is
    # every head's row when the table has one head or the group one member
    head0 = f.g * f.G if per_head else 0
    row0 = nl.ndarray((1, 2 + trip), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(row0, meta_k[hb, head0, nl.ds(pos, 1), 0:2 + trip], legacy_isa=True)
    shared_row = not per_head or f.G == 1
    bc0 = M.broadcast_row(row0, 2 + trip if shared_row and trip else 1)
    k_first = bc0[:, 0:1]
    k_pos = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(k_pos, k_first, nl.add, geo.part)
    out_idx = rows_at(k_pos, f.Nk, geo.kv)
    if not trip:
        zeros = nl.ndarray((P, f.D), dtype=cfg.dk.dtype, buffer=nl.sbuf)
        port.memset(zeros, 0.0, engine="gpsimd")
        scatter(cfg.dk, (f.b, f.g), out_idx, zeros)
        scatter(cfg.dv, (f.b, f.g), out_idx, zeros)
        return
    regs = None
    if flags is not None:
        # the block's trip counts (0 or 1) of its sums' steps (:func:`_accumulate`)
        table, col = flags
        n = table.shape[1] // 4
        regs = [port.register(table[0:1, nl.ds(k * n + col, 1)]) for k in T.unrolled(4)]
    # zeros the slot loop's accumulate=True matmuls add onto: in nki.* a group a matmul of
    # the instance's zero row opened (no fill first), in legacy a zero fill
    dk_ps = port.group_alloc()((P, f.D), dtype=nl.float32, buffer=nl.psum)
    dv_ps = port.group_alloc()((P, f.D), dtype=nl.float32, buffer=nl.psum)
    port.open_group(dk_ps, cfg.zero_row)
    port.open_group(dv_ps, cfg.zero_row)
    skip = cfg.need_mask(geo, exact)
    # keys at or past kv_len are not read (without lengths: the partial last block's)
    k_idx = rows_at(k_pos, geo.kv_len, geo.kv) if geo.has_lens else out_idx
    if cfg.acc_k is not None and step == "last" and shared_row:
        # nki.*: the last chunk reads K, V only for the blocks it meets (count > 0; the
        # other blocks' outputs are their earlier sums)
        unmet = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(unmet, bc0[:, 1:2], nl.less_equal, 0.0, op1=nl.multiply,
                           operand1=float(T.BSP_PAD_FIRST))
        met_pos = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(met_pos, unmet, k_pos, nl.add)
        k_idx = rows_at(met_pos, geo.kv_len if geo.has_lens else f.Nk, geo.kv)
    # with several chunks a row may name no block (pushed past Nk): nothing read
    kT, vT, k_mm = _key_side(cfg, k_idx, geo.has_lens or f.Nk % P != 0
                             or cfg.scratch is not None)
    key_thr0 = None
    if skip:
        key_thr0 = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(key_thr0, geo.kv_len, k_first, nl.subtract)
    big = float(2 * P + f.Nk + f.Nq)
    places0 = _places(cfg, hb, head0, pos, trip) if shared_row else None

    def head(h):
        if shared_row:
            row = row0
        else:
            row = nl.ndarray((1, 2 + trip), dtype=nl.float32, buffer=nl.sbuf)
            port.dma_copy(row, meta_k[hb, f.head(h), nl.ds(pos, 1), 0:2 + trip],
                          legacy_isa=True)
        # the staged tiles are read at the entries' blocks, not gathered
        rw = Row(row, trip, geo.part, geo.q_len, None, bc=bc0 if shared_row else None)
        hi = lo = thr = gap = None
        if skip or cfg.mods.alibi:
            gap = nl.ndarray((P, trip), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(gap, rw.block_first, nl.subtract, k_first, op1=nl.multiply,
                               operand1=-1.0)
        if skip:
            # a query row not read (padding slot, past q_len) masks every key
            thr = nl.ndarray((P, trip), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(thr, rw.bad, nl.multiply, -big, op1=nl.add, operand1=key_thr0)
            hi, lo = geo.band_columns(gap)
        dist = geo.distance_columns(gap) if cfg.mods.alibi else None
        seeds = (unit_seeds(f, f.head(h), rw.bc[0:1, 2:2 + trip], rw.bc[0:1, 0:1])
                 if cfg.dropout_p else None)
        places = places0 if shared_row else _places(cfg, hb, f.head(h), pos, trip)
        blocks = res.blocks(f, geo, rw, h, chunk, places)

        def slot(sl):
            q_mm, do_mm, qT, doT, neg_lse, neg_delta, acc = res.tile(f, blocks, sl)
            p_dv, ds = _pair(cfg, geo, qT, doT, kT, vT, neg_lse, neg_delta,
                             *_slot(sl, seeds, thr, hi, lo), h=h,
                             dist=None if dist is None else geo.distance_tile(dist, sl, 1))
            port.nc_matmul(dv_ps, p_dv, do_mm, accumulate=True)
            port.nc_matmul(dk_ps, ds, q_mm, accumulate=True)
            res.add_dq(acc, _dq_product(f, ds, k_mm))

        count = None
        if counts is not None:
            table, col = counts
            n = table.shape[1] // (f.G if per_head else 1)
            count = table[0:1, nl.ds(h * n + col if per_head else col, 1)]
        rw.slot_loop(exact, slot, count)

    port.loop(f.G, head, carried=True)
    # ScalarE copies out of PSUM (VectorE has the pairs' dS and dQ work)
    for out, ps, factor, part in ((cfg.dk, dk_ps, cfg.scale, 0), (cfg.dv, dv_ps, 1.0, 1)):
        if cfg.scratch is None:
            done = nl.ndarray((P, f.D), dtype=out.dtype, buffer=nl.sbuf)
            port.activation(done, nl.copy, ps, scale=factor)
        elif flags is not None:
            _accumulate(cfg, part, r, ps, factor, regs, out, out_idx)
            continue
        else:
            done = _add_partial(cfg, part, r, ps, factor, step != "first",
                                out.dtype if step == "last" else None)
            if done is None:
                continue
        scatter(out, (f.b, f.g), out_idx, done)


def _acc_flags(f: F.Instance, acc_k, first, count: int):
    """nki.*, several chunks: int32 ``[1, 4 count]``, column block k (``k count ..``) the
    host's step k (``acc_k``, :func:`host.block_sparse._accumulator_steps`: write, add,
    finish with or without the earlier sums) of the key blocks at table rows ``first ..
    first + count - 1`` (a class of a chunk), 0 or 1. Read once per class, as
    :func:`_row_counts`: the blocks' register trip counts wait for values written long
    before. The DMA casts the fp32 table (exact)."""
    hb = f.b if acc_k.shape[0] > 1 else 0
    g = f.g if acc_k.shape[1] > 1 else 0
    out = nl.ndarray((1, 4 * count), dtype=nl.int32, buffer=nl.sbuf)
    for k in T.unrolled(4):
        port.dma_copy(out[0:1, k * count:(k + 1) * count],
                      acc_k[hb, g, nl.ds(first, count), k:k + 1].permute((1, 0)))
    return out


def _met(flags, count: int):
    """nki.*, a chunk before the last: int32 ``[1, count]``, 1 for the key blocks of a class
    (``flags``: :func:`_acc_flags`) that the chunk meets -- one of a met block's four steps
    is set, none of an unmet one's -- else 0: the trip count of a block's whole sweep
    (:func:`_when_met`). GpSimd, three ``[1, count]`` int32 adds."""
    out = nl.ndarray((1, count), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_tensor(out, flags[0:1, 0:count], flags[0:1, count:2 * count], nl.add,
                       engine="gpsimd")
    for k in T.unrolled(2):
        total = nl.ndarray((1, count), dtype=nl.int32, buffer=nl.sbuf)
        port.tensor_tensor(total, out, flags[0:1, (k + 2) * count:(k + 3) * count], nl.add,
                           engine="gpsimd")
        out = total
    return out


def _when_met(runs, r, body):
    """``body()``, with ``runs`` (:func:`_met`) under a runtime trip count of 0 or 1, its
    column r: before the last chunk a key block the chunk does not meet (its table row
    pushed past every sequence, its sums untouched) then costs nothing, where its sweep
    would still transpose and copy a zero K/V block."""
    if runs is None:
        body()
        return
    port.loop_between(0, port.register(runs[0:1, nl.ds(r, 1)]), lambda _: body())


def _accumulate(cfg: _Cfg, part: int, r, ps, factor: float, regs, out, out_idx):
    """nki.* with several chunks: this chunk's step with ``factor ps`` (a key block's dK or
    dV sums of this chunk, PSUM ``[128, D]``) and ``scratch[part]``, the fp32 sums at the
    block's order position r (static addresses: the blocks' transfers are independent DMAs),
    each a runtime loop of trip 0 or 1 (``regs``: registers of :func:`_acc_flags`), so only
    the chunks that meet a block move its sums, and a block one chunk meets never leaves
    it: 0. written by the first meeting chunk (unless it is the last); 1. added to by a
    middle one (read back, added on GpSimd, written: ``nisa.dma_compute`` would add in the DMA
    engines, but without an indirect operand it takes compile-time addresses only, and r is
    a runtime loop index; its scatter form orders every block's RMW behind the others in
    the simulator); 2. or 3. the
    block's last meeting chunk (for a block no chunk meets, the last chunk) adds the earlier
    sums read back (2; a plain DMA that need not wait for this chunk's sums) or none (3), at
    ``out``'s dtype (GpSimd), and stores the block's rows of ``out`` (``out_idx``). ScalarE
    copies out of PSUM (VectorE has the pairs' dS and dQ work)."""
    f = cfg.f
    rows = cfg.scratch[part][nl.ds(r * P, P), :]
    new = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.sbuf)
    port.activation(new, nl.copy, ps, scale=factor)
    port.loop_between(0, regs[0], lambda _: port.dma_copy(rows, new))

    def add():
        prev = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.sbuf)
        port.dma_copy(prev, rows)
        total = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(total, prev, new, nl.add, engine="gpsimd")
        port.dma_copy(rows, total)

    port.loop_between(0, regs[1], lambda _: add())

    def finish(read: bool):
        total = nl.ndarray((P, f.D), dtype=out.dtype, buffer=nl.sbuf)
        if read:
            prev = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.sbuf)
            port.dma_copy(prev, rows)
            port.tensor_tensor(total, prev, new, nl.add, engine="gpsimd")
        else:
            port.tensor_copy(total, new, engine="gpsimd")
        scatter(out, (f.b, f.g), out_idx, total)

    port.loop_between(0, regs[2], lambda _: finish(True))
    port.loop_between(0, regs[3], lambda _: finish(False))


def _add_partial(cfg: _Cfg, part: int, r, ps, factor: float, read: bool, out_dtype):
    """Legacy with several chunks: ``factor ps`` (a key block's dK or dV sums of this chunk,
    PSUM ``[128, D]``) plus, with ``read``, the sums of the earlier chunks, held in rows
    ``128 r ..`` of ``scratch[part]`` (the block's order position r, the same in every
    chunk: a static address, so the read-add-writes of different blocks are independent
    DMAs). Before the last chunk (``out_dtype`` None) the fp32 total is written there and
    None returned (the first chunk writes every row a later one reads: each lists the same
    rows); in it the total at ``out_dtype`` is returned (the block's output). ScalarE
    copies out of PSUM and GpSimd adds (VectorE has the pairs' dS and dQ work)."""
    f = cfg.f
    rows = cfg.scratch[part][nl.ds(r * P, P), :]
    new = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.sbuf)
    port.activation(new, nl.copy, ps, scale=factor)
    if not read:
        port.dma_copy(rows, new)
        return None
    prev = nl.ndarray((P, f.D), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(prev, rows)
    total = nl.ndarray((P, f.D), dtype=nl.float32 if out_dtype is None else out_dtype,
                       buffer=nl.sbuf)
    port.tensor_tensor(total, prev, new, nl.add, engine="gpsimd")
    if out_dtype is not None:
        return total
    port.dma_copy(rows, total)
    return None


@port.jit
def block_sparse_attention_bwd(q, k, v, o, do, lse, meta_k, kv_lens=None, q_lens=None,
                               seed=None, alibi_slopes=None, sinks=None, acc_k=None,
                               order_q=None, slots_k=None, *,
                               classes_k,
                               chunk_tiles, scale=1.0, causal=None, window=None,
                               mm_dtype="bfloat16", dropout_p=0.0, softcap=None):
    """Gradients ``(dq, dk, dv)`` of the block-sparse forward, over the instances ``(B, Hkv)``
    (as the forward: :func:`port.for_programs`).

    ``chunk_tiles``: query tiles per head and chunk (``tiles.bsp_bwd_chunks``; the chunks
    are ``ceil(ceil(Nq / 128) / chunk_tiles)``). ``meta_k``/``classes_k``: the transposed
    pattern's tables (key blocks and their query tiles), one per chunk,
    ``(B or 1, Hq or 1, chunks ceil(Nk/128), 2 + trip)``: rows ``c nkt ..`` those of chunk c
    (its query tiles only), in one order per (kv group, chunk), the classes common to all
    (``host.block_sparse.launch_tables``). ``acc_k``: under nki.* with several chunks (and
    only then) the steps of the dK/dV sums, ``(B or 1, Hkv or 1, chunks ceil(Nk/128), 4)``
    fp32
    (``LaunchTables.acc_k``). ``order_q``, ``slots_k`` (both or neither; ``LaunchTables``):
    the query tiles reordered, ``order_q`` ``(B or 1, Hkv or 1, ceil(Nq / 128))`` fp32 the
    first rows of the kv group's tiles in processing order (chunk c: positions ``c
    chunk_tiles ..``), ``slots_k`` ``meta_k.shape[:3] + (trip,)`` fp32 each entry's place in
    its chunk (``chunk_tiles`` for padding); the table entries keep the tiles' own
    positions (the masks'). Other arguments as the forward; o and lse are the
    forward's outputs, do the gradient of o. Score modifiers as the forward's (``softcap``,
    ``alibi_slopes``, ``sinks``; ``score_mods.py``): with sinks also ``dsinks`` ``(B, Hq)``
    float32, each sequence's ``-sum_i exp(sink - lse_i) D_i``. Rows or dropout units that
    may reach 2^24 are numbered in int32 under nki.*, as the forward.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    nqt, nkt = T.ceil_div(Nq, P), T.ceil_div(Nk, P)
    T.check_chunk_tiles(chunk_tiles, nqt)
    chunks = T.ceil_div(nqt, chunk_tiles)
    if meta_k.shape[2] != chunks * nkt:
        raise ValueError(f"meta_k: expected {chunks} x {nkt} rows ({chunks} chunks of "
                         f"{chunk_tiles} query tiles), got shape {meta_k.shape}")
    check_classes(classes_k, nkt, meta_k.shape[3] - 2)
    nki_acc = chunks > 1 and port.api() == "nki"
    if nki_acc and (acc_k is None or tuple(acc_k.shape[2:]) != (chunks * nkt, 4)
                    or acc_k.shape[0] not in (1, B) or acc_k.shape[1] not in (1, Hkv)):
        raise ValueError(f"acc_k: nki.* with {chunks} chunks needs the accumulator steps "
                         f"(B or 1, Hkv or 1, {chunks * nkt}, 4) (LaunchTables.acc_k), got "
                         f"{None if acc_k is None else tuple(acc_k.shape)}")
    if not nki_acc and acc_k is not None:
        raise ValueError(f"acc_k: read only by the nki.* backward with several chunks; this "
                         f"is {chunks} chunk(s) through {port.api()}: pass None")
    reordered = order_q is not None
    trip_max = meta_k.shape[3] - 2
    if reordered != (slots_k is not None) or reordered and (
            tuple(slots_k.shape) != tuple(meta_k.shape[:3]) + (trip_max,)
            or order_q.shape[0] not in (1, B) or order_q.shape[1] not in (1, Hkv)
            or order_q.shape[2] != nqt):
        raise ValueError(f"order_q, slots_k: both or neither, (B or 1, Hkv or 1, {nqt}) and "
                         f"{tuple(meta_k.shape[:3]) + (trip_max,)} (LaunchTables); got "
                         f"{None if order_q is None else tuple(order_q.shape)} and "
                         f"{None if slots_k is None else tuple(slots_k.shape)}")
    int_rows = exact_indices(max(B * Hq * Nq, B * Hkv * Nk),
                             B * Hq * nqt * nkt if dropout_p else 0)
    if dropout_p and seed is None:
        raise ValueError("dropout_p > 0 needs the seed tensor (HBM (1,) int32)")
    mods = SM.check_mods(softcap, alibi_slopes, sinks)
    extras = (mods != SM.Mods() or bool(dropout_p) or kv_lens is not None
              or q_lens is not None)
    target = "trn2" if port.gen3() else "trn1"
    need = T.bsp_bwd_chunk_bytes(G, chunk_tiles, D, 4 if mm_dtype == "float32" else 2, extras,
                                 chunks > 1)
    if need > T.BWD_SBUF_BUDGET_BYTES[target]:
        raise ValueError(f"chunk_tiles: {chunk_tiles} query tiles of {G} heads need {need} "
                         f"bytes per partition, more than {target}'s budget "
                         f"{T.BWD_SBUF_BUDGET_BYTES[target]} (tiles.bsp_bwd_chunks)")
    spec = M.MaskSpec(Nq, Nk, causal, window, q_lens is not None, kv_lens is not None,
                      mods.alibi)
    dq = nl.ndarray((B, Hq, Nq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    dsinks = (nl.ndarray((B, Hq), dtype=nl.float32, buffer=nl.shared_hbm) if mods.sinks
              else None)
    dk = nl.ndarray((B, Hkv, Nk, D), dtype=q.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray((B, Hkv, Nk, D), dtype=q.dtype, buffer=nl.shared_hbm)
    # several chunks: each program's fp32 dK, dV partial sums (its instances run one after
    # another; each one's first chunk writes them, no zeroing)
    scratch = ((nl.ndarray((nkt * P, D), dtype=nl.float32, buffer=nl.hbm),
                nl.ndarray((nkt * P, D), dtype=nl.float32, buffer=nl.hbm)) if chunks > 1
               else None)
    tiles = T.ForwardTiles(q_tile=P, kv_resident=False)
    # loop indices as data (0.7): batch, heads, chunks and the staged query tiles
    indices = port.OffsetColumns(0, max(B, Hq, nqt), 1, exact=int_rows)
    tail = Nq % P

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
        cfg = _Cfg(f, do, dq, dk, dv, scratch, score, dsink_acc, acc_k, slots_k)
        geo = Geometry(spec, kv_lens, q_lens, k, b, g, Nq, Nk, indices)
        res = _Resident(f, chunk_tiles, reordered)

        def chunk(ci, n_tiles: int, last_tail: int, step: str):
            """1. stage the chunk's query tiles, delta included; 2. dK, dV (partial sums
            with several chunks) and dQ, one key-major sweep over the chunk's key blocks;
            3. dQ out. Reordered: the chunk's tiles are the host's order's (its first rows on
            every partition, ``order``), gathered, and stored at their rows."""
            order = None
            if reordered:
                row = nl.ndarray((1, n_tiles), dtype=nl.float32, buffer=nl.sbuf)
                port.dma_copy(row, order_q[f.b if order_q.shape[0] > 1 else 0,
                                           nl.ds(f.g if order_q.shape[1] > 1 else 0, 1),
                                           nl.ds(ci * chunk_tiles, n_tiles)], legacy_isa=True)
                order = M.broadcast_row(row, n_tiles)
            res.run(cfg, geo, lambda *args: res.stage(cfg, geo, *args),
                    q_lens is not None or reordered, ci, n_tiles, last_tail,
                    carried=mods.sinks, order=order)
            for first, count, trip, exact in classes_k:
                if not trip and step != "last":
                    continue                    # no pair in any chunk: zeros at the last
                counts = (_row_counts(f, meta_k, ci * nkt + first, count)
                          if trip and not exact and port.api() == "nki" else None)
                flags = (_acc_flags(f, acc_k, ci * nkt + first, count)
                         if trip and acc_k is not None else None)
                runs = _met(flags, count) if flags is not None and step != "last" else None
                port.loop(count, lambda r, first=first, trip=trip, exact=exact,
                          counts=counts, flags=flags, runs=runs: _when_met(
                              runs, r, lambda: _key_block(
                                  cfg, geo, meta_k, res, ci, step, first + r, trip, exact,
                                  None if counts is None else (counts, r),
                                  None if flags is None else (flags, r))),
                          carried=True)
            res.run(cfg, geo, lambda *args: res.write_dq(cfg, geo, *args), reordered, ci,
                    n_tiles, last_tail, order=order)

        # every chunk but the last holds chunk_tiles full tiles; the last the rest. The first
        # writes the scratch, the middle ones read-add-write it, the last reads it
        if chunks > 1:
            chunk(0, chunk_tiles, 0, "first")
        if chunks > 2:
            port.loop(chunks - 1, lambda ci: chunk(ci, chunk_tiles, 0, "mid"), carried=True,
                      start=1)
        chunk(chunks - 1, nqt - (chunks - 1) * chunk_tiles, tail, "last")
        if mods.sinks:
            store_dsinks(f, cfg.dsink_acc, dsinks)

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
