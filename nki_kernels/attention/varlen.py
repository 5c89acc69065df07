"""Packed variable-length flash attention forward (FlashAttention's ``varlen``).

Sequences are packed along the row axis of one batch: q ``(1, Hq, total_q, D)``, k and v
``(1, Hkv, total_k, D)``, and int32 offsets ``cu_seqlens_q``/``cu_seqlens_k`` ``(S + 1,)``:
sequence s owns query rows ``[cu_q[s], cu_q[s+1])`` and keys ``[cu_k[s], cu_k[s+1])``. The
offsets are device data: one compilation serves every packing with the same totals and S.

Each row sees a contiguous key range. For row i of sequence s, with the alignment offset
``off = cu_k[s+1] - cu_q[s+1]`` (bottom_right) or ``cu_k[s] - cu_q[s]`` (top_left) and the
band bounds ``lo``/``hi`` of ``j - i - off`` (``masks.MaskSpec``: causal, window)::

    first_i = max(cu_k[s], i + off + lo)       last_i = min(cu_k[s+1] - 1, i + off + hi)

(an unbounded side drops its term). A row with ``first_i > last_i`` sees nothing: o = 0,
lse = -inf. The columns are computed on chip per query tile from the offsets broadcast on every
partition: ``cu_q[s] <= i`` selects the sequences starting at or before the row, and since the
offsets do not decrease, the row's ``cu_k[s]`` (and the other offsets) is the maximum of the
selected ones (a compare-and-multiply, then a max-reduction; a sequence with no query rows
starts where the next one does, so the last selected sequence is the row's own).

Per query tile (128 rows, every query head of the kv group at once; one loop body)::

    first, last columns of the tile's rows (O(S) VectorE work)
    kb0 = min first, n = ceil((max last + 1 - kb0) / 512)   transposes + reductions, on chip
    gather Q rows of each head; Q^T by TensorE
    for step in loop(0, n):                    a runtime trip count (nki.*: a register bound)
        gather K, V rows kb0 + 512 step + [0, 512) (rows past total_k skipped, zero)
        K^T by TensorE; for each head: S = Q K^T (one PSUM bank), scores outside
        [first_i, last_i] selected to MASK_NEG, online-softmax update (forward.fold_block)
    O, LSE of each head scattered to the tile's rows (rows past total_q skipped)

Keys of other sequences inside the step window are masked like causal ones; tiles never
sweep keys outside ``[min first, max last]``, so the work of a packed batch is that of its
sequences (plus what their tiles share at sequence boundaries).

One source, two namespaces (:mod:`nki_kernels.port`): under nki.* (NKI 0.7) the step loop's
trip count ``n`` is a ``VirtualRegister`` loaded from SBUF (:func:`port.loop_between`). Legacy
NKI has no runtime trip count, so its loop runs the static worst case, ``ceil(total_k / 512)``
steps from ``kb0`` (the extra steps gather nothing and are masked): correct, dense in cost.
The gathers address K/V and Q rows as block-sparse's do (:class:`block_sparse.RowFrame`).

Positions are fp32 on chip: totals below 2^24 (refused otherwise).
"""
from __future__ import annotations

from typing import NamedTuple

from nki_kernels import port
from nki_kernels import tiles as T
from nki_kernels.attention import block_sparse as BS
from nki_kernels.attention import forward as F
from nki_kernels.attention import masks as M
from nki_kernels.port import nl

P = T.PMAX
W = T.VARLEN_STEP_KEYS


class Offsets(NamedTuple):
    """The packing's offsets on every partition (fp32 ``[128, S + 1]`` each, loaded once per
    program), ``S`` the number of sequences, and the constant iota tiles the masks compare
    against: ``part`` (p, ``[128, 1]``), ``cols`` (c, ``[128, W]``), ``keys`` (``128 w + p``,
    ``[128, W / 128]``: a step's key of partition p, block w)."""
    cu_q: object
    cu_k: object
    S: int
    part: object
    cols: object
    keys: object


def load_offsets(cu_seqlens_q, cu_seqlens_k) -> Offsets:
    """Both int32 ``(S + 1,)`` offset vectors as fp32 on every partition (a K=1 matmul each,
    exact below 2^24), and the iota tiles."""
    n = cu_seqlens_q.shape[0]
    out = []
    for cu in (cu_seqlens_q, cu_seqlens_k):
        raw = nl.ndarray((1, n), dtype=nl.int32, buffer=nl.sbuf)
        port.dma_copy(raw, cu.reshape((1, n)))
        row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(row, raw, engine="gpsimd")
        out.append(M.broadcast_row(row, n))
    part = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(part, [[0, 1]], channel_multiplier=1)
    cols = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(cols, [[1, W]])
    keys = nl.ndarray((P, W // P), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(keys, [[P, W // P]], channel_multiplier=1)
    return Offsets(out[0], out[1], n - 1, part, cols, keys)


def _row_offset(off: Offsets, started, table, col0: int):
    """fp32 ``[128, 1]``: per row, ``table[s + col0]`` of the row's sequence s -- the largest
    over the sequences started at or before the row (``started``: 1.0/0.0 ``[128, S]``)."""
    sel = nl.ndarray((P, off.S), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(sel, started, table[:, col0:col0 + off.S], nl.multiply)
    out = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_reduce(out, nl.maximum, sel, axis=1)
    return out


def row_bounds(off: Offsets, spec: M.MaskSpec, pos):
    """fp32 ``[128, 2]``: ``first_i``, ``last_i`` of the rows at positions ``pos`` (fp32
    ``[128, 1]``; module docstring)."""
    started = nl.ndarray((P, off.S), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(started, off.cu_q[:, 0:off.S], nl.less_equal, pos)
    k_first = _row_offset(off, started, off.cu_k, 0)
    k_end = _row_offset(off, started, off.cu_k, 1)
    bounds = nl.ndarray((P, 2), dtype=nl.float32, buffer=nl.sbuf)
    # last key of the sequence: cu_k[s+1] - 1
    port.tensor_scalar(bounds[:, 1:2], k_end, nl.subtract, 1.0)
    if not spec.has_diag:
        port.tensor_copy(bounds[:, 0:1], k_first, engine="gpsimd")
        return bounds
    # the row's diagonal key i + off
    if spec.top_left:
        q_ref = _row_offset(off, started, off.cu_q, 0)
        k_ref = k_first
    else:
        q_ref = _row_offset(off, started, off.cu_q, 1)
        k_ref = k_end
    shift = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(shift, k_ref, q_ref, nl.subtract)
    diag = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(diag, pos, shift, nl.add)
    if spec.lo is None:
        port.tensor_copy(bounds[:, 0:1], k_first, engine="gpsimd")
    else:
        port.scalar_tensor_tensor(bounds[:, 0:1], diag, nl.add, float(spec.lo), nl.maximum,
                                  k_first)
    if spec.hi is not None:
        port.scalar_tensor_tensor(bounds[:, 1:2], diag, nl.add, float(spec.hi), nl.minimum,
                                  bounds[:, 1:2])
    return bounds


def tile_sweep(bounds, ident):
    """``(kb0, n)``: fp32 ``[128, 1]`` the tile's first key ``min first_i`` on every partition
    and int32 ``[1, 1]`` its step count ``max(0, ceil((max last_i + 1 - kb0) / W))``.
    Cross-partition: a TensorE transpose of ``(first, -last)``, a min-reduction along the free
    axis, and a ones matmul that spreads the two results to every partition (``ident``: fp32
    ``[2, 2]`` identity, which places each on its own column)."""
    neg = nl.ndarray((P, 2), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(neg[:, 0:1], bounds[:, 0:1], engine="gpsimd")
    port.tensor_scalar(neg[:, 1:2], bounds[:, 1:2], nl.multiply, -1.0, engine="gpsimd")
    tp = nl.ndarray((2, P), dtype=nl.float32, buffer=nl.psum)
    port.nc_transpose(tp, neg)
    red = nl.ndarray((2, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_reduce(red, nl.minimum, tp, axis=1)
    diag = nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(diag, ident, nl.multiply, red)
    ones = nl.ndarray((2, P), dtype=nl.float32, buffer=nl.sbuf)
    port.memset(ones, 1.0, engine="gpsimd")
    ps = nl.ndarray((P, 2), dtype=nl.float32, buffer=nl.psum)
    port.nc_matmul(ps, ones, diag)
    ext = nl.ndarray((P, 2), dtype=nl.float32, buffer=nl.sbuf)        # (min first, -max last)
    port.tensor_copy(ext, ps, engine="vector")
    # width = max last + 1 - kb0;  n = (width + W - 1 - mod(width + W - 1, W)) / W, >= 0
    wide = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(wide, ext[0:1, 1:2], nl.multiply, -1.0, nl.subtract,
                              ext[0:1, 0:1])
    port.tensor_scalar(wide, wide, nl.add, float(W), op1=nl.maximum, operand1=0.0)
    rem = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(rem, wide, nl.mod, float(W))
    n = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_scalar(n, wide, nl.subtract, rem, op1=nl.multiply, operand1=1.0 / W)
    return ext[:, 0:1], n


@port.jit
def varlen_attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=1.0, causal=None,
                         window=None, mm_dtype="bfloat16"):
    """Packed variable-length flash attention forward: ``o (1, Hq, total_q, D)`` in q's dtype
    and ``lse (1, Hq, total_q)`` float32 for q ``(1, Hq, total_q, D)``, k/v ``(1, Hkv,
    total_k, D)`` and int32 ``cu_seqlens_q``/``cu_seqlens_k`` ``(S + 1,)`` (validated by the
    host: 0 first, non-decreasing, the totals last). ``causal`` (None, "top_left",
    "bottom_right") and ``window`` apply per sequence; ``scale``, ``mm_dtype`` as
    :func:`forward.flash_attention_fwd`. Instances ``(1, Hkv)`` as the block-sparse kernel's
    (:func:`port.for_programs`). Totals of 2^24 rows or more are refused (fp32 positions)."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if B != 1:
        raise ValueError(f"q: packed sequences take batch 1, got shape {q.shape}")
    if tuple(cu_seqlens_q.shape) != tuple(cu_seqlens_k.shape) or cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k: expected equal shapes (S + 1,), S >= 1; "
                         f"got {cu_seqlens_q.shape} and {cu_seqlens_k.shape}")
    if max(Nq, Nk) >= T.FP32_EXACT_INT:
        raise ValueError(f"varlen_attention_fwd: totals must be below 2^24 (fp32 positions); "
                         f"got total_q {Nq}, total_k {Nk}")
    BS.refuse_large_in_nki("varlen_attention_fwd", max(Hq * Nq, Hkv * Nk))
    spec = M.MaskSpec(Nq, Nk, causal, window)
    tiles = T.ForwardTiles(q_tile=P, kv_resident=False)
    o = nl.ndarray((B, Hq, Nq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, Hq, Nq), dtype=nl.float32, buffer=nl.shared_hbm)
    indices = port.OffsetColumns(0, Hq, 1)
    off = load_offsets(cu_seqlens_q, cu_seqlens_k)
    ident = nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(ident, [[1, 2]], channel_multiplier=-1)
    port.tensor_scalar(ident, ident, nl.equal, 0.0)
    # legacy: no runtime trip count, every tile runs the steps of the longest possible sweep
    static_steps = T.ceil_div(Nk, W)

    def instance(b, g):
        # guard: non-finite values reach only the rows that see them; the P^T copies split
        # evenly between ScalarE and VectorE (as block-sparse's)
        c = F.Config(q, k, v, o, lse, mm_dtype, scale, tiles, spec, b, g, None, indices,
                     guard=True, act_share=0.5)
        f = F.Instance.of(c)
        kv = BS.RowFrame.of(k, (b, g), indices)
        q_frames = [BS.RowFrame.of(q, (b, f.head(h)), indices) for h in T.unrolled(f.G)]
        pos = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)     # the tile's rows
        port.tensor_copy(pos, off.part, engine="gpsimd")
        port.loop(T.ceil_div(Nq, P),
                  lambda t: _tile(f, off, kv, q_frames, pos, ident, static_steps),
                  carried=True)

    port.for_programs((B, Hkv), instance)
    return o, lse


def _tile(f, off: Offsets, kv, q_frames, pos, ident, static_steps: int):
    """One query tile (rows ``pos``, a carried column advanced by 128 at the end) of every
    query head of the instance's kv group: the sweep of the module docstring."""
    bounds = row_bounds(off, f.spec, pos)
    kb0, n = tile_sweep(bounds, ident)
    st = F.GroupState(f, f.G, P)
    outs = []
    for h in T.unrolled(f.G):
        idx = BS.rows_at(pos, f.Nq, q_frames[h])
        x = nl.ndarray((P, f.D), dtype=f.q.dtype, buffer=nl.sbuf)
        BS.gather(x, f.q, (f.b, f.head(h)), idx, 0, f.Nq % P != 0)
        for pi, (d0, rows) in enumerate(f.d_passes):
            tp = nl.ndarray((rows, P), dtype=f.transpose_psum_dtype(x.dtype), buffer=nl.psum)
            port.nc_transpose(tp, x[:, d0:d0 + rows])
            port.activation(st.qT[pi][:, h, :], nl.copy, tp, scale=f.q_scale)
        outs.append(idx)
    # carried through the steps: the keys of the step (partition p, block w) and the bounds
    # relative to the step's first key
    keys = nl.ndarray((P, W // P), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(keys, off.keys, nl.add, kb0)
    rel = nl.ndarray((P, 2), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(rel, bounds, nl.subtract, kb0)
    v = nl.ndarray((P, W // P, f.vcols), dtype=f.mm, buffer=nl.sbuf)
    port.memset(v[:, :, f.D:f.D + 1], 1.0, engine="gpsimd")

    def step(s):
        _step(f, off, st, kv, keys, rel, v)

    if port.api() == "nki":
        port.loop_between(0, port.register(n), step)
    else:
        port.loop(static_steps, step, carried=True)
    for h in T.unrolled(f.G):
        o_out, lse_out = F.finalize(f, st, h)
        BS.store_tile(f, outs[h], f.head(h), o_out, lse_out)
    port.tensor_scalar(pos, pos, nl.add, float(P), engine="gpsimd")


def _step(f, off: Offsets, st, kv, keys, rel, v):
    """One step of W keys for every head of the tile: gather K and V (rows past total_k
    skipped and zero), K^T, then per head the scores, the selection of the keys outside each
    row's ``[first, last]`` to MASK_NEG, and the online-softmax update; ``keys`` and ``rel``
    advance by W for the next step."""
    D, n = f.D, W // P
    rows = BS.rows_at(keys, f.Nk, kv)
    kx = nl.ndarray((P, n, D), dtype=f.k.dtype, buffer=nl.sbuf)
    same = f.v.dtype == f.mm
    vx = v if same else nl.ndarray((P, n, D), dtype=f.v.dtype, buffer=nl.sbuf)
    port.memset(kx, 0.0, engine="gpsimd")
    port.memset(vx[:, 0:n, 0:D], 0.0, engine="gpsimd")
    for w in T.unrolled(n):
        port.dma_copy(kx[:, w, :], port.lead_rows(f.k, (f.b, f.g), rows, w), legacy_isa=True,
                      oob_skip=True)
        port.dma_copy(vx[:, w, 0:D], port.lead_rows(f.v, (f.b, f.g), rows, w),
                      legacy_isa=True, oob_skip=True)
    if not same:
        port.tensor_copy(v[:, 0:n, 0:D], vx, engine="gpsimd")
    F.guard_values(f, v[:, 0:n, 0:D], v[:, 0:n, D + 1:D + 2], sum_on_scalar=True)
    kT = [nl.ndarray((rows_d, W), dtype=f.mm, buffer=nl.sbuf) for _, rows_d in f.d_passes]
    F.transpose_keys(f, kT, 0, [(w * P, P, kx[:, w, :]) for w in T.unrolled(n)], f.k.dtype)
    # 1 where key column c is outside the row's [first, last] (relative to the step)
    before = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(before, off.cols, nl.less, rel[:, 0:1], engine="gpsimd")
    ind = nl.ndarray((P, W), dtype=nl.uint8, buffer=nl.sbuf)
    port.scalar_tensor_tensor(ind, off.cols, nl.greater, rel[:, 1:2], nl.maximum, before)
    for h in T.unrolled(f.G):
        sc = F.contract([(st.qT[pi][:, h, :], kT[pi]) for pi in T.unrolled(len(f.d_passes))],
                        (P, W))
        s_tile = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(s_tile, sc, engine="vector")
        port.tensor_copy_predicated(s_tile, T.FWD_MASK_NEG, ind)
        F.fold_block(f, st, h, [s_tile], [W], F.KV(None, kT, v), 0, None)
    port.tensor_scalar(keys, keys, nl.add, float(W), engine="gpsimd")
    port.tensor_scalar(rel, rel, nl.subtract, float(W), engine="gpsimd")


__all__ = ["varlen_attention_fwd", "Offsets", "load_offsets", "row_bounds", "tile_sweep"]
