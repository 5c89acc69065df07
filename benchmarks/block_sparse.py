"""Block-sparse flash attention against dense attention: HBM traffic and scheduled time per
density s.

For each N and D this measures, with ``simulate.measure`` (exact HBM bytes; the scheduled
estimate of the named target, one core, B = Hkv = 1, Hq = ``--hq`` query heads sharing the
kv head (GQA; default 1), bf16), the dense kernel once per pass (forward, backward) and the
block-sparse kernels on

- the evenly spread ``host.block_sparse.fixed_density`` pattern (exactly ``round(s nkt)`` key
  blocks per query tile, rotated by the tile index), s = 1 .. 1/``--min-density``;
- ``band+strided``: a local band of three key blocks around the diagonal plus one strided
  global key block per query tile (block ``8 floor(i / 8)``: every eighth key block is global
  for the eight query tiles from it), s = 0.115 at 4K, 0.029 at 16K;
- with ``--random S ...``: a random pattern at each density S (every block active with
  probability S, drawn by ``np.random.default_rng(--seed)``; no structure for the host to
  group, the hard case past SBUF);

in both forms of a pattern: ``dense`` (a bool block mask, a compile-time pattern: the host sorts
and groups the query tiles, and a group loads its common key blocks once) and ``index``
(FlexAttention's ``(num_blocks, indices)``: one compilation per bound ``max_blocks``, the
pattern's largest count or ``--max-blocks``; padding slots masked, and under nki.* a group's
steps of padding skipped).
The block-sparse kernel runs at s = 1 too (``flash_attention`` would send an all-True dense
pattern to the dense kernel). Each row prints the bytes and the estimate over the dense
kernel's, beside issue 25's time goal ``1.3 s + 0.1``.

    python benchmarks/block_sparse.py [--n 4096 16384] [--d 64 128] [--target trn2]
        [--min-density 64 | --densities S ...] [--forms dense index] [--passes fwd bwd]
        [--max-blocks M] [--no-band] [--no-fixed] [--random S ...] [--seed K] [--hq G]
        [--dense-cache FILE] [--out DIR]

``--dense-cache FILE`` keeps the dense kernel's rows in a JSON file, keyed by target, N, D,
pass, API and (with ``--hq`` > 1) the query heads, and reuses them (the dense 32K backward
simulates for ~10 minutes).

Writes ``DIR/block_sparse.json`` and, with matplotlib, ``DIR/block_sparse.png``. Every number
is the simulator's model, not a hardware timing.
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


def inputs(N, D, seed=0, hq=1):
    """``q, k, v, do``: standard normal bf16, q and do ``(1, hq, N, D)``, k and v ``(1, 1,
    N, D)``."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, h, N, D)).astype(BF16) for h in (hq, 1, 1, hq))


def random_pattern(nqt: int, density: float, seed: int) -> np.ndarray:
    """A ``(1, 1, nqt, nqt)`` bool block mask whose blocks are active with probability
    ``density`` each, drawn by ``np.random.default_rng(seed)``, with at least one block per
    query tile (a tile with none would output zeros, not attention)."""
    if not 0.0 < density <= 1.0:
        raise SystemExit(f"--random: expected densities in (0, 1], got {density}")
    active = np.random.default_rng(seed).random((nqt, nqt)) < density
    empty = ~active.any(axis=1)
    active[empty, np.flatnonzero(empty) % nqt] = True
    return active[None, None]


def run_sparse(x, mask, form, passes, target, max_blocks=None):
    """``{pass: measure row}`` of the block-sparse kernels on ``mask`` given in ``form``
    (``max_blocks``: the index form's bound, None: the pattern's largest count)."""
    q, k, v, do = x
    N = q.shape[2]
    pattern = mask if form == "dense" else tuple(bs.dense_to_index(mask, max_blocks))
    call = api._attention_call(_v.check_attention_inputs(q, k, v), _v.dtype_name(q),
                               bs.check_block_mask(pattern, 1, q.shape[1], N, N),
                               return_lse=True)
    out = {}
    if "fwd" in passes:
        out["fwd"] = measure(lambda: api._block_sparse_forward(q, k, v, call), target)
    if "bwd" in passes:
        o, lse = api._block_sparse_forward(q, k, v, call)
        out["bwd"] = measure(lambda: api._block_sparse_backward(do, q, k, v, o, lse, call),
                             target)
    return out


def run_dense(x, passes, target, cache=None):
    """``{pass: measure row}`` of the dense kernel; ``cache``: ``(path, dict)`` of rows kept
    by :func:`main`'s ``--dense-cache`` (read and updated)."""
    q, k, v, do = x
    key = f"{target} {q.shape[2]} {q.shape[3]} {os.environ.get('NKI_FLASH_API', 'auto')}"
    if q.shape[1] > 1:
        key += f" hq{q.shape[1]}"
    if cache is not None:
        path, rows = cache
        missing = [p for p in passes if f"{key} {p}" not in rows]
        if missing:
            rows.update({f"{key} {p}": r for p, r in run_dense(x, missing, target).items()})
            with open(path, "w") as fh:
                json.dump(rows, fh, indent=1)
        return {p: rows[f"{key} {p}"] for p in passes}
    out = {}
    if "fwd" in passes:
        out["fwd"] = measure(lambda: api.flash_attention(q, k, v, lnc=1), target)
    if "bwd" in passes:
        o, lse = api.flash_attention(q, k, v, lnc=1, return_lse=True)
        out["bwd"] = measure(lambda: api.flash_attention_backward(do, q, k, v, o, lse, lnc=1),
                             target)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--target", default="trn2", choices=["trn1", "trn2"])
    ap.add_argument("--min-density", type=int, default=64, help="sweep s = 1 .. 1/this")
    ap.add_argument("--densities", type=float, nargs="+",
                    help="these densities instead of the sweep")
    ap.add_argument("--forms", nargs="+", default=["dense", "index"], choices=["dense", "index"])
    ap.add_argument("--max-blocks", type=int,
                    help="the index form's bound (default: the pattern's largest count)")
    ap.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--no-band", action="store_true", help="skip the band+strided pattern")
    ap.add_argument("--no-fixed", action="store_true", help="skip the fixed_density patterns")
    ap.add_argument("--random", type=float, nargs="+", default=[],
                    help="random patterns at these densities")
    ap.add_argument("--seed", type=int, default=1, help="the random patterns' generator seed")
    ap.add_argument("--hq", type=int, default=1,
                    help="query heads sharing the one kv head (GQA G:1; the pattern is "
                         "broadcast over them)")
    ap.add_argument("--dense-cache", help="JSON file of the dense kernel's rows to reuse")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    cache = None
    if args.dense_cache:
        rows = {}
        if os.path.exists(args.dense_cache):
            with open(args.dense_cache) as fh:
                rows = json.load(fh)
        cache = (args.dense_cache, rows)
    os.makedirs(args.out, exist_ok=True)
    dens = args.densities or [1.0 / (1 << i) for i in range(int(np.log2(args.min_density)) + 1)]
    results = {"target": args.target, "rows": [], "dense": []}
    path = os.path.join(args.out, "block_sparse.json")
    print(f"{'N':>6} {'D':>4} {'pattern':>12} {'s':>7} {'form':>5} {'pass':>4} {'MB':>9} "
          f"{'MB/dense':>8} {'est us':>9} {'est/dense':>9} {'goal':>6}")
    for D in args.d:
        for N in args.n:
            nqt = -(-N // 128)
            x = inputs(N, D, hq=args.hq)
            dense = run_dense(x, args.passes, args.target, cache)
            for p, r in dense.items():
                results["dense"].append(dict(N=N, D=D, Hq=args.hq, pass_=p, **r))
            patterns = [] if args.no_fixed else [
                ("fixed", s, bs.fixed_density(nqt, nqt, s)) for s in dens if round(s * nqt) >= 1]
            patterns += [("random", s, random_pattern(nqt, s, args.seed)) for s in args.random]
            if not args.no_band:
                patterns.append(("band+strided", None, bs.band_strided(nqt, nqt)))
            for name, _, mask in patterns:
                s = float(mask.mean())
                for form in args.forms:
                    rows = run_sparse(x, mask, form, args.passes, args.target,
                                      args.max_blocks)
                    for p, r in rows.items():
                        d = dense[p]
                        row = dict(N=N, D=D, Hq=args.hq, pattern=name, density=s, form=form,
                                   pass_=p,
                                   bytes_over_dense=r["hbm_bytes"] / d["hbm_bytes"],
                                   est_over_dense=(r["modeled_us_estimate"]
                                                   / d["modeled_us_estimate"]),
                                   goal=1.3 * s + 0.1, **r)
                        results["rows"].append(row)
                        print(f"{N:6d} {D:4d} {name:>12} {s:7.4f} {form:>5} {p:>4} "
                              f"{r['hbm_bytes'] / 1e6:9.2f} {row['bytes_over_dense']:8.2f} "
                              f"{r['modeled_us_estimate']:9.1f} {row['est_over_dense']:9.3f} "
                              f"{row['goal']:6.3f}", flush=True)
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
    rows = [r for r in results["rows"] if r["pattern"] == "fixed"]
    for key in sorted({(r["N"], r["D"], r["form"], r["pass_"]) for r in rows}):
        sel = [r for r in rows if (r["N"], r["D"], r["form"], r["pass_"]) == key]
        s = np.array([r["density"] for r in sel])
        form = "bool mask" if key[2] == "dense" else "index form"
        label = f"N={key[0] // 1024}K d={key[1]} {form} {key[3]}"
        line, = axes[0].loglog(s, [r["bytes_over_dense"] for r in sel], "o-", label=label)
        axes[1].loglog(s, [r["est_over_dense"] for r in sel], "o-", color=line.get_color(),
                       label=label)
    s = np.logspace(np.log10(min((r["density"] for r in rows), default=1.0)), 0, 50)
    axes[1].loglog(s, 1.3 * s + 0.1, "k:", label="goal 1.3 s + 0.1")
    axes[0].set(xlabel="density s", ylabel="HBM bytes / dense kernel's",
                title="HBM traffic against dense attention")
    axes[1].set(xlabel="density s", ylabel="scheduled estimate / dense kernel's",
                title=f"time against dense attention, {results['target']}")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
