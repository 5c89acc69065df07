"""Flash attention backward: HBM bytes and modeled time on trn1/trn2, the chosen design against
its alternatives and against the limits of reference/hardware-and-limits.md §5.

For one batch and one head (bf16, N x N, head dim D) it measures with ``simulate.measure``:

* ``single-pass`` -- the design (``host.flash_attention_backward``): K/V streamed once, the
  query-side state and the fp32 dQ accumulator resident in SBUF, dK/dV in PSUM, dS^T by
  TensorE transposes. 5 matmuls per score = 10 N^2 D FLOPs (plus the transposes).
* ``dq-in-hbm`` -- same, but dQ read-add-written in an fp32 HBM scratch after every
  (query tile, key tile) visit: what a one-kernel GPU backward does with atomics.
* ``two-kernel`` -- a dK/dV kernel plus a dQ kernel, each recomputing P and dP (the Triton /
  FlashAttention-2 split): 7 matmuls per score = 14 N^2 D FLOPs. Measured as the sum of the two
  launches of the same kernel with ``grads=("dk", "dv")`` and ``grads=("dq",)``.
* ``dma-transpose`` (trn2 only) -- the design with dS^T by SBUF -> SBUF DMA transposes
  instead of TensorE (opt-in: AWS disables this DMA transpose in its own kernels as unstable).
* ``passes=N/1024`` -- the design forced to keep only 1024 query rows resident per pass
  (what happens past the SBUF limit): K/V re-read per pass, dK/dV partial sums through HBM.
* ``lens=full``, ``lens=N/2``, ``q_lens=N/2`` -- the design with runtime length tensors
  (``kv_lens`` and ``q_lens``, or ``q_lens`` alone): all positions valid, or half of them
  padding. One compiled kernel serves any lengths, so the time is that of the padded shape;
  the lengths only save the padding's HBM reads. ``kv_lens`` costs one rank-1 TensorE mask
  matmul per score tile (the forward's key-length mask); with bottom_right the gathers rotate
  the sequence so that causal tile skipping still applies.

Limits (per NeuronCore, µs; causal counts N^2/2 scores): *strict* = max(TensorE at peak on the
5 matmul passes, the minimum HBM traffic 16 N D + 4 N bytes at the per-NC HBM share);
*engine-aware* = TensorE with 7 passes (5 + 2 transposes), the table's figure (the design needs
5 on trn2, 6 on trn1).

Modeled numbers are not hardware timings. Requires the bundled simulator backend.

    python benchmarks/backward.py [--n 4096] [--d 128] [--targets trn2 trn1] [--json out.json]
"""
import argparse
import sys
import time

import ml_dtypes
import numpy as np

from _common import hardware, write_json

import host  # noqa: E402
import simulate  # noqa: E402
from host import reference  # noqa: E402
from host._launch import launch  # noqa: E402
from nki_kernels import tiles  # noqa: E402
from nki_kernels.attention.backward import flash_attn_bwd  # noqa: E402
from nki_kernels.nki import BACKEND  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
#: Matmuls per score of the two designs (S, dP, dV, dK, dQ vs. + S and dP again).
MATMULS = {"single-pass": 5, "two-kernel": 7}


def flops(N, D, causal, matmuls=5):
    """2 N^2 D FLOPs per matmul pass over all scores (half with a causal mask)."""
    return matmuls * 2 * N * N * D / (2 if causal else 1)


def limits(target, N, D, causal):
    """The §5 limits in seconds: strict and engine-aware (7 TensorE passes per score)."""
    hw = hardware(target)
    scores = N * N / (2 if causal else 1)
    d_passes = -(-D // 128)
    pe5 = 5 * d_passes * scores / 128 / hw.clock_hz["tensor"]
    hbm = (16 * N * D + 4 * N) / hw.hbm_share_bytes_per_s
    pe7 = (5 * d_passes + 2) * scores / 128 / hw.clock_hz["tensor"]
    return {"strict": max(pe5, hbm), "engine_aware": pe7, "hbm_min_bytes": 16 * N * D + 4 * N}


def inputs(N, D, causal, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((1, 1, N, D)).astype(BF16) for _ in range(4))
    o, lse = reference.attention_forward(q, k, v, causal=causal)
    return do, q, k, v, o.astype(BF16), lse.astype(np.float32)


def measure(target, variant, args, causal):
    do, q, k, v, o, lse = args
    N, D = q.shape[2], q.shape[3]
    kw = dict(scale=1.0 / np.sqrt(D), causal=causal)
    t0 = time.time()
    lens = {"lens=full": ([N], [N]), "lens=N/2": ([N // 2], [N // 2]),
            "q_lens=N/2": ([N // 2], None)}
    with simulate.measure(target=target) as m:
        if variant == "single-pass":
            host.flash_attention_backward(do, q, k, v, o, lse, causal=causal)
        elif variant in lens:
            q_lens, kv_lens = lens[variant]
            host.flash_attention_backward(do, q, k, v, o, lse, causal=causal, q_lens=q_lens,
                                          kv_lens=kv_lens)
        elif variant == "dq-in-hbm":
            launch(flash_attn_bwd, (1, 1), q, k, v, o, do, lse, dq_accumulate="hbm", **kw)
        elif variant == "two-kernel":
            launch(flash_attn_bwd, (1, 1), q, k, v, o, do, lse, grads=("dk", "dv"), **kw)
            launch(flash_attn_bwd, (1, 1), q, k, v, o, do, lse, grads=("dq",), **kw)
        elif variant == "dma-transpose":
            launch(flash_attn_bwd, (1, 1), q, k, v, o, do, lse, ds_transpose="dma", **kw)
        elif variant.startswith("passes"):
            launch(flash_attn_bwd, (1, 1), q, k, v, o, do, lse, rows_per_pass=1024, **kw)
        else:
            raise ValueError(variant)
    lo, hi = m.modeled_seconds
    return {
        "target": target, "variant": variant, "N": N, "D": D, "causal": bool(causal),
        "hbm_read": m.hbm_bytes_read, "hbm_written": m.hbm_bytes_written,
        "modeled_us": [lo * 1e6, hi * 1e6],
        "estimated_us": m.estimated_seconds * 1e6,
        "engine_us": {e: s * 1e6 for e, s in m.engine_seconds.items()},
        "peak_sbuf_bytes_per_partition": m.peak_sbuf_bytes_per_partition,
        "peak_psum_banks": m.peak_psum_banks,
        "kernels": len(m.kernels), "sim_wall_s": time.time() - t0,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--targets", nargs="+", default=["trn2", "trn1"])
    ap.add_argument("--variants", nargs="+",
                    default=["single-pass", "dq-in-hbm", "two-kernel", "dma-transpose",
                             "passes=N/1024", "lens=full", "lens=N/2", "q_lens=N/2"])
    ap.add_argument("--json", help="write all rows to this file")
    a = ap.parse_args(argv)
    if BACKEND != "simulate":
        sys.exit("benchmarks/backward.py needs the bundled simulator (NKI_FLASH_BACKEND=simulate)")

    rows = []
    for target in a.targets:
        rows_on_chip = tiles.bwd_rows_per_pass(a.d, 2, target)
        print(f"\n== {target}: D={a.d} bf16; one pass (dQ and the query side on chip) up to "
              f"G*N = {rows_on_chip} query rows per kv head ==")
        for N in a.n:
            for causal in (None, "bottom_right"):
                lim = limits(target, N, a.d, causal)
                args = inputs(N, a.d, causal)
                print(f"-- N={N} {'causal' if causal else 'non-causal'}: strict "
                      f"{lim['strict'] * 1e6:.0f} us, engine-aware (7 PE passes) "
                      f"{lim['engine_aware'] * 1e6:.0f} us, min HBM {lim['hbm_min_bytes']} B")
                print(f"   {'variant':<14}{'HBM read':>11}{'written':>10}{'modeled us':>17}"
                      f"{'est us':>9}"
                      f"{'PE':>8}{'ACT':>8}{'DVE':>8}{'POOL':>7}{'DMA':>8}{'TFLOP/s':>9}")
                for variant in a.variants:
                    if variant == "dma-transpose" and target != "trn2":
                        continue
                    r = measure(target, variant, args, causal)
                    r.update(limits_us={k: v * 1e6 for k, v in lim.items() if k != "hbm_min_bytes"},
                             flops_useful=flops(N, a.d, causal),
                             flops_executed=flops(N, a.d, causal, MATMULS.get(variant, 5)),
                             single_pass_rows=rows_on_chip)
                    rows.append(r)
                    e = r["engine_us"]
                    tflops = r["flops_useful"] / (r["modeled_us"][0] * 1e-6) / 1e12
                    print(f"   {variant:<14}{r['hbm_read']:>11}{r['hbm_written']:>10}"
                          f"{r['modeled_us'][0]:>8.1f}..{r['modeled_us'][1]:<7.0f}"
                          f"{r['estimated_us']:>9.1f}"
                          f"{e['tensor']:>8.1f}{e['scalar']:>8.1f}{e['vector']:>8.1f}"
                          f"{e['gpsimd']:>7.1f}{e['dma']:>8.1f}{tflops:>9.1f}")
    write_json(a.json, rows)
    return rows


if __name__ == "__main__":
    main()
