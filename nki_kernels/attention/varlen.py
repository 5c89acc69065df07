"""Packed variable-length flash attention forward (FlashAttention's ``varlen``).

Sequences are packed along the row axis of one batch: q ``(1, Hq, total_q, D)``, k and v
``(1, Hkv, total_k, D)``, and int32 offsets ``cu_seqlens_q``/``cu_seqlens_k`` ``(S + 1,)``:
sequence s owns query rows ``[cu_q[s], cu_q[s+1])`` and keys ``[cu_k[s], cu_k[s+1])``. The
offsets are device data: one compilation serves every packing with the same totals and S.

Each row sees a contiguous key range. For row i of sequence s, with the alignment offset
``off = cu_k[s+1] - cu_q[s+1]`` (bottom_right) or ``cu_k[s] - cu_q[s]`` (top_left) and the
band bounds ``lo``/``hi`` of ``j - i - off`` (``masks.MaskSpec``: causal, window)::

    first_i = max(cu_k[s], i + off + lo)       end_i = min(cu_k[s+1], i + off + hi + 1)

(an unbounded side drops its term). A row with ``first_i >= end_i`` sees nothing: o = 0,
lse = -inf. The columns are computed on chip from the offsets broadcast on every partition:
``cu_q[s] <= i`` selects the sequences starting at or before the row and, the offsets being
non-decreasing, the row's own values are the largest selected ones (one compare-and-multiply,
one max-reduction; a sequence without query rows starts where the next one does, so it never
stands in for the row's own).

Per group of ``tiles.VARLEN_GROUP_TILES`` query tiles (128 rows each) and every query head of
``tiles.VARLEN_KV_HEADS`` kv heads (one loop body)::

    first, end columns of every tile's rows
    kb0 = min first, n = ceil((max end - kb0) / 512)   a transpose, reductions, a ones matmul
    gather Q rows of each (tile, head); Q^T by TensorE
    for step in loop(0, n):                    a runtime trip count (nki.*: a register bound)
        per kv head: gather K, V rows kb0 + 512 step + [0, 512) (clamped to total_k - 1:
        those keys are masked), guard V, K^T by TensorE
        per (tile, head): S = Q K^T (one PSUM bank); scores outside [first_i, end_i) to the
        mask value; online-softmax update (forward.fold_block)
    O, LSE of each (tile, head) scattered to its rows (rows past total_q skipped)

Keys of other sequences inside a step are masked like causal ones; a group never sweeps keys
outside ``[min first, max end)``, so the work of a packed batch is close to that of its
sequences run separately (``benchmarks/varlen.py``). The four tiles of a group are 512 rows,
one step's width, so a long causal sequence issues the same score tiles as per-tile sweeps.

One source, two namespaces (:mod:`nki_kernels.port`): under nki.* (NKI 0.7) the step loop's
trip count ``n`` is a ``VirtualRegister`` loaded from SBUF (:func:`port.loop_between`), and the
mask is one VectorE ``range_select`` out of PSUM that also gives the row max
(:func:`port.range_select_max`, as AWS's ``attention_cte`` masks its diagonal tiles). Legacy
NKI has no runtime trip count nor ``range_select``: its loop runs the static worst case,
``ceil(total_k / 512)`` steps from ``kb0`` (the extra steps are masked), and the mask is an
indicator and a predicated copy: correct, dense in cost. The gathers address K/V and Q rows as
block-sparse's do (:class:`block_sparse.RowFrame`).

Attention dropout (:func:`drop_units`): the dense kernels' 128 x 128 units, numbered in the
packed frame ``(head nqu + i) nku + j`` (packed query tile i, key unit j), each drawn with the
RNG reseeded by ``seed + unit``; under dropout ``kb0`` is rounded down to a multiple of 128 so
each step's four 128-key blocks are whole units (without it the sweep starts at the least
visible key). The backward (``varlen_bwd.py``) draws them again.

Positions are fp32 on chip: totals below 2^24 (refused otherwise).
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

from nki_kernels import port
from nki_kernels import tiles as T
from nki_kernels.attention import block_sparse as BS
from nki_kernels.attention import forward as F
from nki_kernels.attention import masks as M
from nki_kernels.attention import score_mods as SM
from nki_kernels.port import nl

P = T.PMAX
W = T.VARLEN_STEP_KEYS


class Offsets(NamedTuple):
    """The packing on every partition, loaded once per program: ``starts`` fp32 ``[128, m,
    S]``, each sequence's first query row ``cu_q[s]`` (repeated m times), and ``seqs`` the m
    per-sequence values the rows select (``cu_k[s]``, ``cu_k[s+1]`` and with a band or ALiBi
    the references of its diagonal: ``cu_k[s+1]``, ``cu_q[s+1]`` bottom_right, ``cu_k[s]``,
    ``cu_q[s]`` top_left), all non-decreasing in s and >= 0; and the constant iota tiles:
    ``part`` (p, ``[128, 1]``), ``cols`` (c, ``[128, W]``; legacy, and with ALiBi), ``keys``
    (``128 w + p``, ``[128, W / 128]``: a step's key of partition p, block w)."""
    starts: object
    seqs: object
    part: object
    cols: object
    keys: object


def load_offsets(cu_seqlens_q, cu_seqlens_k, spec: M.MaskSpec) -> Offsets:
    """The :class:`Offsets` of the int32 ``(S + 1,)`` offset vectors (fp32 on every partition
    by a K=1 matmul each, exact below 2^24)."""
    n = cu_seqlens_q.shape[0]
    S = n - 1
    cu = []
    for src in (cu_seqlens_q, cu_seqlens_k):
        raw = nl.ndarray((1, n), dtype=nl.int32, buffer=nl.sbuf)
        port.dma_copy(raw, src.reshape((1, n)))
        row = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(row, raw, engine="gpsimd")
        cu.append(M.broadcast_row(row, n))
    cu_q, cu_k = cu
    cols = [cu_k[:, 0:S], cu_k[:, 1:n]]
    if spec.has_diag or spec.alibi:
        ref = 0 if spec.top_left else 1
        cols += [cu_k[:, ref:ref + S], cu_q[:, ref:ref + S]]
    m = len(cols)
    starts = nl.ndarray((P, m, S), dtype=nl.float32, buffer=nl.sbuf)
    seqs = nl.ndarray((P, m, S), dtype=nl.float32, buffer=nl.sbuf)
    for c, src in enumerate(cols):
        port.tensor_copy(starts[:, c, :], cu_q[:, 0:S], engine="gpsimd")
        port.tensor_copy(seqs[:, c, :], src, engine="gpsimd")
    part = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(part, [[0, 1]], channel_multiplier=1)
    iota_cols = None
    if port.api() == "legacy" or spec.alibi:
        iota_cols = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(iota_cols, [[1, W]])
    keys = nl.ndarray((P, W // P), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(keys, [[P, W // P]], channel_multiplier=1)
    return Offsets(starts, seqs, part, iota_cols, keys)


def row_bounds(off: Offsets, spec: M.MaskSpec, pos, dst):
    """``first_i`` and ``end_i`` (one past the last visible key) of the rows at positions
    ``pos`` (fp32 ``[128, 1]``; module docstring) into ``dst`` (fp32 ``[128, 2]``; with ALiBi
    ``[128, 3]``, the third the row's diagonal key ``i + off``, from which ALiBi measures
    ``j - i - off``). The row's sequence values are the largest of those of the sequences
    started at or before it (one compare-and-multiply, one max-reduction over the sequences),
    then the band: two or three ``[128, 1]`` instructions."""
    m, S = off.seqs.shape[1], off.seqs.shape[2]
    sel = nl.ndarray((P, m, S), dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(sel, off.starts, nl.less_equal, pos, nl.multiply, off.seqs)
    own = nl.ndarray((P, m), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_reduce(own, nl.maximum, sel, axis=2)
    if not (spec.has_diag or spec.alibi):
        port.tensor_copy(dst, own, engine="gpsimd")
        return
    # the row's diagonal key i + off = (i - q_ref) + k_ref
    diag = (dst[:, 2:3] if spec.alibi
            else nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf))
    port.scalar_tensor_tensor(diag, pos, nl.subtract, own[:, 3:4], nl.add, own[:, 2:3])
    if spec.lo is None:
        port.tensor_copy(dst[:, 0:1], own[:, 0:1], engine="gpsimd")
    else:
        port.scalar_tensor_tensor(dst[:, 0:1], diag, nl.add, float(spec.lo), nl.maximum,
                                  own[:, 0:1])
    if spec.hi is None:
        port.tensor_copy(dst[:, 1:2], own[:, 1:2], engine="gpsimd")
    else:
        port.scalar_tensor_tensor(dst[:, 1:2], diag, nl.add, float(spec.hi + 1), nl.minimum,
                                  own[:, 1:2])


def tile_sweep(bounds, ident, align: bool = False):
    """``(kb0, n)``: fp32 ``[128, 1]`` the tiles' first key ``min first_i`` on every partition
    and int32 ``[1, 1]`` their step count ``max(0, ceil((max end_i - kb0) / W))`` (``bounds``:
    fp32 ``[128, 2]``, per partition the min first and max end of the group's rows).
    Cross-partition: a TensorE transpose of ``(first, -end)``, a min-reduction along the free
    axis, and a ones matmul that spreads the two results to every partition (``ident``: fp32
    ``[2, 2]`` identity, which places each on its own column). With ``align`` (dropout) kb0 is
    rounded down to a multiple of 128, so the sweep's 128-key blocks are dropout units."""
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
    ext = nl.ndarray((P, 2), dtype=nl.float32, buffer=nl.sbuf)        # (min first, -max end)
    port.tensor_copy(ext, ps, engine="vector")
    if align:
        below = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(below, ext[:, 0:1], nl.mod, float(P), engine="gpsimd")
        port.tensor_tensor(ext[:, 0:1], ext[:, 0:1], below, nl.subtract, engine="gpsimd")
    # width = max end - kb0;  n = (width + W - 1 - mod(width + W - 1, W)) / W, >= 0
    wide = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.scalar_tensor_tensor(wide, ext[0:1, 1:2], nl.multiply, -1.0, nl.subtract,
                              ext[0:1, 0:1])
    port.tensor_scalar(wide, wide, nl.add, float(W - 1), op1=nl.maximum, operand1=0.0)
    rem = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(rem, wide, nl.mod, float(W))
    n = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    port.tensor_scalar(n, wide, nl.subtract, rem, op1=nl.multiply, operand1=1.0 / W)
    return ext[:, 0:1], n


def body_shape(Hkv: int, G: int, Nq: int) -> Tuple[int, int]:
    """``(Hc, R)``: the kv heads and query tiles one loop body serves. R:
    ``tiles.VARLEN_GROUP_TILES`` tiles (fewer for short sequences, or when G query heads per
    kv head would exceed ``tiles.VARLEN_MAX_SLOTS`` (tile, head) slots); Hc:
    ``tiles.VARLEN_KV_HEADS`` when it divides Hkv and the slots allow, else 1 (the heads'
    tiles share the sweep's setup and give the engines independent chains)."""
    R = max(1, min(T.VARLEN_GROUP_TILES, T.ceil_div(Nq, P), T.VARLEN_MAX_SLOTS // G))
    Hc = T.VARLEN_KV_HEADS
    if Hkv % Hc or Hc * R * G > T.VARLEN_MAX_SLOTS:
        Hc = 1
    return Hc, R


def varlen_grid(Hkv: int, G: int, Nq: int, lnc: int, api: str):
    """The launch grid of :func:`varlen_attention_fwd` for ``Hkv`` kv heads of ``G`` query
    heads each and ``Nq`` packed rows: its instances ``(1, Hkv / Hc)`` (:func:`body_shape`)
    as the dense backward's (``backward.backward_grid``; with ``lnc=2`` they spread over the
    two cores when their count allows)."""
    from nki_kernels.attention.backward import backward_grid

    return backward_grid(1, Hkv // body_shape(Hkv, G, Nq)[0], lnc, api=api)


def check_shapes(kernel: str, q, k, cu_seqlens_q, cu_seqlens_k):
    """The packed kernels' shape rules: batch 1, offsets of equal shapes ``(S + 1,)`` with S
    >= 1, totals below 2^24 (fp32 positions)."""
    Nq, Nk = q.shape[2], k.shape[2]
    if q.shape[0] != 1:
        raise ValueError(f"q: packed sequences take batch 1, got shape {q.shape}")
    if tuple(cu_seqlens_q.shape) != tuple(cu_seqlens_k.shape) or cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k: expected equal shapes (S + 1,), S >= 1; "
                         f"got {cu_seqlens_q.shape} and {cu_seqlens_k.shape}")
    if max(Nq, Nk) >= T.FP32_EXACT_INT:
        raise ValueError(f"{kernel}: totals must be below 2^24 (fp32 positions); got total_q "
                         f"{Nq}, total_k {Nk}")


def loop_indices(q, k):
    """The packed kernels' loop indices (query heads) as data for 0.7
    (:class:`port.OffsetColumns`): the first rows of the head slices the indirect DMAs
    address, summed in int32 where ``Hq total_q`` or ``Hkv total_k`` rows may reach 2^24
    (:func:`block_sparse.exact_indices`)."""
    Hq, Nq, Hkv, Nk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    return port.OffsetColumns(0, Hq, 1, exact=BS.exact_indices(max(Hq * Nq, Hkv * Nk)))


def check_mods(softcap, alibi_slopes, sinks) -> SM.Mods:
    """The packed kernels' :class:`score_mods.Mods`: ALiBi's slopes one per query head,
    ``(Hq,)`` (the packed batch is one row of sequences: a per-batch ``(B, Hq)`` has no
    meaning)."""
    if alibi_slopes is not None and len(alibi_slopes.shape) != 1:
        raise ValueError(f"alibi_slopes: packed sequences take one slope per query head, "
                         f"shape (Hq,); got shape {tuple(alibi_slopes.shape)}")
    return SM.check_mods(softcap, alibi_slopes, sinks)


@port.jit
def varlen_attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, sinks=None,
                         seed=None, *, scale=1.0, causal=None, window=None,
                         mm_dtype="bfloat16", softcap=None, dropout_p=0.0, dropout_mask=False):
    """Packed variable-length flash attention forward: ``o (1, Hq, total_q, D)`` in q's dtype
    and ``lse (1, Hq, total_q)`` float32 for q ``(1, Hq, total_q, D)``, k/v ``(1, Hkv,
    total_k, D)`` and int32 ``cu_seqlens_q``/``cu_seqlens_k`` ``(S + 1,)`` (validated by the
    host: 0 first, non-decreasing, the totals last). ``causal`` (None, "top_left",
    "bottom_right") and ``window`` apply per sequence; ``scale``, ``mm_dtype`` as
    :func:`forward.flash_attention_fwd`, and the score modifiers (``score_mods.py``, per
    sequence): ``softcap`` (compile-time), ``alibi_slopes`` (HBM ``(Hq,)`` float32: the
    distance ``j - i - off`` inside the row's sequence, aligned as its band) and ``sinks``
    (HBM ``(Hq,)`` float32; a row without visible keys then has ``lse = sink``). Attention
    dropout as the dense kernel's (``dropout_p`` with the HBM ``(1,)`` int32 ``seed``,
    :func:`forward.dropout_units`) with the 128 x 128 units numbered in the packed frame
    ``(head nqu + i) nku + j`` (i, j: packed query tile and key unit; each group's sweep then
    starts on a multiple of 128, :func:`tile_sweep`); ``dropout_mask=True`` (debugging) also
    returns the keep mask ``(1, Hq, total_q, 128 ceil(total_k / 128))`` float32, positions no
    sweep reaches unspecified (their P is 0). Instances
    ``(1, Hkv / Hc)`` (:func:`body_shape`)
    (:func:`port.for_programs`; the grid :func:`varlen_grid`). Totals of 2^24 rows or more
    are refused (fp32 positions)."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    check_shapes("varlen_attention_fwd", q, k, cu_seqlens_q, cu_seqlens_k)
    check_dropout(dropout_p, seed, Hq, Nq, Nk, dropout_mask)
    mods = check_mods(softcap, alibi_slopes, sinks)
    spec = M.MaskSpec(Nq, Nk, causal, window, alibi=mods.alibi)
    tiles = T.ForwardTiles(q_tile=P, kv_resident=False)
    o = nl.ndarray((B, Hq, Nq, D), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((B, Hq, Nq), dtype=nl.float32, buffer=nl.shared_hbm)
    mask_out = (nl.ndarray((B, Hq, Nq, T.ceil_div(Nk, P) * P), dtype=nl.float32,
                           buffer=nl.shared_hbm) if dropout_p and dropout_mask else None)
    indices = loop_indices(q, k)
    off = load_offsets(cu_seqlens_q, cu_seqlens_k, spec)
    ident = identity2()
    # legacy: no runtime trip count, every tile runs the steps of the longest possible sweep
    static_steps = T.ceil_div(Nk, W)

    Hc, R = body_shape(Hkv, Hq // Hkv, Nq)

    def instance(b, g0):
        insts = kv_heads(q, k, v, o, lse, mm_dtype, scale, tiles, spec, b, g0, Hc, indices,
                         mods, alibi_slopes, sinks, (dropout_p, seed, mask_out),
                         act_share=(T.VARLEN_NKI_ACT_SHARE if port.api() == "nki"
                                    else T.VARLEN_ACT_SHARE))
        group_loop(insts, off, ident, static_steps, R, Nq,
                   lambda plan, pos: _group(insts, off, ident, static_steps, plan, pos))

    port.for_programs((B, Hkv // Hc), instance)
    if mask_out is not None:
        return o, lse, mask_out
    return o, lse


def check_dropout(dropout_p, seed, Hq: int, Nq: int, Nk: int, mask: bool):
    """The packed forward's dropout rules: the seed tensor with ``dropout_p > 0``, and unit
    numbers (and with the debug mask its rows) exact in fp32, below 2^24."""
    if not dropout_p:
        return
    if seed is None:
        raise ValueError("dropout_p > 0 needs the seed tensor (HBM (1,) int32)")
    units = Hq * T.ceil_div(Nq, P) * T.ceil_div(Nk, P)
    rows = Hq * Nq * T.ceil_div(Nk, P) if mask else 0
    if max(units, rows) >= T.FP32_EXACT_INT:
        raise ValueError(f"dropout_p: packed dropout numbers its 128 x 128 units (and the debug "
                         f"mask's rows) in fp32, below 2^24; got {units} units, {rows} mask "
                         f"rows (Hq {Hq}, total_q {Nq}, total_k {Nk})")


class KvHead(NamedTuple):
    """One kv head of a loop body: its :class:`forward.Instance`, the :class:`RowFrame` of
    its K/V rows and those of its member query heads' rows."""
    f: object
    kv: object
    q_frames: list


def identity2():
    """fp32 ``[2, 2]`` identity (:func:`tile_sweep`'s spreading matmul)."""
    ident = nl.ndarray((2, 2), dtype=nl.float32, buffer=nl.sbuf)
    port.iota(ident, [[1, 2]], channel_multiplier=-1)
    port.tensor_scalar(ident, ident, nl.equal, 0.0)
    return ident


def kv_heads(q, k, v, o, lse, mm_dtype, scale, tiles, spec, b, g0, Hc: int, indices,
             mods: SM.Mods, slopes, sinks, dropout=(0.0, None, None),
             act_share: float = T.VARLEN_ACT_SHARE):
    """The :class:`KvHead` records of instance ``(b, g0)``: kv heads ``g0 Hc .. g0 Hc + Hc -
    1`` (``o``/``lse``: the HBM outputs, or the backward's saved ones), with the score
    modifiers ``mods`` (``slopes``, ``sinks``: their HBM ``(Hq,)`` values, or None) and the
    dropout ``(p, seed, mask_out)`` (p 0: none; :func:`forward.load_dropout`, once).
    ``act_share``: the P^T copies' share on ScalarE without a transforming modifier (the
    forward's under nki.* is ``tiles.VARLEN_NKI_ACT_SHARE``)."""
    insts = []
    drop = None
    for c in T.unrolled(Hc):
        # guard: non-finite values reach only the rows that see them; the P^T copies split
        # between ScalarE and VectorE (act_share)
        cf = F.Config(q, k, v, o, lse, mm_dtype, scale, tiles, spec, b, g0 * Hc + c, None,
                      indices, guard=True,
                      act_share=(T.VARLEN_MODS_ACT_SHARE if mods.transforms
                                 else act_share))
        if dropout[0] and drop is None:
            drop = F.load_dropout(dropout[0], dropout[1], cf.mm, mask_out=dropout[2])
        f = F.Instance.of(cf, drop=drop, score=F.score_mods(cf, mods, slopes, sinks,
                                                            cf.act_scale))
        insts.append(KvHead(f, BS.RowFrame.of(k, (b, f.g), indices),
                            [BS.RowFrame.of(q, (b, f.head(h)), indices)
                             for h in T.unrolled(f.G)]))
    return insts


def group_loop(insts, off, ident, static_steps: int, R: int, Nq: int, group):
    """``group(plan, pos)`` for the groups of R query tiles of ``Nq`` rows: a compiled loop
    over the full groups, then the remainder group (``pos`` None). Software-pipelined: each
    body plans the next group's sweep (into ``plan``, from rows ``pos``) before its own
    loop, so the register its loop bound loads was written long before (the engines wait
    for it, ``simulate._sched.register_wait``)."""
    spec, align = insts[0].f.spec, bool(insts[0].f.dropout_p)
    n_tiles = T.ceil_div(Nq, P)
    n_full = n_tiles // R
    if n_full:
        pos = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)      # next group's rows
        port.tensor_copy(pos, off.part, engine="gpsimd")
        nxt = Sweep.alloc(R, spec)
        plan_sweep(spec, off, pos, ident, nxt, align)
        port.loop(n_full, lambda t: group(nxt, pos), carried=True)
    if n_tiles % R:
        pos = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(pos, off.part, nl.add, float(n_full * R * P), engine="gpsimd")
        last = Sweep.alloc(n_tiles % R, spec)
        plan_sweep(spec, off, pos, ident, last, align)
        group(last, None)


class Sweep(NamedTuple):
    """The plan of one group's sweep (:func:`plan_sweep`), in SBUF: ``rows`` fp32 ``[128, R]``
    the positions of its R query tiles' rows, ``bounds`` fp32 ``[128, R, 2]`` their
    ``(first, end)`` (with ALiBi ``[128, R, 3]``: and the diagonal key, :func:`row_bounds`),
    ``kb0`` fp32 ``[128, 1]`` the first key of the sweep, ``n`` int32
    ``[1, 1]`` its step count."""
    rows: object
    bounds: object
    kb0: object
    n: object

    @staticmethod
    def alloc(R: int, spec: M.MaskSpec) -> "Sweep":
        return Sweep(nl.ndarray((P, R), dtype=nl.float32, buffer=nl.sbuf),
                     nl.ndarray((P, R, 3 if spec.alibi else 2), dtype=nl.float32,
                                buffer=nl.sbuf),
                     nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf),
                     nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf))


def plan_sweep(spec: M.MaskSpec, off: Offsets, pos, ident, out: Sweep, align: bool = False):
    """Plan the sweep of the R query tiles from rows ``pos`` (fp32 ``[128, 1]``, advanced by
    ``128 R``) into ``out``: every row's bounds, the union of their ranges, its first key and
    step count (:func:`tile_sweep`; ``align``: its first key a multiple of 128)."""
    R = out.rows.shape[1]
    span = nl.ndarray((P, 2), dtype=nl.float32, buffer=nl.sbuf)      # min first, max end
    for r in T.unrolled(R):
        port.tensor_scalar(out.rows[:, r:r + 1], pos, nl.add, float(r * P), engine="gpsimd")
        row_bounds(off, spec, out.rows[:, r:r + 1], out.bounds[:, r, :])
    port.tensor_scalar(pos, pos, nl.add, float(R * P), engine="gpsimd")
    port.tensor_copy(span, out.bounds[:, 0, 0:2], engine="gpsimd")
    for r in T.unrolled(1, R):
        port.tensor_tensor(span[:, 0:1], span[:, 0:1], out.bounds[:, r, 0:1], nl.minimum,
                           engine="gpsimd")
        port.tensor_tensor(span[:, 1:2], span[:, 1:2], out.bounds[:, r, 1:2], nl.maximum,
                           engine="gpsimd")
    kb0, n = tile_sweep(span, ident, align)
    port.tensor_copy(out.kb0, kb0, engine="gpsimd")
    port.tensor_copy(out.n, n, engine="gpsimd")


def _group(insts, off: Offsets, ident, static_steps: int, plan: Sweep, pos=None):
    """The R query tiles of ``plan`` (:class:`Sweep`) of every query head of the kv heads
    ``insts`` (:class:`KvHead`): the sweep of the module docstring over the union of their
    key ranges (slot ``(c R + r) G + h``: kv head c, tile r, member head h). With ``pos``
    (the next group's rows) the body plans the next group into ``plan`` once it has read its
    own plan (software pipelining)."""
    f0 = insts[0].f
    G = f0.G
    R = plan.rows.shape[1]
    n, outs, keys, rel, rows = open_group(insts, off, ident, plan, pos)
    st = F.GroupState(f0, len(insts) * R * G, P)
    for c, kh in enumerate(insts):
        for r in T.unrolled(R):
            for h in T.unrolled(G):
                sl = (c * R + r) * G + h
                if f0.mods.sinks:
                    F.start_at_sink(kh.f, st, h, 1, slot0=sl)
                x = nl.ndarray((P, kh.f.D), dtype=kh.f.q.dtype, buffer=nl.sbuf)
                BS.gather(x, kh.f.q, (kh.f.b, kh.f.head(h)), outs[sl], 0, kh.f.Nq % P != 0)
                for pi, (d0, d) in enumerate(kh.f.d_passes):
                    tp = nl.ndarray((d, P), dtype=kh.f.transpose_psum_dtype(x.dtype),
                                    buffer=nl.psum)
                    port.nc_transpose(tp, x[:, d0:d0 + d])
                    port.activation(st.qT[pi][:, sl, :], nl.copy, tp, scale=kh.f.q_scale)
    vs = []
    for kh in insts:
        v = nl.ndarray((P, W // P, f0.vcols), dtype=f0.mm, buffer=nl.sbuf)
        F.ones_column(f0, v[:, :, f0.D:f0.D + 1])
        vs.append(v)

    def step(s):
        for c, kh in enumerate(insts):
            _step(kh, off, st, keys, rel, rows, vs[c], R, c * R * G)
        port.tensor_scalar(keys, keys, nl.add, float(W), engine="gpsimd")
        port.tensor_scalar(rel, rel, nl.subtract, float(W), engine="gpsimd")

    run_steps(n, static_steps, step)
    for c, kh in enumerate(insts):
        for j in T.unrolled(R * G):
            sl = c * R * G + j
            o_out, lse_out = F.finalize(kh.f, st, sl)
            BS.store_tile(kh.f, outs[sl], kh.f.head(j % G), o_out, lse_out)


def open_group(insts, off, ident, plan: Sweep, pos):
    """What a group's sweep needs of its ``plan``: ``(n, idx, keys, rel, rows)`` -- the step count
    as a register (nki.*; None in legacy), the Q rows' indices per slot, and (carried through
    the steps) the keys of the step (partition p, block w) and each tile's bounds relative to
    the step's first key, and with dropout a copy of the tiles' rows (else None). Then, with ``pos`` (the next group's rows), plans the next group
    into ``plan`` (software pipelining, :func:`group_loop`)."""
    f0 = insts[0].f
    R = plan.rows.shape[1]
    n = port.register(plan.n) if port.api() == "nki" else None
    idx = [BS.rows_at(plan.rows[:, r:r + 1], kh.f.Nq, kh.q_frames[h])
           for kh in insts for r in T.unrolled(R) for h in T.unrolled(f0.G)]
    keys = nl.ndarray((P, W // P), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(keys, off.keys, nl.add, plan.kb0)
    rel = nl.ndarray(tuple(plan.bounds.shape), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(rel, plan.bounds, nl.subtract, plan.kb0)
    rows = None
    if f0.dropout_p:
        rows = nl.ndarray((P, R), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_copy(rows, plan.rows, engine="gpsimd")
    if pos is not None:
        plan_sweep(f0.spec, off, pos, ident, plan, bool(f0.dropout_p))
    return n, idx, keys, rel, rows


def run_steps(n, static_steps: int, step):
    """The sweep's steps: ``n`` (a register) of them under nki.*, else the static worst case
    (legacy: no runtime trip count; the extra steps are masked)."""
    if n is not None:
        port.loop_between(0, n, step)
    else:
        port.loop(static_steps, step, carried=True)


def outside(off: Offsets, rel):
    """uint8 ``[128, W]``: 1 where key column c of the step is outside the row's ``[first,
    end)`` (``rel``: the bounds relative to the step's first key); legacy's mask (GpSimd and
    VectorE compares)."""
    before = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(before, off.cols, nl.less, rel[:, 0:1], engine="gpsimd")
    ind = nl.ndarray((P, W), dtype=nl.uint8, buffer=nl.sbuf)
    port.scalar_tensor_tensor(ind, off.cols, nl.greater_equal, rel[:, 1:2], nl.maximum,
                              before)
    return ind


def modified(f, off: Offsets, sc, h, rel):
    """``(y, t)``: the raw scores ``sc`` (PSUM fp32 ``[128, W]``, query head ``h`` of the kv
    head) with the score modifiers (``score_mods.modify_scores``: a new SBUF tile in raw
    units; the masks select after it), ``sc`` itself without one; ``t`` the tanh tile with
    soft-capping (the backward's derivative), else None. ALiBi's distance ``j - i - off`` of
    step column c is ``c - rel[:, 2]`` (``rel``: the tile's ``[128, 3]`` bounds relative to
    the step's first key): the column iota and a ``[128, 1]`` column the bias's first
    instruction adds (one-sided: GpSimd's ``(c + col) slope``; two-sided: ScalarE's
    ``|c + col|``)."""
    if not f.mods.transforms:
        return sc, None
    col = None
    if f.mods.alibi:
        col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(col, rel[:, 2:3], nl.multiply, -1.0, engine="gpsimd")
    return SM.modify_scores(f.mods, f.score.cols, sc, P, W, h, None, f.act_scale / f.unit,
                            not SM.one_sided(f.spec), dist=off.cols if col is not None else None,
                            dist_col=col)


def _step(kh: KvHead, off: Offsets, st, keys, rel, rows_q, v, R: int, slot0: int):
    """One step of W keys (``keys``) of kv head ``kh`` for the R tiles and its member heads
    (slots from ``slot0``): gather K and V, K^T, then per tile and head the scores, the
    selection of the keys outside each row's ``[first, end)`` (``rel``: ``[128, R, 2]``,
    relative to the step's first key), and the online-softmax update (with dropout
    :func:`drop_units` on P, ``rows_q``: the tiles' rows)."""
    f, kv = kh.f, kh.kv
    D, n = f.D, W // P
    # keys past total_k read the last key (masked: every row's last key is below total_k),
    # so every row is read and nothing needs zeroing
    rows = nl.ndarray((P, n), dtype=nl.int32, buffer=nl.sbuf)
    if kv.base is None:
        port.tensor_scalar(rows, keys, nl.minimum, float(f.Nk - 1))
    else:
        port.tensor_scalar(rows, keys, nl.minimum, float(f.Nk - 1), op1=nl.add,
                           operand1=kv.base)
    rows = kv.rows(rows)
    kx = nl.ndarray((P, n, D), dtype=f.k.dtype, buffer=nl.sbuf)
    same = f.v.dtype == f.mm
    vx = v if same else nl.ndarray((P, n, D), dtype=f.v.dtype, buffer=nl.sbuf)
    for w in T.unrolled(n):
        port.dma_copy(kx[:, w, :], port.lead_rows(f.k, (f.b, f.g), rows, w), legacy_isa=True)
        port.dma_copy(vx[:, w, 0:D], port.lead_rows(f.v, (f.b, f.g), rows, w),
                      legacy_isa=True)
    if not same:
        port.tensor_copy(v[:, 0:n, 0:D], vx, engine="gpsimd")
    F.guard_values(f, v[:, 0:n, 0:D], v[:, 0:n, D + 1:D + 2], sum_on_scalar=True)
    kT = [nl.ndarray((rows_d, W), dtype=f.mm, buffer=nl.sbuf) for _, rows_d in f.d_passes]
    F.transpose_keys(f, kT, 0, [(w * P, P, kx[:, w, :]) for w in T.unrolled(n)], f.k.dtype)
    nki = port.api() == "nki"
    for j in T.unrolled(R * f.G):
        r, sl = j // f.G, slot0 + j
        sc, _ = modified(f, off, F.contract([(st.qT[pi][:, sl, :], kT[pi])
                                             for pi in T.unrolled(len(f.d_passes))], (P, W)),
                         j % f.G, rel[:, r, :])
        if nki:
            # one VectorE range_select (out of PSUM without a modifier) keeps [first, end)
            # and gives the row max
            s_tile = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
            port.range_select_max(s_tile, sc, [(rel[:, r, 0:1], nl.greater_equal),
                                               (rel[:, r, 1:2], nl.less)],
                                  st.stats[:, sl, 2:3])
        else:
            if j % f.G == 0:
                ind = outside(off, rel[:, r, :])
            s_tile = sc
            if not f.mods.transforms:
                s_tile = nl.ndarray((P, W), dtype=nl.float32, buffer=nl.sbuf)
                port.tensor_copy(s_tile, sc, engine="vector")
            port.tensor_copy_predicated(s_tile, T.FWD_MASK_NEG, ind)
        drop = None
        if f.dropout_p:
            def drop(p, r_, w_, pred, r=r, h=j % f.G):
                drop_units(f, off, p, keys, rows_q[:, r:r + 1], f.head(h), kh.q_frames[h])
        F.fold_block(f, st, sl, [s_tile], [W], F.KV(None, kT, v), 0, None, drop,
                     fused=(nki,))


def drop_units(f, off: Offsets, p, keys, rows, head, q_frame):
    """Attention dropout on a step's P ``[128, W]`` of query head ``head`` and the tile of
    rows ``rows`` (fp32 ``[128, 1]``): each 128-key block is one unit (the sweep starts on a
    multiple of 128, :func:`tile_sweep`), drawn with the RNG reseeded by ``seed + (head nqu +
    i) nku + j`` (:func:`block_sparse.unit_seeds`, batch 0: the packed frame's numbering). With
    the debug mask the same draw on ones is stored (:func:`block_sparse.store_unit_mask`)."""
    n = W // P
    seeds = BS.unit_seeds(f, head, rows[0:1, 0:1], keys[0:1, 0:n])
    for w in T.unrolled(n):
        port.random_seed(seeds[0:1, w:w + 1])
        port.dropout(p[:, w * P:(w + 1) * P], p[:, w * P:(w + 1) * P], f.dropout_p)
        if f.drop.mask_out is not None:
            port.random_seed(seeds[0:1, w:w + 1])
            keep = nl.ndarray((P, P), dtype=f.drop.ones.dtype, buffer=nl.sbuf)
            port.dropout(keep, f.drop.ones, f.dropout_p)
            first = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_tensor(first, keys[:, w:w + 1], off.part, nl.subtract)
            BS.store_unit_mask(f, head, q_frame, rows, first, keep)


__all__ = ["varlen_attention_fwd", "varlen_grid", "check_shapes", "body_shape", "Sweep", "plan_sweep",
           "Offsets", "load_offsets", "row_bounds", "tile_sweep", "modified", "check_mods",
           "loop_indices"]
