"""``y = GELU(x @ W + b)``: one fused kernel, and the three-kernel unfused pipeline it replaces.

Layouts (row-major in HBM): x ``(M, K)``, W ``(K, N)``, b ``(N,)``, y ``(M, N)`` in x's dtype.
Matmul operands run in ``mm_dtype`` (the input dtype, or bf16 for fp32 inputs with
``mixed_precision``); PSUM accumulates fp32; GELU is computed in fp32 on ScalarE.

Why this arrangement (the bias is the design question). ``nisa.activation`` computes
``op(data * scale + bias)`` with ``bias`` a per-partition ``(P, 1)`` vector, so a bias that varies
along N is free in that instruction only when N lies on partitions, i.e. when the kernel computes
y^T tiles (``stationary = W[k, n]``, ``moving = x^T[k, m]``). But y is stored row-major, so y^T
tiles must be transposed back on TensorE before the store: 4 transposes of 128 cycles per
128 x 512 output tile plus one more PSUM -> SBUF copy. Here the output tile is y itself
(``stationary = x^T[k, 128 rows]``, ``moving = W[k, n-block]``) and the bias rides on the PSUM
accumulation as a rank-1 update, ``acc += ones[1, m]^T @ b[1, n]`` -- one K=1 matmul that costs
the same 512 TensorE cycles as those transposes but needs no extra copy and no extra PSUM bank.
Evacuating PSUM is then exactly one ScalarE instruction per tile, ``activation(gelu, acc)``, which
writes y's dtype straight to the SBUF tile that is stored. (x itself must be transposed in either
arrangement -- the contraction dim K has to sit on partitions -- and that happens once per x
element, when an x row block is loaded.)

Fused kernel (:func:`linear_gelu_fused`)::

    for each block of block_m rows of x:                      x read once in total
        x^T block <- load rows, transpose on TensorE           (stays in SBUF)
        for each block of block_n columns of W:               W read ceil(M / block_m) times
            W block <- load; b block <- load                  (b: N elements per row block)
            for each 128-row tile of the block:
                acc  = sum_k x^T[k, rows]^T @ W[k, cols]       (PSUM, fp32)
                acc += ones^T @ b[cols]                         (the bias)
                y[rows, cols] <- activation(gelu, acc)          (one ScalarE instruction, store)

HBM bytes: ``s_x (M K) + s_w (K N) ceil(M / block_m) + s_b N ceil(M / block_m) + s_y M N``.

Unfused pipeline (seed 000's "without fusion"): :func:`matmul_kernel` (same blocking, epilogue a
plain copy) writes ``z = x @ W``; :func:`bias_add_kernel` reads z and b and writes ``z + b``;
:func:`gelu_kernel` reads that and writes y. The intermediates are stored in x's dtype, as a
framework running three operators would, so the pipeline moves ``4 M N`` more elements than the
fused kernel (seed 000: 6n vs 2n when the matmul's own traffic is about one tensor).

For very long K (no 128-row block of x^T fits in SBUF next to a W block; see
``tiles.linear_gelu_blocks``), :func:`linear_gelu_fused` runs the streaming variant: x and W
tiles are loaded per output tile, so x is read ``ceil(N / 512)`` times and W ``ceil(M / 128)``
times.

One source for both NKI namespaces (``nki.*`` on trn2/trn3, ``neuronxcc.nki`` on trn1), written
against :mod:`nki_kernels.port`: every walk over row, column and contraction tiles is a compiled
loop in both (``port.for_tiles``), so the program does not grow with M, K or N. Each tile is
allocated at the statement that fills it, at the shape the legacy ``nl.load`` / instruction
result had, so the legacy instruction stream and estimate are the ones before the port.
"""
from nki_kernels import port, tiles
from nki_kernels.fused._onchip import PMAX, for_tiles, load_rows_transposed, matmul_accumulate
from nki_kernels.port import nl

#: ``approximate`` argument (torch.nn.functional.gelu) -> ScalarE activation function.
_GELU = {"none": "gelu", "tanh": "gelu_apprx_tanh"}


def _gelu_op(approximate):
    return getattr(nl, _GELU[approximate])


def _dtype(name):
    """A matmul operand dtype name (kernel arguments are compile-time strings) -> the traced
    namespace's dtype."""
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"mm_dtype: expected float32, bfloat16 or float16, got {name!r}")
    return getattr(nl, name)


def _x_load_cols(K, itemsize):
    """Columns of x per DMA: as many as LINEAR_X_LOAD_BYTES allows, a multiple of 128."""
    cols = max(PMAX, tiles.LINEAR_X_LOAD_BYTES // itemsize // PMAX * PMAX)
    return min(cols, tiles.ceil_div(K, PMAX) * PMAX)


def _matmul_blocks(y, x, w, b, act, mm_dtype, block_m, block_n):
    """``y = act(x @ w [+ b])`` with x^T row blocks resident and W streamed in column blocks."""
    M, K = x.shape
    N = w.shape[1]
    kt_full, k_tail = divmod(K, PMAX)
    n_kt = kt_full + (1 if k_tail else 0)
    cast = None if mm_dtype == x.dtype else mm_dtype
    x_cols = _x_load_cols(K, x.dtype.itemsize)
    if b is not None:
        b_row_view = b.reshape((1, N))
        ones = nl.ones((1, PMAX), dtype=mm_dtype, buffer=nl.sbuf)

    def m_block(mb, bm):
        m0 = mb * block_m
        # x^T for the block: contraction tile kt of rows ms*128.. at columns kt*bm + ms*128.
        x_t = nl.ndarray((PMAX, n_kt * bm), dtype=mm_dtype, buffer=nl.sbuf)

        def load_x(ms, msz):
            load_rows_transposed(x, (), m0 + ms * PMAX, msz, K, x_t, bm, ms * PMAX,
                                 load_dtype=cast, load_cols=x_cols)

        for_tiles(bm, PMAX, load_x)

        def n_block(nb, bn):
            n0 = nb * block_n
            w_blk = nl.ndarray((PMAX, n_kt * bn), dtype=mm_dtype, buffer=nl.sbuf)

            def load_w(kt, ksz):
                port.dma_copy(w_blk[0:ksz, nl.ds(kt * bn, bn)],
                              w[nl.ds(kt * PMAX, ksz), nl.ds(n0, bn)])

            for_tiles(K, PMAX, load_w)
            if b is not None:
                b_row = nl.ndarray((1, bn), dtype=mm_dtype, buffer=nl.sbuf)
                port.dma_copy(b_row, b_row_view[0:1, nl.ds(n0, bn)])

            def out_tile(ms, msz):
                acc = nl.ndarray((PMAX, bn), dtype=nl.float32, buffer=nl.psum)

                def operands(kt, ksz):
                    return (x_t[0:ksz, nl.ds(kt * bm + ms * PMAX, msz)],
                            w_blk[0:ksz, nl.ds(kt * bn, bn)])

                matmul_accumulate(acc[0:msz, 0:bn], K, PMAX, operands)
                if b is not None:
                    # the bias as a rank-1 update: every row of the tile gets b[cols]
                    port.nc_matmul(acc[0:msz, 0:bn], ones[0:1, 0:msz], b_row[0:1, 0:bn],
                                   accumulate=True)
                _evacuate_and_store(y, acc[0:msz, 0:bn], act, m0 + ms * PMAX, msz, n0, bn)

            for_tiles(bm, PMAX, out_tile)

        for_tiles(N, block_n, n_block)

    for_tiles(M, block_m, m_block)


def _matmul_streaming(y, x, w, b, act, mm_dtype):
    """``y = act(x @ w [+ b])`` for K too long to keep an x^T block on chip.

    Per 128 x 512 output tile, K is walked in chunks: x rows loaded and transposed, W tiles
    loaded, products accumulated in PSUM. Constant SBUF; x and W are re-read per output tile.
    """
    M, K = x.shape
    N = w.shape[1]
    cast = None if mm_dtype == x.dtype else mm_dtype
    kc = _x_load_cols(K, x.dtype.itemsize)
    n_tile = tiles.LINEAR_N_TILE
    if b is not None:
        b_row_view = b.reshape((1, N))
        ones = nl.ones((1, PMAX), dtype=mm_dtype, buffer=nl.sbuf)

    def out_tile(mi, msz):
        m0 = mi * PMAX

        def n_col(ni, nsz):
            n0 = ni * n_tile
            acc = nl.zeros((PMAX, n_tile), dtype=nl.float32, buffer=nl.psum)

            def k_chunk(ci, cw):
                x_t = nl.ndarray((PMAX, (kc // PMAX) * PMAX), dtype=mm_dtype, buffer=nl.sbuf)
                load_rows_transposed(x, (), m0, msz, cw, x_t, PMAX, 0, load_dtype=cast,
                                     c0=ci * kc)

                def k_tile(kt, ksz):
                    w_t = nl.ndarray((ksz, nsz), dtype=mm_dtype, buffer=nl.sbuf)
                    port.dma_copy(w_t, w[nl.ds(ci * kc + kt * PMAX, ksz), nl.ds(n0, nsz)])
                    port.nc_matmul(acc[0:msz, 0:nsz], x_t[0:ksz, nl.ds(kt * PMAX, msz)],
                                   w_t[0:ksz, 0:nsz], accumulate=None)

                for_tiles(cw, PMAX, k_tile)

            for_tiles(K, kc, k_chunk)
            if b is not None:
                b_row = nl.ndarray((1, nsz), dtype=mm_dtype, buffer=nl.sbuf)
                port.dma_copy(b_row, b_row_view[0:1, nl.ds(n0, nsz)])
                port.nc_matmul(acc[0:msz, 0:nsz], ones[0:1, 0:msz], b_row[0:1, 0:nsz],
                               accumulate=None)
            _evacuate_and_store(y, acc[0:msz, 0:nsz], act, m0, msz, n0, nsz)

        for_tiles(N, n_tile, n_col)

    for_tiles(M, PMAX, out_tile)


def _evacuate_and_store(y, acc, act, r0, rows, c0, cols):
    """PSUM -> SBUF in y's dtype (through ``act`` on ScalarE, or a VectorE copy) -> HBM."""
    out = nl.ndarray((rows, cols), dtype=y.dtype, buffer=nl.sbuf)
    if act is None:
        port.tensor_copy(out, acc, engine="vector")
    else:
        port.activation(out, act, acc)
    port.dma_copy(y[nl.ds(r0, rows), nl.ds(c0, cols)], out)


@port.jit
def linear_gelu_fused(x, w, b, approximate="none", mm_dtype="bfloat16", block_m=0, block_n=0):
    """``GELU(x @ w + b)`` in one kernel (launch on a grid of ``(1,)``).

    Parameters
    ----------
    x : (M, K), w : (K, N), b : (N,)
        One float dtype (fp32, bf16, fp16).
    approximate : "none" | "tanh"
        Exact (erf) GELU or its tanh approximation (torch.nn.functional.gelu).
    mm_dtype : "float32" | "bfloat16" | "float16"
        Matmul operand dtype.
    block_m, block_n : int
        x rows kept resident and W columns per block (``tiles.linear_gelu_blocks``); 0 selects
        the streaming variant for very long K.

    Returns
    -------
    y : (M, N) in x's dtype
    """
    M = x.shape[0]
    N = w.shape[1]
    y = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
    act = _gelu_op(approximate)
    if block_m:
        _matmul_blocks(y, x, w, b, act, _dtype(mm_dtype), block_m, block_n)
    else:
        _matmul_streaming(y, x, w, b, act, _dtype(mm_dtype))
    return y


@port.jit
def matmul_kernel(x, w, mm_dtype="bfloat16", block_m=0, block_n=0):
    """Unfused step 1: ``z = x @ w`` written to HBM in x's dtype (same blocking as the fused
    kernel, so the two differ only by fusion)."""
    M = x.shape[0]
    N = w.shape[1]
    z = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
    if block_m:
        _matmul_blocks(z, x, w, None, None, _dtype(mm_dtype), block_m, block_n)
    else:
        _matmul_streaming(z, x, w, None, None, _dtype(mm_dtype))
    return z


@port.jit
def bias_add_kernel(z, b):
    """Unfused step 2: ``z + b`` (b broadcast over rows), written to HBM in z's dtype.

    b varies along the free dim, so each column block of b is broadcast to all 128 partitions
    once, on TensorE (``ones^T @ b`` into a PSUM bank), and added to every row tile by VectorE
    reading that bank directly. b is read from HBM once in total.
    """
    M, N = z.shape
    out = nl.ndarray((M, N), dtype=z.dtype, buffer=nl.shared_hbm)
    b_row_view = b.reshape((1, N))
    ones = nl.ones((1, PMAX), dtype=b.dtype, buffer=nl.sbuf)
    cols = tiles.PSUM_FMAX

    def col_block(ci, cw):
        c0 = ci * cols
        b_row = nl.ndarray((1, cw), dtype=b.dtype, buffer=nl.sbuf)
        port.dma_copy(b_row, b_row_view[0:1, nl.ds(c0, cw)])
        b_bcast = nl.zeros((PMAX, cols), dtype=nl.float32, buffer=nl.psum)
        port.nc_matmul(b_bcast[0:PMAX, 0:cw], ones[0:1, 0:PMAX], b_row[0:1, 0:cw],
                       accumulate=None)

        def row_tile(ri, rsz):
            r0 = ri * PMAX
            t = nl.ndarray((rsz, cw), dtype=z.dtype, buffer=nl.sbuf)
            port.dma_copy(t, z[nl.ds(r0, rsz), nl.ds(c0, cw)])
            s = nl.ndarray((rsz, cw), dtype=z.dtype, buffer=nl.sbuf)
            port.tensor_tensor(s, t[0:rsz, 0:cw], b_bcast[0:rsz, 0:cw], op=nl.add)
            port.dma_copy(out[nl.ds(r0, rsz), nl.ds(c0, cw)], s)

        for_tiles(M, PMAX, row_tile)

    for_tiles(N, cols, col_block)
    return out


@port.jit
def gelu_kernel(z, approximate="none"):
    """Unfused step 3: ``GELU(z)`` element-wise on ScalarE, written to HBM in z's dtype."""
    M, N = z.shape
    out = nl.ndarray((M, N), dtype=z.dtype, buffer=nl.shared_hbm)
    act = _gelu_op(approximate)
    cols = tiles.ELEMENTWISE_COLS

    def tile(ri, rsz):
        r0 = ri * PMAX

        def col(ci, cw):
            c0 = ci * cols
            t = nl.ndarray((rsz, cw), dtype=z.dtype, buffer=nl.sbuf)
            port.dma_copy(t, z[nl.ds(r0, rsz), nl.ds(c0, cw)])
            g = nl.ndarray((rsz, cw), dtype=z.dtype, buffer=nl.sbuf)
            port.activation(g, act, t)
            port.dma_copy(out[nl.ds(r0, rsz), nl.ds(c0, cw)], g)

        for_tiles(N, cols, col)

    for_tiles(M, PMAX, tile)
    return out
