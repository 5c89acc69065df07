"""``nki-flash bench``: the IO study -- why fusion (and FlashAttention) wins on Trainium.

Every measured value comes from :func:`simulate.measure` (exact HBM bytes; modeled time from the
engine cost model, lower bound = perfect overlap of the engines, upper = fully serial). Formula
curves are drawn beside the measurements. Four studies:

``attention``   flash vs standard (unfused, Algorithm 0) attention forward against the sequence
                length N: HBM bytes (the paper's Figure 2 left) and modeled time (Figure 3), with
                the paper's counts ``8 N d + 8 N^2`` (2-byte elements) and the flash IO lower bound.
``block``       flash forward HBM bytes and modeled time against its block size: the query rows
                kept on chip per pass over K/V (the forward's ``tiles=ForwardTiles(q_group=g)``;
                FlashAttention-2 loop order, where the query block plays the role of the
                paper's B_c), the paper's Figure 2 middle, with Theorem 2's
                ``s (2 N d + 2 N^2 d^2 / M)`` for M = rows x d on-chip query elements.
``gelu``        GELU(x W + b): one fused kernel vs three (matmul, bias add, GELU) against the
                output size n, with seed 000's ``2n`` and ``6n``.
``softmax``     a long-row softmax: online (one walk for the statistics) vs two-pass, with
                ``3 R C`` and ``4 R C`` element accesses.

Writes ``results.csv``, ``results.json`` and (with matplotlib, the ``plot`` extra) PNG plots under
``--out``; prints the table. Run as ``nki-flash bench`` or ``python -m host.bench``.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from host.validation import MAX_HEAD_DIM
from nki_kernels import tiles as T

STUDIES = ("attention", "block", "gelu", "softmax")
TARGETS = ("trn1", "trn2")
DTYPES = ("bfloat16", "float16", "float32")

#: Default sweeps: a few minutes on 2 CPU cores with the bundled simulator.
DEFAULT_SEQS = (128, 256, 512, 1024, 2048, 4096, 8192)
LARGE_SEQS = (16384,)
DEFAULT_BLOCK_SEQ = 4096
#: Query tiles (of 128 rows) the flash forward keeps on chip per pass over K/V in the block
#: study (0 = K/V resident: one pass).
DEFAULT_BLOCK_GROUPS = (1, 2, 4, 8, 16, 0)
#: K of GELU(x W + b) with M = N = 2K: the matmul's inputs are then one output's worth (n).
DEFAULT_GELU_K = (64, 128, 256, 512, 1024)
LARGE_GELU_K = (2048,)
DEFAULT_SOFTMAX_COLS = (4096, 16384)
LARGE_SOFTMAX_COLS = (65536,)
#: Rows of the softmax study: one partition tile.
SOFTMAX_ROWS = T.PMAX

CSV_FIELDS = ("study", "variant", "x_name", "x", "N", "D", "M", "K", "dtype", "target",
              "hbm_read", "hbm_written", "hbm_bytes", "formula_bytes", "formula",
              "modeled_us_overlap", "modeled_us_serial", "peak_sbuf_per_partition", "wall_s",
              "note")


# --------------------------------------------------------------------------------------------
# argument parsing and progress
# --------------------------------------------------------------------------------------------


def _ints_at_least(minimum: int) -> Callable[[str], List[int]]:
    """argparse ``type`` for a non-empty comma-separated list of integers >= ``minimum``."""

    def parse(text: str) -> List[int]:
        try:
            values = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
        return values

    return parse


_int_list = _ints_at_least(1)


def _head_dim(text: str) -> int:
    """argparse ``type`` of ``--dim``: the kernels' head-dim range."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if not 1 <= value <= MAX_HEAD_DIM:
        raise argparse.ArgumentTypeError(
            f"the attention kernels take head dims 1..{MAX_HEAD_DIM}, got {value}")
    return value
_group_list = _ints_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nki-flash bench",
        description="IO study on the simulator: flash vs standard attention (HBM bytes and "
        "modeled time against N), flash HBM bytes against its block size, fused vs unfused "
        "GELU(xW+b), online vs two-pass softmax. Writes a table (printed, CSV, JSON) and PNG "
        "plots under --out.")
    p.add_argument("--out", default="bench-out", metavar="DIR",
                   help="output directory (bench-out)")
    p.add_argument("--studies", nargs="+", choices=STUDIES, default=list(STUDIES),
                   help="which studies to run (all)")
    p.add_argument("--target", choices=TARGETS, default="trn2",
                   help="generation whose cost model gives the modeled times (trn2)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="input dtype (bfloat16)")
    p.add_argument("--dim", "-d", type=_head_dim, default=64,
                   help=f"attention head dim d, 1..{MAX_HEAD_DIM} (64)")
    p.add_argument("--seqs", type=_int_list, default=None,
                   help=f"attention sequence lengths (default {','.join(map(str, DEFAULT_SEQS))})")
    p.add_argument("--block-seq", type=int, default=DEFAULT_BLOCK_SEQ,
                   help=f"sequence length of the block study ({DEFAULT_BLOCK_SEQ})")
    p.add_argument("--block-groups", type=_group_list, default=None,
                   help="query tiles of 128 rows on chip per pass over K/V in the block study; "
                   "0 = K/V resident (default " + ",".join(map(str, DEFAULT_BLOCK_GROUPS)) + ")")
    p.add_argument("--gelu-k", type=_int_list, default=None,
                   help="K values of GELU(xW+b) with M = N = 2K "
                   f"(default {','.join(map(str, DEFAULT_GELU_K))})")
    p.add_argument("--softmax-cols", type=_int_list, default=None,
                   help="softmax row lengths with 128 rows "
                   f"(default {','.join(map(str, DEFAULT_SOFTMAX_COLS))})")
    p.add_argument("--large", action="store_true",
                   help=f"add N in {LARGE_SEQS}, K in {LARGE_GELU_K} and rows of "
                   f"{LARGE_SOFTMAX_COLS} columns (about two minutes more, ~6 GB of RAM)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs (0)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return p


class Progress:
    """A plain one-line stderr progress bar over the points of the sweep."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30, stream=None):
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.width = width
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        """Announce the point about to run (the bar shows the points finished so far)."""
        if not self.enabled:
            return
        filled = int(self.width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] "
                          f"{self.done}/{self.total} {elapsed:6.1f}s  {label:<44.44s}")
        self.stream.flush()

    def advance(self) -> None:
        self.done += 1

    def close(self) -> None:
        if self.enabled:
            self.step("done")
            self.stream.write("\n")
            self.stream.flush()


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------


def _require_simulator() -> None:
    from host._launch import runs_on_simulator
    from nki_kernels.nki import BACKEND

    if BACKEND != "simulate" or not runs_on_simulator():
        raise RuntimeError(
            "nki-flash bench measures HBM bytes and modeled time with the bundled simulator "
            f"(simulate.measure); the active backend is {BACKEND!r}. Set NKI_FLASH_BACKEND=simulate.")


def measure(fn: Callable[[], object], target: str) -> Dict[str, float]:
    """Run ``fn`` inside ``simulate.measure(target)``; the numbers of the row (also used by the
    scripts under benchmarks/)."""
    import simulate

    t0 = time.perf_counter()
    with simulate.measure(target=target) as m:
        fn()
    wall = time.perf_counter() - t0
    lo, hi = m.modeled_seconds
    return {
        "hbm_read": int(m.hbm_bytes_read),
        "hbm_written": int(m.hbm_bytes_written),
        "hbm_bytes": int(m.hbm_bytes_read) + int(m.hbm_bytes_written),
        "modeled_us_overlap": float(lo) * 1e6,
        "modeled_us_serial": float(hi) * 1e6,
        "modeled_us_estimate": float(m.estimated_seconds) * 1e6,
        "program_instructions": int(m.program_instructions),
        "peak_sbuf_per_partition": int(m.peak_sbuf_bytes_per_partition),
        "wall_s": wall,
    }


def _dtype(name: str) -> np.dtype:
    import ml_dtypes

    return {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
            "float32": np.dtype(np.float32)}[name]


def _randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


# --------------------------------------------------------------------------------------------
# formulas (drawn beside the measurements)
# --------------------------------------------------------------------------------------------


def unfused_attention_formula(N: int, d: int, itemsize: int) -> int:
    """The paper's count of standard attention for one head: ``s (4 N d + 4 N^2)``
    (``8 N d + 8 N^2`` for 2-byte elements)."""
    from host import reference

    return reference.unfused_attention_bytes(N, d, itemsize=itemsize)


def flash_lower_bound(N: int, d: int, itemsize: int) -> int:
    """Flash forward with K/V read once: Q, K, V read and O written once, plus the fp32 LSE."""
    from host import reference

    return reference.io_lower_bound_bytes(1, 1, 1, N, N, d, itemsize)


# --------------------------------------------------------------------------------------------
# the studies
# --------------------------------------------------------------------------------------------


def flash_block_tiles(N: int, d: int, q_group: int, in_itemsize: int = 2):
    """The forward's tiling with ``q_group`` query tiles on chip per pass over K/V (0 = K/V
    resident), its query rows per pass and the SBUF bytes per partition it plans for (matmul
    operands in 2-byte precision: bf16/fp16 inputs, or fp32 with mixed precision)."""
    base = T.ForwardTiles()
    if q_group == 0:
        t = base
        rows = N
        sbuf = T.fwd_kv_bytes(N, d, 2) + T.fwd_q_state_bytes(d, 2, in_itemsize)
    else:
        t = T.ForwardTiles(kv_resident=False, q_group=q_group)
        rows = min(N, q_group * t.q_tile)
        sbuf = (T.fwd_kv_bytes(t.kv_chunk, d, 2)
                + q_group * T.fwd_q_state_bytes(d, 2, in_itemsize))
    sbuf += T.fwd_working_bytes(d, in_itemsize, 2, t, masks=False)
    return t, rows, sbuf


def flash_block_formula(N: int, d: int, itemsize: int, rows: int) -> int:
    """Theorem 2's form with the query block on chip: ``s (2 N d + 2 N^2 d^2 / M)`` with
    ``M = rows * d`` elements of queries per pass, i.e. K and V read ``ceil(N / rows)`` times;
    plus the fp32 LSE."""
    passes = -(-N // rows)
    return itemsize * (2 * N * d + 2 * N * d * passes) + 4 * N


def plan(args) -> List[dict]:
    """The sweep points: one dict per measured run (study, variant, sizes, callable maker)."""
    def sizes(given, default, large):
        return sorted(set(given or default) | (set(large) if args.large else set()))

    seqs = sizes(args.seqs, DEFAULT_SEQS, LARGE_SEQS)
    gelu_k = sizes(args.gelu_k, DEFAULT_GELU_K, LARGE_GELU_K)
    cols = sizes(args.softmax_cols, DEFAULT_SOFTMAX_COLS, LARGE_SOFTMAX_COLS)
    # a group of query tiles covering all of N is the resident case (0): keep one of them
    tiles_n = T.ceil_div(args.block_seq, T.PMAX)
    groups = sorted({g if g < tiles_n else 0 for g in (args.block_groups or DEFAULT_BLOCK_GROUPS)},
                    key=lambda g: g or tiles_n)
    points = []
    if "attention" in args.studies:
        for n in seqs:
            for variant in ("flash", "unfused"):
                points.append(dict(study="attention", variant=variant, N=n, D=args.dim))
    if "block" in args.studies:
        for g in groups:
            points.append(dict(study="block", variant="flash", N=args.block_seq, D=args.dim,
                               q_group=g))
    if "gelu" in args.studies:
        for k in gelu_k:
            for variant in ("fused", "unfused"):
                points.append(dict(study="gelu", variant=variant, M=2 * k, K=k, N=2 * k))
    if "softmax" in args.studies:
        for c in cols:
            for variant in ("online", "two_pass"):
                points.append(dict(study="softmax", variant=variant, M=SOFTMAX_ROWS, N=c))
    return points


def run_point(pt: dict, args, rng) -> dict:
    """Measure one sweep point; returns the table row."""
    import host

    dtype = _dtype(args.dtype)
    s = dtype.itemsize
    row = {k: "" for k in CSV_FIELDS}
    row.update(study=pt["study"], variant=pt["variant"], dtype=args.dtype, target=args.target)
    study = pt["study"]
    if study in ("attention", "block"):
        N, D = pt["N"], pt["D"]
        q, k, v = (_randn(rng, (1, 1, N, D), dtype) for _ in range(3))
        row.update(N=N, D=D)
        if study == "attention":
            row.update(x_name="N", x=N)
            if pt["variant"] == "unfused":
                fn = lambda: host.attention_unfused(q, k, v)  # noqa: E731
                row.update(formula_bytes=unfused_attention_formula(N, D, s),
                           formula="s(4Nd+4N^2) (8Nd+8N^2 at 2 B)")
            else:
                # one NeuronCore (lnc=1): the IO theorem's M is one core's SBUF
                fn = lambda: host.flash_attention(q, k, v, lnc=1)  # noqa: E731
                row.update(formula_bytes=flash_lower_bound(N, D, s),
                           formula="s(4Nd)+4N (Q,K,V,O once + LSE)")
        else:
            t, rows, sbuf = flash_block_tiles(N, D, pt["q_group"], s)
            row.update(x_name="rows_per_pass", x=rows, M=sbuf,
                       formula_bytes=flash_block_formula(N, D, s, rows),
                       formula="s(2Nd+2N^2d^2/M)+4N, M=rows*d")
            fn = lambda: host.flash_attention(q, k, v, tiles=t, lnc=1)  # noqa: E731
    elif study == "gelu":
        M, K, N = pt["M"], pt["K"], pt["N"]
        x = _randn(rng, (M, K), dtype)
        w = _randn(rng, (K, N), dtype, 1.0 / math.sqrt(K))
        b = _randn(rng, (N,), dtype, 0.5)
        n = s * M * N
        fused = pt["variant"] == "fused"
        row.update(x_name="n_bytes", x=n, M=M, K=K, N=N,
                   formula_bytes=(2 if fused else 6) * n, formula="2n" if fused else "6n")
        fn = lambda: host.linear_gelu(x, w, b, fused=fused)  # noqa: E731
    else:
        R, C = pt["M"], pt["N"]
        x = _randn(rng, (R, C), dtype, 3.0)
        n = s * R * C
        online = pt["variant"] == "online"
        if C <= T.SOFTMAX_CHUNK:
            row.update(formula_bytes=2 * n, formula="2RC (row on chip)")
        else:
            row.update(formula_bytes=(3 if online else 4) * n, formula="3RC" if online else "4RC")
        row.update(x_name="n_bytes", x=n, M=R, N=C)
        fn = lambda: host.online_softmax(x, algorithm=pt["variant"],  # noqa: E731
                                         chunk_size=T.SOFTMAX_CHUNK)
    row.update(measure(fn, args.target))
    return row


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def _fmt_bytes(n) -> str:
    if n == "" or n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def format_table(rows: List[dict]) -> str:
    head = (f"{'study':10s}{'variant':10s}{'size':>22s}{'HBM bytes':>14s}{'formula':>14s}"
            f"{'  (formula)':<34s}{'modeled us':>12s}{'serial us':>12s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["study"] in ("attention", "block"):
            size = f"N={r['N']} d={r['D']}" + (f" rows={r['x']}" if r["study"] == "block" else "")
        else:
            size = f"{r['M']}x{r['K']}x{r['N']}" if r["study"] == "gelu" else f"{r['M']}x{r['N']}"
        lo = r.get("modeled_us_overlap")
        hi = r.get("modeled_us_serial")
        lines.append(
            f"{r['study']:10s}{r['variant']:10s}{size:>22s}{_fmt_bytes(r['hbm_bytes']):>14s}"
            f"{_fmt_bytes(r['formula_bytes']):>14s}  {str(r['formula'])[:32]:<32s}"
            f"{(f'{lo:12.1f}' if lo != '' else '           -')}"
            f"{(f'{hi:12.1f}' if hi != '' else '           -')}"
            + (f"   [{r['note']}]" if r.get("note") else ""))
    return "\n".join(lines)


def write_tables(rows: List[dict], out: str, meta: dict) -> None:
    with open(os.path.join(out, "results.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in CSV_FIELDS})
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2)


def _series(rows, study, variant, key="hbm_bytes"):
    pts = [(r["x"], r[key]) for r in rows
           if r["study"] == study and r["variant"] == variant and r[key] != "" and r["x"] != ""]
    pts.sort()
    return [p[0] for p in pts], [p[1] for p in pts]


def make_plots(rows: List[dict], out: str, meta: dict) -> List[str]:
    """PNG plots; returns the files written. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    s = _dtype(meta["dtype"]).itemsize
    d = meta["dim"]
    tag = f"{meta['dtype']}, d={d}, 1 head, simulated {meta['target']}"

    def log_log(ax, xlabel, ylabel, title):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)

    def save(fig, name):
        path = os.path.join(out, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    xs_f, ys_f = _series(rows, "attention", "flash")
    xs_u, ys_u = _series(rows, "attention", "unfused")
    if xs_f or xs_u:
        ns = sorted(set(xs_f) | set(xs_u))
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        if xs_u:
            ax.plot(xs_u, [y / 2**20 for y in ys_u], "o", color="C3", label="standard (measured)")
        ax.plot(ns, [unfused_attention_formula(n, d, s) / 2**20 for n in ns], "--", color="C3",
                label=f"paper: {'8Nd + 8N²' if s == 2 else f'{s}(4Nd + 4N²)'}")
        if xs_f:
            ax.plot(xs_f, [y / 2**20 for y in ys_f], "s", color="C0", label="flash (measured)")
        ax.plot(ns, [flash_lower_bound(n, d, s) / 2**20 for n in ns], ":", color="C0",
                label="Q, K, V, O once (+LSE)")
        log_log(ax, "sequence length N", "HBM traffic (MiB)",
                 f"Attention forward HBM traffic ({tag})")
        save(fig, "attention_hbm_bytes.png")

        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for variant, color, mark, label in (("unfused", "C3", "o", "standard"),
                                            ("flash", "C0", "s", "flash")):
            xs, lo = _series(rows, "attention", variant, "modeled_us_overlap")
            _, hi = _series(rows, "attention", variant, "modeled_us_serial")
            if xs:
                ax.plot(xs, lo, mark + "-", color=color, label=f"{label} (engines overlapped)")
                ax.fill_between(xs, lo, hi, color=color, alpha=0.15,
                                label=f"{label}: overlapped .. serial")
        log_log(ax, "sequence length N", "modeled time (µs)",
                 f"Attention forward modeled time ({tag})")
        save(fig, "attention_modeled_time.png")

    blk = [r for r in rows if r["study"] == "block" and r["hbm_bytes"] != ""]
    if blk:
        blk.sort(key=lambda r: r["x"])
        n_b = blk[0]["N"]
        xs = [r["x"] for r in blk]
        fig, ax1 = plt.subplots(figsize=(6.4, 4.4))
        ax1.plot(xs, [r["hbm_bytes"] / 2**20 for r in blk], "s", color="C0", ms=7,
                 label="flash HBM traffic (measured)")
        ax1.plot(xs, [flash_block_formula(n_b, d, s, x) / 2**20 for x in xs], ":", color="C0",
                 label="s(2Nd + 2N²d²/M) + 4N,  M = rows·d")
        ax1.set_xlabel("block size: query rows on chip per pass over K/V")
        ax1.set_ylabel("HBM traffic (MiB)")
        ax1.set_xscale("log", base=2)
        ax1.set_yscale("log")
        ax2 = ax1.twinx()
        ax2.plot(xs, [r["modeled_us_overlap"] for r in blk], "o--", color="C2",
                 label="modeled time, engines overlapped (µs)")
        ax2.set_ylabel("modeled time (µs)")
        h1, l1 = ax1.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax1.legend(h1 + h2, l1 + l2, fontsize=8)
        ax1.set_title(f"Flash forward vs block size, N={n_b} ({tag})", fontsize=9)
        ax1.grid(True, which="both", alpha=0.3)
        save(fig, "flash_block_size.png")

    xs_f, ys_f = _series(rows, "gelu", "fused")
    xs_u, ys_u = _series(rows, "gelu", "unfused")
    if xs_f or xs_u:
        ns = sorted(set(xs_f) | set(xs_u))
        fig, (ax, axt) = plt.subplots(1, 2, figsize=(10.4, 4.4))
        ax.plot(xs_u, [y / 2**20 for y in ys_u], "o", color="C3", label="unfused: 3 kernels")
        ax.plot(ns, [6 * n / 2**20 for n in ns], "--", color="C3", label="6n")
        ax.plot(xs_f, [y / 2**20 for y in ys_f], "s", color="C0", label="fused: 1 kernel")
        ax.plot(ns, [2 * n / 2**20 for n in ns], ":", color="C0", label="2n")
        log_log(ax, "n = bytes of y (M = N = 2K)", "HBM traffic (MiB)", "HBM traffic")
        for variant, color, mark, label in (("unfused", "C3", "o", "unfused"),
                                            ("fused", "C0", "s", "fused")):
            xs, lo = _series(rows, "gelu", variant, "modeled_us_overlap")
            _, hi = _series(rows, "gelu", variant, "modeled_us_serial")
            axt.plot(xs, lo, mark + "-", color=color, label=f"{label} (engines overlapped)")
            axt.fill_between(xs, lo, hi, color=color, alpha=0.15,
                             label=f"{label}: overlapped .. serial")
        log_log(axt, "n = bytes of y (M = N = 2K)", "modeled time (µs)", "modeled time")
        fig.suptitle(f"GELU(xW + b): fused vs unfused ({meta['dtype']}, simulated "
                     f"{meta['target']})", fontsize=10)
        save(fig, "gelu_fusion.png")
    return written


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def main_bench(argv: Optional[List[str]] = None) -> int:
    """``nki-flash bench [options]``: run the sweeps, print and write the table and plots."""
    args = build_parser().parse_args(argv)
    try:
        _require_simulator()
    except RuntimeError as exc:
        print(f"nki-flash bench: error: {exc}", file=sys.stderr)
        return 2
    try:
        os.makedirs(args.out, exist_ok=True)
        probe = os.path.join(args.out, ".nki-flash-write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"--out {args.out}: cannot write there ({exc.strerror})") from None
    rng = np.random.default_rng(args.seed)
    points = plan(args)
    meta = {"target": args.target, "dtype": args.dtype, "dim": args.dim,
            "command": "nki-flash bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "studies": args.studies}
    bar = Progress(len(points), enabled=not args.quiet)
    rows = []
    t0 = time.perf_counter()
    for pt in points:
        size = " ".join(f"{k}={v}" for k, v in pt.items() if k not in ("study", "variant"))
        bar.step(f"{pt['study']} {pt['variant']} {size}")
        rows.append(run_point(pt, args, rng))
        bar.advance()
    bar.close()
    meta["wall_seconds"] = time.perf_counter() - t0

    print(format_table(rows))
    write_tables(rows, args.out, meta)
    print(f"\ntable written to {os.path.join(args.out, 'results.csv')} and results.json")
    if args.no_plots:
        print("plots skipped (--no-plots)")
    else:
        try:
            files = make_plots(rows, args.out, meta)
        except ImportError:
            print("plots skipped: matplotlib is not installed (pip install 'nki-flash[plot]')")
        else:
            print("plots: " + ", ".join(files))
    _print_ratios(rows)
    return 0


def _print_ratios(rows: List[dict]) -> None:
    """One line per study: the headline ratio at the largest size measured."""
    def pair(study, a, b):
        xs = {r["x"]: r for r in rows if r["study"] == study and r["variant"] == a
              and r["hbm_bytes"] != ""}
        ys = {r["x"]: r for r in rows if r["study"] == study and r["variant"] == b
              and r["hbm_bytes"] != ""}
        common = sorted(set(xs) & set(ys))
        return (common[-1], xs[common[-1]], ys[common[-1]]) if common else None

    for study, a, b, what in (("attention", "unfused", "flash", "standard/flash"),
                              ("gelu", "unfused", "fused", "unfused/fused"),
                              ("softmax", "two_pass", "online", "two-pass/online")):
        p = pair(study, a, b)
        if p:
            x, ra, rb = p
            print(f"{study}: at {ra['x_name']}={x}, {what} HBM bytes = "
                  f"{ra['hbm_bytes'] / rb['hbm_bytes']:.2f}x, modeled time = "
                  f"{ra['modeled_us_overlap'] / rb['modeled_us_overlap']:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main_bench(sys.argv[1:]))
