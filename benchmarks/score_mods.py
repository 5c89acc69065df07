"""What the score modifiers (soft-capping, ALiBi, sinks) cost on the simulator's model.

For the forward and backward at N = 4096 (one head, bf16, trn2, one NeuronCore) and decode
(B=1, Hq=32, Hkv=8, one token over a 32K cache), each modifier alone and all three together,
next to the plain kernel: the perfect-overlap bound (``modeled_seconds``) and the scheduled
estimate (``estimated_seconds``). Run: ``python benchmarks/score_mods.py [--n 4096] [--d 128]
[--json FILE]``.
"""
import argparse
import json
import os
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import host  # noqa: E402
import simulate  # noqa: E402

MODS = {
    "none": {},
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "all three": dict(softcap=30.0, alibi=True, sinks=True),
}


def _kwargs(spec, Hq, rng):
    kw = {}
    if "softcap" in spec:
        kw["softcap"] = spec["softcap"]
    if spec.get("alibi"):
        kw["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, Hq + 1) / Hq)
    if spec.get("sinks"):
        kw["sinks"] = rng.standard_normal(Hq)
    return kw


def _measured(fn):
    with simulate.measure(target="trn2") as m:
        out = fn()
    return m, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--cache", type=int, default=32768)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    bf = ml_dtypes.bfloat16
    N, D = args.n, args.d
    q, k, v, do = (rng.standard_normal((1, 1, N, D)).astype(bf) for _ in range(4))
    rows = []
    print(f"trn2, one NeuronCore, bf16, N = {N}, D = {D}; microseconds, bound / estimate")
    print(f"{'modifiers':12s} {'forward':>16s} {'fwd causal':>16s} {'backward':>16s}")
    for name, spec in MODS.items():
        kw = _kwargs(spec, 1, rng)
        cells = []
        for causal in (None, True):
            m, (o, lse) = _measured(lambda: host.flash_attention(
                q, k, v, causal=causal, lnc=1, return_lse=True, **kw))
            cells.append((m.modeled_seconds[0], m.estimated_seconds))
            if causal is None:
                saved = (o, lse)
        mb, _ = _measured(lambda: host.flash_attention_backward(do, q, k, v, *saved, lnc=1,
                                                                **kw))
        cells.append((mb.modeled_seconds[0], mb.estimated_seconds))
        row = {"modifiers": name, "forward": cells[0], "forward_causal": cells[1],
               "backward": cells[2]}
        rows.append(row)
        print(f"{name:12s} " + " ".join(f"{b * 1e6:7.1f} /{e * 1e6:7.1f}" for b, e in cells))

    B, Hq, Hkv, S = 1, 32, 8, args.cache
    qd = rng.standard_normal((B, Hq, 1, D)).astype(bf)
    kc, vc = (rng.standard_normal((B, Hkv, S, D)).astype(bf) for _ in range(2))
    print(f"\ndecode B={B} Hq={Hq} Hkv={Hkv} T=1 cache {S}: bound / estimate (us)")
    for name in ("none", "all three"):
        kw = _kwargs(MODS[name], Hq, rng)
        m, _ = _measured(lambda: host.flash_decode(qd, kc, vc, cache_lens=np.array([S]), lnc=1,
                                                     **kw))
        rows.append({"modifiers": name, "decode": (m.modeled_seconds[0], m.estimated_seconds)})
        print(f"{name:12s} {m.modeled_seconds[0] * 1e6:7.1f} /{m.estimated_seconds * 1e6:7.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
