"""Block-sparse flash attention: HBM traffic and modeled time against the density s.

FlashAttention's Proposition 4 bounds the IO of block-sparse attention by Theta(N d + N^2 d^2
M^-1 s): a term for Q, O (and here the LSE) that does not depend on the pattern, plus a term
proportional to the fraction s of active blocks. This sweeps s from 1 to 1/64 at several N and
D (the evenly spread ``host.block_sparse.fixed_density`` pattern: exactly ``round(s nkt)``
key blocks per query tile), measures every launch with ``simulate.measure`` (exact HBM bytes;
modeled time, perfect-overlap bound and serial bound), and fits Proposition 4's form to the
measurements: ``fixed`` is the pattern-independent bytes (computed from the shapes: Q read,
O and LSE written, the pattern tables), and the *proportional part* ``(bytes(s) - fixed) /
(bytes(1) - fixed)`` is compared with s. Time gets the same treatment with its own fixed part
(the s -> 0 intercept of a least-squares line). It also runs the paper's butterfly pattern and
a local + global pattern (sliding window of one block plus one global block) and, at s = 1,
the dense kernel, for comparison.

    python benchmarks/block_sparse.py [--n 4096 16384 ...] [--d 64 128] [--target trn2]
                                      [--min-density 64] [--out DIR]

Writes ``DIR/block_sparse.json`` and, with matplotlib, ``DIR/block_sparse.png``. Every number
is the simulator's model of the named target (forward kernel, B = Hq = Hkv = 1, bf16): the
perfect-overlap bound (``us``) and the scheduled estimate (``est us``); ``t/(s t1)`` is the
bound's time over s times its time at s = 1 (1.0 = exactly proportional).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import ml_dtypes  # noqa: E402

from host import api  # noqa: E402
from host import block_sparse as bs  # noqa: E402
from host import validation as _v  # noqa: E402
from host.bench import measure  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def inputs(N, D, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, 1, N, D)).astype(BF16) for _ in range(3))


def fixed_bytes(N, D, trip_cols):
    """Pattern-independent traffic of one launch: Q read, O written (bf16), LSE written (fp32),
    and the pattern table read (int32, one row of 2 + trip per query tile)."""
    nqt = -(-N // 128)
    return 2 * N * D * 2 + N * 4 + nqt * (2 + trip_cols) * 4


def run_pattern(N, D, mask, target):
    q, k, v = inputs(N, D)
    sp = bs.check_block_mask(mask, 1, 1, N, N)
    trip = max(t for _, _, t, _ in bs.launch_tables(sp, group=1, backward=False).q.classes)
    # the block-sparse kernel itself, also at density 1 (where flash_attention would hand an
    # all-True pattern to the dense kernel)
    call = api._attention_call(_v.check_attention_inputs(q, k, v), _v.dtype_name(q), sp)
    row = measure(lambda: api._block_sparse_forward(q, k, v, call), target)
    row.update(density=float(mask.mean()), fixed_bytes=fixed_bytes(N, D, trip))
    return row


def proportional(rows, key, fixed):
    """``(part(s) / part(1), s)`` pairs of the s-dependent part of ``key``."""
    full = next(r for r in rows if r["density"] == 1.0)
    base = full[key] - fixed(full)
    return [((r[key] - fixed(r)) / base, r["density"]) for r in rows]


def time_intercept(rows):
    """Least-squares ``us = a + b s``: the fixed part a of the modeled time."""
    s = np.array([r["density"] for r in rows])
    t = np.array([r["modeled_us_overlap"] for r in rows])
    b, a = np.polyfit(s, t, 1)
    return float(a), float(b)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--target", default="trn2", choices=["trn1", "trn2"])
    ap.add_argument("--min-density", type=int, default=64, help="sweep s = 1 .. 1/this")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dens = [1.0 / (1 << i) for i in range(int(np.log2(args.min_density)) + 1)]
    results = {"target": args.target, "sweeps": [], "patterns": []}
    path = os.path.join(args.out, "block_sparse.json")
    print(f"{'N':>6} {'D':>4} {'s':>8} {'HBM MB':>9} {'part/s':>7} {'us':>9} {'est us':>9} "
          f"{'t/(s t1)':>8} {'dense us':>9} {'dense est':>9}")
    for D in args.d:
        for N in args.n:
            nqt = N // 128
            rows = []
            for s in dens:
                rows.append(run_pattern(N, D, bs.fixed_density(nqt, nqt, s), args.target))
            q, k, v = inputs(N, D)
            dense = measure(lambda: api.flash_attention(q, k, v, lnc=1), args.target)
            part = proportional(rows, "hbm_bytes", lambda r: r["fixed_bytes"])
            a, b = time_intercept(rows)
            for r, (ratio, s) in zip(rows, part):
                us, us1 = r["modeled_us_overlap"], rows[0]["modeled_us_overlap"]
                r["bytes_part_over_s"] = ratio / s
                r["time_part_over_s"] = ((us - a) / b) / s
                r["time_over_s"] = us / (s * us1)
                dense_us, dense_est = ((dense["modeled_us_overlap"], dense["modeled_us_estimate"])
                                       if s == 1.0 else (float("nan"), float("nan")))
                print(f"{N:6d} {D:4d} {s:8.4f} {r['hbm_bytes'] / 1e6:9.2f} {ratio / s:7.3f} "
                      f"{us:9.1f} {r['modeled_us_estimate']:9.1f} {r['time_over_s']:8.3f} "
                      f"{dense_us:9.1f} {dense_est:9.1f}", flush=True)
            results["sweeps"].append(dict(N=N, D=D, rows=rows, dense=dense,
                                          time_fit_us=dict(fixed=a, per_density=b)))
            with open(path, "w") as fh:
                json.dump(results, fh, indent=1)
    for N in args.n:
        nqt = N // 128
        for name, mask in (("butterfly", bs.butterfly(nqt, nqt)),
                           ("local-global", bs.local_global(nqt, nqt))):
            row = run_pattern(N, 128, mask, args.target)
            row.update(N=N, D=128, pattern=name)
            results["patterns"].append(row)
            print(f"{name:>12} N={N} s={row['density']:.4f} {row['hbm_bytes'] / 1e6:.2f} MB "
                  f"{row['modeled_us_overlap']:.1f} us (estimate "
                  f"{row['modeled_us_estimate']:.1f} us)", flush=True)
            with open(path, "w") as fh:
                json.dump(results, fh, indent=1)
    plot(results, os.path.join(args.out, "block_sparse.png"))
    print(f"wrote {path}")


def plot(results, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for sw in results["sweeps"]:
        s = np.array([r["density"] for r in sw["rows"]])
        label = f"N={sw['N'] // 1024}K d={sw['D']}"
        fixed = sw["rows"][0]["fixed_bytes"]
        by = np.array([r["hbm_bytes"] for r in sw["rows"]])
        line, = axes[0].loglog(s, by / 1e6, "o-", label=label)
        # Proposition 4's form: fixed (N d) + a part proportional to s
        axes[0].loglog(s, (fixed + s * (by[0] - fixed)) / 1e6, ":", color=line.get_color())
        us = np.array([r["modeled_us_overlap"] for r in sw["rows"]])
        fit = sw["time_fit_us"]
        axes[1].loglog(s, us, "o-", color=line.get_color(), label=label)
        axes[1].loglog(s, fit["fixed"] + s * fit["per_density"], ":", color=line.get_color())
    axes[0].set(xlabel="density s", ylabel="HBM MB", title="HBM traffic (dotted: N d + c s)")
    axes[1].set(xlabel="density s", ylabel="modeled us (overlap bound)",
                title=f"modeled time, {results['target']} (dotted: a + b s)")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
