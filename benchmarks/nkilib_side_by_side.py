"""nki-library's attention kernels (AWS's production attention_cte, attention_bwd and
attention_tkg) and ours, side by side on the same simulator: trn2, one NeuronCore, the
scheduled estimate, plus the accuracy of each against a float64 reference.

    python benchmarks/nkilib_side_by_side.py /tmp/nkilib [--kernel cte bwd tkg]
        [--n 2048 8192] [--d 64 128] [--causal both|yes|no] [--allow-32k]
        [--extras | --extras-only] [--extras-n 8192]                       (cte)
        [--n 2048 8192] [--d 128] [--causal both|yes|no]                   (bwd)
        [--decode 1x131072 8x16384 64x2048] [--hq 32] [--hkv 8]            (tkg)
        [--k-layout bhds|bhsd]

``/tmp/nkilib`` is a checkout of aws-neuron/nki-library (d2ad3a5 was used; nothing is
downloaded). After ``simulate.register_as_nki()`` the kernels are imported from that checkout
and run unchanged on the simulator's ``nki.*`` (NKI 0.7) front end exactly as in
benchmarks/nkilib_acceptance.py, whose helpers this script imports. Ours run through
``host.flash_attention``, ``host.flash_attention_backward`` and ``host.flash_decode`` with
``lnc=1`` on whichever front end they trace through today; the table's last column names both
front ends as ``simulate.measure(...).api`` records them ("nki": the simulator's ``nki.*``
NKI 0.7 front end; "legacy": its ``neuronxcc.nki`` front end). Inputs are bf16, drawn once
per shape and given to both kernels in each one's layout (ours (B, H, N, D) everywhere). Max
error is the largest absolute difference from a float64 computation from the same bf16-rounded
inputs. Modeled numbers, not hardware timings.

``--kernel cte`` (default): attention_cte vs our forward. One batch, one head; attention_cte
takes Q as (B, S, d), K as (B, d, S), V as (B, S, d); scale 1/sqrt(D); causal is the square
top-left mask for both. Shapes from issue 24, item 5: N in {2K, 8K} x D in {64, 128} x causal
or not; N = 32K only with ``--allow-32k``: attention_cte unrolls its Python loops under NKI 0.7
(76441 program instructions at 32K causal, 147401 non-causal). One 32K D = 128 shape takes
about 7 min here causal (ours 5 min of it) and 31 min non-causal (ours 26 min: the simulation
of our forward grows faster than its work from 8K to 32K), beyond a 15-minute budget.
``--extras`` adds, at N = ``--extras-n`` (8K), D = 128, causal:

* GQA 4:1: four query heads on one kv head. attention_cte has no head axis: its GQA is
  ``batch_size = 4`` query sequences over ``batch_size_kv = 1`` kv sequence (query batch b
  reads kv batch b // 4, its torch reference's ``repeat_interleave``); ours is B = 1, Hq = 4,
  Hkv = 1.
* sliding window 1024: attention_cte's ``sliding_window=1024`` with its causal mask hides key
  j from query i when j - i <= -1024 (attention_cte_torch.py), so i sees j in [i - 1023, i];
  ours is ``causal="top_left", window=(1023, 0)``, the same mask. attention_cte accepts only
  ``scale=1.0`` with a sliding window, so in this row q is drawn with standard deviation
  1/sqrt(D) (then rounded to bf16) and both kernels and the reference use scale 1.
* sinks: one sink logit per head joins every row's softmax denominator with no value, not
  scaled: attention_cte's ``sink`` (batch_size, 1) and our ``sinks`` (Hq,) are the same
  semantics (gpt-oss); the bf16-drawn sink is given to ours as float32 (exact).

``--kernel bwd``: attention_bwd vs ``host.flash_attention_backward``; B = H = 1, D = 128 by
default. Both get the same q, k, v, dO (bf16) and the forward's o (the float64 output rounded to
bf16) and lse (float64 natural-log log-sum-exp of the scaled scores, as float32).
attention_bwd takes q, k, v, o, dO as (B, H, d, S) and lse as (B, H, 128, S / 128) (row
t * 128 + p at [p, t], compute_o_lse's layout), ``mixed_precision=True`` (fp32 intermediates),
``softmax_scale`` 1/sqrt(D); causal is top-left for both. The reference is the exact float64
gradient (its o is the unrounded one). The error columns give dQ / dK / dV.

``--kernel tkg``: attention_tkg vs ``host.flash_decode``: one new token per sequence, Hq = 32,
Hkv = 8, D = 128, (B, S) in {(1, 128K), (8, 16K), (64, 2K)} with S the sequence length
including the new token (``--decode BxS ...``). Ours: v_cache (B, 8, S, D) and, by default
(``--k-layout bhds``), k_cache (B, 8, D, S) -- ``flash_decode(k_layout="bhds")``, K already
transposed, the layout attention_tkg's k_prior has, so both kernels read K as [d, S] --
holding the new token at S - 1, ``cache_lens = S``; ``--k-layout bhsd`` gives ours its
default (B, 8, S, D) k_cache instead (it then transposes K on chip). attention_tkg serves one kv head per call (k_prior is
[B, 1, d, S]), so the 8 kv heads are folded into its batch: B' = 8 B sequences of H = 4 query
heads, q [d, B' * 4] and k_active [d, B'] in SBUF (``qk_in_sb``; the top-level kernel is
nkilib_acceptance.tkg_program), k_prior [B', 1, d, S] (its default untransposed layout),
v_prior [B', 1, S, d], and an all-ones mask [S, B', 4, 1] (uint8, read from HBM): the new
token sees every position, its own included, as ours does. attention_tkg expects q already
scaled (its docstring), so q is drawn with standard deviation 1/sqrt(D) and both use scale 1.

Simulation time (wall clock on 2 shared cores, both kernels and the reference): every default
shape is feasible; the slowest are tkg B = 64, S = 2K (about 3 min) and cte GQA at 8K (about
1 min); the whole default set (``--kernel cte bwd tkg --extras``) takes about 12 min.
``--decode``, ``--n`` and ``--d`` pick fewer or other shapes. The per-row notes on stderr give
program instructions, modeled spill refills (0 everywhere here), wall times and the error of
merely rounding the reference to bf16 (the causal rows' errors are near that floor: their
first rows average few values).
"""
from __future__ import annotations

import argparse
import contextlib
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
from nkilib_acceptance import _bf16, _f32, _modules, _rand, tkg_program  # noqa: E402


# -- float64 references -------------------------------------------------------------------------
def _f64(a):
    return np.asarray(a).astype(np.float64)


ROWS = 1024            # query rows per block of the references (memory stays O(ROWS N))


def _visible(rows, nk, causal, left):
    """(len(rows), nk) bool: top-left causal (j <= i) and/or a left window (j >= i - left)."""
    i, j = rows[:, None], np.arange(nk)[None, :]
    vis = np.ones((len(rows), nk), bool)
    if causal:
        vis &= j <= i
    if left is not None:
        vis &= j >= i - left
    return vis


def _probs(q, k, rows, causal, scale, left=None, sink=None):
    """float64 softmax probabilities of query rows ``rows`` and their lse; ``sink`` a logit in
    the denominator."""
    s = (q[rows] @ k.T) * scale
    if causal or left is not None:
        s = np.where(_visible(rows, len(k), causal, left), s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    p = np.exp(s - m)
    den = p.sum(axis=1, keepdims=True) + (np.exp(sink - m) if sink is not None else 0.0)
    p /= den
    return p, (m + np.log(den))[:, 0]


def reference(q, k, v, causal, scale, left=None, sink=None):
    """float64 attention of one head, (N, D) q, k, v: ``(o, lse)``, ROWS query rows at a
    time."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    o, lse = np.empty((len(q), v.shape[1])), np.empty(len(q))
    for r0 in range(0, len(q), ROWS):
        rows = np.arange(r0, min(r0 + ROWS, len(q)))
        p, lse[rows] = _probs(q, k, rows, causal, scale, left, sink)
        o[rows] = p @ v
    return o, lse


def backward_reference(q, k, v, do, causal, scale):
    """Exact float64 (dq, dk, dv) of one head, plus the forward's (o, lse)."""
    o, lse = reference(q, k, v, causal, scale)
    q, k, v, do = _f64(q), _f64(k), _f64(v), _f64(do)
    dq, dk, dv = np.empty_like(q), np.zeros_like(k), np.zeros_like(v)
    for r0 in range(0, len(q), ROWS):
        rows = np.arange(r0, min(r0 + ROWS, len(q)))
        p, _ = _probs(q, k, rows, causal, scale)
        dv += p.T @ do[rows]
        ds = p * (do[rows] @ v.T - (do[rows] * o[rows]).sum(axis=1, keepdims=True))
        dq[rows] = scale * ds @ k
        dk += scale * ds.T @ q[rows]
    return (dq, dk, dv), (o, lse)


def _err(got, want):
    return float(np.abs(_f64(got) - want).max())


def _floor(want):
    """Max |bf16(x) - x| of the reference: the error of merely storing it in bf16."""
    if isinstance(want, (list, tuple)):
        return [_floor(w) for w in want]
    return _err(np.asarray(want).astype(np.float32).astype(_bf16()), want)


def _timed(target, fn):
    t0 = time.time()
    # attention_cte's Logger prints its warnings on stdout: keep them off the tables
    with simulate.measure(target=target) as m, contextlib.redirect_stdout(sys.stderr):
        out = fn()
    return out, {"us": m.estimated_seconds * 1e6, "api": getattr(m, "api", None),
                 "wall": time.time() - t0, "instr": int(m.program_instructions),
                 "refills": int(m.spill_refills)}


# -- attention_cte vs our forward ---------------------------------------------------------------
def run_forward(mods, N, D, causal, target, variant=None):
    """One row: ``variant`` None, "gqa" (Hq = 4, Hkv = 1), "window" (left 1023, scale 1) or
    "sinks"; see the module docstring."""
    rng = np.random.default_rng(0)
    Hq = 4 if variant == "gqa" else 1
    scale, left, qstd = 1.0 / math.sqrt(D), None, 1.0
    if variant == "window":
        scale, left, qstd = 1.0, 1023, 1.0 / math.sqrt(D)
    q = _rand(rng, (Hq, N, D), qstd)
    k, v = _rand(rng, (N, D)), _rand(rng, (N, D))
    sink = _rand(rng, (Hq, 1)) if variant == "sinks" else None
    want = np.stack([reference(q[h], k, v, causal, scale, left,
                               None if sink is None else float(sink[h, 0]))[0]
                     for h in range(Hq)])

    kw = {}
    if left is not None:
        kw["window"] = (left, 0)
    if sink is not None:
        kw["sinks"] = _f32(sink[:, 0])
    ours, m_ours = _timed(target, lambda: host.flash_attention(
        q[None], k[None, None], v[None, None], scale=scale,
        causal="top_left" if causal else False, lnc=1, **kw))

    aws_kw = {}
    if left is not None:
        aws_kw["sliding_window"] = left + 1
    if sink is not None:
        aws_kw["sink"] = sink
    kT = np.ascontiguousarray(k.T)
    theirs, m_aws = _timed(target, lambda: mods["cte"](
        q, kT[None], v[None], scale=scale, causal_mask=causal, **aws_kw))
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs

    m_ours["floor"] = _floor(want)
    m_ours["err"] = _err(_f32(ours).reshape(Hq, N, D), want)
    m_aws["err"] = _err(_f32(theirs).reshape(Hq, N, D), want)
    return m_ours, m_aws


# -- attention_bwd vs our backward --------------------------------------------------------------
def run_backward(mods, N, D, causal, target):
    rng = np.random.default_rng(1)
    q, k, v, do = (_rand(rng, (N, D)) for _ in range(4))
    scale = 1.0 / math.sqrt(D)
    want, (o64, lse64) = backward_reference(q, k, v, do, causal, scale)
    o = o64.astype(np.float32).astype(_bf16())
    lse = lse64.astype(np.float32)

    def b4(x):          # (N, D) -> (1, 1, N, D)
        return np.ascontiguousarray(x)[None, None]
    ours, m_ours = _timed(target, lambda: host.flash_attention_backward(
        b4(do), b4(q), b4(k), b4(v), b4(o), lse[None, None], scale=scale,
        causal="top_left" if causal else False, lnc=1))

    def t4(x):          # (N, D) -> (1, 1, D, N)
        return np.ascontiguousarray(x.T)[None, None]
    lse_t = np.ascontiguousarray(lse.reshape(N // 128, 128).T)[None, None]
    theirs, m_aws = _timed(target, lambda: mods["bwd"](
        t4(q), t4(k), t4(v), t4(o), t4(do), lse_t, use_causal_mask=causal,
        mixed_precision=True, softmax_scale=scale))

    m_ours["floor"] = _floor(want)
    m_ours["err"] = [_err(_f32(g).reshape(N, D), w) for g, w in zip(ours[:3], want)]
    m_aws["err"] = [_err(_f32(g).reshape(D, N).T, w) for g, w in zip(theirs[:3], want)]
    return m_ours, m_aws


# -- attention_tkg vs our decode ----------------------------------------------------------------
def run_decode(mods, B, S, Hq, Hkv, D, target, k_layout="bhds"):
    rng = np.random.default_rng(2)
    G = Hq // Hkv
    q = _rand(rng, (B, Hq, 1, D), 1.0 / math.sqrt(D))
    kc, vc = _rand(rng, (B, Hkv, S, D)), _rand(rng, (B, Hkv, S, D))
    want = np.empty((B, Hq, D))
    for b in range(B):
        for h in range(Hq):
            want[b, h] = reference(q[b, h], kc[b, h // G], vc[b, h // G], False, 1.0)[0][0]

    k_ours = np.ascontiguousarray(kc.transpose(0, 1, 3, 2)) if k_layout == "bhds" else kc
    ours, m_ours = _timed(target, lambda: host.flash_decode(
        q, k_ours, vc, cache_lens=np.full(B, S, np.int32), scale=1.0, lnc=1,
        k_layout=k_layout))

    Bp = B * Hkv                                            # kv heads folded into the batch
    cfg = mods["tkg_cfg"](Bp, G, 1, S, S, D, 0, qk_in_sb=True)
    q_t = np.ascontiguousarray(q.reshape(B * Hq, D).T)      # [d, B' * G]
    k_act = np.ascontiguousarray(kc[:, :, S - 1].reshape(Bp, D).T)
    v_act = np.ascontiguousarray(vc[:, :, S - 1:].reshape(Bp, 1, 1, D))
    k_prior = np.ascontiguousarray(kc.reshape(Bp, S, D).transpose(0, 2, 1))[:, None]
    v_prior = vc.reshape(Bp, 1, S, D)
    mask = np.ones((S, Bp, G, 1), np.uint8)
    top = tkg_program(mods, cfg, Bp, G, D, 1)
    theirs, m_aws = _timed(target, lambda: top(q_t, k_act, v_act, k_prior, v_prior, mask))

    m_ours["floor"] = _floor(want)
    m_ours["err"] = _err(_f32(ours).reshape(B, Hq, D), want)
    m_aws["err"] = _err(_f32(theirs).reshape(B, Hq, D), want)
    return m_ours, m_aws


# -- tables -------------------------------------------------------------------------------------
HEADER = ("| {} | ours (us) | ours max err | nki-library (us) | nki-library max err "
          "| ours / nki-library | front ends (ours / nki-library) |")


def _fmt_err(e):
    return " / ".join(f"{x:.2e}" for x in e) if isinstance(e, list) else f"{e:.2e}"


def _table(title, first):
    print(f"\n{title}\n")
    head = HEADER.format(first)
    print(head)
    print("|---" * (head.count("|") - 1) + "|", flush=True)


def _row(shape, o, t):
    print(f"| {shape} | {o['us']:.1f} | {_fmt_err(o['err'])} | {t['us']:.1f} | "
          f"{_fmt_err(t['err'])} | {o['us'] / t['us']:.2f} | {o['api']} / {t['api']} |",
          flush=True)
    print(f"  ({shape}: program instructions {o['instr']} / {t['instr']}; modeled spill "
          f"refills {o['refills']} / {t['refills']}; wall {o['wall']:.0f} s / "
          f"{t['wall']:.0f} s; bf16 rounding of the reference alone: {_fmt_err(o['floor'])})",
          file=sys.stderr, flush=True)


def _decode_shape(text):
    b, s = text.lower().split("x")
    return int(b), int(s)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("nkilib", help="path of an nki-library checkout (e.g. /tmp/nkilib)")
    ap.add_argument("--kernel", nargs="+", choices=("cte", "bwd", "tkg"), default=["cte"])
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 8192],
                    help="sequence lengths (cte and bwd)")
    ap.add_argument("--d", type=int, nargs="+", default=None,
                    help="head dims (default: 64 128 for cte, 128 for bwd)")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--allow-32k", action="store_true",
                    help="permit N > 8192 (minutes per shape: see the docstring)")
    ap.add_argument("--extras", action="store_true",
                    help="cte: also GQA 4:1, sliding window 1024 and sinks (causal, D = 128)")
    ap.add_argument("--extras-only", action="store_true", help="cte: only the extras")
    ap.add_argument("--extras-n", type=int, default=8192)
    ap.add_argument("--decode", type=_decode_shape, nargs="+",
                    default=[(1, 131072), (8, 16384), (64, 2048)], metavar="BxS",
                    help="tkg: (batch, sequence length) shapes")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--k-layout", choices=("bhds", "bhsd"), default="bhds",
                    help="tkg: our k_cache layout (bhds: K as [d, S], attention_tkg's)")
    ap.add_argument("--target", default="trn2")
    a = ap.parse_args(argv)
    if not a.allow_32k and any(n > 8192 for n in a.n + [a.extras_n]):
        ap.error("N > 8192 needs --allow-32k (several minutes per shape)")
    simulate.register_as_nki()
    mods, errs = _modules(os.path.abspath(a.nkilib))
    for kern in a.kernel:
        if kern not in mods:
            sys.exit(f"cannot import attention_{kern} from {a.nkilib}: {errs.get(kern)}")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    mask = {False: "none", True: "causal"}
    print(f"nki-library at {a.nkilib}; target {a.target}, one NeuronCore, bf16; scheduled "
          f"estimate; max |error| against float64 from the same bf16 inputs")
    if "cte" in a.kernel:
        _table("attention_cte vs host.flash_attention (B = H = 1 unless stated)",
               "N | D | mask")
        if not a.extras_only:
            for N in a.n:
                for D in a.d or [64, 128]:
                    for causal in causals:
                        _row(f"{N} | {D} | {mask[causal]}",
                             *run_forward(mods, N, D, causal, a.target))
        if a.extras or a.extras_only:
            N = a.extras_n
            for variant, label in (("gqa", "causal, GQA Hq 4 : Hkv 1"),
                                   ("window", "causal, window 1024 (scale 1)"),
                                   ("sinks", "causal, sinks")):
                _row(f"{N} | 128 | {label}", *run_forward(mods, N, 128, True, a.target, variant))
    if "bwd" in a.kernel:
        _table("attention_bwd vs host.flash_attention_backward (B = H = 1; errors dQ / dK / dV)",
               "N | D | mask")
        for N in a.n:
            for D in a.d or [128]:
                for causal in causals:
                    _row(f"{N} | {D} | {mask[causal]}",
                         *run_backward(mods, N, D, causal, a.target))
    if "tkg" in a.kernel:
        _table(f"attention_tkg vs host.flash_decode (one new token, Hq {a.hq}, Hkv {a.hkv}, "
               f"D 128; our k_cache {a.k_layout})", "B | S")
        for B, S in a.decode:
            _row(f"{B} | {S}", *run_decode(mods, B, S, a.hq, a.hkv, 128, a.target,
                                           a.k_layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
