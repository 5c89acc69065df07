"""Acceptance: AWS's maintained attention kernels (nki-library) run unchanged on the nki.*
(NKI 0.7) front end of the simulator.

    python benchmarks/nkilib_acceptance.py /tmp/nkilib [--target trn2] [--only cte,bwd,tkg]

``/tmp/nkilib`` is a checkout of aws-neuron/nki-library (``git -C <mirror> archive HEAD | tar
x -C /tmp/nkilib``). After ``simulate.register_as_nki()`` the script imports
``nkilib_src.nkilib.core.attention.{attention_cte, attention_bwd, attention_tkg}`` from that
checkout, runs each kernel on small shapes and compares with nki-library's own torch
reference (``*_torch.py``, torch on the CPU) computed from the same bf16-rounded inputs. It
prints one row per case: pass, or fail with the first line of the error, and the scheduled
estimate (``simulate.measure(target=...)``) of the passing ones. Shapes stay small because
attention_cte loops with Python ``range``, which NKI 0.7 unrolls.

nki-library's pytest harness (``test/utils``) needs AWS-internal packages (metrics emitters,
``neuron_dtypes``), so the cases here call the kernels as its tests do, with inputs made here.
attention_tkg is not a top-level kernel (it takes an ``SbufManager`` and the output tensor);
a small top-level kernel written here allocates those and calls it, as its documentation
describes.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import simulate  # noqa: E402

RTOL = ATOL = 2e-2          # bf16 inputs and P@V in bf16 against an fp32 reference


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def _rand(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(_bf16())


def _f32(a):
    return np.asarray(a).astype(np.float32)


def _t(a):
    import torch
    return torch.from_numpy(_f32(a))


def _cmp(got, want):
    got, want = _f32(got), _f32(want)
    if got.shape != want.shape:
        return f"shape {got.shape} != reference {want.shape}"
    if not np.isfinite(got).all():
        return f"{int((~np.isfinite(got)).sum())} non-finite values"
    err = np.abs(got - want)
    bad = err > ATOL + RTOL * np.abs(want)
    if bad.any():
        return f"max abs err {err.max():.3g} ({int(bad.sum())}/{bad.size} beyond rtol=atol={RTOL})"
    return None


# -- attention_cte ------------------------------------------------------------------------------
def cte_case(B, Bkv, S, d, causal=True, **kw):
    def run(mods):
        cte, ref = mods["cte"], mods["cte_ref"]
        rng = np.random.default_rng(0)
        q = _rand(rng, (B, S, d))
        k = _rand(rng, (Bkv, d, S))
        v = _rand(rng, (Bkv, S, d))
        extra = {}
        if kw.get("sink"):
            extra["sink"] = _rand(rng, (B, 1))
        scale = kw.get("scale", 1.0 / math.sqrt(d))
        args = dict(scale=scale, causal_mask=causal, **extra,
                    **{k_: v_ for k_, v_ in kw.items() if k_ not in ("sink", "scale")})
        out = cte(q, k, v, **args)
        rargs = {k_: (_t(v_) if isinstance(v_, np.ndarray) else v_) for k_, v_ in args.items()}
        if rargs.get("sliding_window") is None:
            rargs["sliding_window"] = 0
        want = ref(_t(q), _t(k), _t(v), **rargs)
        if isinstance(want, tuple):
            outs = out if isinstance(out, tuple) else (out,)
            errs = [_cmp(o, w.numpy()) for o, w in zip(outs, want)]
            return next((e for e in errs if e), None)
        return _cmp(out, want.numpy())
    return run


# -- attention_bwd ------------------------------------------------------------------------------
def bwd_case(B, Hq, Hkv, S, d, causal=False):
    def run(mods):
        bwd, ref, o_lse = mods["bwd"], mods["bwd_ref"], mods["bwd_o_lse"]
        rng = np.random.default_rng(1)
        q = _rand(rng, (B, Hq, d, S))
        k = _rand(rng, (B, Hkv, d, S))
        v = _rand(rng, (B, Hkv, d, S))
        dy = _rand(rng, (B, Hq, d, S))
        o, lse, _ = o_lse(_t(q), _t(k), _t(v), causal, False)
        o = np.ascontiguousarray(o.float().numpy().astype(_bf16()))
        lse = np.ascontiguousarray(lse.float().numpy())
        got = bwd(q, k, v, o, dy, lse, use_causal_mask=causal)
        want = ref(_t(q), _t(k), _t(v), _t(o), _t(dy), _t(lse), use_causal_mask=causal)
        if isinstance(want, dict):
            want = [want[n] for n in ("dq", "dk", "dv") if n in want] or list(want.values())
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            e = _cmp(g, w.detach().numpy() if hasattr(w, "detach") else w)
            if e:
                return f"{name}: {e}"
        return None
    return run


# -- attention_tkg ------------------------------------------------------------------------------
def tkg_program(mods, cfg, B, H, d, s_active):
    """A top-level kernel (written here) around attention_tkg, which is not one: it allocates
    the kernel's ``SbufManager`` and the HBM output (B, H, d, s_active), DMAs q and k_active
    into SBUF (``cfg.qk_in_sb``: 2-D [d, B * H * s_active] and [d, B * s_active]) and calls
    it, as attention_tkg's documentation describes."""
    import nki
    import nki.isa as nisa
    import nki.language as nl
    tkg, Sbm, Logger = mods["tkg"], mods["sbm"], mods["logger"]

    @nki.jit
    def top(q, k_active, v_active, k_prior, v_prior, mask):
        sbm = Sbm(0, nl.tile_size.total_available_sbuf_size - 16 * 1024, Logger("SBM"))
        sbm.open_scope()
        out = nl.ndarray((B, H, d, s_active), dtype=q.dtype, buffer=nl.shared_hbm)
        q_sb = sbm.alloc_stack(q.shape, dtype=q.dtype, buffer=nl.sbuf)
        k_sb = sbm.alloc_stack(k_active.shape, dtype=k_active.dtype, buffer=nl.sbuf)
        nisa.dma_copy(q_sb, q)
        nisa.dma_copy(k_sb, k_active)
        o, _ = tkg(q_sb, k_sb, v_active, k_prior, v_prior, mask, out, cfg, sbm)
        sbm.close_scope()
        return o
    return top


def tkg_case(B, H, s_active, s_prior, d):
    def run(mods):
        ref, Cfg = mods["tkg_ref"], mods["tkg_cfg"]
        # without fused RoPE the kernel takes Q and K_active in SBUF (its own validation)
        cfg = Cfg(B, H, s_active, s_prior, s_prior, d, 0, qk_in_sb=True)
        rng = np.random.default_rng(2)
        # with qk_in_sb the kernel documents q as [d, B * H * s_active] and k_active as
        # [d, B * s_active] (2-D; attention_tkg docstring); it folds them with views itself
        q = _rand(rng, (d, B * H * s_active))
        k_active = _rand(rng, (d, B * s_active))
        v_active = _rand(rng, (B, 1, s_active, d))
        k_prior = _rand(rng, (B, 1, d, s_prior))
        v_prior = _rand(rng, (B, 1, s_prior, d))
        # causal mask over (prior + active) positions: the prior is visible, the active block
        # is lower-triangular
        mask = np.ones((s_prior, B, H, s_active), np.uint8)
        act = np.tril(np.ones((s_active, s_active), np.uint8))
        mask[s_prior - s_active:] = act.T[:, None, None, :]

        top = tkg_program(mods, cfg, B, H, d, s_active)
        got = top(q, k_active, v_active, k_prior, v_prior, mask)
        out_ref = np.zeros((B, H, d, s_active), np.float32)
        want = ref[1](q=_t(q), k_active=_t(k_active), v_active=_t(v_active),
                      k_prior=_t(k_prior), v_prior=_t(v_prior), mask=_t(mask),
                      out=_t(out_ref), cfg=cfg, sbm=None)
        want = want[0] if isinstance(want, tuple) else want
        return _cmp(got, want.numpy().reshape(np.shape(got)))
    return run


CASES = [
    ("cte", "causal B=1 S=256 d=64", cte_case(1, 1, 256, 64)),
    ("cte", "non-causal B=2 S=256 d=128", cte_case(2, 2, 256, 128, causal=False)),
    ("cte", "GQA B=2 Bkv=1 S=256 d=64", cte_case(2, 1, 256, 64)),
    ("cte", "causal S=512 d=128", cte_case(1, 1, 512, 128)),
    ("cte", "sliding window 128 (scale=1)", cte_case(1, 1, 512, 64, sliding_window=128,
                                                      scale=1.0)),
    ("cte", "cache_softmax", cte_case(1, 1, 256, 64, cache_softmax=True)),
    ("cte", "tp_out", cte_case(1, 1, 256, 64, tp_out=True)),
    ("cte", "sink", cte_case(1, 1, 256, 64, sink=True)),
    ("bwd", "B=1 H=1 S=256 d=64", bwd_case(1, 1, 1, 256, 64)),
    ("bwd", "causal B=1 H=1 S=256 d=64", bwd_case(1, 1, 1, 256, 64, causal=True)),
    ("bwd", "GQA Hq=2 Hkv=1 S=256 d=128", bwd_case(1, 2, 1, 256, 128)),
    ("tkg", "B=1 H=1 s_active=1 s_prior=512 d=64", tkg_case(1, 1, 1, 512, 64)),
    ("tkg", "B=2 H=2 s_active=4 s_prior=1024 d=128", tkg_case(2, 2, 4, 1024, 128)),
]


def _modules(root):
    sys.path.insert(0, os.path.join(root, "src"))
    mods = {}
    errs = {}
    base = "nkilib_src.nkilib.core"
    import importlib
    for key, mod, name in (
            ("cte", "attention.attention_cte", "attention_cte"),
            ("cte_ref", "attention.attention_cte_torch", "attention_cte_torch_ref"),
            ("bwd", "attention.attention_bwd", "attention_bwd"),
            ("bwd_ref", "attention.attention_bwd_torch", "attention_bwd_torch_ref"),
            ("bwd_o_lse", "attention.attention_bwd_torch", "compute_o_lse"),
            ("tkg", "attention.attention_tkg", "attention_tkg"),
            ("tkg_ref", "attention.attention_tkg_torch", "attention_tkg_torch_ref"),
            ("tkg_cfg", "attention.attention_tkg_utils", "AttnTKGConfig"),
            ("sbm", "utils.allocator", "SbufManager"),
            ("logger", "utils.logging", "Logger")):
        try:
            mods[key] = getattr(importlib.import_module(f"{base}.{mod}"), name)
        except Exception as e:       # noqa: BLE001 (reported per case)
            errs[key] = f"import: {type(e).__name__}: {e}"
    return mods, errs


def _first_line(e):
    msg = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return msg[:160]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("nkilib", help="path of an nki-library checkout")
    ap.add_argument("--target", default="trn2")
    ap.add_argument("--only", default="", help="comma-separated kernels: cte,bwd,tkg")
    ap.add_argument("--traceback", action="store_true")
    a = ap.parse_args(argv)
    simulate.register_as_nki()
    mods, errs = _modules(os.path.abspath(a.nkilib))
    only = set(filter(None, a.only.split(",")))
    print(f"nki-library at {a.nkilib}, target {a.target}")
    print(f"{'kernel':6} {'case':42} {'result':6} {'estimate':>11} {'s':>5}  detail")
    tally = {"pass": 0, "fail": 0}
    for kern, name, run in CASES:
        if only and kern not in only:
            continue
        t0 = time.time()
        est = ""
        need = [k for k in mods if k.startswith(kern)]
        missing = [errs[k] for k in errs if k.startswith(kern) or (kern == "tkg" and k in (
            "sbm", "logger"))]
        if missing:
            res, detail = "fail", missing[0]
        else:
            try:
                with simulate.measure(target=a.target) as m:
                    detail = run(mods)
                res = "fail" if detail else "pass"
                if not detail:
                    est = f"{m.estimated_seconds * 1e6:.1f} us"
                    detail = f"{m.program_instructions} program instructions"
            except Exception as e:   # noqa: BLE001 (reported per case)
                res, detail = "fail", _first_line(e)
                if a.traceback:
                    traceback.print_exc()
        _ = need
        tally[res] += 1
        print(f"{kern:6} {name:42} {res:6} {est:>11} {time.time() - t0:5.1f}  {detail}",
              flush=True)
    print(f"{tally['pass']} passed, {tally['fail']} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
