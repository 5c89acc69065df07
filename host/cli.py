"""The ``nki-flash`` command.

``nki-flash run``
    runs flash attention (prefill forward, ``--decode``, or ``--kvcache``: any number of new
    tokens over a KV cache, e.g. a chunked prefill) on the active backend, checks it
    against the float64 reference, and reports the error and its tolerance, HBM traffic against
    the IO lower bound and the unfused algorithm, and modeled time on trn1, trn2 and trn3 with
    the TensorE utilization it implies (trn3 through ``nki.*``, the only namespace trn3
    runs).
``nki-flash bench``
    the IO study (flash vs unfused attention, block sizes, fused GELU(xW+b)): tables and plots.

Exit status (both commands): 0 success, 1 the correctness check failed, 2 a usage error (one
line on stderr naming the flag), 3 an environment problem (says what to set or install).
Errors never print a traceback; ``NKI_FLASH_DEBUG=1`` re-raises them for debugging.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from host._version import __version__

TARGETS = ("trn1", "trn2", "trn3")
DTYPES = ("bfloat16", "float16", "float32")
CAUSAL_CHOICES = ("none", "top_left", "bottom_right")
CHECK_CHOICES = ("full", "fast", "none")

#: Exit statuses (documented in the module docstring and ``--help``).
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 1, 2, 3
EXIT_HELP = (
    "exit status: 0 success; 1 the correctness check failed; 2 usage error; "
    "3 environment problem (e.g. NKI_FLASH_BACKEND, memory)"
)
DEBUG_ENV = "NKI_FLASH_DEBUG"

#: Peak bytes per score element of the float64 reference check of the forward (measured with
#: tracemalloc: the float64 reference peaks at ~34 B per score of B*Hq*Nq*Nk, the low-precision
#: baseline at ~17 B, run one after the other), with a little margin.
REFERENCE_BYTES_PER_SCORE = 36
#: Query rows per head the sampled ``--check fast`` compares: the first and last 64 rows (where
#: causal and padding edges live) and 128 spread over the rest.
FAST_CHECK_EDGE_ROWS = 64
FAST_CHECK_SPREAD_ROWS = 128
#: Fraction of the available memory the reference may plan to use.
REFERENCE_MEMORY_FRACTION = 0.8

#: Flags of one mode only: (attribute, flag) pairs. ``--kvcache`` takes the cache flags of
#: ``--decode`` and the masks of :data:`_KVCACHE_MASKS`.
_DECODE_ONLY = (("tokens", "--tokens"), ("cache_len", "--cache-len"),
                ("num_splits", "--num-splits"), ("paged", "--paged"),
                ("page_size", "--page-size"), ("kv_dtype", "--kv-dtype"))
_KVCACHE_MASKS = ("causal", "window")
#: ``--kv-dtype``: the FP8 KV-cache formats (host.flash_decode's k_scale/v_scale caches).
KV_DTYPES = {"fp8_e5m2": "float8_e5m2", "fp8_e4m3": "float8_e4m3",
             "fp8_e4m3fn": "float8_e4m3fn"}
_PREFILL_ONLY = (("seq_q", "--seq-q"), ("seq_k", "--seq-k"), ("causal", "--causal"),
                 ("window", "--window"), ("kv_lens", "--kv-lens"), ("q_lens", "--q-lens"),
                 ("dropout", "--dropout"), ("block_sparse", "--block-sparse"),
                 ("varlen", "--varlen"))
#: Flags --varlen (one packed batch of self-attention sequences) does not take.
_NOT_VARLEN = (("seq_q", "--seq-q"), ("seq_k", "--seq-k"), ("kv_lens", "--kv-lens"),
               ("q_lens", "--q-lens"), ("dropout", "--dropout"),
               ("block_sparse", "--block-sparse"))
#: ``--block-sparse`` patterns (host/block_sparse.py); ``density=S`` is the benchmark's
#: evenly spread pattern with a fraction S of the key blocks per query tile.
BLOCK_SPARSE_PATTERNS = ("butterfly", "local-global", "density=S")


class UsageError(Exception):
    """A bad combination of command-line flags (exit status 2)."""


class EnvironmentProblem(Exception):
    """Something about the machine or its environment variables (exit status 3)."""


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
        epilog=EXIT_HELP,
    )
    parser.add_argument("--version", action="version", version=f"nki-flash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run flash attention, check it against the float64 reference, report IO and time",
        description="Run flash attention on the active backend (the bundled CPU simulator when "
        "neuronx-cc is absent), check it against the float64 NumPy reference, and report HBM "
        "traffic and modeled time on trn1, trn2 and trn3 (each row names the NKI namespace the "
        "kernel was traced through: neuronxcc.nki on trn1, nki.* on trn2/trn3).",
        epilog=EXIT_HELP,
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
    run.add_argument("--causal", choices=CAUSAL_CHOICES, default=None,
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
    run.add_argument("--kvcache", action="store_true",
                     help="flash_attention_with_kvcache: --tokens new tokens (any number: a "
                          "chunked prefill) over a KV cache; takes the --decode flags and "
                          "--causal (none, bottom_right) and --window")
    run.add_argument("--tokens", "-t", type=_positive_int, default=None,
                     help="decode: new tokens T per sequence (1)")
    run.add_argument("--cache-len", type=_int_list, default=None,
                     help="decode: valid cache length per sequence (default: --seq for all)")
    run.add_argument("--num-splits", type=_positive_int, default=None,
                     help="decode: KV splits (chosen from the real lengths when omitted)")
    run.add_argument("--paged", action="store_true",
                     help="decode: store the caches as a shuffled page pool with a block table")
    run.add_argument("--page-size", type=_positive_int, default=None,
                     help="decode --paged: positions per page, a power of two >= 16 (256)")
    run.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default=None,
                     help="decode, kvcache: an FP8 KV cache (per-kv-head scales): fp8_e5m2 "
                          "(trn1-3), fp8_e4m3 (IEEE-style, max 240: trn1, trn2), fp8_e4m3fn "
                          "(OCP, max 448: trn3); checked against the reference on the "
                          "dequantized cache")
    run.add_argument("--dropout", type=float, default=None, metavar="P",
                     help="attention dropout probability in [0, 1) (the mask's seed is --seed; "
                          "the check uses the mask the kernel drew)")
    run.add_argument("--block-sparse", default=None, metavar="PATTERN",
                     help="block-sparse attention over 128 x 128 blocks: butterfly, "
                          "local-global (window of one block plus one global block) or "
                          "density=S (S in (0, 1]: that fraction of the key blocks per query "
                          "tile); inactive blocks are never loaded")
    run.add_argument("--varlen", type=_int_list, default=None, metavar="LENS",
                     help="packed variable-length sequences: comma-separated lengths (each "
                          ">= 0, total >= 1) of self-attention sequences packed into one batch "
                          "row (cu_seqlens_q = cu_seqlens_k; --seq is not used); needs "
                          "--batch 1 and --check full or none")
    run.add_argument("--softcap", type=float, default=None, metavar="C",
                     help="logit soft-capping C tanh(s / C) (Gemma 2), C in [2^-24, 2^24]")
    run.add_argument("--alibi", action="store_true",
                     help="ALiBi bias with the standard slopes 2^(-8 (h + 1) / Hq)")
    run.add_argument("--sinks", action="store_true",
                     help="attention sinks (gpt-oss): one random N(0, 1) logit per query head")
    run.add_argument("--seed", type=int, default=0, help="random seed for the inputs (0)")
    run.add_argument("--targets", nargs="+", choices=TARGETS, default=None,
                     help="targets to model (default trn1 trn2 trn3)")
    run.add_argument("--lnc", type=int, choices=(1, 2), default=None,
                     help="NeuronCores per logical core on trn2 (default 2 on trn2, 1 on trn1; "
                          "trn1 always runs 1)")
    run.add_argument("--check", choices=CHECK_CHOICES, default="full",
                     help="correctness check: 'full' compares every output with the float64 "
                     "reference (needs ~36 bytes per score B*Hq*Nq*Nk: the command refuses up "
                     "front when that does not fit in memory); 'fast' compares a sample of "
                     f"{2 * FAST_CHECK_EDGE_ROWS + FAST_CHECK_SPREAD_ROWS} query rows per head "
                     "(the first and last 64 and 128 spread between) exactly; 'none' skips it")
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


def _block_pattern(text: str, nqt: int, nkt: int) -> np.ndarray:
    """The dense ``(1, 1, nqt, nkt)`` block mask of a ``--block-sparse`` pattern."""
    from host import block_sparse as bs

    if text == "butterfly":
        return bs.butterfly(nqt, nkt)
    if text == "local-global":
        return bs.local_global(nqt, nkt)
    if text.startswith("density="):
        try:
            s = float(text[len("density="):])
        except ValueError:
            s = float("nan")
        if not 0.0 < s <= 1.0:
            raise UsageError(f"--block-sparse {text}: expected density=S with S in (0, 1]")
        return bs.fixed_density(nqt, nkt, s)
    raise UsageError(f"--block-sparse {text}: expected one of "
                     f"{', '.join(BLOCK_SPARSE_PATTERNS)}")


def _score_mods(args: argparse.Namespace, Hq: int, rng) -> dict:
    """The score-modifier keyword arguments of ``--softcap``, ``--alibi``, ``--sinks``."""
    mods: dict = {}
    if args.softcap is not None:
        mods["softcap"] = args.softcap
    if args.alibi:
        # the ALiBi paper's geometric slopes (exact for a power-of-two head count)
        mods["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, Hq + 1) / Hq)
    if args.sinks:
        mods["sinks"] = rng.standard_normal(Hq)
    return mods


def _mods_label(args: argparse.Namespace) -> str:
    return ((f" softcap={args.softcap}" if args.softcap is not None else "")
            + (" alibi" if args.alibi else "") + (" sinks" if args.sinks else ""))


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse flags that the chosen mode would silently ignore."""
    if args.decode and args.kvcache:
        raise UsageError("--decode and --kvcache: choose one (--kvcache runs any T, decode "
                         "included)")
    if args.decode or args.kvcache:
        given = [flag for attr, flag in _PREFILL_ONLY if getattr(args, attr) not in (None, False)
                 and not (args.kvcache and attr in _KVCACHE_MASKS)]
        if given and args.kvcache:
            raise UsageError(f"{', '.join(given)} does not apply to --kvcache (the new tokens "
                             "attend to their cache: set the lengths with --cache-len, --seq "
                             "and --tokens)")
        if given:
            raise UsageError(
                f"{', '.join(given)} does not apply to --decode (decode attends each new token to "
                "its cache prefix: set the lengths with --cache-len and --seq)")
        if args.page_size is not None and not args.paged:
            raise UsageError("--page-size applies only with --paged")
    else:
        given = [flag for attr, flag in _DECODE_ONLY if getattr(args, attr) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)} applies only with --decode or --kvcache")
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        raise UsageError(f"--dropout {args.dropout}: expected a probability in [0, 1)")
    if args.softcap is not None and not 2.0 ** -24 <= args.softcap <= 2.0 ** 24:
        raise UsageError(f"--softcap {args.softcap}: expected a cap in [2^-24, 2^24]")
    if args.block_sparse is not None:
        _block_pattern(args.block_sparse, 1, 1)          # the pattern's name and value
    if args.varlen is not None:
        _check_varlen(args)
    explicit = args.targets is not None
    if args.targets is None:
        args.targets = list(TARGETS)
    if args.kv_dtype is not None:
        from nki_kernels.tiles import DECODE_FP8_CACHE_DTYPES

        fmt = KV_DTYPES[args.kv_dtype]
        takes = [t for t in TARGETS if fmt in DECODE_FP8_CACHE_DTYPES[t]]
        lacking = [t for t in args.targets if t not in takes]
        if explicit and lacking:
            raise UsageError(f"--kv-dtype {args.kv_dtype}: {', '.join(lacking)} has no {fmt} "
                             f"cache format (it is {', '.join(takes)}'s); choose --targets "
                             f"among those")
        args.targets = [t for t in args.targets if t in takes]
    if args.json_out is not None:
        path = os.path.abspath(args.json_out)
        parent = os.path.dirname(path)
        if os.path.isdir(path):
            raise UsageError(f"--json {args.json_out}: is a directory; give a file name")
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise UsageError(f"--json {args.json_out}: cannot write there (directory {parent} "
                             "does not exist or is not writable)")


def _check_varlen(args: argparse.Namespace) -> None:
    """``--varlen``: lengths >= 0 summing to >= 1, one batch row, flags it can take."""
    if any(n < 0 for n in args.varlen) or sum(args.varlen) < 1:
        raise UsageError(f"--varlen {','.join(map(str, args.varlen))}: expected lengths >= 0 "
                         "with a total >= 1")
    given = [flag for attr, flag in _NOT_VARLEN if getattr(args, attr) not in (None, False)]
    if given:
        raise UsageError(f"{', '.join(given)} does not apply to --varlen (packed sequences "
                         "take causal, window, --softcap, --alibi and --sinks)")
    if args.batch != 1:
        raise UsageError(f"--batch {args.batch}: --varlen packs its sequences into one batch "
                         "row; use --batch 1")
    if args.check == "fast":
        raise UsageError("--check fast: not with --varlen (its reference runs each sequence "
                         "in full); use --check full or none")


def _available_memory_bytes():
    """MemAvailable from /proc/meminfo (Linux), else free physical pages; None if unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _fast_rows(nq: int) -> np.ndarray:
    """Query rows of ``--check fast``: the first and last FAST_CHECK_EDGE_ROWS and
    FAST_CHECK_SPREAD_ROWS evenly spread between them."""
    edge = FAST_CHECK_EDGE_ROWS
    spread = np.linspace(0, nq - 1, FAST_CHECK_SPREAD_ROWS).round().astype(np.int64)
    return np.unique(np.concatenate([np.arange(min(edge, nq)), np.arange(max(0, nq - edge), nq),
                                     spread]))


def _stage(args: argparse.Namespace, text: str) -> None:
    """A progress line on stderr before a step that can take more than a second."""
    if not args.quiet:
        print(f"... {text}", file=sys.stderr, flush=True)


def _kernel_rows(m) -> list:
    """Per kernel launched: the NKI namespace it was traced through ("nki" or "legacy"), its
    program size and peak SBUF (the largest over its launches)."""
    rows: dict = {}
    for k in m.kernels:
        row = rows.setdefault(k.name, {"name": k.name, "api": getattr(k, "api", "legacy"),
                                       "program_instructions": 0,
                                       "peak_sbuf_bytes_per_partition": 0, "launches": 0})
        row["program_instructions"] = max(row["program_instructions"], k.program_instructions)
        row["peak_sbuf_bytes_per_partition"] = max(row["peak_sbuf_bytes_per_partition"],
                                                   k.peak_sbuf_bytes_per_partition)
        row["launches"] += 1
    return list(rows.values())


def _run(args: argparse.Namespace) -> int:
    _check_flags(args)
    import host
    from host import reference
    from nki_kernels.nki import BACKEND

    rng = np.random.default_rng(args.seed)
    dtype = _dtype(args.dtype)
    B, Hq, Hkv, D = args.batch, args.heads, args.kv_heads, args.dim
    opts: dict = {"scale": args.scale}
    mods = _score_mods(args, Hq, rng)
    mm_dtype = _matmul_dtype(dtype, args)
    rows = None     # query rows the check compares (None: all)

    if args.decode or args.kvcache:
        T = 1 if args.tokens is None else args.tokens
        from nki_kernels.tiles import kvcache_decode_max_tokens

        # the split-KV decode kernels stream the cache (memory-bound); the prefill forward
        # over it is compute-bound
        memory_bound = args.decode or T <= kvcache_decode_max_tokens(Hq // Hkv)
        page_size = 256 if args.page_size is None else args.page_size
        cache_lens = np.array(args.cache_len if args.cache_len else [args.seq] * B, dtype=np.int32)
        s_max = int(max(int(cache_lens.max()), args.seq))
        q = rng.standard_normal((B, Hq, T, D)).astype(dtype)
        k = rng.standard_normal((B, Hkv, s_max, D)).astype(dtype)
        v = rng.standard_normal((B, Hkv, s_max, D)).astype(dtype)
        kwargs = dict(cache_lens=cache_lens, num_splits=args.num_splits,
                      mixed_precision=not args.no_mixed_precision, return_lse=True, **opts,
                      **mods)
        mode = "decode"
        if args.kvcache:
            causal = None if args.causal == "none" else (args.causal or "bottom_right")
            cache_masks = dict(causal=causal,
                               window=tuple(args.window) if args.window else None)
            mode = f"kvcache causal={causal}" + (f" window={cache_masks['window']}"
                                                 if args.window else "")
        label = (f"{mode} B={B} Hq={Hq} Hkv={Hkv} T={T} cache_lens={cache_lens.tolist()} "
                 f"S_max={s_max} D={D} {args.dtype}" + _mods_label(args))
        kv_itemsize = dtype.itemsize
        if args.kv_dtype is not None:
            # the kernel reads the FP8 cache; the check's truth is the cache it stands for
            fmt = KV_DTYPES[args.kv_dtype]
            k, kwargs["k_scale"] = reference.quantize_cache(k, fmt)
            v, kwargs["v_scale"] = reference.quantize_cache(v, fmt)
            label += f" cache {fmt} (per-kv-head scales)"
            kv_itemsize = k.itemsize
        k_in, v_in = k, v
        if args.paged:
            (k_in, v_in), kwargs["block_table"] = reference.contiguous_to_paged(
                (k, v), cache_lens, page_size, rng)
            label += f" paged (page_size {page_size}, {k_in.shape[0]} pages)"

        def call(target):
            lnc = args.lnc if target == "trn2" else None   # trn1: one core per logical core
            if args.kvcache:
                return host.flash_attention_with_kvcache(q, k_in, v_in, lnc=lnc, **cache_masks,
                                                         **kwargs)
            return host.flash_decode(q, k_in, v_in, lnc=lnc, **kwargs)

        def check_refs():
            kd, vd = k, v
            if args.kv_dtype is not None:
                kd = reference.dequantize_cache(k, kwargs["k_scale"])
                vd = reference.dequantize_cache(v, kwargs["v_scale"])
            if args.kvcache:
                # the forward over the contiguous cache with kv_lens = cache_lens
                ref = reference.attention_forward(q, kd, vd, scale=args.scale,
                                                  kv_lens=cache_lens, **cache_masks, **mods)
                base = reference.attention_baseline_lowp(
                    q, kd, vd, dtype=mm_dtype, out_dtype=dtype, scale=args.scale,
                    kv_lens=cache_lens, **cache_masks, **mods)
                return ref, (base, None)
            ref = reference.decode(q, kd, vd, cache_lens=cache_lens, scale=args.scale, **mods)
            base = reference.decode_baseline_lowp(q, kd, vd, cache_lens=cache_lens,
                                                  dtype=mm_dtype, out_dtype=dtype,
                                                  scale=args.scale, **mods)
            return ref, (base, None)

        scores = B * Hq * T * s_max
        if args.kvcache:
            visible_pairs = Hq * int(reference.attention_mask(
                T, s_max, batch=B, kv_lens=cache_lens, **cache_masks).sum())
        else:
            visible_pairs = int(sum(Hq * (T * (int(c) - T) + T * (T + 1) // 2)
                                    for c in cache_lens))
        lower_bound = (q.nbytes + 2 * sum(Hkv * int(c) * D * kv_itemsize for c in cache_lens)
                       + q.nbytes + B * Hq * T * 4)
        bound_says = "Q read, the valid K/V read once, O and LSE written once"
        unfused = None
    else:
        memory_bound = False
        causal = "bottom_right" if args.causal is None else args.causal
        causal = None if causal == "none" else causal
        Nq = args.seq_q or args.seq
        Nk = args.seq_k or args.seq
        cu = None
        if args.varlen is not None:
            cu = np.concatenate([[0], np.cumsum(args.varlen)]).astype(np.int32)
            Nq = Nk = int(cu[-1])
        q = rng.standard_normal((B, Hq, Nq, D)).astype(dtype)
        k = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
        v = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
        mask_opts = dict(causal=causal, window=tuple(args.window) if args.window else None,
                         kv_lens=np.array(args.kv_lens, dtype=np.int32) if args.kv_lens else None,
                         q_lens=np.array(args.q_lens, dtype=np.int32) if args.q_lens else None)
        if args.block_sparse is not None:
            from host import block_sparse as bs
            mask_opts["block_mask"] = _block_pattern(args.block_sparse, *bs.block_grid(Nq, Nk))
        packed = {} if cu is None else dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
        kwargs = dict(mixed_precision=not args.no_mixed_precision, return_lse=True,
                      **opts, **mask_opts, **mods, **packed)
        drop = {}
        if args.dropout:
            kwargs.update(dropout_p=args.dropout, seed=args.seed,
                          return_dropout_mask=args.check != "none")
        label = (f"forward B={B} Hq={Hq} Hkv={Hkv} Nq={Nq} Nk={Nk} D={D} {args.dtype} "
                 f"causal={causal}" + (f" window={tuple(args.window)}" if args.window else "")
                 + (f" dropout={args.dropout}" if args.dropout else "")
                 + (f" block-sparse={args.block_sparse} (density "
                    f"{mask_opts['block_mask'].mean():.3f})" if args.block_sparse else "")
                 + _mods_label(args)
                 + (f" varlen={','.join(map(str, args.varlen))}" if cu is not None else ""))
        if args.check == "fast":
            rows = _fast_rows(Nq)

        def call(target):
            lnc = args.lnc if target == "trn2" else None   # trn1: one core per logical core
            res = host.flash_attention(q, k, v, lnc=lnc, **kwargs)
            if kwargs.get("return_dropout_mask"):
                drop.update(dropout_p=args.dropout, dropout_mask=res[2])
                res = res[:2]
            return res

        def check_refs():
            if cu is not None:
                band = dict(scale=args.scale, causal=causal, window=mask_opts["window"], **mods)
                ref = reference.attention_varlen_forward(q, k, v, cu, cu, **band)
                base = reference.per_sequence(reference.attention_baseline_lowp, q, k, v, cu,
                                              cu, dtype=mm_dtype, out_dtype=dtype,
                                              return_lse=True, **band)
                return ref, (base[0], None)
            ref = reference.attention_forward(q, k, v, scale=args.scale, rows=rows, **mask_opts,
                                              **drop, **mods)
            base = reference.attention_baseline_lowp(q, k, v, dtype=mm_dtype, out_dtype=dtype,
                                                     scale=args.scale, rows=rows, **mask_opts,
                                                     **drop, **mods)
            return ref, (base, None)

        scores = B * Hq * (Nq if rows is None else len(rows)) * Nk
        # visible pairs per batch row, counted without materializing the mask for long rows
        blocks = mask_opts.get("block_mask")

        def visible(r0):
            r = np.arange(r0, min(Nq, r0 + 1024))
            if cu is not None:
                return int(reference.varlen_mask(cu, cu, causal=causal,
                                                 window=mask_opts["window"])[r].sum())
            m = reference.attention_mask(Nq, Nk, batch=B, causal=causal,
                                         window=mask_opts["window"], q_lens=mask_opts["q_lens"],
                                         kv_lens=mask_opts["kv_lens"], rows=r)
            if blocks is not None:
                m = m & np.repeat(blocks[0, 0][r // 128], 128, axis=-1)[None, :, :Nk]
            return int(m.sum())

        visible_pairs = Hq * sum(visible(r0) for r0 in range(0, Nq, 1024))
        lower_bound = reference.io_lower_bound_bytes(B, Hq, Hkv, Nq, Nk, D, dtype.itemsize,
                                                     q_lens=mask_opts["q_lens"],
                                                     kv_lens=mask_opts["kv_lens"])
        bound_says = ("Q, K and V read once, O and LSE written once"
                      if mask_opts["kv_lens"] is None and mask_opts["q_lens"] is None else
                      "the valid rows of Q, K and V read once, O and LSE written once in full")
        # Standard attention per query head (seed 000), with the inputs' element size.
        unfused = B * Hq * reference.unfused_attention_bytes(Nq, D, itemsize=dtype.itemsize, nk=Nk)

    print(f"nki-flash run: {label}", flush=True)
    print(f"backend: {BACKEND}", flush=True)

    need = REFERENCE_BYTES_PER_SCORE * scores
    if args.check != "none":
        avail = _available_memory_bytes()
        if avail is not None and need > REFERENCE_MEMORY_FRACTION * avail:
            sampled = args.check == "full" and not (args.decode or args.kvcache)
            hint = ("use --check fast (an exact float64 check of up to "
                    f"{2 * FAST_CHECK_EDGE_ROWS + FAST_CHECK_SPREAD_ROWS} sampled query rows per "
                    "head) or --check none" if sampled else
                    "use --check none, or fewer heads/sequences")
            raise EnvironmentProblem(
                f"the float64 reference check needs about {_fmt_bytes(need)} of memory and "
                f"{_fmt_bytes(avail)} is available; {hint}")

    report: dict = {"config": label, "backend": BACKEND, "check": args.check, "targets": {}}
    outputs = None
    for target in args.targets:
        _stage(args, f"running the kernel, modeling {target}")
        with _measure(target) as m, _progress(f"{target:5s}", enabled=not args.quiet):
            t0 = time.perf_counter()
            result = call(target)
            wall = time.perf_counter() - t0
        if outputs is None:
            outputs = result
        entry = {"wall_seconds": wall}
        if m is not None:
            lo, hi = m.modeled_seconds
            flops = 4.0 * D * visible_pairs
            from simulate import _hw     # m is a simulator measurement: its hardware table

            hw = _hw.get_target(target)
            # NeuronCores the launch ran on in parallel (2 with LNC=2): the peak scales with them
            cores = max((k.cores for k in m.kernels), default=1)
            if memory_bound:    # the fraction of the HBM-bandwidth bound reached
                # (the chip's HBM bandwidth shared evenly by its cores, hardware-and-limits.md §3)
                bound = lower_bound / (cores * hw.hbm_share_bytes_per_s)
                util = [bound / hi, bound / lo]
            else:               # compute-bound: the fraction of dense bf16 TensorE peak
                peak = cores * hw.tensor_peak_flops
                util = [flops / (hi * peak), flops / (lo * peak)]
            entry.update(
                hbm_bytes_read=int(m.hbm_bytes_read), hbm_bytes_written=int(m.hbm_bytes_written),
                modeled_seconds=[lo, hi], cores=int(cores),
                estimated_seconds=float(m.estimated_seconds),
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
    print()
    if args.check == "none":
        ok = bool(np.isfinite(np.asarray(o, np.float64)).all())
        report.update(passed=ok)
        print("check        skipped (--check none); outputs are "
              + ("finite" if ok else "NOT finite: FAIL"))
    else:
        _stage(args, f"checking against the float64 reference (about {_fmt_bytes(need)})")
        (ref_o, ref_lse), (base_o, _) = check_refs()
        o64 = np.asarray(o, dtype=np.float64)
        lse64 = np.asarray(lse, dtype=np.float64)
        if rows is not None:
            o64, lse64 = o64[:, :, rows], lse64[:, :, rows]
        err_o = reference.max_abs_err(o64, ref_o)
        err_lse = reference.max_abs_err(lse64, ref_lse)
        # The tolerance rule of docs/semantics.md: 2x a plain implementation in the kernel's
        # matmul precision, plus a floor. LSE is fp32 all the way, so it gets a fixed 1e-2.
        tol_o = reference.tolerance(ref_o, base_o, floor=reference.atol_floor(mm_dtype))
        tol_lse = 1e-2
        ok = err_o <= tol_o and err_lse <= tol_lse and bool(np.isfinite(o64).all())
        report.update(max_abs_err_o=err_o, tolerance_o=tol_o, max_abs_err_lse=err_lse,
                      tolerance_lse=tol_lse, passed=bool(ok))
        what = "" if rows is None else f" ({len(rows)} sampled query rows per head)"
        print(f"check{what}  max|o - ref| = {err_o:.3e}  (tolerance {tol_o:.3e})   "
              f"max|lse - ref| = {err_lse:.3e}  (tolerance {tol_lse:.1e})   "
              f"{'PASS' if ok else 'FAIL'}")
    first = report["targets"].get(args.targets[0], {})
    if "hbm_bytes_read" in first:
        total = first["hbm_bytes_read"] + first["hbm_bytes_written"]
        print(f"HBM traffic  read {_fmt_bytes(first['hbm_bytes_read'])}, written "
              f"{_fmt_bytes(first['hbm_bytes_written'])}; total {_fmt_bytes(total)} = "
              f"{total / lower_bound:.3f}x the IO lower bound ({_fmt_bytes(lower_bound)}: "
              f"{bound_says})"
              + (f"; unfused attention would move {_fmt_bytes(unfused)} "
                 f"({unfused / total:.1f}x more)" if unfused else ""))
        report.update(io_lower_bound_bytes=int(lower_bound),
                      unfused_bytes=int(unfused) if unfused else None)
        util_name = "HBM-BW util" if memory_bound else "TensorE util"
        print(f"{'target':8s}{'modeled time (overlap .. serial)':>36s}{'scheduled':>12s}"
              f"{util_name:>18s}   busiest engines")
        for target, e in report["targets"].items():
            lo, hi = e["modeled_seconds"]
            # engine time per core (the totals are spread over the cores of an LNC=2 launch)
            per_core = {k: v / e.get("cores", 1) for k, v in e["engine_seconds"].items()}
            busiest = sorted(per_core.items(), key=lambda kv: -kv[1])[:3]
            name = target if e.get("cores", 1) == 1 else f"{target}x{e['cores']}"
            print(f"{name:8s}{lo * 1e6:15.1f} us .. {hi * 1e6:9.1f} us"
                  f"{e['estimated_seconds'] * 1e6:9.1f} us"
                  f"{e['utilization'][1] * 100:10.1f}% ..{e['utilization'][0] * 100:5.1f}%"
                  "   " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in busiest))
        for target, e in report["targets"].items():
            cap = e["sbuf_capacity_bytes_per_partition"]
            for row in e["kernels"]:
                peak = row["peak_sbuf_bytes_per_partition"]
                ns = "nki.*" if row["api"] == "nki" else "neuronxcc.nki"
                print(f"{target:8s}kernel {row['name']} ({ns}): program "
                      f"{row['program_instructions']} "
                      f"instructions (loop bodies once), peak SBUF {peak / 1024:.1f} KiB/partition "
                      f"= {100 * peak / cap:.0f}% of {cap // 1024} KiB")
    else:
        print("(HBM bytes and modeled time come from the simulator; this backend ran on a device)")
    if "modeled_seconds" in first:
        print("modeled time: the perfect-overlap bound .. the serial bound; scheduled: the list-"
              "scheduled estimate (simulate.measure().estimated_seconds, docs/simulator.md)")
    if args.json_out:
        try:
            with open(args.json_out, "w") as fh:
                json.dump(report, fh, indent=2)
        except OSError as exc:
            raise UsageError(f"--json {args.json_out}: cannot write the report ({exc.strerror})")
        print(f"report written to {args.json_out}")
    return EXIT_OK if report["passed"] else EXIT_CHECK_FAILED


def _check_backend() -> None:
    """Bind the NKI backend now, turning a bad NKI_FLASH_BACKEND or a missing neuronx-cc into an
    environment problem with what to set."""
    try:
        import nki_kernels.nki  # noqa: F401
    except ValueError as exc:
        raise EnvironmentProblem(f"{exc}; unset it for the default (auto)") from None
    except ImportError as exc:      # its message says what to install or set
        raise EnvironmentProblem(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        if argv and argv[0] == "bench":
            _check_backend()
            from host.bench import main_bench

            return int(main_bench(argv[1:]) or 0)
        args = parser.parse_args(argv)
        _check_backend()
        if args.command == "run":
            return _run(args)
        parser.error(f"unknown command {args.command}")
    except UsageError as exc:
        print(f"nki-flash: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, TypeError) as exc:
        if debug:
            raise
        print(f"nki-flash: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (EnvironmentProblem, MemoryError) as exc:
        if debug:
            raise
        what = str(exc) if isinstance(exc, EnvironmentProblem) else \
            "out of memory; try --check fast or --check none, or a smaller shape"
        print(f"nki-flash: environment problem: {what}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except KeyboardInterrupt:
        print("nki-flash: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:        # no traceback reaches a CLI user unless asked for
        if debug:
            raise
        print(f"nki-flash: internal error: {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 "
              "for the traceback, and please report it)", file=sys.stderr)
        return EXIT_ENVIRONMENT
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
