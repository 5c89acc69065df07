"""On-chip building blocks shared by the fused kernels and the unfused attention baseline.

Helpers called from inside an ``@nki.jit`` kernel:

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
from nki_kernels import tiles
from nki_kernels.nki import nisa, nl
from nki_kernels.port import for_tiles  # noqa: F401 (re-exported for the kernels)

PMAX = tiles.PMAX


def matmul_accumulate(acc, idx, total, size, operands):
    """``acc[idx] = sum_i stationary_i^T @ moving_i`` over contraction tiles covering
    ``[0, total)`` in tiles of ``size``.

    ``operands(i, n)`` returns the ``(stationary, moving)`` pair of tile ``i`` (``n`` rows on
    partitions). Tile 0's matmul overwrites the PSUM region and the rest accumulate onto it (the
    hardware's accumulation-group semantics), instead of zero-filling the tile with an extra
    VectorE instruction first.
    """
    n_full, tail = divmod(total, size)
    if n_full:
        acc[idx] = nisa.nc_matmul(*operands(0, size))
        if n_full == 2:
            acc[idx] += nisa.nc_matmul(*operands(1, size))
        elif n_full > 2:
            for i in nl.affine_range(1, n_full):
                acc[idx] += nisa.nc_matmul(*operands(i, size))
    if tail:
        if n_full:
            acc[idx] += nisa.nc_matmul(*operands(n_full, tail))
        else:
            acc[idx] = nisa.nc_matmul(*operands(n_full, tail))


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
        x_rows = nl.load(src[(*lead, nl.ds(r0, rows), nl.ds(c0 + ci * load_cols, cw))],
                         dtype=load_dtype)

        def piece(ji, jw):
            tp = nl.ndarray((PMAX, PMAX), dtype=nl.float32, buffer=nl.psum)
            tp[0:jw, 0:rows] = nisa.nc_transpose(x_rows[0:rows, nl.ds(ji * PMAX, jw)])
            col = (ci * per_load + ji) * col_stride + col_offset
            dst[0:jw, nl.ds(col, rows)] = nisa.tensor_copy(
                tp[0:jw, 0:rows], dtype=dst.dtype, engine=nisa.vector_engine)

        for_tiles(cw, PMAX, piece)

    for_tiles(cols, load_cols, chunk)
