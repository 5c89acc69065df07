"""Flash attention forward: modeled time on trn1/trn2/trn3 against the engine-aware limits.

Runs ``host.flash_attention`` (one batch, one head, bf16) inside ``simulate.measure`` and reports
the modeled time range (perfect overlap .. fully serial), the busy time of every engine, the
TensorE utilization ``4 N^2 D / (t * peak)`` (causal: half the FLOPs) and HBM bytes against the
IO lower bound, next to the limits of reference/hardware-and-limits.md §5:

- *FLOP bound*: TensorE at peak on the useful FLOPs (two matmul passes per score);
- *engine-aware*: each engine's unavoidable per-score work -- TensorE 3 passes (S, the P
  transposes, PV: 1/128 cycle each per score for D <= 128), ScalarE one exp (1/128), VectorE one
  fp32 max read of PSUM (1/128) -- the largest of them.

Causal runs count N^2/2 scores for the limits (the tile diagonal adds ~N*128/2 more in the kernel).

``--lens`` adds runs with runtime length tensors (``kv_lens = q_lens``, int32 inputs of the one
compiled kernel): ``full`` (every position valid) and ``N/2`` (the second half of each sequence is
padding). One compilation serves every set of lengths, so the compute is that of the padded shape
(causal = bottom_right: the kernel rotates each sequence by its lengths so that causal tile
skipping holds); the lengths save only the HBM reads of padding (HBM/LB below 1). The limits
columns stay those of the padded shape.

Modeled numbers are not hardware timings. Requires the bundled simulator backend.

    python benchmarks/forward.py [--n 4096 16384] [--d 128] [--targets trn2 trn1]
                                 [--lens none full N/2] [--p-dma-transpose 0.5] [--lnc 1|2]
                                 [--json out.json]

``--lnc 2`` (trn2) runs the two-core layout; its utilization is against both cores' peak.
"""
import argparse
import itertools
import sys
import time
from dataclasses import replace

import ml_dtypes
import numpy as np

from _common import TARGETS, hardware, write_json

import host  # noqa: E402
import simulate  # noqa: E402
from host import reference  # noqa: E402
from nki_kernels.nki import BACKEND  # noqa: E402

#: The issue's goals: TensorE utilization on the scheduled estimate >= 50 % for N = 4096,
#: D = 128, non-causal, trn2; >= 45 % causal.
GOALS = ({"target": "trn2", "N": 4096, "D": 128, "causal": False, "lnc": 1, "utilization": 0.5},
         {"target": "trn2", "N": 4096, "D": 128, "causal": True, "lnc": 1, "utilization": 0.45},
         {"target": "trn3", "N": 4096, "D": 128, "causal": False, "lnc": 1, "utilization": 0.55})


def limits(target, N, D, causal):
    """Per-engine lower limits (seconds) from the per-score costs of hardware-and-limits.md §5."""
    scores = N * N / (2 if causal else 1)
    passes = -(-D // 128)  # S and PV contract / produce D in passes of 128 columns
    clk = hardware(target).clock_hz
    pe_flop = 2 * passes * scores / 128 / clk["tensor"]
    pe_with_t = (2 * passes + 1) * scores / 128 / clk["tensor"]
    act = scores / 128 / clk["scalar"]
    dve = scores / 128 / clk["vector"]
    return {"flop_bound": pe_flop, "tensor_with_transposes": pe_with_t, "scalar_exp": act,
            "vector_max": dve, "engine_aware": max(pe_with_t, act, dve)}


#: ``--lens`` choices: the (kv_lens = q_lens) of the single sequence, or None.
LENS = {"none": lambda N: None, "full": lambda N: [N], "N/2": lambda N: [N // 2]}


def run(target, N, D, causal, seed=0, p_dma_transpose=None, lens="none", lnc=1):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 1, N, D)).astype(ml_dtypes.bfloat16) for _ in range(3))
    lengths = LENS[lens](N)
    t0 = time.time()
    with simulate.measure(target=target) as m:
        tiles = None
        if p_dma_transpose is not None:
            kw = host.plan_attention_forward(q, k, v, causal=causal, kv_lens=lengths,
                                             q_lens=lengths, lnc=lnc)[2]
            tiles = replace(kw["tiles"], p_dma_transpose_share=p_dma_transpose)
        # utilization is against the TensorE peak of the lnc cores
        host.flash_attention(q, k, v, causal=causal, tiles=tiles, kv_lens=lengths,
                             q_lens=lengths, lnc=lnc)
    wall = time.time() - t0
    lower, upper = m.modeled_seconds
    flops = 4 * N * N * D / (2 if causal else 1)
    bound = reference.io_lower_bound_bytes(1, 1, 1, N, N, D, 2)
    return {
        "target": target, "N": N, "D": D, "causal": causal, "lens": lens,
        "modeled_lower_us": lower * 1e6, "modeled_upper_us": upper * 1e6,
        "estimated_us": m.estimated_seconds * 1e6,
        "engine_us": {e: s * 1e6 for e, s in m.engine_seconds.items()},
        "lnc": lnc,
        "utilization": flops / (lower * lnc * hardware(target).tensor_peak_flops),
        "utilization_estimate": flops / (m.estimated_seconds * lnc
                                         * hardware(target).tensor_peak_flops),
        "hbm_bytes": m.hbm_bytes_read + m.hbm_bytes_written, "io_lower_bound_bytes": bound,
        "peak_sbuf_bytes_per_partition": m.peak_sbuf_bytes_per_partition,
        "limits_us": {name: s * 1e6 for name, s in limits(target, N, D, causal).items()},
        "simulation_wall_s": wall,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--targets", nargs="+", default=["trn2", "trn1"],
                    choices=TARGETS + ("trn3",), help="trn3 runs through nki.* only")
    ap.add_argument("--p-dma-transpose", type=float, default=None, metavar="SHARE",
                    help="fraction of P^T transposes done by the DMA engines "
                         "(tiles.ForwardTiles.p_dma_transpose_share; ignored on trn1); default: "
                         "the planner's (0 under legacy, tiles.FWD_NKI_P_DMA_SHARE under nki.*)")
    ap.add_argument("--lens", nargs="+", default=["none"], choices=list(LENS),
                    help="runs without length tensors (none) and/or with kv_lens = q_lens = [N] "
                         "(full) or [N/2] (N/2)")
    ap.add_argument("--lnc", type=int, choices=(1, 2), default=1,
                    help="NeuronCores per logical core (2: trn2 only; default 1)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if BACKEND != "simulate":
        sys.exit("benchmarks/forward.py needs the bundled simulator: set NKI_FLASH_BACKEND=simulate")

    rows = []
    head = (f"{'target':6} {'N':>6} {'causal':6} {'lens':4} {'lower us':>9} {'est us':>9} "
            f"{'upper us':>9} "
            f"{'util':>6} {'util est':>8} {'PE':>8} {'DVE':>8} {'ACT':>8} {'POOL':>7} "
            f"{'DMA':>7} | {'FLOP':>8} "
            f"{'eng-aware':>9} {'HBM bytes':>10} {'HBM/LB':>6}")
    print(head)
    print("-" * len(head))
    for target, N, causal, lens in itertools.product(args.targets, args.n, (False, True),
                                                     args.lens):
        if args.lnc == 2 and target != "trn2":
            continue
        r = run(target, N, args.d, causal, p_dma_transpose=args.p_dma_transpose, lens=lens,
                lnc=args.lnc)
        rows.append(r)
        e, lim = r["engine_us"], r["limits_us"]
        print(f"{target:6} {N:6d} {str(causal):6} {lens:4} {r['modeled_lower_us']:9.1f} "
              f"{r['estimated_us']:9.1f} "
              f"{r['modeled_upper_us']:9.1f} {100 * r['utilization']:5.1f}% "
              f"{100 * r['utilization_estimate']:7.1f}% "
              f"{e['tensor']:8.1f} {e['vector']:8.1f} {e['scalar']:8.1f} {e['gpsimd']:7.1f} "
              f"{e['dma']:7.1f} | {lim['flop_bound']:8.1f} {lim['engine_aware']:9.1f} "
              f"{r['hbm_bytes']:10d} {r['hbm_bytes'] / r['io_lower_bound_bytes']:6.3f}")
    for goal in GOALS:
        hit = [r for r in rows if r["lens"] == "none"
               and all(r[key] == goal[key] for key in ("target", "N", "D", "causal", "lnc"))]
        if hit:
            g = hit[0]
            verdict = "met" if g["utilization_estimate"] >= goal["utilization"] else "NOT met"
            mask = "causal" if goal["causal"] else "non-causal"
            print(f"goal ({goal['target']}, N=4096, D=128, {mask}, utilization on the estimate >= "
                  f"{100 * goal['utilization']:.0f} %): {verdict} -- "
                  f"{100 * g['utilization_estimate']:.1f} % at {g['estimated_us']:.1f} us "
                  f"(bound {100 * g['utilization']:.1f} % at {g['modeled_lower_us']:.1f} us)")
    write_json(args.json, rows, indent=2)
    return rows


if __name__ == "__main__":
    main()
