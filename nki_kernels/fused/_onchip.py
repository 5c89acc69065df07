"""On-chip building blocks shared by the fused kernels and the unfused attention baseline.

Helpers called from inside a kernel, written against :mod:`nki_kernels.port` (so they trace
through ``nki.*`` or legacy, whichever the kernel is being traced through; legacy outside
``port.tracing``):

- :func:`for_tiles` (:func:`nki_kernels.port.for_tiles`) walks ``[0, total)`` in tiles of a fixed
  size: a compiled loop over the full tiles (``nl.affine_range`` in legacy, ``nl.fori_loop`` in
  ``nki.*``), then one statically sized tail. Every tile size a body sees is a Python int, so
  partial tiles are plain static slices (no masks, and no uninitialized rows reach TensorE).
- :func:`matmul_accumulate` sums matmuls over contraction tiles into one PSUM tile; the first
  matmul writes the tile, so no zero-fill instruction is spent on it.
- :func:`load_rows_transposed` loads up to 128 rows of a row-major HBM matrix and writes their
  transpose into an SBUF buffer with the columns on partitions -- the layout a matmul contraction
  needs. The transpose runs on TensorE (``nc_transpose`` into PSUM, then a VectorE copy out), which
  is fast on both generations; ``load_transpose2d`` would be a DMA transpose, which
  hardware-and-limits.md §1 calls "much lower DMA bandwidth" on trn1.
"""
from nki_kernels import port, tiles
from nki_kernels.port import for_tiles, nl  # noqa: F401 (for_tiles re-exported for the kernels)

PMAX = tiles.PMAX


def matmul_accumulate(acc, total, size, operands):
    """``acc = sum_i stationary_i^T @ moving_i`` over contraction tiles covering ``[0, total)``
    in tiles of ``size``; ``acc`` is a PSUM tile (or a slice of one).

    ``operands(i, n)`` returns the ``(stationary, moving)`` pair of tile ``i`` (``n`` rows on
    partitions). Tile 0's matmul overwrites the PSUM region and the rest accumulate onto it (the
    hardware's accumulation-group semantics), instead of zero-filling the tile with an extra
    VectorE instruction first. Tiles 1 .. are a compiled loop when there are more than two.
    """
    n_full, tail = divmod(total, size)
    if n_full:
        port.nc_matmul(acc, *operands(0, size))
        if n_full == 2:
            port.nc_matmul(acc, *operands(1, size), accumulate=True)
        elif n_full > 2:
            def more(i):
                port.nc_matmul(acc, *operands(i, size), accumulate=True)

            port.loop(n_full, more, start=1)
    if tail:
        port.nc_matmul(acc, *operands(n_full, tail), accumulate=bool(n_full))


def load_rows_transposed(src, lead, r0, rows, cols, dst, col_stride, col_offset,
                         load_dtype=None, load_cols=None, c0=0):
    """Transpose ``src[*lead, r0:r0+rows, c0:c0+cols]`` into ``dst`` with columns on partitions.

    Column tile ``j`` (columns ``c0 + 128 j ...``, ``csz <= 128`` of them) lands in
    ``dst[0:csz, j * col_stride + col_offset : ... + rows]``: for a matmul operand that is the
    128-deep contraction tile ``j`` of ``rows`` consecutive stationary or moving columns.

    Parameters
    ----------
    src : HBM tensor, row-major, ``len(lead) + 2`` dims
    lead : tuple
        Leading indices selecting a 2-D matrix of ``src`` (``()`` for a 2-D src).
    r0 : index expression or int
    rows : int <= 128
    cols : int
    dst : SBUF tensor ``(128, >= ceil(cols/128) * col_stride)`` in the matmul operand dtype
    col_stride, col_offset : int or index expression
    load_dtype : dtype, optional
        Cast applied by the DMA (e.g. fp32 -> bf16 operands).
    load_cols : int, optional
        Columns per DMA, a multiple of 128; default all ``cols`` in one transfer.
    c0 : int or index expression
        First column.
    """
    load_cols = cols if load_cols is None else load_cols
    per_load = load_cols // PMAX

    def chunk(ci, cw):
        x_rows = nl.ndarray((rows, cw), dtype=load_dtype or src.dtype, buffer=nl.sbuf)
        port.dma_copy(x_rows, src[(*lead, nl.ds(r0, rows), nl.ds(c0 + ci * load_cols, cw))])

        def piece(ji, jw):
            tp = nl.ndarray((PMAX, PMAX), dtype=port.transpose_dtype(x_rows.dtype),
                            buffer=nl.psum)
            port.nc_transpose(tp[0:jw, 0:rows], x_rows[0:rows, nl.ds(ji * PMAX, jw)])
            col = (ci * per_load + ji) * col_stride + col_offset
            port.tensor_copy(dst[0:jw, nl.ds(col, rows)], tp[0:jw, 0:rows], engine="vector")

        for_tiles(cw, PMAX, piece)

    for_tiles(cols, load_cols, chunk)
