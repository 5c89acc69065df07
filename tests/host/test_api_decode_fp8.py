"""host.flash_decode and host.flash_attention_with_kvcache over an FP8 KV cache
(``k_scale``/``v_scale``): the formats each target defines, results against the float64
reference on the dequantized cache (the bf16 tolerance rule of the other decode tests), the
exact HBM bytes (1 byte per cached element) of the decode kernels and of the prefill forward,
the torch entry points and every error path.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import host
from host import api, reference
from nki_kernels import tiles
from nki_kernels.nki import BACKEND

from _decode_helpers import BF16, inputs

E5M2 = np.dtype(ml_dtypes.float8_e5m2)
E4M3 = np.dtype(ml_dtypes.float8_e4m3)          # IEEE-style, max 240: trn1, trn2
E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)      # OCP, max 448: trn3

needs_measure = pytest.mark.skipif(BACKEND != "simulate",
                                   reason="simulate.measure needs the bundled simulator")


def fp8_inputs(fmt, B=2, Hq=8, Hkv=2, T=2, S_max=256, D=64, per_head=True):
    """q (bf16) and FP8 caches with their scales: per kv head (distinct) or one number."""
    q, k, v = inputs(B=B, Hq=Hq, Hkv=Hkv, T=T, S_max=S_max, D=D)
    heads = np.arange(1, Hkv + 1, dtype=np.float32)[:, None, None]
    out = []
    for cache in (k.astype(np.float32) * heads, v.astype(np.float32) / heads):
        c8, scale = reference.quantize_cache(cache, fmt)
        if not per_head:
            scale = float(scale.max())
            c8 = (cache / scale).astype(fmt)
        out += [c8, scale]
    k8, ks, v8, vs = out
    return q, k8, v8, ks, vs


def assert_within_bf16_rule(q, k8, v8, ks, vs, lens, o, table=None):
    """The bf16 rule of the decode tests on the dequantized cache: the error of ``o`` against
    the float64 reference at most 2x a plain bf16 implementation's, plus the floor."""
    kd, vd = reference.dequantize_cache(k8, ks), reference.dequantize_cache(v8, vs)
    ref = reference.decode(q, kd, vd, cache_lens=lens, block_table=table)[0]
    base = reference.decode_baseline_lowp(q, kd, vd, cache_lens=lens, dtype=BF16,
                                          out_dtype=q.dtype, block_table=table)
    tol = reference.tolerance(ref, base, floor=reference.atol_floor(BF16))
    err = reference.max_abs_err(o, ref)
    assert err <= tol, (err, tol)
    # the scales matter: the stored values alone are far off
    assert reference.max_abs_err(o, reference.decode(q, k8.astype(np.float64), v8.astype(
        np.float64), cache_lens=lens, block_table=table)[0]) > 10 * tol


# --------------------------------------------------------------------------------------------
# formats per target, results, bytes
# --------------------------------------------------------------------------------------------
def test_format_table_is_the_simulators():
    """tiles.DECODE_FP8_CACHE_DTYPES is each simulated target's 8-bit data formats (its E8M0
    is a block-scale format), and an unknown target takes only the one they all share."""
    from simulate import _hw

    for name in ("trn1", "trn2", "trn3"):
        data = tuple(f for f in _hw.get_target(name).fp8_dtypes if f != "float8_e8m0fnu")
        assert set(tiles.DECODE_FP8_CACHE_DTYPES[name]) == set(data)
    shared = set.intersection(*(set(tiles.DECODE_FP8_CACHE_DTYPES[t])
                                for t in ("trn1", "trn2", "trn3")))
    assert set(tiles.DECODE_FP8_CACHE_DTYPES[None]) == shared


@needs_measure
@pytest.mark.parametrize("target,fmt,paged,per_head,legacy", [
    ("trn2", E5M2, False, True, False),     # nki.*, LNC=2
    ("trn2", E4M3, True, False, True),      # legacy namespace, paged, one scale for all heads
    ("trn3", E4M3FN, False, True, False),
    ("trn1", E4M3, False, True, True),      # trn1 (legacy): supported, its IEEE-style E4M3
])
def test_fp8_cache_matches_the_dequantized_reference(target, fmt, paged, per_head, legacy,
                                                     monkeypatch):
    """Within the bf16 rule of the dequantized cache, with the exact HBM bytes: K and V read
    at 1 byte per valid element."""
    import simulate

    if legacy:
        monkeypatch.setenv("NKI_FLASH_API", "legacy")
    B, Hq, Hkv, T, D = 2, 8, 2, 2, 64
    q, k8, v8, ks, vs = fp8_inputs(fmt, B, Hq, Hkv, T, 256, D, per_head)
    lens = np.array([200, 77])
    kw, table = {}, None
    if paged:
        (k8, v8), table = reference.contiguous_to_paged((k8, v8), lens, 32,
                                                        np.random.default_rng(3))
        kw["block_table"] = table
    with simulate.measure(target=target) as m:
        o = host.flash_decode(q, k8, v8, cache_lens=lens, k_scale=ks, v_scale=vs, **kw)
        plan = host.plan_flash_decode(q, k8, v8, cache_lens=lens, k_scale=ks, v_scale=vs, **kw)
    assert o.dtype == BF16
    assert_within_bf16_rule(q, k8, v8, ks, vs, lens, o, table)
    lnc = 2 if target == "trn2" else 1
    read, written = host.flash_decode_hbm_bytes(B, Hq, T, D, Hkv, lens, 2, plan, paged=paged,
                                                lnc=lnc, api=m.api, cache_itemsize=1)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)
    if lnc == 1:
        assert m.per_tensor["k_cache"]["read"] == Hkv * D * int(lens.sum())


@needs_measure
def test_fp8_cache_with_fp16_queries_score_modifiers_and_a_tree_mask():
    """The scales compose with the rest: K's scale acts before the soft-cap, ALiBi and sinks
    (the dequantized keys' scores), V's after the sink's weight (fp16 rule)."""
    import simulate

    rng = np.random.default_rng(5)
    B, Hq, Hkv, T, D = 2, 4, 2, 3, 32
    q = rng.standard_normal((B, Hq, T, D)).astype(np.float16)
    k8, ks = reference.quantize_cache(rng.standard_normal((B, Hkv, 96, D)), E5M2)
    v8, vs = reference.quantize_cache(rng.standard_normal((B, Hkv, 96, D)), E5M2)
    lens, tree = np.array([96, 40]), np.tril(np.ones((T, T), bool))
    tree[2, 1] = False
    mods = dict(softcap=20.0, alibi_slopes=np.linspace(0.01, 0.1, Hq),
                sinks=np.linspace(-1.0, 1.0, Hq))
    with simulate.measure(target="trn2"):
        o = host.flash_decode(q, k8, v8, cache_lens=lens, k_scale=ks, v_scale=vs,
                              tree_mask=tree, **mods)
    kd, vd = reference.dequantize_cache(k8, ks), reference.dequantize_cache(v8, vs)
    ref = reference.decode(q, kd, vd, cache_lens=lens, tree_mask=tree, **mods)[0]
    base = reference.decode_baseline_lowp(q, kd, vd, cache_lens=lens, dtype=np.float16,
                                          tree_mask=tree, **mods)
    assert reference.max_abs_err(o, ref) <= reference.tolerance(
        ref, base, floor=reference.atol_floor(np.float16))


def test_decode_traffic_at_most_0_6x_the_bf16_caches_on_the_readme_shape():
    """B = 1, Hq = 32, Hkv = 8, S = 32K, T = 1, D = 128 (README): all HBM bytes of the FP8
    call (the exact formula, asserted against the simulator above) against the bf16 call's."""
    q = np.zeros((1, 32, 1, 128), BF16)
    k = np.zeros((1, 8, 32768, 128), E5M2)
    lens = [32768]
    plan = host.plan_flash_decode(q, k, k, cache_lens=lens, k_scale=1.0, v_scale=1.0)
    assert plan == host.plan_flash_decode(q, k.astype(BF16), k.astype(BF16), cache_lens=lens)
    for lnc, api_ in ((1, "legacy"), (2, "nki")):
        fp8 = sum(host.flash_decode_hbm_bytes(1, 32, 1, 128, 8, lens, 2, plan, lnc=lnc,
                                              api=api_, cache_itemsize=1))
        bf16 = sum(host.flash_decode_hbm_bytes(1, 32, 1, 128, 8, lens, 2, plan, lnc=lnc,
                                               api=api_))
        assert fp8 <= 0.6 * bf16, (fp8, bf16)


# --------------------------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------------------------
@needs_measure
def test_torch_takes_float8_e5m2_and_on_trn3_float8_e4m3fn():
    torch = pytest.importorskip("torch")
    import simulate
    from host import torch_ops

    q, k8, v8, ks, vs = fp8_inputs(E5M2, B=1, Hq=4, Hkv=2, T=1, S_max=64, D=32)
    lens = [40]

    def tt(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(dtype)

    qt = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16)
    with simulate.measure(target="trn2"):
        o = torch_ops.flash_decode(qt, tt(k8, torch.float8_e5m2), tt(v8, torch.float8_e5m2),
                                   cache_lens=lens, k_scale=torch.from_numpy(ks), v_scale=vs)
        np.testing.assert_array_equal(
            o.view(torch.int16).numpy().view(BF16),
            host.flash_decode(q, k8, v8, cache_lens=lens, k_scale=ks, v_scale=vs))
        _, k3, v3, ks3, vs3 = fp8_inputs(E4M3FN, B=1, Hq=4, Hkv=2, T=1, S_max=64, D=32)
        fn = (tt(k3, torch.float8_e4m3fn), tt(v3, torch.float8_e4m3fn))
        with pytest.raises(TypeError, match="k_cache: dtype float8_e4m3fn is not an FP8 "
                                            "KV-cache format of trn2"):
            torch_ops.flash_decode(qt, *fn, cache_lens=lens, k_scale=ks3, v_scale=vs3)
    with simulate.measure(target="trn3"):
        o3 = torch_ops.flash_decode(qt, *fn, cache_lens=lens, k_scale=ks3, v_scale=vs3)
    assert_within_bf16_rule(q, k3, v3, ks3, vs3, lens, o3.view(torch.int16).numpy().view(BF16))


@needs_measure
def test_torch_kvcache_chunk_takes_float8_e5m2_and_on_trn3_float8_e4m3fn():
    """The torch flash_attention_with_kvcache over FP8 caches at a T the forward runs: the
    NumPy call's bits on trn2 (float8_e5m2), the rule of the dequantized cache on trn3."""
    torch = pytest.importorskip("torch")
    import simulate
    from host import torch_ops

    def tt(a, dtype):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(dtype)

    for target, fmt, tdtype in (("trn2", E5M2, torch.float8_e5m2),
                                ("trn3", E4M3FN, torch.float8_e4m3fn)):
        q, (k8, v8), _, ks, vs, lens, _ = _prefill_case(fmt)
        qt = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16)
        with simulate.measure(target=target):
            o = torch_ops.flash_attention_with_kvcache(
                qt, tt(k8, tdtype), tt(v8, tdtype), cache_lens=torch.from_numpy(lens),
                k_scale=torch.from_numpy(ks), v_scale=vs)
            o = o.view(torch.int16).numpy().view(BF16)
            if target == "trn2":
                np.testing.assert_array_equal(o, host.flash_attention_with_kvcache(
                    q, k8, v8, cache_lens=lens, k_scale=ks, v_scale=vs, lnc=1))
        _assert_forward_rule(q, k8, v8, ks, vs, lens, o)


# --------------------------------------------------------------------------------------------
# validation: every error path names the argument
# --------------------------------------------------------------------------------------------
def _bad_calls():
    q, k8, v8, ks, vs = fp8_inputs(E5M2, B=2, Hq=4, Hkv=2, T=1, S_max=64, D=32)
    _, k, v = inputs(B=2, Hq=4, Hkv=2, T=1, S_max=64, D=32)
    return [
        # (target, kwargs overrides, exception, message fragment)
        ("trn2", dict(k_scale=None), ValueError, "k_scale: an FP8 cache (k_cache float8_e5m2) "
                                                 "needs k_scale and v_scale"),
        ("trn2", dict(v_scale=None), ValueError, "v_scale: an FP8 cache"),
        ("trn2", dict(k_cache=k, v_cache=v), ValueError, "k_scale: only an FP8 cache takes "
                                                         "scales; k_cache is bfloat16"),
        ("trn2", dict(k_scale=0.0), ValueError, "k_scale: scales must be finite and > 0"),
        ("trn2", dict(v_scale=np.array([1.0, -2.0])), ValueError,
         "v_scale: scales must be finite and > 0 (in float32), got -2.0 for kv head 1"),
        ("trn2", dict(k_scale=float("nan")), ValueError, "k_scale: scales must be finite"),
        ("trn2", dict(k_scale=np.array([np.inf, 1.0])), ValueError, "k_scale: scales must"),
        ("trn2", dict(v_scale=1e-50), ValueError, "v_scale: scales must be finite and > 0 "
                                                  "(in float32), got 1e-50"),
        ("trn2", dict(k_scale=np.ones(3)), ValueError, "k_scale: expected a number or an array "
                                                      "of shape (2,)"),
        ("trn2", dict(k_scale="1"), TypeError, "k_scale: expected a number > 0"),
        ("trn2", dict(k_scale=True), TypeError, "k_scale: expected a number > 0"),
        ("trn2", dict(k_cache=k8.astype(E4M3FN), v_cache=v8.astype(E4M3FN)), TypeError,
         "k_cache: dtype float8_e4m3fn is not an FP8 KV-cache format of trn2; allowed there: "
         "float8_e4m3, float8_e5m2"),
        ("trn3", dict(k_cache=k8.astype(E4M3), v_cache=v8.astype(E4M3)), TypeError,
         "k_cache: dtype float8_e4m3 is not an FP8 KV-cache format of trn3"),
        ("trn3", dict(k_cache=np.ones(k8.shape, ml_dtypes.float8_e8m0fnu),
                      v_cache=np.ones(k8.shape, ml_dtypes.float8_e8m0fnu)), TypeError,
         "k_cache: dtype float8_e8m0fnu is not an FP8 KV-cache format of trn3"),
        ("trn2", dict(k_cache=k8.astype(np.float32).astype(ml_dtypes.float8_e4m3fnuz)), TypeError,
         "k_cache: dtype float8_e4m3fnuz is not an FP8 KV-cache format"),
        ("trn2", dict(v_cache=v), TypeError, "v_cache: dtype bfloat16 does not match k_cache's "
                                             "FP8 format float8_e5m2"),
        ("trn2", dict(v_cache=v8.astype(E4M3)), TypeError, "v_cache: dtype float8_e4m3"),
        (None, dict(k_cache=k8.astype(E4M3), v_cache=v8.astype(E4M3)), TypeError,
         "target unknown: set NEURON_PLATFORM_TARGET_OVERRIDE); allowed there: float8_e5m2"),
    ], (q, k8, v8, ks, vs)


@needs_measure
@pytest.mark.parametrize("index", range(len(_bad_calls()[0])))
def test_validation_errors(index, monkeypatch):
    import simulate

    cases, (q, k8, v8, ks, vs) = _bad_calls()
    target, overrides, exc, fragment = cases[index]
    if target is None:      # the host does not know the device's target
        monkeypatch.setattr(api, "active_target", lambda: None)
    kw = dict(q=q, k_cache=k8, v_cache=v8, cache_lens=[30, 64], k_scale=ks, v_scale=vs)
    kw.update(overrides)
    args = (kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"))
    with simulate.measure(target=target or "trn2"), pytest.raises(exc) as info:
        host.flash_decode(*args, **kw)
    assert fragment in str(info.value)



# --------------------------------------------------------------------------------------------
# flash_attention_with_kvcache: any T (large T: the prefill forward's casting key gathers)
# --------------------------------------------------------------------------------------------
PREFILL = dict(B=2, Hq=8, Hkv=2, T=80, S_max=160, D=32)     # G = 4: the forward for T > 64


def _prefill_case(fmt=E5M2, per_head=True, paged=False):
    """An FP8 chunk of T = 80 over a cache, sequence 0 short (100 of 160 positions): q, the
    contiguous caches, the caches passed (page pools when paged), scales, lengths, table."""
    q, k8, v8, ks, vs = fp8_inputs(fmt, per_head=per_head, **PREFILL)
    lens, table, given = np.array([100, 160]), None, (k8, v8)
    if paged:
        given, table = reference.contiguous_to_paged((k8, v8), lens, 32,
                                                     np.random.default_rng(3))
    return q, (k8, v8), given, ks, vs, lens, table


def _assert_forward_rule(q, k8, v8, ks, vs, lens, o, causal="bottom_right"):
    """The bf16 rule on the dequantized cache for the forward over it (and the scales matter)."""
    kd, vd = reference.dequantize_cache(k8, ks), reference.dequantize_cache(v8, vs)
    ref = reference.attention_forward(q, kd, vd, kv_lens=lens, causal=causal)[0]
    base = reference.attention_baseline_lowp(q, kd, vd, dtype=BF16, out_dtype=BF16,
                                             kv_lens=lens, causal=causal)
    tol = reference.tolerance(ref, base, floor=reference.atol_floor(BF16))
    assert reference.max_abs_err(o, ref) <= tol, (reference.max_abs_err(o, ref), tol)
    raw = reference.attention_forward(q, k8.astype(np.float64), v8.astype(np.float64),
                                      kv_lens=lens, causal=causal)[0]
    assert reference.max_abs_err(o, raw) > 10 * tol


@needs_measure
@pytest.mark.parametrize("paged,per_head,causal", [
    (False, True, False),        # contiguous, no mask: tiles.forward_hbm_bytes too
    (True, False, True),         # paged, one scale for every head
])
def test_prefill_over_an_fp8_cache_reads_one_byte_per_element(paged, per_head, causal):
    """T above the decode threshold runs the forward: within the bf16 rule of the dequantized
    cache, HBM bytes exactly ``forward.plan_hbm_bytes(..., cache_itemsize=1)`` (K and V at 1
    byte, 8 bytes of scales per program; paged: plus the table entries)."""
    import simulate
    from nki_kernels.attention import forward as F

    q, kv, given, ks, vs, lens, table = _prefill_case(per_head=per_head, paged=paged)
    kw = dict(cache_lens=lens, k_scale=ks, v_scale=vs, causal=causal, lnc=1)
    if paged:
        kw["block_table"] = table
    with simulate.measure(target="trn2") as m:
        o = host.flash_attention_with_kvcache(q, *given, **kw)
    call = api._kvcache_call(q, *given, **kw)
    assert call.prefill
    _assert_forward_rule(q, *kv, ks, vs, lens, o, "bottom_right" if causal else None)
    tiles_ = api._plan_forward(api._prefill_call(call))[2]["tiles"]
    B, Hq, Hkv, T, S, D = PREFILL.values()
    read, written = F.plan_hbm_bytes(B, Hq, Hkv, T, S, D, 2, tiles_, kv_lens=lens,
                                     causal="bottom_right" if causal else None,
                                     cache_itemsize=1)
    table_bytes = m.per_tensor["block_table"]["read"] if paged else 0
    assert (m.hbm_bytes_read - table_bytes, m.hbm_bytes_written) == (read, written)
    assert m.per_tensor["v"]["read"] == Hkv * D * int(lens.sum())
    assert m.per_tensor["kv_scale"]["read"] == 8 * B * Hkv
    if not causal:
        assert (read, written) == tiles.forward_hbm_bytes(B, Hq, Hkv, T, S, D, 2, tiles_,
                                                          kv_lens=lens, cache_itemsize=1)
    with pytest.raises(ValueError, match="cache_itemsize: None .* or 1 .* got 2"):
        tiles.forward_hbm_bytes(B, Hq, Hkv, T, S, D, 2, tiles_, cache_itemsize=2)


@needs_measure
def test_prefill_over_an_fp8_cache_nki_matches_legacy_bit_for_bit(monkeypatch):
    """The paged FP8 forward traces through both namespaces to the same bits (trn2)."""
    import simulate

    q, kv, given, ks, vs, lens, table = _prefill_case(paged=True)
    outs = []
    for name in ("nki", "legacy"):
        monkeypatch.setenv("NKI_FLASH_API", name)
        with simulate.measure(target="trn2") as m:
            outs.append(host.flash_attention_with_kvcache(q, *given, cache_lens=lens,
                                                          block_table=table, k_scale=ks,
                                                          v_scale=vs, lnc=1))
        assert m.api == name
    np.testing.assert_array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))
    _assert_forward_rule(q, *kv, ks, vs, lens, outs[0])


@needs_measure
def test_kvcache_small_t_is_the_decode_call_and_a_window_runs_the_forward():
    """flash_attention_with_kvcache at small T is flash_decode's call, bit for bit; flash_decode
    with a window (the forward) over an FP8 cache within the rule of the dequantized cache."""
    import simulate

    q, k8, v8, ks, vs = fp8_inputs(E5M2, B=1, Hq=4, Hkv=2, T=2, S_max=96, D=32)
    kw = dict(cache_lens=np.array([70]), k_scale=ks, v_scale=vs)
    with simulate.measure(target="trn2"):
        np.testing.assert_array_equal(host.flash_attention_with_kvcache(q, k8, v8, **kw),
                                      host.flash_decode(q, k8, v8, **kw))
        o = host.flash_decode(q, k8, v8, window=(16, 0), **kw)
    kd, vd = reference.dequantize_cache(k8, ks), reference.dequantize_cache(v8, vs)
    lens = kw["cache_lens"]
    ref = reference.attention_forward(q, kd, vd, kv_lens=lens, causal="bottom_right",
                                      window=(16, 0))[0]
    base = reference.attention_baseline_lowp(q, kd, vd, dtype=BF16, out_dtype=BF16,
                                             kv_lens=lens, causal="bottom_right",
                                             window=(16, 0))
    assert reference.max_abs_err(o, ref) <= reference.tolerance(
        ref, base, floor=reference.atol_floor(BF16))


def test_forward_kernel_refuses_kv_scale_without_kv_lens():
    """The forward reads an FP8 cache only through the lengths' casting gathers."""
    from host._launch import launch
    from nki_kernels.attention import forward as F
    from nki_kernels.nki import select_api

    q, k8 = np.zeros((1, 2, 8, 32), BF16), np.zeros((1, 1, 16, 32), E5M2)
    grid, lnc = F.forward_grid(1, 1, 1, api=select_api())
    with pytest.raises(ValueError, match="kv_scale: an FP8 K/V cache needs kv_lens"):
        launch(F.flash_attention_fwd, grid, q, k8, k8, kv_scale=np.ones((1, 2), np.float32),
               lnc=lnc)
