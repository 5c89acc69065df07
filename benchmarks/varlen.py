"""Packed variable-length attention against separate calls (issue 26, item 1's cost goal).

``--seqs`` causal sequences of ``--n`` tokens each, packed into one
``flash_attention(..., cu_seqlens_q=, cu_seqlens_k=)`` call, against the sum of as many
separate dense ``flash_attention`` calls of one sequence (B = 1), on one NeuronCore (lnc=1),
H heads (Hq = Hkv), D = 128, bf16. Every number is the simulator's scheduled estimate
(``simulate.measure``'s ``estimated_seconds``) of the named target. The goal holds the packed
call to at most 1.15x the separate calls on trn2 through ``nki.*``; trn1's legacy kernel (no
runtime trip count: every query tile sweeps all keys) is reported, not held to it.

    python benchmarks/varlen.py [--seqs 8] [--n 512] [--heads 8] [--target trn2 trn1]
                                [--backward] [--mods]

``--mods``: the same case with each score modifier (soft-capping 30, ALiBi with the CLI's
slopes, sinks, all three), packed against separate calls, and the packed call's cost over
the plain packed one (reported, no goal).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import ml_dtypes  # noqa: E402

import host  # noqa: E402
from host.bench import measure  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
GOAL = 1.15


def _qkv(H, N, D, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, H, N, D)).astype(BF16) for _ in range(3))


#: --mods: the modifier sets measured (ALiBi's slopes those of ``nki-flash run --alibi``)
def mod_sets(H: int) -> dict:
    slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    sinks = np.random.default_rng(2).standard_normal(H)
    return {"none": {}, "softcap": dict(softcap=30.0), "alibi": dict(alibi_slopes=slopes),
            "sinks": dict(sinks=sinks),
            "all three": dict(softcap=30.0, alibi_slopes=slopes, sinks=sinks)}


def compare(seqs: int, n: int, H: int, D: int, target: str, backward: bool = False,
            mods=None):
    """``(packed us, separate us)``: scheduled estimates on ``target`` of the forward, or
    with ``backward`` of ``flash_attention_backward`` (its inputs from the forward), with the
    score modifiers ``mods`` (keyword arguments of both, or None)."""
    mods = mods or {}
    q, k, v = _qkv(H, seqs * n, D)
    do = _qkv(H, seqs * n, D, seed=1)[0]
    cu = np.arange(0, seqs * n + 1, n, dtype=np.int32)

    def run(rows, **packed):
        args = [x[:, :, rows] for x in (q, k, v)]
        if not backward:
            return lambda: host.flash_attention(*args, causal=True, lnc=1, **packed, **mods)
        o, lse = host.flash_attention(*args, causal=True, lnc=1, return_lse=True, **packed,
                                      **mods)
        return lambda: host.flash_attention_backward(do[:, :, rows], *args, o, lse,
                                                     causal=True, lnc=1, **packed, **mods)

    packed = measure(run(slice(None), cu_seqlens_q=cu, cu_seqlens_k=cu), target)
    separate = sum(measure(run(slice(s * n, (s + 1) * n)), target)["modeled_us_estimate"]
                   for s in range(seqs))
    return packed["modeled_us_estimate"], separate


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--target", nargs="+", default=["trn2", "trn1"])
    ap.add_argument("--backward", action="store_true",
                    help="the backward (no goal: reported) instead of the forward")
    ap.add_argument("--mods", action="store_true",
                    help="each score modifier's cost (reported) instead of the goal")
    args = ap.parse_args(argv)
    if args.mods:
        return report_mods(args)
    print(f"{'backward' if args.backward else 'forward'}: {args.seqs} causal sequences of "
          f"{args.n}, Hq = Hkv = {args.heads}, D = {args.d}, bf16, lnc=1; scheduled estimates")
    print(f"{'target':8} {'api':7} {'packed us':>10} {'separate us':>12} {'ratio':>7}  goal")
    for target in args.target:
        # NKI_FLASH_API=auto (the default) traces trn2 through nki.*, trn1 through legacy
        api = "nki" if target != "trn1" else "legacy"
        packed, separate = compare(args.seqs, args.n, args.heads, args.d, target,
                                   args.backward)
        ratio = packed / separate
        goal = (f"<= {GOAL} {'met' if ratio <= GOAL else 'NOT met'}"
                if api == "nki" and not args.backward else "reported")
        print(f"{target:8} {api:7} {packed:10.1f} {separate:12.1f} {ratio:7.3f}  {goal}")


def report_mods(args):
    """``--mods``: per target and modifier set, the packed and separate estimates, their
    ratio and the packed call's cost over the plain packed one."""
    print(f"{'backward' if args.backward else 'forward'}: {args.seqs} causal sequences of "
          f"{args.n}, Hq = Hkv = {args.heads}, D = {args.d}, bf16, lnc=1, score modifiers; "
          f"scheduled estimates")
    print(f"{'target':8} {'modifiers':10} {'packed us':>10} {'separate us':>12} {'ratio':>7} "
          f"{'vs plain packed':>16}")
    for target in args.target:
        plain = None
        for name, mods in mod_sets(args.heads).items():
            packed, separate = compare(args.seqs, args.n, args.heads, args.d, target,
                                       args.backward, mods)
            plain = packed if plain is None else plain
            print(f"{target:8} {name:10} {packed:10.1f} {separate:12.1f} "
                  f"{packed / separate:7.3f} {packed / plain:16.3f}")


if __name__ == "__main__":
    main()
