"""Score modifiers of the attention kernels: logit soft-capping, ALiBi and attention sinks.

Definitions (``host/reference.py``, ``_modify_scores``): with ``s = scale q_i . k_j`` the scaled
score of aligned query position ``qpos`` (``i`` for top_left, ``i + kv_len - q_len`` otherwise,
as the masks align) and key position ``j``,

    s'   = cap tanh(s / cap)                   soft-capping (Gemma 2), when ``softcap`` is given
    s''  = s' - slope_h |qpos - j|             ALiBi (per query head, per batch or shared)
    P_ij = exp(s''_ij - lse_i),   lse_i = log(exp(sink_h) + sum_j visible exp(s''_ij))

where the sink (gpt-oss) is one more logit per head whose value vector is 0: it takes part of
every row's probability mass and adds nothing to O. A row without visible keys then has
``o = 0`` and ``lse = sink_h`` (not -inf).

Kernel units. The kernels keep scores in "raw units" ``y`` with ``s'' = u y``, ``u`` the scale
of their exp: the softmax scale when it is folded into the exp, 1 when Q^T carries it, and
``cap`` with soft-capping, where ``y = tanh(c x / cap)`` lies in [-1, 1] (``x`` the PSUM score,
``c`` the exp scale without capping) -- one ScalarE activation reading PSUM. ALiBi then adds
``(-slope_h / u) |d|`` with ``d = j - i - off`` the key-minus-row distance in the kernel's frame
(``MaskSpec.alibi`` makes sequences with lengths rotate, so the distance is static there): one
GpSimd ``iota`` of the affine index expression, one ScalarE ``abs`` (skipped when every visible
key of the band has ``d <= 0``, causal: ``|d| = -d``), one GpSimd multiply by the head's column
and one VectorE add of the scores (read from PSUM). Per score: GpSimd 2 cycles, VectorE 1,
ScalarE 1 (two-sided); soft-capping costs ScalarE 1 (the tanh). :func:`engine_extra` gives
these to the kernels' engine balancing. Masks select ``MASK_NEG`` after the
modifiers (a tanh would map it to -1). The sink enters as the initial state of the online
softmax: ``m_0 = max(sink / u, M_FLOOR)``, ``l_0 = exp(sink - u m_0)`` (1 unless floored).

Backward (``backward.py``): with ``t = tanh(s / cap)`` recomputed, ``ds/dx`` gains the factor
``1 - t^2``; ALiBi's bias is a constant; ``dsink_h = -sum_i exp(sink_h - lse_i) D_i`` with
``D_i = rowsum(dO_i * O_i)``, reduced on chip per (sequence, head).

Per-head values (slopes, sinks) are device data, HBM fp32: one compiled kernel serves every
value. They reach every partition by a K=1 TensorE broadcast (``masks.broadcast_row``).

Valid ranges: ``cap`` in ``tiles.FWD_FOLD_SCALE_RANGE`` (the masks' margin survives ``u = cap``
as it does the folded scale); sinks and slopes within ``tiles.SCORE_MOD_ABS_MAX`` (the host
checks them: they are device data).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from nki_kernels import tiles as T
from nki_kernels.attention import masks as M
from nki_kernels import port
from nki_kernels.port import nl


class Mods(NamedTuple):
    """Compile-time modifiers of one launch."""

    softcap: Optional[float] = None
    alibi: bool = False
    sinks: bool = False

    @property
    def transforms(self) -> bool:
        """The score tiles change (soft-capping or ALiBi)."""
        return self.softcap is not None or self.alibi

    def unit(self, exp_scale: float) -> float:
        """``u``: the exp's scale on raw units (the cap with soft-capping)."""
        return float(self.softcap) if self.softcap is not None else float(exp_scale)


def check_mods(softcap, alibi_slopes, sinks) -> Mods:
    """Compile-time :class:`Mods` from a kernel's arguments (tensors only checked for
    presence; their shapes are the host's to validate)."""
    if softcap is not None:
        lo, hi = T.FWD_FOLD_SCALE_RANGE
        if not lo <= float(softcap) <= hi:
            raise ValueError(f"softcap: expected a value in [{lo}, {hi}], got {softcap!r}")
        softcap = float(softcap)
    return Mods(softcap, alibi_slopes is not None, sinks is not None)


def head_values(hbm, b, h0, G: int):
    """fp32 ``[128, G]``: per-head values of heads ``h0 .. h0 + G - 1`` on every partition, from
    an HBM ``(Hq,)`` or ``(B or 1, Hq)`` fp32 tensor (row ``b``, or row 0 when it has one)."""
    row = nl.ndarray((1, G), dtype=nl.float32, buffer=nl.sbuf)
    if len(hbm.shape) == 1:
        src = hbm.reshape((1, hbm.shape[0]))[0:1, nl.ds(h0, G)]
    elif hbm.shape[0] == 1:
        src = hbm[0:1, nl.ds(h0, G)]
    else:
        src = hbm[nl.ds(b, 1), nl.ds(h0, G)]
    port.dma_copy(row, src, legacy_isa=True)
    return M.broadcast_row(row, G)


class HeadColumns:
    """Per-head ``[128, G]`` fp32 columns of one grid instance (query heads ``h0 ..``):
    ``slope_u`` = ``slope / u`` (ALiBi's bias is ``-slope_u |d|``), ``sink`` (scaled units), ``neg_m0`` = ``-max(sink / u, M_FLOOR)``
    and ``l0`` = ``exp(sink - u m_0)`` (the online softmax's initial state)."""

    def __init__(self, mods: Mods, u: float, slopes, sinks, b, h0, G: int):
        self.slope_u = self.sink = self.neg_m0 = self.l0 = None
        P = T.PMAX
        if mods.alibi:
            self.slope_u = nl.ndarray((P, G), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(self.slope_u, head_values(slopes, b, h0, G), nl.multiply,
                               1.0 / u, engine="gpsimd")
        if mods.sinks:
            self.sink = head_values(sinks, b, h0, G)
            # -m_0 = min(-sink / u, -M_FLOOR)
            self.neg_m0 = nl.ndarray((P, G), dtype=nl.float32, buffer=nl.sbuf)
            port.tensor_scalar(self.neg_m0, self.sink, nl.multiply, -1.0 / u, op1=nl.minimum,
                               operand1=-T.FWD_M_FLOOR, engine="gpsimd")
            # l_0 = exp(sink - u m_0) = exp(u (-m_0) + sink)
            self.l0 = nl.ndarray((P, G), dtype=nl.float32, buffer=nl.sbuf)
            port.loop(G, lambda h: port.activation(
                self.l0[:, nl.ds(h, 1)], nl.exp, self.neg_m0[:, nl.ds(h, 1)],
                bias=self.sink[:, nl.ds(h, 1)], scale=u))

    @staticmethod
    def col(tile, h, rows: int):
        """Column of member head ``h`` (a loop index), ``[rows, 1]``."""
        return tile[0:rows, nl.ds(h, 1)]


def distance_tile(d0, rows: int, width: int, pred=None, d_static=0, offsets=None):
    """fp32 ``[rows, width]``: ``d0 + d_static + key - row`` (``d0`` an index expression, the
    first key's distance from the first row, ``d_static`` a compile-time part), one GpSimd
    iota; returns ``(d, col)``. ``col`` is None when ``d`` is complete (legacy, or a
    compile-time ``d0``); under nki.* a loop-index ``d0`` is read from ``offsets``
    (:class:`port.OffsetColumns`) as the fp32 ``[rows, 1]`` column ``col`` still to be added
    to ``d`` (:func:`port.iota_column`: the caller folds it into its next instruction)."""
    d = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
    col = port.iota_column(d, [[1, width]], offset=d_static, channel_multiplier=-1,
                           runtime=d0, offsets=offsets, mask=pred)
    return d, col


def one_sided(spec: M.MaskSpec) -> bool:
    """Every visible score has ``d = j - i - off <= 0`` (a causal band), so ``|d| = -d``."""
    return spec.hi is not None and spec.hi <= 0


def modify_scores(mods: Mods, cols: HeadColumns, sc, rows: int, width: int, h, d0,
                  tanh_scale: float, two_sided: bool, pred=None, d_static=0, offsets=None,
                  dist=None, dist_col=None):
    """Soft-capping then ALiBi on a score tile ``sc`` (PSUM or SBUF fp32 ``[rows, width]`` of
    raw scores). Returns ``(y, t)``: ``y`` a new SBUF fp32 tile in raw units (module
    docstring) and ``t`` the tanh tile (None without soft-capping; ``y is t`` without ALiBi),
    which the backward differentiates. ``h``: member head (a loop index); ``d0 + d_static``:
    the tile's ``j0 - i0 - off`` (:func:`distance_tile`); ``tanh_scale``: ``c / cap``. Every
    instruction predicated on ``pred`` (legacy). ``dist``: None, or the distance tile itself
    (SBUF fp32 ``[rows, width]``, overwritten when two-sided) where the key positions are data
    (the block-sparse kernels: ``d0`` is then unused); with ``dist_col`` (fp32 ``[rows, 1]``)
    the distance is ``dist + dist_col``, folded into the next instruction as an iota's column
    is, and ``dist`` is only read (the packed kernels' shared column iota)."""
    y = t = None
    if mods.softcap is not None:
        t = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
        port.activation(t, nl.tanh, sc, scale=tanh_scale, mask=pred)
        y = t
    if mods.alibi:
        # the bias on GpSimd (iota, then times the head's column) and ScalarE (|d|), one add on
        # VectorE (reading the scores from PSUM: 1 cycle per element)
        # -slope_u |d|: with a one-sided band |d| = -d, so + slope_u d. Under nki.* the
        # distance's loop-index part (col) is added by the |d| activation's bias, or one-sided
        # by the GpSimd multiply's first operation (no VectorE pass)
        d, col = ((dist, dist_col) if dist is not None
                  else distance_tile(d0, rows, width, pred, d_static, offsets))
        slope = cols.col(cols.slope_u, h, rows)
        if two_sided:
            a = (d if dist is None or dist_col is None
                 else nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf))
            port.activation(a, nl.abs, d, bias=col, mask=pred)
            d = a
        bias = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
        if col is None or two_sided:
            port.tensor_scalar(bias, d, nl.multiply, slope, engine="gpsimd", mask=pred)
        else:
            port.tensor_scalar(bias, d, nl.add, col, op1=nl.multiply, operand1=slope,
                               engine="gpsimd", mask=pred)
        y = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(y, sc if t is None else t, bias,
                           nl.subtract if two_sided else nl.add, mask=pred)
    return y, t


def engine_extra(mods: Mods, two_sided: bool):
    """``(act, dve)``: extra ScalarE and VectorE cycles per score column the modifiers add to
    the forward (for ``tiles.fwd_act_evac_share``)."""
    act = (1.0 if mods.softcap is not None else 0.0) + (1.0 if mods.alibi and two_sided else 0.0)
    # the add reads PSUM (1 cycle) unless it follows the tanh (two fp32 SBUF operands: 2)
    dve = 0.0 if not mods.alibi else (2.0 if mods.softcap is not None else 1.0)
    return act, dve


def softcap_grad_factor(t, rows: int, width: int, pred=None):
    """fp32 ``[rows, width]``: ``1 - t^2`` of a tanh tile (the soft-cap's derivative), both
    steps on GpSimd (the backward's ScalarE and VectorE are its busy engines)."""
    sq = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(sq, t, t, nl.multiply, engine="gpsimd", mask=pred)
    out = nl.ndarray((rows, width), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(out, sq, nl.multiply, -1.0, op1=nl.add, operand1=1.0, engine="gpsimd",
                       mask=pred)
    return out


__all__ = ["Mods", "check_mods", "head_values", "HeadColumns", "distance_tile", "one_sided",
           "modify_scores", "engine_extra", "softcap_grad_factor"]
