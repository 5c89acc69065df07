"""Phase 2 of split-KV decoding (``attention/decode.py``): merge the partials of every query row
by their LSE, in fp32 (seed 003). One source through ``nki.*`` and legacy (:mod:`nki_kernels.port`).

    M = max_X lse^X,  w_X = exp(lse^X - M),  o = sum_X w_X o^X / sum_X w_X,  lse = M + log sum_X w_X

Legacy: one program per tile of ``rows_per_program`` rows (grid ``(ceil(N / rows_per_program),)``).
nki.* (``kernel[1]``): one program, a compiled loop over the full row tiles, then the partial one
(:func:`nki_kernels.port.for_tile_programs`). The sum over the partials is a compiled loop
either way (the slot count grows with the cache length), so the program size is flat in it.
"""
import numpy as np  # compile-time constants only (-inf)

from nki_kernels import port, tiles
from nki_kernels.port import nl

_DTYPES = ("float32", "bfloat16", "float16")


def _merge_rows(part, row_splits, o, lse, r0, rows, S, D):
    """Merge rows ``r0 .. r0 + rows`` (``r0`` an int or a runtime index, ``rows`` an int):
    one load of their ``(S, D + 1)`` partials, the LSE column copied out contiguous."""
    o_all = nl.ndarray((rows, S, D + 1), dtype=nl.float32, buffer=nl.sbuf)
    port.dma_copy(o_all, part[nl.ds(r0, rows), 0:S, 0:D + 1])
    lse_all = nl.ndarray((rows, S), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_copy(lse_all, o_all[0:rows, 0:S, D], engine="vector")
    if row_splits is not None and S > 1:
        # slot x < S - 1 holds a split partial iff x < row_splits[row] (compared as p + x <
        # row_splits + p: iota needs the partition index p to span the partitions)
        used = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.dma_copy(used, row_splits.reshape((row_splits.shape[0], 1))[nl.ds(r0, rows), 0:1])
        p_col = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(p_col, [[0, 1]], channel_multiplier=1)
        limit = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        port.tensor_tensor(limit, used, p_col, op=nl.add)
        slot = nl.ndarray((rows, S - 1), dtype=nl.float32, buffer=nl.sbuf)
        port.iota(slot, [[1, S - 1]], channel_multiplier=1)
        live = nl.ndarray((rows, S - 1), dtype=nl.uint8, buffer=nl.sbuf)
        port.tensor_scalar(live, slot, op0=nl.less, operand0=limit)
        port.keep_where(lse_all[0:rows, 0:S - 1], live, -np.inf)
        port.keep_where(o_all[0:rows, 0:S - 1, 0:D], port.repeat_last(live, D), 0.0)
    m = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_reduce(m, nl.maximum, lse_all, axis=(1,))
    # a finite shift even when every partial is empty: exp(-inf - shift) = 0
    port.tensor_scalar(m, m, op0=nl.maximum, operand0=tiles.DECODE_MERGE_M_FLOOR)
    neg_m = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.activation(neg_m, nl.copy, m, scale=-1.0)
    den = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    w = nl.ndarray((rows, S), dtype=nl.float32, buffer=nl.sbuf)
    port.activation_reduce(w, nl.exp, lse_all, reduce_op=nl.add, reduce_res=den, bias=neg_m)
    # the weighted sum over the partials: a compiled loop carrying acc
    acc = nl.ndarray((rows, D), dtype=nl.float32, buffer=nl.sbuf)
    port.activation(acc, nl.copy, o_all[0:rows, 0, 0:D], scale=w[0:rows, 0:1])

    def add_partial(x):
        port.scalar_tensor_tensor(acc, o_all[0:rows, x, 0:D], op0=nl.multiply,
                                  operand0=w[0:rows, nl.ds(x, 1)], op1=nl.add, operand1=acc)

    port.loop(S, add_partial, carried=True, start=1)
    den_safe = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_scalar(den_safe, den, op0=nl.maximum, operand0=tiles.DECODE_MERGE_L_FLOOR)
    inv = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.reciprocal(inv, den_safe)
    o_sb = nl.ndarray((rows, D), dtype=o.dtype, buffer=nl.sbuf)
    port.activation(o_sb, nl.copy, acc, scale=inv)
    port.dma_copy(o[nl.ds(r0, rows), 0:D], o_sb)
    log_den = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.activation(log_den, nl.log, den_safe)
    total = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    port.tensor_tensor(total, m, log_den, op=nl.add)
    live_row = nl.ndarray((rows, 1), dtype=nl.uint8, buffer=nl.sbuf)
    port.tensor_scalar(live_row, den, op0=nl.greater, operand0=0.0)
    port.keep_where(total, live_row, -np.inf)
    port.dma_copy(lse[nl.ds(r0, rows), 0:1], total)


@port.jit
def flash_decode_merge_kernel(part, row_splits=None, out_dtype="bfloat16",
                              rows_per_program=tiles.DECODE_MERGE_ROWS):
    """Phase 2: merge the partials of every query row by LSE, in fp32 (seed 003).

    Parameters
    ----------
    part : (>= N, S, D + 1) float32
        S partials per row, each ``o | lse`` (``decode.flash_decode_split_kernel``'s output).
    row_splits : (N,) int32 or None
        Split slots in use per row: slots ``row_splits[r] .. S - 2`` were never written and
        are ignored (their contents are garbage); the last slot (the tail) is always used.
        None: every slot is used.
    out_dtype : dtype name of o (q's dtype).
    rows_per_program : int <= 128

    Legacy grid ``(ceil(N / rows_per_program),)``: program i merges rows ``i *
    rows_per_program ...``; nki.*: ``kernel[1]``, one program merging every row tile (module
    docstring). A partial with lse = -inf weighs exp(-inf) = 0; a row whose every partial is
    empty (impossible in decode: each new token sees itself) gets o = 0 and lse = -inf.

    Returns
    -------
    o : (N, D) out_dtype;  lse : (N, 1) float32
    """
    N, S, D = part.shape[0], part.shape[1], part.shape[2] - 1
    if row_splits is not None:
        N = row_splits.shape[0]          # rows past it (the split kernel's trash) are ignored
    if out_dtype not in _DTYPES:
        raise ValueError(f"out_dtype: expected one of {_DTYPES}, got {out_dtype!r}")
    o = nl.ndarray((N, D), dtype=getattr(nl, out_dtype), buffer=nl.shared_hbm)
    lse = nl.ndarray((N, 1), dtype=nl.float32, buffer=nl.shared_hbm)

    def merge_tile(i, rows):
        _merge_rows(part, row_splits, o, lse, i * rows_per_program, rows, S, D)

    port.for_tile_programs(N, rows_per_program, merge_tile)
    return o, lse
