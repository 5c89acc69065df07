"""The ``nki-flash`` command.

``nki-flash run``
    runs flash attention (prefill forward, or ``--decode``) on the active backend, checks it
    against the float64 reference, and reports the error and its tolerance, HBM traffic against
    the IO lower bound and the unfused algorithm, and modeled time on trn1 and trn2 with the
    TensorE utilization it implies. Exit status 1 when the check fails.
``nki-flash bench``
    the IO study (flash vs unfused attention, block sizes, fused GELU(xW+b)): tables and plots.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

TARGETS = ("trn1", "trn2")
DTYPES = ("bfloat16", "float16", "float32")
CAUSAL_CHOICES = ("none", "top_left", "bottom_right")


# --------------------------------------------------------------------------------------------
# argument parsing


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nki-flash",
        description="FlashAttention for AWS Trainium in NKI: run, check and measure kernels.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run flash attention, check it against the float64 reference, report IO and time",
        description="Run flash attention on the active backend (the bundled CPU simulator when "
        "neuronx-cc is absent), check it against the float64 NumPy reference, and report HBM "
        "traffic and modeled time on trn1 and trn2.",
    )
    run.add_argument("--batch", "-b", type=_positive_int, default=1, help="batch size B (1)")
    run.add_argument("--heads", type=_positive_int, default=8, help="query heads Hq (8)")
    run.add_argument("--kv-heads", type=_positive_int, default=2, help="key/value heads Hkv (2)")
    run.add_argument("--seq", "-n", type=_positive_int, default=1024,
                     help="sequence length for both queries and keys (1024)")
    run.add_argument("--seq-q", type=_positive_int, default=None, help="query length Nq (--seq)")
    run.add_argument("--seq-k", type=_positive_int, default=None, help="key length Nk (--seq)")
    run.add_argument("--dim", "-d", type=_positive_int, default=128, help="head dim D (128)")
    run.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="input dtype (bfloat16)")
    run.add_argument("--causal", choices=CAUSAL_CHOICES, default="bottom_right",
                     help="causal mask alignment (bottom_right; 'none' disables it)")
    run.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), default=None,
                     help="sliding window (-1 = unbounded on that side)")
    run.add_argument("--kv-lens", type=_int_list, default=None,
                     help="valid key length per sequence, comma-separated (padded batch)")
    run.add_argument("--q-lens", type=_int_list, default=None,
                     help="valid query length per sequence, comma-separated")
    run.add_argument("--scale", type=float, default=None, help="softmax scale (1/sqrt(D))")
    run.add_argument("--no-mixed-precision", action="store_true",
                     help="fp32 inputs: run matmuls in fp32 instead of bf16")
    run.add_argument("--decode", action="store_true",
                     help="decode instead of prefill: --tokens new tokens against a KV cache")
    run.add_argument("--tokens", "-t", type=_positive_int, default=1,
                     help="decode: new tokens T per sequence (1)")
    run.add_argument("--cache-len", type=_int_list, default=None,
                     help="decode: valid cache length per sequence (default: --seq for all)")
    run.add_argument("--num-splits", type=_positive_int, default=None,
                     help="decode: KV splits (chosen from the real lengths when omitted)")
    run.add_argument("--paged", action="store_true",
                     help="decode: store the caches as a shuffled page pool with a block table")
    run.add_argument("--page-size", type=_positive_int, default=256,
                     help="decode --paged: positions per page, a power of two >= 16 (256)")
    run.add_argument("--seed", type=int, default=0, help="random seed for the inputs (0)")
    run.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS),
                     help="targets to model (trn1 trn2)")
    run.add_argument("--json", dest="json_out", default=None, metavar="FILE",
                     help="also write the report as JSON to FILE")
    run.add_argument("--quiet", "-q", action="store_true", help="no progress bar")

    bench = sub.add_parser("bench", help="IO study: flash vs unfused attention, fusion; tables and plots",
                           add_help=False)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


# --------------------------------------------------------------------------------------------
# progress


class _ProgressBar:
    """A one-line stderr progress bar over kernel grid instances."""

    def __init__(self, label: str, enabled: bool):
        self.label = label
        self.enabled = enabled and sys.stderr.isatty() or enabled == "force"
        self._start = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        width = 30
        filled = int(width * done / total)
        elapsed = time.perf_counter() - self._start
        sys.stderr.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
            f"grid instances  {elapsed:5.1f}s"
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _progress(label: str, enabled: bool):
    """Context manager reporting grid progress from the simulator (a no-op on a device)."""
    import contextlib

    from host._launch import runs_on_simulator

    if not runs_on_simulator():
        return contextlib.nullcontext()
    import simulate

    return simulate.progress(_ProgressBar(label, enabled))


def _measure(target: str):
    import contextlib

    from host._launch import runs_on_simulator
    from nki_kernels.nki import BACKEND

    if BACKEND != "simulate" or not runs_on_simulator():
        return contextlib.nullcontext(None)
    import simulate

    return simulate.measure(target=target)


# --------------------------------------------------------------------------------------------
# the run command


def _dtype(name: str):
    from nki_kernels.nki import nl

    return {"bfloat16": np.dtype(nl.bfloat16), "float16": np.dtype(np.float16),
            "float32": np.dtype(np.float32)}[name]


def _matmul_dtype(dtype: np.dtype, args: argparse.Namespace) -> np.dtype:
    """The kernels' matmul operand dtype (docs/semantics.md, Precision)."""
    if dtype == np.float32 and not args.no_mixed_precision:
        return _dtype("bfloat16")
    return dtype


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _kernel_rows(m) -> list:
    """Per kernel launched: its program size and peak SBUF (the largest over its launches)."""
    rows: dict = {}
    for k in m.kernels:
        row = rows.setdefault(k.name, {"name": k.name, "program_instructions": 0,
                                       "peak_sbuf_bytes_per_partition": 0, "launches": 0})
        row["program_instructions"] = max(row["program_instructions"], k.program_instructions)
        row["peak_sbuf_bytes_per_partition"] = max(row["peak_sbuf_bytes_per_partition"],
                                                   k.peak_sbuf_bytes_per_partition)
        row["launches"] += 1
    return list(rows.values())


def _run(args: argparse.Namespace) -> int:
    import host
    from host import reference
    from nki_kernels.nki import BACKEND

    rng = np.random.default_rng(args.seed)
    dtype = _dtype(args.dtype)
    B, Hq, Hkv, D = args.batch, args.heads, args.kv_heads, args.dim
    causal = None if args.causal == "none" else args.causal
    opts: dict = {"scale": args.scale}

    if args.decode:
        T = args.tokens
        cache_lens = np.array(args.cache_len if args.cache_len else [args.seq] * B, dtype=np.int32)
        s_max = int(max(int(cache_lens.max()), args.seq))
        q = rng.standard_normal((B, Hq, T, D)).astype(dtype)
        k = rng.standard_normal((B, Hkv, s_max, D)).astype(dtype)
        v = rng.standard_normal((B, Hkv, s_max, D)).astype(dtype)
        kwargs = dict(cache_lens=cache_lens, num_splits=args.num_splits,
                      mixed_precision=not args.no_mixed_precision, return_lse=True, **opts)
        label = (f"decode B={B} Hq={Hq} Hkv={Hkv} T={T} cache_lens={cache_lens.tolist()} "
                 f"S_max={s_max} D={D} {args.dtype}")
        k_in, v_in = k, v
        if args.paged:
            (k_in, v_in), kwargs["block_table"] = reference.contiguous_to_paged(
                (k, v), cache_lens, args.page_size, rng)
            label += f" paged (page_size {args.page_size}, {k_in.shape[0]} pages)"

        def call():
            return host.flash_decode(q, k_in, v_in, **kwargs)

        ref_o, ref_lse = reference.decode(q, k, v, cache_lens=cache_lens, scale=args.scale)
        base_o = reference.decode_baseline_lowp(q, k, v, cache_lens=cache_lens,
                                                dtype=_matmul_dtype(dtype, args), out_dtype=dtype,
                                                scale=args.scale)
        visible_pairs = int(sum(Hq * (T * (int(c) - T) + T * (T + 1) // 2) for c in cache_lens))
        lower_bound = (q.nbytes + 2 * sum(Hkv * int(c) * D * dtype.itemsize for c in cache_lens)
                       + q.nbytes + B * Hq * T * 4)
        unfused = None
    else:
        Nq = args.seq_q or args.seq
        Nk = args.seq_k or args.seq
        q = rng.standard_normal((B, Hq, Nq, D)).astype(dtype)
        k = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
        v = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
        mask_opts = dict(causal=causal, window=tuple(args.window) if args.window else None,
                         kv_lens=np.array(args.kv_lens, dtype=np.int32) if args.kv_lens else None,
                         q_lens=np.array(args.q_lens, dtype=np.int32) if args.q_lens else None)
        kwargs = dict(mixed_precision=not args.no_mixed_precision, return_lse=True,
                      **opts, **mask_opts)
        label = (f"forward B={B} Hq={Hq} Hkv={Hkv} Nq={Nq} Nk={Nk} D={D} {args.dtype} "
                 f"causal={causal}" + (f" window={tuple(args.window)}" if args.window else ""))

        def call():
            return host.flash_attention(q, k, v, **kwargs)

        ref_o, ref_lse = reference.attention_forward(q, k, v, scale=args.scale, **mask_opts)
        base_o = reference.attention_baseline_lowp(q, k, v, dtype=_matmul_dtype(dtype, args),
                                                   out_dtype=dtype,
                                                   scale=args.scale, **mask_opts)
        mask = reference.attention_mask(Nq, Nk, batch=B, causal=causal,
                                        window=mask_opts["window"], q_lens=mask_opts["q_lens"],
                                        kv_lens=mask_opts["kv_lens"])
        visible_pairs = int(mask.sum()) * Hq
        lower_bound = reference.io_lower_bound_bytes(B, Hq, Hkv, Nq, Nk, D, dtype.itemsize)
        # Standard attention per query head (seed 000), with the inputs' element size.
        unfused = B * Hq * reference.unfused_attention_bytes(Nq, D, itemsize=dtype.itemsize, nk=Nk)

    print(f"nki-flash run: {label}")
    print(f"backend: {BACKEND}")

    report: dict = {"config": label, "backend": BACKEND, "targets": {}}
    ok = True
    outputs = None
    for i, target in enumerate(args.targets):
        with _measure(target) as m, _progress(f"{target:5s}", enabled=not args.quiet):
            t0 = time.perf_counter()
            result = call()
            wall = time.perf_counter() - t0
        if outputs is None:
            outputs = result
        entry = {"wall_seconds": wall}
        if m is not None:
            lo, hi = m.modeled_seconds
            flops = 4.0 * D * visible_pairs
            from simulate import _hw     # m is a simulator measurement: its hardware table

            hw = _hw.get_target(target)
            if args.decode:     # memory-bound: the fraction of the HBM-bandwidth bound reached
                # (the chip's HBM bandwidth shared evenly by its cores, hardware-and-limits.md §3)
                bound = lower_bound / hw.hbm_share_bytes_per_s
                util = [bound / hi, bound / lo]
            else:               # compute-bound: the fraction of dense bf16 TensorE peak
                util = [flops / (hi * hw.tensor_peak_flops), flops / (lo * hw.tensor_peak_flops)]
            entry.update(
                hbm_bytes_read=int(m.hbm_bytes_read), hbm_bytes_written=int(m.hbm_bytes_written),
                modeled_seconds=[lo, hi],
                engine_seconds={k: float(v) for k, v in m.engine_seconds.items()},
                utilization=util,
                peak_sbuf_bytes_per_partition=int(m.peak_sbuf_bytes_per_partition),
                sbuf_capacity_bytes_per_partition=int(hw.sbuf_bytes_per_partition),
                kernels=_kernel_rows(m),
                program_instructions=int(m.program_instructions),
                executed_instructions=int(sum(m.instructions.values())),
            )
        report["targets"][target] = entry

    o, lse = outputs
    err_o = reference.max_abs_err(np.asarray(o, dtype=np.float64), ref_o)
    err_lse = reference.max_abs_err(np.asarray(lse, dtype=np.float64), ref_lse)
    # The tolerance rule of docs/semantics.md: 2x a plain implementation in the kernel's matmul
    # precision, plus a floor. LSE is fp32 all the way, so it gets a fixed 1e-2.
    tol_o = reference.tolerance(ref_o, base_o,
                                floor=reference.atol_floor(_matmul_dtype(dtype, args)))
    tol_lse = 1e-2
    ok = err_o <= tol_o and err_lse <= tol_lse and bool(np.isfinite(np.asarray(o, np.float64)).all())
    report.update(max_abs_err_o=err_o, tolerance_o=tol_o, max_abs_err_lse=err_lse,
                  tolerance_lse=tol_lse, passed=bool(ok))

    print()
    print(f"check        max|o - ref| = {err_o:.3e}  (tolerance {tol_o:.3e})   "
          f"max|lse - ref| = {err_lse:.3e}  (tolerance {tol_lse:.1e})   "
          f"{'PASS' if ok else 'FAIL'}")
    first = report["targets"].get(args.targets[0], {})
    if "hbm_bytes_read" in first:
        total = first["hbm_bytes_read"] + first["hbm_bytes_written"]
        print(f"HBM traffic  read {_fmt_bytes(first['hbm_bytes_read'])}, written "
              f"{_fmt_bytes(first['hbm_bytes_written'])}; total {_fmt_bytes(total)} = "
              f"{total / lower_bound:.3f}x the IO lower bound ({_fmt_bytes(lower_bound)})"
              + (f"; unfused attention would move {_fmt_bytes(unfused)} "
                 f"({unfused / total:.1f}x more)" if unfused else ""))
        report.update(io_lower_bound_bytes=int(lower_bound),
                      unfused_bytes=int(unfused) if unfused else None)
        util_name = "HBM-BW util" if args.decode else "TensorE util"
        print(f"{'target':8s}{'modeled time (overlap .. serial)':>36s}{util_name:>18s}"
              f"   busiest engines")
        for target, e in report["targets"].items():
            lo, hi = e["modeled_seconds"]
            busiest = sorted(e["engine_seconds"].items(), key=lambda kv: -kv[1])[:3]
            print(f"{target:8s}{lo * 1e6:15.1f} us .. {hi * 1e6:9.1f} us"
                  f"{e['utilization'][1] * 100:10.1f}% ..{e['utilization'][0] * 100:5.1f}%"
                  "   " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in busiest))
        for target, e in report["targets"].items():
            cap = e["sbuf_capacity_bytes_per_partition"]
            for row in e["kernels"]:
                peak = row["peak_sbuf_bytes_per_partition"]
                print(f"{target:8s}kernel {row['name']}: program {row['program_instructions']} "
                      f"instructions (loop bodies once), peak SBUF {peak / 1024:.1f} KiB/partition "
                      f"= {100 * peak / cap:.0f}% of {cap // 1024} KiB")
    else:
        print("(HBM bytes and modeled time come from the simulator; this backend ran on a device)")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"report written to {args.json_out}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if argv and argv[0] == "bench":
        from host.bench import main_bench

        return int(main_bench(argv[1:]) or 0)
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
    except (ValueError, TypeError) as exc:
        print(f"nki-flash: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
