"""Chunked prefill over a KV cache (issue 26, item 2): ``host.flash_attention_with_kvcache``
against ``host.flash_attention`` on the same data stored contiguously.

Default case: T = 2048 new tokens appended to a cache that then holds 8192 positions (B=1,
Hq=8, Hkv=2, D=128, bf16, causal), the cache paged with page sizes 128 and 256 (pages scattered
over a shuffled pool) and contiguous. The baseline is ``flash_attention(q, k, v, causal=True)``
with k, v the 8192 cache positions as plain ``(B, Hkv, 8192, D)`` arrays. Goal: the paged
call within 1.15x the baseline's time and 1.10x its HBM bytes (scheduled estimate, one
NeuronCore of trn2). ``--threshold`` instead compares the split-KV decode kernels with the
prefill forward over the same cache for several T (the choice of
``tiles.kvcache_decode_max_tokens``). ``--kv-dtype float8_e5m2`` (or another FP8 format of
the target) adds the same calls over an FP8 copy of the cache (per-kv-head scales,
``reference.quantize_cache``), compared with the bf16 cache of the same layout.

Numbers come from ``simulate.measure`` (exact HBM bytes; the scheduled estimate
``estimated_seconds``; NOT hardware timings).

    python benchmarks/kvcache.py                          # the goal case
    python benchmarks/kvcache.py --threshold --tokens 16 32 64 128 --seq 8192
    python benchmarks/kvcache.py --kv-dtype float8_e5m2 --page-sizes 128  # FP8 vs bf16

Runs on the bundled simulator only (``NKI_FLASH_BACKEND=simulate`` is set if unset).
"""
from __future__ import annotations

import argparse
import os

from _common import TARGETS, write_json

os.environ.setdefault("NKI_FLASH_BACKEND", "simulate")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

#: Goals of issue 26 item 2: paged chunked prefill against the contiguous forward.
TIME_GOAL, BYTES_GOAL = 1.15, 1.10


def _inputs(args, T):
    rng = np.random.default_rng(0)
    dt = ml_dtypes.bfloat16
    q = rng.standard_normal((args.batch, args.hq, T, args.dim)).astype(np.float32).astype(dt)
    kv = [rng.standard_normal((args.batch, args.hkv, args.seq, args.dim)).astype(np.float32)
          .astype(dt) for _ in range(2)]
    return q, kv[0], kv[1]


def _measure(target, fn):
    import simulate

    with simulate.measure(target=target) as m:
        fn()
    return {"estimated_us": m.estimated_seconds * 1e6,
            "read": m.hbm_bytes_read, "written": m.hbm_bytes_written,
            "bytes": m.hbm_bytes_read + m.hbm_bytes_written}


def goal_case(args, target):
    import host
    from host import reference

    q, k, v = _inputs(args, args.tokens[0])
    lens = np.full(args.batch, args.seq)
    rows = [dict(case="flash_attention contiguous",
                 **_measure(target, lambda: host.flash_attention(q, k, v, causal=True,
                                                                 lnc=1)))]
    caches = [("", k, v, {})]
    if args.kv_dtype is not None:
        fmt = np.dtype(getattr(ml_dtypes, args.kv_dtype))
        (k8, ks), (v8, vs) = reference.quantize_cache(k, fmt), reference.quantize_cache(v, fmt)
        caches.append((f" {args.kv_dtype}", k8, v8, dict(k_scale=ks, v_scale=vs)))
    for suffix, kc, vc, scales in caches:
        rows.append(dict(case="with_kvcache contiguous" + suffix, **_measure(
            target, lambda: host.flash_attention_with_kvcache(q, kc, vc, cache_lens=lens,
                                                              lnc=1, **scales))))
        for ps in args.page_sizes:
            (kp, vp), table = reference.contiguous_to_paged((kc, vc), lens, ps,
                                                            np.random.default_rng(1))
            rows.append(dict(case=f"with_kvcache paged {ps}" + suffix, **_measure(
                target, lambda: host.flash_attention_with_kvcache(
                    q, kp, vp, cache_lens=lens, block_table=table, lnc=1, **scales))))
    base = rows[0]
    print(f"\n{target}, one NeuronCore: B={args.batch} Hq={args.hq} Hkv={args.hkv} "
          f"T={args.tokens[0]} cache={args.seq} D={args.dim} bf16 causal")
    for r in rows:
        r.update(target=target, time_ratio=r["estimated_us"] / base["estimated_us"],
                 bytes_ratio=r["bytes"] / base["bytes"])
        ok = r["time_ratio"] <= TIME_GOAL and r["bytes_ratio"] <= BYTES_GOAL
        print(f"  {r['case']:<36} {r['estimated_us']:9.1f} us  HBM {r['bytes']:>11} B  "
              f"time {r['time_ratio']:.3f}x  bytes {r['bytes_ratio']:.4f}x"
              f"{'' if r is base else ('  within goal' if ok else '  OUTSIDE goal')}")
    if args.kv_dtype is not None:
        bf16 = {r["case"]: r for r in rows}
        for r in rows:
            if r["case"].endswith(args.kv_dtype):
                other = bf16[r["case"][:-len(args.kv_dtype) - 1]]
                print(f"  {r['case']:<36} vs the bf16 cache: time "
                      f"{r['estimated_us'] / other['estimated_us']:.3f}x  bytes "
                      f"{r['bytes'] / other['bytes']:.4f}x")
    return rows


def threshold_case(args, target):
    import host
    from nki_kernels import tiles

    chosen = tiles.kvcache_decode_max_tokens

    rows = []
    print(f"\n{target}, one NeuronCore: B={args.batch} Hq={args.hq} Hkv={args.hkv} "
          f"cache={args.seq} D={args.dim} bf16: decode kernels vs prefill forward")
    for T in args.tokens:
        q, k, v = _inputs(args, T)
        lens = np.full(args.batch, args.seq)
        runs = {}
        try:
            for name, limit in (("decode", T), ("prefill", T - 1)):
                # the same call, its kernel forced by the threshold
                tiles.kvcache_decode_max_tokens = lambda group, limit=limit: limit
                runs[name] = _measure(target, lambda: host.flash_attention_with_kvcache(
                    q, k, v, cache_lens=lens, lnc=1))
        finally:
            tiles.kvcache_decode_max_tokens = chosen
        dec, pre = runs["decode"], runs["prefill"]
        rows.append(dict(target=target, T=T, decode=dec, prefill=pre))
        print(f"  T={T:4d}: decode {dec['estimated_us']:9.1f} us  prefill "
              f"{pre['estimated_us']:9.1f} us  (HBM {dec['bytes']} / {pre['bytes']} B)")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hq", type=int, default=8)
    p.add_argument("--hkv", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048],
                   help="new tokens T (several with --threshold)")
    p.add_argument("--seq", type=int, default=8192, help="cache_lens (every sequence)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--page-sizes", type=int, nargs="+", default=[128, 256])
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=["trn2"])
    p.add_argument("--kv-dtype", default=None,
                   choices=["float8_e5m2", "float8_e4m3", "float8_e4m3fn"],
                   help="also the calls over an FP8 copy of the cache (per-kv-head scales)")
    p.add_argument("--threshold", action="store_true",
                   help="compare the decode kernels with the prefill forward per T")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    results = []
    for t in args.targets:
        results += (threshold_case if args.threshold else goal_case)(args, t)
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
