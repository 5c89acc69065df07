"""AWS's legacy flash attention kernels and ours, side by side under the same cost model.

AWS's ``flash_fwd`` and ``flash_attn_bwd`` (aws-neuron/nki-samples at 0898a77,
``src/nki_samples/reference/attention.py``) run unchanged on the bundled simulator (see
benchmarks/aws_acceptance.py), so both families can be measured by the same
``simulate.measure``: HBM bytes, program size and the two modeled times (the perfect-overlap
lower bound and the serial upper bound). One batch, one head, bf16, N x N, D = 128; AWS's
kernels take Q and K as ``(B, H, D, N)`` and the LSE as ``(B, H, 128, N / 128)``, ours the
standard ``(B, H, N, D)``. Nothing of AWS's is copied here: point ``--samples`` (or
``NKI_SAMPLES_DIR``) at your own checkout.

    python benchmarks/aws_side_by_side.py --samples ../nki-samples [--n 4096] [--targets trn2]

Modeled numbers, not hardware timings.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import ml_dtypes  # noqa: E402

import host  # noqa: E402
import simulate  # noqa: E402
from host.bench import measure  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def run(target, N, D, causal, aws):
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 1, N, D)).astype(BF16) for _ in range(4))
    o, lse = host.flash_attention(q, k, v, causal=causal, return_lse=True, lnc=1)
    mask = "bottom_right" if causal else None
    rows = {
        "nki-flash forward": measure(lambda: host.flash_attention(
            q, k, v, causal=causal, lnc=1), target),
        "nki-flash backward": measure(lambda: host.flash_attention_backward(
            do, q, k, v, o, lse, causal=mask, lnc=1), target),
    }
    if aws is not None:
        flash_fwd, flash_attn_bwd, FlashConfig = aws
        qT, kT = q.transpose(0, 1, 3, 2).copy(), k.transpose(0, 1, 3, 2).copy()
        oT, doT = o.transpose(0, 1, 3, 2).copy(), do.transpose(0, 1, 3, 2).copy()
        lse_aws = lse.reshape(1, 1, N // 128, 128).transpose(0, 1, 3, 2).copy()
        cfg = FlashConfig(seq_tile_size=2048, training=False)
        rows["AWS flash_fwd"] = measure(lambda: simulate.simulate_kernel(
            flash_fwd[1, 1], qT, kT, v, None, use_causal_mask=causal, mixed_precision=True,
            config=cfg), target)
        rows["AWS flash_attn_bwd"] = measure(lambda: simulate.simulate_kernel(
            flash_attn_bwd[1, 1], qT, kT, v.transpose(0, 1, 3, 2).copy(), oT, doT, lse_aws,
            None, use_causal_mask=causal, mixed_precision=True), target)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", default=os.environ.get("NKI_SAMPLES_DIR"),
                    help="a checkout of aws-neuron/nki-samples at 0898a77 (or NKI_SAMPLES_DIR);"
                         " without it only nki-flash is measured")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--targets", nargs="+", default=["trn2"])
    a = ap.parse_args(argv)
    aws = None
    if a.samples:
        simulate.register_as_neuronxcc()
        sys.path.insert(0, os.path.join(a.samples, "src"))
        from nki_samples.reference.attention import FlashConfig, flash_attn_bwd, flash_fwd
        aws = (flash_fwd, flash_attn_bwd, FlashConfig)
    print(f"| target | mask | kernel | modeled (overlap .. serial) | scheduled estimate | "
          f"HBM read / written | program |")
    print("|---|---|---|---|---|---|---|")
    for target in a.targets:
        for causal in (False, True):
            for name, r in run(target, a.n, a.d, causal, aws).items():
                print(f"| {target} | {'causal' if causal else 'none'} | {name} | "
                      f"{r['modeled_us_overlap']:.1f} .. {r['modeled_us_serial']:.1f} us | "
                      f"{r['modeled_us_estimate']:.1f} us | {r['hbm_read'] / 1e6:.2f} / "
                      f"{r['hbm_written'] / 1e6:.2f} MB | {r['program_instructions']} |",
                      flush=True)


if __name__ == "__main__":
    main()
