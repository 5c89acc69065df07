"""nki-library's attention_cte (AWS's production prefill kernel) and our forward, side by side
on the same simulator: trn2, one NeuronCore, the scheduled estimate, plus the accuracy of each
against a float64 reference.

    python benchmarks/nkilib_side_by_side.py /tmp/nkilib [--n 2048 8192] [--d 64 128]
                                             [--causal both|yes|no] [--allow-32k]

``/tmp/nkilib`` is a checkout of aws-neuron/nki-library (d2ad3a5 was used; nothing is
downloaded). After ``simulate.register_as_nki()`` attention_cte is imported from that checkout
and runs on the simulator's ``nki.*`` (NKI 0.7) front end exactly as in
benchmarks/nkilib_acceptance.py, whose helpers this script imports. Our forward is
``host.flash_attention(..., lnc=1)`` on whichever front end it traces through today (printed in
the header when the measurement records it). One batch, one head, bf16 inputs drawn once per
shape and given to both kernels (attention_cte takes Q as (B, S, d), K as (B, d, S), V as
(B, S, d); ours (B, H, N, D)); scale 1/sqrt(D); causal is the square top-left mask for both.

Max error is the largest absolute difference from softmax(scale q k^T) v computed in float64
from the same bf16-rounded inputs. Shapes from issue 24, item 5: N in {2K, 8K} x D in {64, 128}
x causal or not; N = 32K only with ``--allow-32k`` (attention_cte unrolls its Python loops under
NKI 0.7 and tracing it at 32K takes very long). Modeled numbers, not hardware timings.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import host  # noqa: E402
import simulate  # noqa: E402
from nkilib_acceptance import _bf16, _f32, _modules, _rand  # noqa: E402


def reference(q, k, v, causal, scale):
    """float64 attention of (N, D) q, k, v."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    s = (q @ k.T) * scale
    if causal:
        n = s.shape[0]
        s = np.where(np.tril(np.ones((n, s.shape[1]), bool)), s, -np.inf)
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=1, keepdims=True)
    return p @ v


def _timed(target, fn):
    t0 = time.time()
    with simulate.measure(target=target) as m:
        out = fn()
    return out, m, time.time() - t0


def run_shape(cte, N, D, causal, target):
    rng = np.random.default_rng(0)
    q, k, v = (_rand(rng, (N, D)) for _ in range(3))
    scale = 1.0 / math.sqrt(D)
    want = reference(q, k, v, causal, scale)

    ours, m_ours, w_ours = _timed(target, lambda: host.flash_attention(
        q[None, None], k[None, None], v[None, None], scale=scale,
        causal="top_left" if causal else False, lnc=1))
    ours = _f32(ours).reshape(N, D)

    kT = np.ascontiguousarray(k.T)
    theirs, m_aws, w_aws = _timed(target, lambda: cte(
        q[None], kT[None], v[None], scale=scale, causal_mask=causal))
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    theirs = _f32(theirs).reshape(N, D)

    def row(out, m, wall):
        return {"us": m.estimated_seconds * 1e6,
                "err": float(np.abs(out.astype(np.float64) - want).max()),
                "api": getattr(m, "api", None), "wall": wall,
                "instr": int(m.program_instructions)}
    floor = float(np.abs(want.astype(_bf16()).astype(np.float64) - want).max())
    return row(ours, m_ours, w_ours), row(theirs, m_aws, w_aws), floor


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("nkilib", help="path of an nki-library checkout (e.g. /tmp/nkilib)")
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--allow-32k", action="store_true",
                    help="permit N > 8192 (attention_cte's trace is very slow there)")
    ap.add_argument("--target", default="trn2")
    a = ap.parse_args(argv)
    if not a.allow_32k and any(n > 8192 for n in a.n):
        ap.error("N > 8192 needs --allow-32k (attention_cte unrolls under NKI 0.7: very slow)")
    simulate.register_as_nki()
    mods, errs = _modules(os.path.abspath(a.nkilib))
    if "cte" not in mods:
        sys.exit(f"cannot import attention_cte from {a.nkilib}: {errs.get('cte')}")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    print(f"nki-library at {a.nkilib}; target {a.target}, one NeuronCore, bf16, B = H = 1; "
          f"scheduled estimate; max |error| against float64")
    print("| N | D | mask | ours (us) | ours max err | nki-library (us) | nki-library max err "
          "| ours / nki-library |")
    print("|---|---|---|---|---|---|---|---|")
    for N in a.n:
        for D in a.d:
            for causal in causals:
                o, t, floor = run_shape(mods["cte"], N, D, causal, a.target)
                print(f"| {N} | {D} | {'causal' if causal else 'none'} | {o['us']:.1f} | "
                      f"{o['err']:.2e} | {t['us']:.1f} | {t['err']:.2e} | "
                      f"{o['us'] / t['us']:.2f} |", flush=True)
                print(f"  (front ends: ours {o['api']}, nki-library {t['api']}; program "
                      f"instructions {o['instr']} / {t['instr']}; wall {o['wall']:.0f} s / "
                      f"{t['wall']:.0f} s; bf16 rounding of the reference alone: {floor:.2e})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
