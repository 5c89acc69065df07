"""Simulator speed benchmark (issue #2): a K-tiled 2048 x 2048 x 2048 bf16 matmul kernel.

The kernel is written the way NKI's matmul tutorial writes it: 128 x 512 output tiles, K tiles
of 128, ``psum += nisa.nc_matmul(lhsT_tile, rhs_tile)`` with the left operand given as [K, M]
(pass ``--transpose-on-load`` to load it as [M, K] with ``nl.load_transpose2d`` instead).
Target: simulation wall time <= 3 x numpy.matmul(float32) + 1 s.

    python benchmarks/sim_matmul.py [--size 2048] [--repeats 3] [--transpose-on-load]
"""

import argparse
import time

import numpy as np
import ml_dtypes

import _common  # noqa: E402,F401  (puts the repository on sys.path)

import simulate as nki  # noqa: E402
import simulate.language as nl  # noqa: E402
import simulate.isa as nisa  # noqa: E402

TILE_M, TILE_K, TILE_N = 128, 128, 512


@nki.jit
def matmul_lhsT(lhsT, rhs):
    """out[M, N] = lhsT[K, M].T @ rhs[K, N]; bf16 in, fp32 PSUM accumulation, fp32 out."""
    K, M = lhsT.shape
    _, N = rhs.shape
    out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            res_psum = nl.zeros((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                lhsT_tile = nl.load(lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
                rhs_tile = nl.load(rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                res_psum += nisa.nc_matmul(lhsT_tile, rhs_tile)
            res_sb = nl.copy(res_psum, dtype=out.dtype)
            nl.store(out[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N], value=res_sb)
    return out


@nki.jit
def matmul_transpose_on_load(lhs, rhs):
    """out[M, N] = lhs[M, K] @ rhs[K, N]; lhs tiles transposed by the DMA (load_transpose2d)."""
    M, K = lhs.shape
    _, N = rhs.shape
    out = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            res_psum = nl.zeros((TILE_M, TILE_N), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TILE_K):
                lhsT_tile = nl.load_transpose2d(
                    lhs[m * TILE_M:(m + 1) * TILE_M, k * TILE_K:(k + 1) * TILE_K])
                rhs_tile = nl.load(rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                res_psum += nisa.nc_matmul(lhsT_tile, rhs_tile)
            res_sb = nl.copy(res_psum, dtype=out.dtype)
            nl.store(out[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N], value=res_sb)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transpose-on-load", action="store_true")
    args = ap.parse_args()
    if args.size < TILE_N or args.size % TILE_N:
        ap.error(f"--size: expected a multiple of the {TILE_N}-column output tile "
                 f"({TILE_N}, {2 * TILE_N}, ...), got {args.size}")
    n = args.size
    rng = np.random.default_rng(0)
    a32 = rng.standard_normal((n, n), dtype=np.float32)
    b32 = rng.standard_normal((n, n), dtype=np.float32)
    a16, b16 = a32.astype(ml_dtypes.bfloat16), b32.astype(ml_dtypes.bfloat16)

    np_times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        ref = np.matmul(a32, b32)
        np_times.append(time.perf_counter() - t)

    kern = matmul_transpose_on_load if args.transpose_on_load else matmul_lhsT
    sim_times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        out = kern(a16, b16)
        sim_times.append(time.perf_counter() - t)

    exact = (a16.astype(np.float64) if args.transpose_on_load else a16.astype(np.float64).T) \
        @ b16.astype(np.float64)
    err = float(np.abs(out - exact).max())
    t_np, t_sim = min(np_times), min(sim_times)
    budget = 3 * t_np + 1.0
    print(f"numpy.matmul float32 {n}x{n}x{n}: {t_np:.3f} s (best of {args.repeats})")
    print(f"simulated NKI kernel ({kern.__name__}, bf16, PSUM fp32): {t_sim:.3f} s "
          f"(best of {args.repeats}); max abs error vs float64 {err:.3e}")
    print(f"ratio sim/numpy = {t_sim / t_np:.2f}; budget 3 x numpy + 1 s = {budget:.3f} s -> "
          f"{'OK' if t_sim <= budget else 'OVER BUDGET'}")
    del ref


if __name__ == "__main__":
    main()
