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

One source for both NKI namespaces (``nki.*`` on trn2/trn3, ``neuronxcc.nki`` on trn1), written
against :mod:`nki_kernels.port`: every loop over row tiles and column chunks is a compiled loop
in both, so the program does not grow with R or C. Tiles are allocated at their full size
(128 partitions, ``chunk`` columns) and partial tiles are static slices of them.
"""
from nki_kernels import port, tiles
from nki_kernels.port import for_tiles, nl

ALGORITHMS = ("online", "two_pass")
PMAX = tiles.PMAX


def _vec():
    """A fresh fp32 (128, 1) per-partition vector."""
    return nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)


def _load(t, x, r0, rsz, c0, cw):
    """``t[0:rsz, 0:cw] = x[r0:r0+rsz, c0:c0+cw]`` (DMA); returns t."""
    port.dma_copy(t[0:rsz, 0:cw], x[nl.ds(r0, rsz), nl.ds(c0, cw)])
    return t


def _row_max(t, rsz, cw):
    """``max_j t[p, j]`` as a (128, 1) vector in t's dtype (VectorE; a max is exact in any
    dtype, and 16-bit in and out runs at 2 elements per cycle)."""
    m = nl.ndarray((PMAX, 1), dtype=t.dtype, buffer=nl.sbuf)
    port.tensor_reduce(m[0:rsz, 0:1], nl.maximum, t[0:rsz, 0:cw], axis=(1,))
    return m


def _e_dtype(out_dtype):
    """dtype of ``exp(x - m)`` before the ``1/l`` scale: the output dtype when it is 16-bit, so
    the VectorE scale runs in trn2's 16-bit mode; fp32 otherwise."""
    return nl.float32 if out_dtype == nl.float32 else out_dtype


def _neg_clamped(m, rsz):
    """``-max(m, M_FLOOR)``: the exp bias of a row with max m (finite even for all -inf rows)."""
    neg_m = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(neg_m[0:rsz, 0:1], m[0:rsz, 0:1], nl.maximum, tiles.SOFTMAX_M_FLOOR,
                       op1=nl.multiply, operand1=-1.0)
    return neg_m


def _exp_sum(t, neg_m, s, rsz, cw, e_dtype=None):
    """``e = exp(t + neg_m)`` (returned, a (128, t's width) tile in ``e_dtype``, default fp32)
    and ``s = sum_j e`` into the vector s, summed in fp32 before e is rounded (ScalarE)."""
    e = nl.ndarray((PMAX, t.shape[1]), dtype=e_dtype or nl.float32, buffer=nl.sbuf)
    port.activation_reduce(e[0:rsz, 0:cw], nl.exp, t[0:rsz, 0:cw], reduce_op=nl.add,
                           reduce_res=s[0:rsz, 0:1], bias=neg_m[0:rsz, 0:1])
    return e


def _inv_sum(l, m, rsz, zero_masked_rows):
    """``1 / max(l, L_FLOOR)``, times ``[m > MASKED_ROW_MAX]`` when zeroing masked rows."""
    l_safe = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(l_safe[0:rsz, 0:1], l[0:rsz, 0:1], nl.maximum, tiles.SOFTMAX_L_FLOOR)
    inv = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.reciprocal(inv[0:rsz, 0:1], l_safe[0:rsz, 0:1])
    if not zero_masked_rows:
        return inv
    seen = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(seen[0:rsz, 0:1], m[0:rsz, 0:1], nl.greater, tiles.SOFTMAX_MASKED_ROW_MAX)
    inv_seen = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(inv_seen[0:rsz, 0:1], inv[0:rsz, 0:1], seen[0:rsz, 0:1], op=nl.multiply)
    return inv_seen


def _rows_resident(x, y, r0, rsz, C, zero_masked_rows):
    """The whole row tile on chip: one read, one write; max, exp-sum and scale on chip."""
    t = _load(nl.ndarray((PMAX, C), dtype=x.dtype, buffer=nl.sbuf), x, r0, rsz, 0, C)
    m = _row_max(t, rsz, C)
    neg_m = _neg_clamped(m, rsz)
    l = _vec()
    e = _exp_sum(t, neg_m, l, rsz, C, _e_dtype(y.dtype))
    inv = _inv_sum(l, m, rsz, zero_masked_rows)
    out = nl.ndarray((PMAX, C), dtype=y.dtype, buffer=nl.sbuf)
    port.tensor_scalar(out[0:rsz, 0:C], e[0:rsz, 0:C], nl.multiply, inv[0:rsz, 0:1])
    port.dma_copy(y[nl.ds(r0, rsz), 0:C], out[0:rsz, 0:C])


def _stats_online(x, r0, rsz, C, chunk, m_run, l_run):
    """One walk over the row: running (m, l) with the rescaling recurrence."""

    def update(ci, cw):
        t = _load(nl.ndarray((PMAX, chunk), dtype=x.dtype, buffer=nl.sbuf),
                  x, r0, rsz, ci * chunk, cw)
        m_chunk = _row_max(t, rsz, cw)
        m_new = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(m_new[0:rsz, 0:1], m_run[0:rsz, 0:1], m_chunk[0:rsz, 0:1],
                           op=nl.maximum)
        neg_m = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_scalar(neg_m[0:rsz, 0:1], m_new[0:rsz, 0:1], nl.multiply, -1.0)
        s_chunk = _vec()
        _exp_sum(t, neg_m, s_chunk, rsz, cw)
        alpha = nl.ndarray((PMAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.activation(alpha[0:rsz, 0:1], nl.exp, m_run[0:rsz, 0:1],
                        bias=neg_m[0:rsz, 0:1])                  # exp(m - m') <= 1
        port.scalar_tensor_tensor(l_run[0:rsz, 0:1], l_run[0:rsz, 0:1], nl.multiply,
                                  alpha[0:rsz, 0:1], nl.add, s_chunk[0:rsz, 0:1])
        port.tensor_copy(m_run[0:rsz, 0:1], m_new[0:rsz, 0:1])

    for_tiles(C, chunk, update, carried=True)


def _stats_two_pass(x, r0, rsz, C, chunk, m_run, l_run):
    """Two walks over the row: the max first, then the sum of exponentials."""

    def take_max(ci, cw):
        t = _load(nl.ndarray((PMAX, chunk), dtype=x.dtype, buffer=nl.sbuf),
                  x, r0, rsz, ci * chunk, cw)
        port.tensor_tensor(m_run[0:rsz, 0:1], m_run[0:rsz, 0:1], _row_max(t, rsz, cw)[0:rsz, 0:1],
                           op=nl.maximum)

    for_tiles(C, chunk, take_max, carried=True)
    neg_m = _neg_clamped(m_run, rsz)

    def add_sum(ci, cw):
        t = _load(nl.ndarray((PMAX, chunk), dtype=x.dtype, buffer=nl.sbuf),
                  x, r0, rsz, ci * chunk, cw)
        s_chunk = _vec()
        _exp_sum(t, neg_m, s_chunk, rsz, cw)
        port.tensor_tensor(l_run[0:rsz, 0:1], l_run[0:rsz, 0:1], s_chunk[0:rsz, 0:1],
                           op=nl.add)

    for_tiles(C, chunk, add_sum, carried=True)


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
        t = _load(nl.ndarray((PMAX, chunk), dtype=x.dtype, buffer=nl.sbuf), x, r0, rsz, c0, cw)
        e = nl.ndarray((PMAX, chunk), dtype=_e_dtype(y.dtype), buffer=nl.sbuf)
        port.activation(e[0:rsz, 0:cw], nl.exp, t[0:rsz, 0:cw], bias=neg_m[0:rsz, 0:1])
        out = nl.ndarray((PMAX, chunk), dtype=y.dtype, buffer=nl.sbuf)
        port.tensor_scalar(out[0:rsz, 0:cw], e[0:rsz, 0:cw], nl.multiply, inv[0:rsz, 0:1])
        port.dma_copy(y[nl.ds(r0, rsz), nl.ds(c0, cw)], out[0:rsz, 0:cw])

    for_tiles(C, chunk, write)


@port.jit
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
