"""Row softmax for rows longer than fit on chip: the online (one-pass) algorithm and the two-pass
safe softmax it improves on.

Layout: x ``(R, C)`` row-major in HBM, output ``(R, C)`` in x's dtype. 128 rows sit on the
partitions of a tile; a row is walked in chunks of ``chunk`` columns. All statistics are fp32
``(128, 1)`` per-partition vectors.

Safe softmax needs the row max m before it can sum ``exp(x - m)``; its two-pass form walks a long
row twice for the statistics (pass 1: ``m = max_j x_j``; pass 2: ``l = sum_j exp(x_j - m)``).
The online form (seed 000, "Online Softmax") gets both in one walk by rescaling the running sum
whenever the max grows::

    m' = max(m, max_j x_j)                       (VectorE tensor_reduce, per chunk)
    l' = l * exp(m - m') + sum_j exp(x_j - m')    (ScalarE activation_reduce; VectorE update)

Both then need one more walk to write ``y_j = exp(x_j - m) / l`` (ScalarE exp with the per-row
bias ``-m``, VectorE multiply by ``1/l``). HBM traffic of a long row, in elements:

- online:    read 2C, write C   (stats walk + output walk)
- two-pass:  read 3C, write C
- a row tile that fits on chip (``resident``): read C, write C, for either algorithm.

Robustness (used by the unfused attention baseline, whose masked scores are fp32.min or -inf):
the running max is clamped below at ``tiles.SOFTMAX_M_FLOOR`` (finite), so ``exp(x - m)`` never
sees ``-inf - -inf``; the sum is clamped at ``tiles.SOFTMAX_L_FLOOR`` before ``1/l``. A row that is
entirely -inf therefore gives zeros (as the float64 reference does). With
``zero_masked_rows=True`` a row whose max is below ``tiles.SOFTMAX_MASKED_ROW_MAX`` (a fully
masked attention row filled with fp32.min) also gives zeros.
"""
import numpy as np

from nki_kernels import tiles
from nki_kernels.fused._onchip import PMAX, for_tiles
from nki_kernels.nki import nisa, nki, nl

ALGORITHMS = ("online", "two_pass")


def _vec():
    """A fresh fp32 (128, 1) per-partition vector."""
    return nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)


def _row_max(t, rsz, cw):
    """``max_j t[p, j]`` as an (rsz, 1) vector in t's dtype (VectorE; a max is exact in any
    dtype, and 16-bit in and out runs at 2 elements per cycle)."""
    return nisa.tensor_reduce(np.max, t[0:rsz, 0:cw], axis=(1,), dtype=t.dtype, keepdims=True)


def _e_dtype(out_dtype):
    """dtype of ``exp(x - m)`` before the ``1/l`` scale: the output dtype when it is 16-bit, so
    the VectorE scale runs in trn2's 16-bit mode; fp32 otherwise."""
    return nl.float32 if out_dtype == nl.float32 else out_dtype


def _neg_clamped(m, rsz):
    """``-max(m, M_FLOOR)``: the exp bias of a row with max m (finite even for all -inf rows)."""
    return nisa.tensor_scalar(m[0:rsz, 0:1], np.maximum, tiles.SOFTMAX_M_FLOOR,
                              op1=np.multiply, operand1=-1.0, dtype=nl.float32)


def _exp_sum(t, neg_m, s, rsz, cw, e_dtype=nl.float32):
    """``e = exp(t + neg_m)`` (returned in ``e_dtype``) and ``s = sum_j e`` into the vector s,
    summed in fp32 before e is rounded (ScalarE)."""
    return nisa.activation_reduce(op=nl.exp, data=t[0:rsz, 0:cw], bias=neg_m[0:rsz, 0:1],
                                  reduce_op=np.add, reduce_res=s[0:rsz, 0:1], dtype=e_dtype)


def _inv_sum(l, m, rsz, zero_masked_rows):
    """``1 / max(l, L_FLOOR)``, times ``[m > MASKED_ROW_MAX]`` when zeroing masked rows."""
    l_safe = nisa.tensor_scalar(l[0:rsz, 0:1], np.maximum, tiles.SOFTMAX_L_FLOOR,
                                dtype=nl.float32)
    inv = nisa.reciprocal(l_safe, dtype=nl.float32)
    if zero_masked_rows:
        seen = nisa.tensor_scalar(m[0:rsz, 0:1], np.greater, tiles.SOFTMAX_MASKED_ROW_MAX,
                                  dtype=nl.float32)
        inv = nisa.tensor_tensor(inv, seen, op=np.multiply, dtype=nl.float32)
    return inv


def _rows_resident(x, y, r0, rsz, C, zero_masked_rows):
    """The whole row tile on chip: one read, one write; max, exp-sum and scale on chip."""
    t = nl.load(x[nl.ds(r0, rsz), 0:C])
    m = _row_max(t, rsz, C)
    neg_m = _neg_clamped(m, rsz)
    l = _vec()
    e = _exp_sum(t, neg_m, l, rsz, C, _e_dtype(y.dtype))
    inv = _inv_sum(l, m, rsz, zero_masked_rows)
    out = nisa.tensor_scalar(e, np.multiply, inv, dtype=y.dtype)
    nl.store(y[nl.ds(r0, rsz), 0:C], value=out)


def _stats_online(x, r0, rsz, C, chunk, m_run, l_run):
    """One walk over the row: running (m, l) with the rescaling recurrence."""

    def update(ci, cw):
        t = nl.load(x[nl.ds(r0, rsz), nl.ds(ci * chunk, cw)])
        m_chunk = _row_max(t, rsz, cw)
        m_new = nisa.tensor_tensor(m_run[0:rsz, 0:1], m_chunk, op=np.maximum, dtype=nl.float32)
        neg_m = nisa.tensor_scalar(m_new, np.multiply, -1.0, dtype=nl.float32)
        s_chunk = _vec()
        _exp_sum(t, neg_m, s_chunk, rsz, cw)
        alpha = nisa.activation(op=nl.exp, data=m_run[0:rsz, 0:1], bias=neg_m,
                                dtype=nl.float32)  # exp(m - m') <= 1
        l_run[0:rsz, 0:1] = nisa.scalar_tensor_tensor(
            data=l_run[0:rsz, 0:1], op0=np.multiply, operand0=alpha, op1=np.add,
            operand1=s_chunk[0:rsz, 0:1], dtype=nl.float32)
        m_run[0:rsz, 0:1] = nisa.tensor_copy(m_new, dtype=nl.float32)

    for_tiles(C, chunk, update, loop=nl.sequential_range)


def _stats_two_pass(x, r0, rsz, C, chunk, m_run, l_run):
    """Two walks over the row: the max first, then the sum of exponentials."""

    def take_max(ci, cw):
        t = nl.load(x[nl.ds(r0, rsz), nl.ds(ci * chunk, cw)])
        m_run[0:rsz, 0:1] = nisa.tensor_tensor(m_run[0:rsz, 0:1], _row_max(t, rsz, cw),
                                               op=np.maximum, dtype=nl.float32)

    for_tiles(C, chunk, take_max, loop=nl.sequential_range)
    neg_m = _neg_clamped(m_run, rsz)

    def add_sum(ci, cw):
        t = nl.load(x[nl.ds(r0, rsz), nl.ds(ci * chunk, cw)])
        s_chunk = _vec()
        _exp_sum(t, neg_m, s_chunk, rsz, cw)
        l_run[0:rsz, 0:1] = nisa.tensor_tensor(l_run[0:rsz, 0:1], s_chunk[0:rsz, 0:1],
                                               op=np.add, dtype=nl.float32)

    for_tiles(C, chunk, add_sum, loop=nl.sequential_range)


def _rows_streamed(x, y, r0, rsz, C, chunk, algorithm, zero_masked_rows):
    """A row tile too long for SBUF: statistics walk(s), then the output walk."""
    m_run = nl.full((PMAX, 1), tiles.SOFTMAX_M_FLOOR, dtype=nl.float32, buffer=nl.sbuf)
    l_run = nl.zeros((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    if algorithm == "online":
        _stats_online(x, r0, rsz, C, chunk, m_run, l_run)
    else:
        _stats_two_pass(x, r0, rsz, C, chunk, m_run, l_run)
    neg_m = _neg_clamped(m_run, rsz)
    inv = _inv_sum(l_run, m_run, rsz, zero_masked_rows)

    def write(ci, cw):
        c0 = ci * chunk
        t = nl.load(x[nl.ds(r0, rsz), nl.ds(c0, cw)])
        e = nisa.activation(op=nl.exp, data=t[0:rsz, 0:cw], bias=neg_m,
                            dtype=_e_dtype(y.dtype))
        out = nisa.tensor_scalar(e, np.multiply, inv, dtype=y.dtype)
        nl.store(y[nl.ds(r0, rsz), nl.ds(c0, cw)], value=out)

    for_tiles(C, chunk, write)


@nki.jit
def softmax_kernel(x, algorithm="online", chunk=tiles.SOFTMAX_CHUNK, resident=False,
                   zero_masked_rows=False):
    """Row softmax of a 2-D HBM tensor (launch on a grid of ``(1,)``).

    Parameters
    ----------
    x : (R, C), fp32/bf16/fp16
    algorithm : "online" | "two_pass"
        How a streamed row gets its statistics (see the module docstring).
    chunk : int
        Columns per streamed chunk.
    resident : bool
        Keep each 128-row tile on chip (requires the whole row to fit: ``tiles.softmax_plan``);
        then the row is read once whatever the algorithm.
    zero_masked_rows : bool
        Rows whose max is below ``tiles.SOFTMAX_MASKED_ROW_MAX`` output zeros.

    Returns
    -------
    y : (R, C) in x's dtype, ``y[i] = softmax(x[i])``
    """
    R, C = x.shape
    y = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)

    def row_tile(ri, rsz):
        if resident:
            _rows_resident(x, y, ri * PMAX, rsz, C, zero_masked_rows)
        else:
            _rows_streamed(x, y, ri * PMAX, rsz, C, chunk, algorithm, zero_masked_rows)

    for_tiles(R, PMAX, row_tile)
    return y
