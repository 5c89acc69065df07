"""Where the bias of GELU(x W + b) goes (issue #6): the two arrangements, measured.

``nisa.activation`` adds a per-partition (P, 1) bias for free, so a bias along N rides on the
PSUM-evacuating instruction only when N is on partitions. Two ways to get one ScalarE instruction
per output tile:

``y tiles`` (nki_kernels/fused/linear_gelu.py)
    x^T stationary, W moving: PSUM holds y[128 rows, 512 cols]; the bias is a rank-1 update
    ``acc += ones^T b`` accumulated in PSUM (one K = 1 matmul), then ``activation(gelu, acc)``.
``y^T tiles`` (this file, an experiment)
    W stationary, x^T moving: PSUM holds y^T[128 cols, 512 rows]; ``activation(gelu, acc,
    bias=b[cols])``, then four TensorE transposes per tile back to y and a PSUM -> SBUF copy
    before 128 x 128 stores.

Both spend the same TensorE cycles (one 512-cycle matmul per tile vs four 128-cycle transposes);
the y^T form adds VectorE copies and 4x the store DMAs. Run::

    python benchmarks/linear_gelu_layouts.py [M K N] [--target trn1|trn2]
"""
import argparse
import os

import ml_dtypes
import numpy as np

import _common  # noqa: E402,F401  (puts the repository on sys.path)
os.environ.setdefault("NKI_FLASH_BACKEND", "simulate")

import simulate  # noqa: E402

import host  # noqa: E402
from host import reference  # noqa: E402
from host._launch import launch  # noqa: E402
from nki_kernels import tiles  # noqa: E402
from nki_kernels.fused._onchip import (PMAX, for_tiles, load_rows_transposed,  # noqa: E402
                                       matmul_accumulate)
from nki_kernels.nki import nisa, nki, nl  # noqa: E402

M_SUB = tiles.GEMM_MOVING_FMAX  # x^T columns (rows of y) per y^T tile


@nki.jit
def linear_gelu_transposed(x, w, b, block_m=512):
    """GELU(x @ w + b) computed as y^T tiles with the bias in the activation (bf16/fp16 only)."""
    M, K = x.shape
    N = w.shape[1]
    y = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
    n_kt = tiles.ceil_div(K, PMAX)
    b_col_view = b.reshape((N, 1))

    def m_block(mb, bm):
        m0 = mb * block_m
        x_t = nl.ndarray((PMAX, n_kt * bm), dtype=x.dtype, buffer=nl.sbuf)
        for_tiles(bm, PMAX, lambda ms, msz: load_rows_transposed(
            x, (), m0 + ms * PMAX, msz, K, x_t, bm, ms * PMAX))

        def n_tile(ni, nsz):
            n0 = ni * PMAX
            w_t = nl.ndarray((PMAX, n_kt * PMAX), dtype=x.dtype, buffer=nl.sbuf)

            def load_w(kt, ksz):
                w_t[0:ksz, nl.ds(kt * PMAX, nsz)] = nl.load(
                    w[nl.ds(kt * PMAX, ksz), nl.ds(n0, nsz)])

            for_tiles(K, PMAX, load_w)
            b_col = nl.load(b_col_view[nl.ds(n0, nsz), 0:1], dtype=nl.float32)

            def m_sub(mi, mw):
                acc = nl.ndarray((PMAX, M_SUB), dtype=nl.float32, buffer=nl.psum)

                def operands(kt, ksz):
                    return (w_t[0:ksz, nl.ds(kt * PMAX, nsz)],
                            x_t[0:ksz, nl.ds(kt * bm + mi * M_SUB, mw)])

                matmul_accumulate(acc, (slice(0, nsz), slice(0, mw)), K, PMAX, operands)
                y_t = nisa.activation(op=nl.gelu, data=acc[0:nsz, 0:mw], bias=b_col,
                                      dtype=x.dtype)

                def back(j, jw):
                    tp = nl.ndarray((PMAX, PMAX), dtype=nl.float32, buffer=nl.psum)
                    tp[0:jw, 0:nsz] = nisa.nc_transpose(y_t[0:nsz, nl.ds(j * PMAX, jw)])
                    out = nisa.tensor_copy(tp[0:jw, 0:nsz], dtype=x.dtype,
                                           engine=nisa.vector_engine)
                    nl.store(y[nl.ds(m0 + mi * M_SUB + j * PMAX, jw), nl.ds(n0, nsz)], value=out)

                for_tiles(mw, PMAX, back)

            for_tiles(bm, M_SUB, m_sub)

        for_tiles(N, PMAX, n_tile)

    for_tiles(M, block_m, m_block)
    return y


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sizes", nargs="*", type=int, default=[2048, 1024, 2048], help="M K N")
    p.add_argument("--target", choices=("trn1", "trn2"), default="trn2")
    args = p.parse_args(argv)
    M, K, N = args.sizes
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    x = rng.standard_normal((M, K)).astype(bf16)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(bf16)
    b = rng.standard_normal(N).astype(bf16)
    block_m = tiles.linear_gelu_blocks(M, K, N, 2)[0]
    ref = reference.linear_gelu(x, w, b)
    print(f"GELU(x W + b), bf16, M={M} K={K} N={N}, simulated {args.target} (modeled, not hardware)")
    for name, run in (
            ("y tiles, bias as a rank-1 PSUM update", lambda: host.linear_gelu(x, w, b)),
            ("y^T tiles, bias in activation, transposed back",
             lambda: launch(linear_gelu_transposed, (1,), x, w, b, block_m=block_m))):
        with simulate.measure(target=args.target) as m:
            y = run()
        eng = ", ".join(f"{e} {s * 1e6:.1f}" for e, s in m.engine_seconds.items())
        print(f"  {name:48s} {m.modeled_seconds[0] * 1e6:8.1f} us  (engines us: {eng}; "
              f"DMAs {m.instructions.get('dma', 0)}; max err {reference.max_abs_err(y, ref):.1e})")


if __name__ == "__main__":
    main()
