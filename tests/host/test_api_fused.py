"""host.linear_gelu, host.online_softmax, host.attention_unfused: results, exact HBM traffic
(simulate.measure) and input validation.

Traffic claims (exact byte counts, derived in the kernels' docstrings):

- GELU(x @ W + b), fused: ``s (M K + K N p + N p + M N)`` with ``p = ceil(M / block_m)`` passes
  over W; unfused (matmul, bias add, GELU kernels): ``s (M K + K N p + 5 M N + N)``. With
  ``M = N = 2 K`` and one pass that is 6n vs 2n (n = M N elements, seed 000): ratio ~3.
- online softmax of a streamed row: reads 2 R C, writes R C elements; two-pass: reads 3 R C.
- standard attention: the FlashAttention paper's count, ``s (2 Nq D + 2 Nk D) + 4 s Nq Nk`` per
  query head (``host.reference.unfused_attention_bytes``).
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from _fused_baselines import (DTYPES, linear_gelu_baseline, linear_inputs,  # noqa: E402
                              mm_dtype, randn, softmax_baseline, tolerance)

import host  # noqa: E402
from host import api, reference  # noqa: E402
from nki_kernels.nki import BACKEND  # noqa: E402

needs_measure = pytest.mark.skipif(BACKEND != "simulate",
                                   reason="HBM byte counts come from simulate.measure")


def _measure():
    import simulate

    return simulate.measure(target="trn2")


def _total(m):
    return int(m.hbm_bytes_read) + int(m.hbm_bytes_written)


# --------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype,mixed", [("bfloat16", True), ("float32", False)])
def test_linear_gelu_matches_reference(fused, dtype, mixed):
    rng = np.random.default_rng(21)
    dt = DTYPES[dtype]
    x, w, b = linear_inputs(rng, 70, 150, 90, dt)
    y = host.linear_gelu(x, w, b, approximate="tanh", fused=fused, mixed_precision=mixed)
    assert y.shape == (70, 90) and y.dtype == dt
    mm = mm_dtype(dt, mixed)
    ref = reference.linear_gelu(x, w, b, approximate="tanh")
    base = linear_gelu_baseline(x, w, b, dtype=mm, out_dtype=dt, approximate="tanh")
    assert reference.max_abs_err(y, ref) <= tolerance(ref, base, mm)


def test_linear_gelu_small_budget_uses_streaming_and_blocks():
    rng = np.random.default_rng(22)
    x, w, b = linear_inputs(rng, 300, 130, 140, DTYPES["bfloat16"])
    ref = reference.linear_gelu(x, w, b)
    base = linear_gelu_baseline(x, w, b, dtype=x.dtype, out_dtype=x.dtype)
    assert api.plan_linear_gelu(300, 130, 140, 2, sbuf_budget=1024) == (0, 0)
    assert api.plan_linear_gelu(300, 130, 140, 2, sbuf_budget=1536) == (128, 128)
    for budget in (1024, 1536):
        y = host.linear_gelu(x, w, b, sbuf_budget=budget)
        assert reference.max_abs_err(y, ref) <= tolerance(ref, base, x.dtype)


@pytest.mark.parametrize("algorithm", ["online", "two_pass"])
def test_online_softmax_matches_reference(algorithm):
    rng = np.random.default_rng(23)
    x = randn(rng, (5, 700), DTYPES["float16"], scale=5.0)
    y = host.online_softmax(x, algorithm=algorithm, chunk_size=128)
    assert y.dtype == x.dtype
    ref = reference.online_softmax(x)
    assert reference.max_abs_err(y, ref) <= tolerance(ref, softmax_baseline(x, dtype=x.dtype),
                                                      x.dtype)
    y_default = host.online_softmax(x, algorithm=algorithm)   # rows resident
    assert reference.max_abs_err(y_default, ref) <= tolerance(
        ref, softmax_baseline(x, dtype=x.dtype), x.dtype)


@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_attention_unfused_single_head_and_4d(causal):
    rng = np.random.default_rng(24)
    dt = DTYPES["bfloat16"]
    q, k, v = (randn(rng, (90, 32), dt) for _ in range(3))
    o = host.attention_unfused(q, k, v, causal=causal, scale=0.3)
    assert o.shape == (90, 32) and o.dtype == dt
    ref = reference.attention_forward(q[None, None], k[None, None], v[None, None], scale=0.3,
                                      causal=causal)[0][0, 0]
    base = reference.attention_baseline_lowp(q[None, None], k[None, None], v[None, None],
                                             dtype=dt, scale=0.3, causal=causal)[0, 0]
    assert reference.max_abs_err(o, ref) <= reference.tolerance(ref, base, floor=1e-3)
    o4 = host.attention_unfused(q[None, None], k[None, None], v[None, None], causal=causal,
                                scale=0.3)
    assert np.array_equal(o4[0, 0].astype(np.float32), o.astype(np.float32))


# --------------------------------------------------------------------------------------------
# HBM traffic
# --------------------------------------------------------------------------------------------

def linear_gelu_bytes(M, K, N, s, block_m, fused):
    passes = math.ceil(M / block_m)
    read = s * (M * K + K * N * passes)
    written = s * M * N
    if fused:
        read += s * N * passes
    else:
        read += s * (M * N + N + M * N)       # bias add reads z and b; GELU reads z + b
        written += 2 * s * M * N              # bias add writes z + b; GELU writes y
    return read, written


@needs_measure
def test_linear_gelu_fusion_saves_two_thirds_of_traffic():
    """M = N = 2K: the matmul's inputs are one output's worth (seed 000's n); 6n vs 2n."""
    M, K, N = 256, 128, 256
    rng = np.random.default_rng(25)
    x, w, b = linear_inputs(rng, M, K, N, DTYPES["bfloat16"])
    block_m = api.plan_linear_gelu(M, K, N, 2)[0]
    assert block_m >= M
    measured = {}
    for fused in (True, False):
        with _measure() as m:
            host.linear_gelu(x, w, b, fused=fused)
        read, written = linear_gelu_bytes(M, K, N, 2, block_m, fused)
        assert (int(m.hbm_bytes_read), int(m.hbm_bytes_written)) == (read, written)
        measured[fused] = _total(m)
    ratio = measured[False] / measured[True]
    assert ratio >= 2.5, f"unfused/fused byte ratio {ratio:.3f} < 2.5"
    assert abs(ratio - 3.0) < 0.01


@needs_measure
def test_linear_gelu_bytes_with_several_passes_over_w():
    M, K, N = 300, 130, 140
    rng = np.random.default_rng(26)
    x, w, b = linear_inputs(rng, M, K, N, DTYPES["float32"])
    budget = 1536
    block_m = api.plan_linear_gelu(M, K, N, 2, sbuf_budget=budget)[0]
    assert block_m == 128  # three passes over W
    with _measure() as m:
        host.linear_gelu(x, w, b, sbuf_budget=budget)
    assert (int(m.hbm_bytes_read), int(m.hbm_bytes_written)) == linear_gelu_bytes(
        M, K, N, 4, block_m, True)


@needs_measure
def test_softmax_traffic_online_vs_two_pass():
    R, C = 130, 1000
    x = randn(np.random.default_rng(27), (R, C), DTYPES["bfloat16"])
    n = R * C * 2
    expected = {"online": (2 * n, n), "two_pass": (3 * n, n)}
    for algorithm, (read, written) in expected.items():
        with _measure() as m:
            host.online_softmax(x, algorithm=algorithm, chunk_size=256)
        assert (int(m.hbm_bytes_read), int(m.hbm_bytes_written)) == (read, written)
    with _measure() as m:
        host.online_softmax(x)           # 1000 columns fit on chip: one read
    assert (int(m.hbm_bytes_read), int(m.hbm_bytes_written)) == (n, n)


@needs_measure
@pytest.mark.parametrize("dtype,Nq,Nk,causal", [("bfloat16", 256, 384, False),
                                                ("float32", 200, 130, "bottom_right")])
def test_attention_unfused_traffic_is_the_papers_count(dtype, Nq, Nk, causal):
    B, Hq, Hkv, D = 1, 2, 1, 64
    rng = np.random.default_rng(28)
    dt = DTYPES[dtype]
    q = randn(rng, (B, Hq, Nq, D), dt)
    k, v = (randn(rng, (B, Hkv, Nk, D), dt) for _ in range(2))
    with _measure() as m:
        host.attention_unfused(q, k, v, causal=causal)
    s = dt.itemsize
    expected = B * Hq * reference.unfused_attention_bytes(Nq, D, itemsize=s, nk=Nk)
    assert _total(m) == expected
    # the split: reads Q, K, S, P, V; writes S, P, O
    per_head_read = s * (Nq * D + 2 * Nk * D + 2 * Nq * Nk)
    assert int(m.hbm_bytes_read) == B * Hq * per_head_read
    if Nq == Nk and s == 2:
        assert expected == B * Hq * (8 * Nq * D + 8 * Nq * Nq)


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------

def _lin(M=4, K=3, N=5, dtype="float32"):
    return linear_inputs(np.random.default_rng(0), M, K, N, DTYPES[dtype])


def test_linear_gelu_errors():
    x, w, b = _lin()
    with pytest.raises(ValueError, match=r"x: expected a 2-D array of shape \(M, K\)"):
        host.linear_gelu(x[None], w, b)
    with pytest.raises(ValueError, match=r"w: expected shape \(K, N\) with K=3"):
        host.linear_gelu(x, w[:2], b)
    with pytest.raises(ValueError, match=r"b: expected shape \(N,\) = \(5,\)"):
        host.linear_gelu(x, w, b[:4])
    with pytest.raises(TypeError, match=r"w: dtype float16 does not match x's dtype float32"):
        host.linear_gelu(x, w.astype(np.float16), b)
    with pytest.raises(TypeError, match=r"x: dtype float64 is not supported"):
        host.linear_gelu(x.astype(np.float64), w, b)
    with pytest.raises(ValueError, match=r"approximate: expected 'none' or 'tanh', got 'fast'"):
        host.linear_gelu(x, w, b, approximate="fast")
    with pytest.raises(TypeError, match=r"fused: expected True or False, got 1 \(int\)"):
        host.linear_gelu(x, w, b, fused=1)
    with pytest.raises(TypeError, match=r"mixed_precision: expected True or False"):
        host.linear_gelu(x, w, b, mixed_precision="yes")
    with pytest.raises(ValueError, match=r"sbuf_budget: expected an int in \[1, 180224\], got 0"):
        host.linear_gelu(x, w, b, sbuf_budget=0)
    with pytest.raises(TypeError, match=r"x: expected a numpy.ndarray or torch.Tensor"):
        host.linear_gelu(x.tolist(), w, b)


def test_online_softmax_errors():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"x: expected a 2-D array of shape \(M, N\), got a 1-D"):
        host.online_softmax(x[0])
    with pytest.raises(ValueError, match=r"x: row length N must be >= 1, got 0"):
        host.online_softmax(np.zeros((2, 0), np.float32))
    with pytest.raises(ValueError, match=r"algorithm: expected one of 'online', 'two_pass', "
                                         r"got 'three_pass'"):
        host.online_softmax(x, algorithm="three_pass")
    with pytest.raises(TypeError, match=r"algorithm: expected one of .* got None \(NoneType\)"):
        host.online_softmax(x, algorithm=None)
    with pytest.raises(ValueError, match=r"chunk_size: expected an int in \[1, 8192\], got 0"):
        host.online_softmax(x, chunk_size=0)
    with pytest.raises(TypeError, match=r"chunk_size: expected an int, got 2.0 \(float\)"):
        host.online_softmax(x, chunk_size=2.0)


def test_attention_unfused_errors():
    q = np.zeros((1, 2, 8, 16), np.float32)
    k = np.zeros((1, 1, 8, 16), np.float32)
    with pytest.raises(ValueError, match=r"q: expected a 2-D \(N, D\) or 4-D \(B, H, N, D\) "
                                         r"array, got a 3-D array of shape \(2, 8, 16\)"):
        host.attention_unfused(q[0], k, k)
    with pytest.raises(ValueError, match=r"k: Hkv=3 kv heads must divide q's Hq=2"):
        host.attention_unfused(q, np.zeros((1, 3, 8, 16), np.float32),
                               np.zeros((1, 3, 8, 16), np.float32))
    with pytest.raises(ValueError, match=r"q: head dim D must be in \[1, 256\], got D=300"):
        z = np.zeros((1, 1, 4, 300), np.float32)
        host.attention_unfused(z, z, z)
    with pytest.raises(ValueError, match=r"causal: expected .* got 'upper'"):
        host.attention_unfused(q, k, k, causal="upper")
    with pytest.raises(TypeError, match=r"v: dtype bfloat16 does not match q's dtype float32"):
        host.attention_unfused(q, k, k.astype(DTYPES["bfloat16"]))
    with pytest.raises(ValueError, match=r"scale: expected a finite real number, got inf"):
        host.attention_unfused(q, k, k, scale=float("inf"))
