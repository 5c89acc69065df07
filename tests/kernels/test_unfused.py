"""Standard (unfused) attention, nki_kernels/attention/unfused.py, against the float64 reference.

Tolerance rule (docs/semantics.md): max abs error <= 2 x the error of
``host.reference.attention_baseline_lowp`` in the matmul operand precision + 1e-5 (fp32
operands) or 1e-3. The HBM traffic of the three kernels is the FlashAttention paper's count
(Algorithm 0) exactly; that is asserted in tests/host/test_api_fused.py with simulate.measure.
"""
import numpy as np
import pytest

from _fused_baselines import DTYPES, mm_dtype, randn
from host import reference
from host._launch import launch
from nki_kernels import nki as binding
from nki_kernels import tiles
from nki_kernels.attention import unfused as ua
from nki_kernels.fused.softmax import softmax_kernel


@pytest.fixture(params=["legacy", "nki"], autouse=True)
def api(request, monkeypatch):
    """Every test runs through both namespaces (one kernel source, nki_kernels.port)."""
    if request.param == "nki" and not binding.nki_available():
        pytest.skip("the nki package is not installed")
    monkeypatch.setenv(binding.API_ENV_VAR, request.param)
    return request.param


def run_unfused(q, k, v, *, scale, causal_offset, mm, kv_block=None, v_resident=None):
    """The three kernels as host.attention_unfused launches them, with blocking overrides."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    default_block, default_resident = tiles.unfused_attention_blocks(Nk, D, mm.itemsize)
    kv_block = default_block if kv_block is None else kv_block
    v_resident = default_resident if v_resident is None else v_resident
    grid = ua.grid(B, Hq, Hkv, binding.select_api())
    s = launch(ua.attention_scores_kernel, grid, q, k, scale=scale, causal_offset=causal_offset,
               mm_dtype=mm.name, s_dtype=q.dtype.name, kv_block=kv_block)
    assert s.shape == (B, Hq, Nq, Nk) and s.dtype == q.dtype
    chunk, resident = tiles.softmax_plan(Nk, q.dtype.itemsize, q.dtype.itemsize)
    p = launch(softmax_kernel, (1,), s.reshape(-1, Nk), algorithm="online", chunk=chunk,
               resident=resident, zero_masked_rows=True)
    o = launch(ua.attention_pv_kernel, grid, p.reshape(B, Hq, Nq, Nk), v, mm_dtype=mm.name,
               o_dtype=q.dtype.name, v_resident=v_resident)
    return s, p, o


CASES = [
    # B, Hq, Hkv, Nq, Nk, D, dtype, causal
    (1, 1, 1, 1, 1, 16, "bfloat16", None),
    (1, 2, 1, 129, 200, 64, "bfloat16", None),          # MQA, partial tiles, Nq != Nk
    (2, 4, 2, 127, 127, 80, "float16", "top_left"),     # GQA 4:2, batch 2
    (1, 1, 1, 200, 130, 128, "bfloat16", "bottom_right"),  # Nq > Nk: 70 rows see no key
    (1, 1, 1, 100, 600, 256, "float32", "bottom_right"),   # D = 256: two contraction tiles
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,dtype,causal", CASES)
def test_unfused_attention(B, Hq, Hkv, Nq, Nk, D, dtype, causal):
    rng = np.random.default_rng(Nq + Nk + D)
    dt = DTYPES[dtype]
    q = randn(rng, (B, Hq, Nq, D), dt)
    k = randn(rng, (B, Hkv, Nk, D), dt)
    v = randn(rng, (B, Hkv, Nk, D), dt)
    mm = mm_dtype(dt, True)
    scale = 1.0 / np.sqrt(D)
    offset = None if causal is None else (0 if causal == "top_left" else Nk - Nq)
    _, p, o = run_unfused(q, k, v, scale=scale, causal_offset=offset, mm=mm)
    assert o.shape == q.shape and o.dtype == dt
    ref = reference.attention_forward(q, k, v, causal=causal)[0]
    base = reference.attention_baseline_lowp(q, k, v, dtype=mm, out_dtype=dt, causal=causal)
    err = reference.max_abs_err(o, ref)
    tol = reference.tolerance(ref, base, floor=reference.atol_floor(mm))
    assert err <= tol, f"max abs error {err:.3e} > tolerance {tol:.3e}"
    if causal == "bottom_right" and Nq > Nk:
        assert np.all(o[..., : Nq - Nk, :] == 0) and np.all(p[..., : Nq - Nk, :] == 0)


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_unfused_attention_blocked_k_and_streamed_v(causal):
    """Key blocks smaller than Nk (Q re-read per block) and V streamed per query tile; with a
    causal mask, the diagonal moves with the runtime tile indices (2 full query tiles, 2 full
    key blocks, tails): masked scores are fp32.min, -inf in bf16, and only they."""
    rng = np.random.default_rng(5)
    Nq, Nk = 300, 1100
    q = randn(rng, (1, 1, Nq, 64), DTYPES["bfloat16"])
    k = randn(rng, (1, 1, Nk, 64), DTYPES["bfloat16"])
    v = randn(rng, (1, 1, Nk, 64), DTYPES["bfloat16"])
    mm = q.dtype
    offset = None if causal is None else (0 if causal == "top_left" else Nk - Nq)
    s, _, o = run_unfused(q, k, v, scale=0.125, causal_offset=offset, mm=mm, kv_block=512,
                          v_resident=False)
    i, j = np.mgrid[0:Nq, 0:Nk]
    masked = np.zeros((Nq, Nk), bool) if offset is None else j > i + offset
    assert np.array_equal(np.isneginf(np.asarray(s[0, 0], np.float32)), masked)
    ref = reference.attention_forward(q, k, v, causal=causal)[0]
    base = reference.attention_baseline_lowp(q, k, v, dtype=mm, causal=causal)
    assert reference.max_abs_err(o, ref) <= reference.tolerance(ref, base, floor=1e-3)
