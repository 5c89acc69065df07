"""Compiled program size of the attention kernels against the sequence length.

neuronx-cc compiles a kernel by tracing it: an ``nl.affine_range``/``nl.sequential_range`` body
becomes one loop in the program, while Python loops and ``nl.static_range`` are unrolled into
straight-line code. The program size is what decides whether a kernel compiles at all (the
5M-instruction limit, aws-neuron-sdk #819) and how long it takes (#1374), so it must not grow
with N. This prints, for N = 1K .. 128K, the instructions of one launch as the compiler would
emit them: ``simulate.program_size`` for the forward and backward (each NKI loop body traced
once, nothing executed), and ``simulate.measure(...).program_instructions`` of a full run for
decode (its work is linear in N, so it runs).

    python benchmarks/program_size.py [--d 128] [--target trn2] [--max-n 131072] [--json out]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import ml_dtypes  # noqa: E402

import simulate  # noqa: E402
from host import api  # noqa: E402
from host._launch import program_size  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def forward_size(N, D, causal):
    q = np.zeros((1, 1, N, D), BF16)
    k = np.zeros((1, 1, N, D), BF16)
    kernel, grid, kw = api.plan_attention_forward(q, k, k, causal=causal, lnc=1)
    return program_size(kernel, grid, q, k, k, **kw)


def backward_size(N, D, causal):
    q = np.zeros((1, 1, N, D), BF16)
    lse = np.zeros((1, 1, N), np.float32)
    kernel, grid, kw = api.plan_attention_backward(q, q, q, q, q, lse, causal=causal)
    return program_size(kernel, grid, q, q, q, q, q, lse, **kw)


def decode_size(N, D):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 1, D)).astype(BF16)
    cache = rng.standard_normal((1, 1, N, D)).astype(BF16)
    with simulate.measure() as m:
        api.flash_decode(q, cache, cache, cache_lens=np.array([N]))
    return m.program_instructions_per_kernel


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--target", default="trn2", choices=["trn1", "trn2"])
    ap.add_argument("--max-n", type=int, default=128 * 1024)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    old = os.environ.get(simulate._hw.TARGET_ENV_VAR)
    os.environ[simulate._hw.TARGET_ENV_VAR] = a.target
    try:
        rows = _table(a)
    finally:
        if old is None:
            os.environ.pop(simulate._hw.TARGET_ENV_VAR, None)
        else:
            os.environ[simulate._hw.TARGET_ENV_VAR] = old
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def _table(a):
    rows = []
    n = 1024
    print(f"program instructions per launch (D = {a.d}, bf16, {a.target}; one head)")
    print("| N | forward | forward causal | backward | backward causal | decode |")
    print("|---:|---:|---:|---:|---:|---:|")
    while n <= a.max_n:
        dec = decode_size(n, a.d)
        row = dict(N=n, forward=forward_size(n, a.d, False),
                   forward_causal=forward_size(n, a.d, True),
                   backward=backward_size(n, a.d, False),
                   backward_causal=backward_size(n, a.d, True),
                   decode=sum(dec.values()) if isinstance(dec, dict) else dec)
        rows.append(row)
        print(f"| {n // 1024}K | {row['forward']} | {row['forward_causal']} | "
              f"{row['backward']} | {row['backward_causal']} | {row['decode']} |", flush=True)
        n *= 2
    return rows


if __name__ == "__main__":
    main()
