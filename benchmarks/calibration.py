"""The scheduled estimate against published hardware measurements.

Two sets of AWS kernels, run unchanged on the simulator (nothing of AWS's is copied here):

* ``--suite matmul``: the matmul tutorial of aws-neuron/nki-samples at 0898a77 (legacy
  ``neuronxcc.nki``), five versions of one kernel. A public autotuning study measured the last
  one, ``nki_matmul_fully_optimized_``, at 2048^3 bf16 on trn2: **60.6 % MFU** with the
  tutorial's blocks (TILES_IN_BLOCK M/N/K = 16/2/8) and **79.1 % MFU** with 4/1/8. MFU is
  against the trn2 TensorE peak the simulator uses (128 x 128 bf16 MACs per PE cycle).
* ``--suite attention``: the attention tutorial of nki-samples at 6905a68
  (``src/nki_samples/tutorials/attention_fwd_performance``, legacy API), versions v3-v8 and
  v11, measured on a trn1.2xlarge (neuronx-cc 2.23, bf16, d = 128, one head, batch 1, p50 in
  microseconds; junjietang.dev, "flash attention on Trainium", 2026-03-12). Protocol: constants
  are fitted on the N <= 2048 rows only (the fit set); the N >= 4096 rows (the judge set) are
  reported separately. Goal: at least 80 % of the judge set within 25 %.

::

    python benchmarks/calibration.py --suite matmul --samples <nki-samples checkout at 0898a77>
    python benchmarks/calibration.py --suite attention --samples <nki-samples checkout at 6905a68>
    # or NKI_SAMPLES_DIR=<checkout>; --n 512 1024 picks lengths of the attention table
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

#: measured p50 latency in us on trn1.2xlarge (junjietang.dev, 2026-03-12): N -> per version
ATTENTION_VERSIONS = ("v3", "v4", "v5", "v6", "v7", "v8", "v11")
ATTENTION_MEASURED_US = {
    512: (57, 25, 23, 23, 19, 20, 19),
    1024: (175, 67, 53, 53, 39, 40, 37),
    2048: (652, 229, 171, 163, 112, 116, 98),
    4096: (3130, 873, 631, 609, 400, 421, 360),
    8192: (13105, 3360, 2455, 2565, 1526, 1613, 1387),
    16384: (67733, 17437, 16111, 16832, 6228, 8617, 35067),
}
FIT_MAX_N = 2048          # rows at or below: the fit set; above: the judge set
WITHIN = 0.25             # a point is "within" when |estimate / measured - 1| <= 25 %

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
    ap.add_argument("--suite", default="matmul", choices=["matmul", "attention"])
    ap.add_argument("--samples", default=os.environ.get("NKI_SAMPLES_DIR"))
    ap.add_argument("--size", type=int, default=2048, help="matmul: M = N = K")
    ap.add_argument("--target", default=None, choices=["trn1", "trn2"],
                    help="default: trn2 for matmul, trn1 (where it was measured) for attention")
    ap.add_argument("--n", type=int, nargs="+", default=sorted(ATTENTION_MEASURED_US),
                    help="attention: sequence lengths (default: every measured one)")
    a = ap.parse_args(argv)
    sub = "matrix_multiplication" if a.suite == "matmul" else "attention_fwd_performance"
    commit = "0898a77" if a.suite == "matmul" else "6905a68"
    path = None if not a.samples else os.path.join(a.samples, "src", "nki_samples", "tutorials",
                                                   sub)
    if not path or not os.path.isdir(path):
        ap.error(f"--samples must be a checkout of aws-neuron/nki-samples at {commit} (or set "
                 f"NKI_SAMPLES_DIR) with src/nki_samples/tutorials/{sub}; got {a.samples!r}. "
                 "Nothing is downloaded at run time.")
    for n in a.n:
        if n not in ATTENTION_MEASURED_US:
            ap.error(f"--n: {n} was not measured; choose from {sorted(ATTENTION_MEASURED_US)}")
    simulate.register_as_neuronxcc()
    if a.suite == "attention":
        return _attention(path, a.target or "trn1", a.n)
    a.target = a.target or "trn2"
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
    print(f"MFU est: of the modeled benchmark latency (estimate + {_hw.BENCH_OVERHEAD_NS / 1e3:.1f}"
          " us fitted benchmark overhead), as a device benchmark measures it")
    print(f"{'kernel':28s}{'bound us':>10s}{'estimate us':>13s}{'serial us':>11s}"
          f"{'MFU bound':>11s}{'MFU est':>9s}{'measured':>10s}{'est/meas':>10s}")
    rows = []
    for label, name, meta, measured in CASES:
        with simulate.measure(target=a.target) as m:
            simulate.simulate_kernel(getattr(mm, name), lhsT, rhs, **meta)
        lo, hi = m.modeled_seconds
        est = m.estimated_seconds
        mfu_b, mfu_e = flops / (lo * peak), flops / (m.benchmark_seconds * peak)
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


def _attention(path, target, lengths) -> int:
    """The attention tutorial's versions at each length beside their trn1 measurements."""
    import warnings

    sys.path.insert(0, path)
    import attention_kernels as ak        # the tutorial's module, run as AWS's test runs it

    print(f"AWS attention tutorial (nki-samples 6905a68) on {target}, bf16, d = 128, one head: "
          "modeled benchmark latency (scheduled estimate + "
          f"{_hw.BENCH_OVERHEAD_NS / 1e3:.1f} us fitted benchmark overhead) against the "
          "measured p50 (us)")
    print(f"{'N':>6s} {'version':>8s} {'estimate':>10s} {'measured':>9s} {'est/meas':>9s} "
          f"{'set':>6s} {'spilled':>8s} {'max err':>9s}")
    tally = {"fit": [0, 0], "judge": [0, 0]}
    for n in lengths:
        rng = np.random.default_rng(0)
        q, k, v = (((rng.random((128, n)) - 0.5) * 2).astype(ml_dtypes.bfloat16)
                   for _ in range(3))
        qf, kf, vf = (x.astype(np.float64) for x in (q, k, v))
        s = qf.T @ kf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        ref = (p / p.sum(axis=1, keepdims=True)) @ vf.T
        for ver, meas in zip(ATTENTION_VERSIONS, ATTENTION_MEASURED_US[n]):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", simulate.SpillWarning)
                with simulate.measure(target=target) as m:
                    out = simulate.simulate_kernel(getattr(ak, f"attn_fwd_{ver}"), q, k, v)
            est = m.benchmark_seconds * 1e6
            err = float(np.abs(np.asarray(out, np.float64) - ref).max())
            which = "fit" if n <= FIT_MAX_N else "judge"
            ok = abs(est / meas - 1) <= WITHIN
            tally[which][0] += ok
            tally[which][1] += 1
            print(f"{n:6d} {ver:>8s} {est:10.1f} {meas:9d} {est / meas:8.2f}{'' if ok else '*'} "
                  f"{which:>6s} {m.spill_refills:8d} {err:9.2e}", flush=True)
    for which, (ok, tot) in tally.items():
        if tot:
            print(f"{which} set (N {'<=' if which == 'fit' else '>'} {FIT_MAX_N}): {ok} of {tot} "
                  f"within {100 * WITHIN:.0f} % ({100 * ok / tot:.0f} %)")
    print("* outside 25 %. spilled: units reloaded after the compiler's spilling "
          "(simulate._spill, UNCONFIRMED)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
