"""The scheduled estimate against published hardware figures: AWS's matmul tutorial kernels.

The matmul tutorial of aws-neuron/nki-samples at 0898a77 (legacy ``neuronxcc.nki``) has five
versions of one kernel, each faster than the one before. A public autotuning study measured
the last one, ``nki_matmul_fully_optimized_``, at 2048^3 bf16 on trn2: **60.6 % MFU** with
the tutorial's blocks (TILES_IN_BLOCK M/N/K = 16/2/8) and **79.1 % MFU** with 4/1/8 (issue
"Simulator fidelity", item 5). MFU is against the trn2 TensorE peak the simulator uses
(128 x 128 bf16 MACs per PE cycle). This runs the kernels unchanged on the simulator and
prints, for each, the perfect-overlap bound, the scheduled estimate and the serial bound, as
MFU, next to the measurement where there is one. Nothing of AWS's is copied here::

    python benchmarks/calibration.py --samples <nki-samples checkout at 0898a77>
    # or NKI_SAMPLES_DIR=<checkout>
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import ml_dtypes  # noqa: E402

import simulate  # noqa: E402
from simulate import _hw  # noqa: E402

#: (label, kernel name, meta-parameters, measured MFU or None)
CASES = (
    ("tiled", "nki_matmul_tiled_", {}, None),
    ("hoist_load", "nki_matmul_hoist_load_", {}, None),
    ("block_free_dimension", "nki_matmul_block_free_dimension_", {}, None),
    ("fully_optimized 16/2/8", "nki_matmul_fully_optimized_",
     dict(TILES_IN_BLOCK_M=16, TILES_IN_BLOCK_N=2, TILES_IN_BLOCK_K=8), 0.606),
    ("fully_optimized 4/1/8", "nki_matmul_fully_optimized_",
     dict(TILES_IN_BLOCK_M=4, TILES_IN_BLOCK_N=1, TILES_IN_BLOCK_K=8), 0.791),
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", default=os.environ.get("NKI_SAMPLES_DIR"))
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--target", default="trn2", choices=["trn1", "trn2"])
    a = ap.parse_args(argv)
    path = None if not a.samples else os.path.join(
        a.samples, "src", "nki_samples", "tutorials", "matrix_multiplication")
    if not path or not os.path.isdir(path):
        ap.error("--samples must be a checkout of aws-neuron/nki-samples at 0898a77 (or set "
                 f"NKI_SAMPLES_DIR); got {a.samples!r}. Nothing is downloaded at run time.")
    simulate.register_as_neuronxcc()
    sys.path.insert(0, os.path.join(a.samples, "src"))
    from nki_samples.tutorials.matrix_multiplication import \
        matrix_multiplication_nki_kernels as mm

    S = a.size
    rng = np.random.default_rng(0)
    lhsT = rng.standard_normal((S, S)).astype(ml_dtypes.bfloat16)
    rhs = rng.standard_normal((S, S)).astype(ml_dtypes.bfloat16)
    peak = _hw.get_target(a.target).tensor_peak_flops
    flops = 2.0 * S ** 3
    print(f"{S}^3 bf16 on {a.target} (MFU = {flops / 1e9:.1f} GFLOP / (time x "
          f"{peak / 1e12:.1f} TFLOP/s))")
    print(f"{'kernel':28s}{'bound us':>10s}{'estimate us':>13s}{'serial us':>11s}"
          f"{'MFU bound':>11s}{'MFU est':>9s}{'measured':>10s}{'est/meas':>10s}")
    rows = []
    for label, name, meta, measured in CASES:
        with simulate.measure(target=a.target) as m:
            simulate.simulate_kernel(getattr(mm, name), lhsT, rhs, **meta)
        lo, hi = m.modeled_seconds
        est = m.estimated_seconds
        mfu_b, mfu_e = flops / (lo * peak), flops / (est * peak)
        rows.append((label, est))
        meas = "" if measured is None else f"{100 * measured:9.1f}%"
        ratio = "" if measured is None else f"{mfu_e / measured:10.2f}"
        print(f"{label:28s}{lo * 1e6:10.1f}{est * 1e6:13.1f}{hi * 1e6:11.1f}"
              f"{100 * mfu_b:10.1f}%{100 * mfu_e:8.1f}%{meas:>10s}{ratio:>10s}")
    ests = [e for _, e in rows[:4]]
    print("ranking of the tutorial's versions by the estimate (slowest first): "
          + ("as the tutorial orders them" if ests == sorted(ests, reverse=True)
             else "NOT the tutorial's order"))
    a168, a418 = rows[3][1], rows[4][1]
    print(f"16/2/8 over 4/1/8: estimate {a168 / a418:.2f}x (measured 79.1 / 60.6 = 1.31x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
