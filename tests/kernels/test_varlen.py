"""Packed variable-length attention (nki_kernels/attention/varlen.py) through the NumPy API,
``host.flash_attention(..., cu_seqlens_q=, cu_seqlens_k=)``.

Tolerance rule of docs/semantics.md: the max abs error of o and lse against the float64
reference (host.reference.attention_varlen_forward) is at most ``2 * err_baseline + floor``,
where the baseline is the plain low-precision implementation
(host.reference.attention_baseline_lowp) run on each sequence alone and packed back, and the
floor 1e-5 for fp32 operands, 1e-3 otherwise. Rows without a visible key (a sequence with no
keys) must be exactly o = 0, lse = -inf. The per-sequence float64 reference
(host.reference.attention_forward on each sequence) must agree with the packed one.

Both namespaces run the same cases where the traces differ (the runtime step count is an
nki.* register; legacy sweeps the static worst case); the cost cases use simulate.measure.
"""
import ml_dtypes
import numpy as np
import pytest

import host
import simulate
from host import reference as R
from host._launch import program_size
from nki_kernels import nki as binding
from nki_kernels.attention.varlen import varlen_attention_fwd, varlen_grid
from nki_kernels.nki import BACKEND

BF16 = np.dtype(ml_dtypes.bfloat16)

pytestmark = pytest.mark.skipif(BACKEND != "simulate",
                                reason="estimates and program sizes use the simulator")


def _packed_inputs(cu_q, cu_k, Hq, Hkv, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, Hq, int(cu_q[-1]), D)).astype(dtype)
    k = rng.standard_normal((1, Hkv, int(cu_k[-1]), D)).astype(dtype)
    v = rng.standard_normal((1, Hkv, int(cu_k[-1]), D)).astype(dtype)
    return q, k, v


def check(q, k, v, cu_q, cu_k, o, lse, mm, **mask):
    ref_o, ref_lse = R.attention_varlen_forward(q, k, v, cu_q, cu_k, **mask)
    seq_o, seq_lse = R.per_sequence(R.attention_forward, q, k, v, cu_q, cu_k, **mask)
    assert R.max_abs_err(seq_o, ref_o) < 1e-12 and R.max_abs_err(seq_lse, ref_lse) < 1e-12
    base_o, base_lse = R.per_sequence(R.attention_baseline_lowp, q, k, v, cu_q, cu_k,
                                      dtype=mm, out_dtype=q.dtype, return_lse=True, **mask)
    floor = R.atol_floor(mm)
    assert not np.isnan(np.asarray(o, np.float64)).any() and not np.isnan(lse).any()
    err_o, tol_o = R.max_abs_err(o, ref_o), R.tolerance(ref_o, base_o, floor=floor)
    err_l, tol_l = R.max_abs_err(lse, ref_lse), R.tolerance(ref_lse, base_lse, floor=floor)
    assert err_o <= tol_o, f"o: max abs error {err_o:.3e} > tolerance {tol_o:.3e}"
    assert err_l <= tol_l, f"lse: max abs error {err_l:.3e} > tolerance {tol_l:.3e}"
    empty = np.isneginf(ref_lse)
    assert np.all(np.isneginf(lse[empty])) and np.all(np.asarray(o, np.float64)[empty] == 0.0)
    if mask.get("sinks") is not None:
        # rows without a visible key: o = 0 exactly, lse = the head's sink
        no_key = ~R.varlen_mask(cu_q, cu_k, causal=mask.get("causal"),
                                window=mask.get("window")).any(axis=1)
        assert no_key.any() and np.all(np.asarray(o, np.float64)[:, :, no_key] == 0.0)
        assert np.allclose(lse[:, :, no_key], mask["sinks"][None, :, None], atol=1e-6)


# sequences of 1 row, 129 rows (two tiles), an empty one, one with no keys for its 20 rows,
# total_q != total_k and no total a multiple of 128
CU_Q = np.array([0, 1, 130, 130, 150, 300], np.int32)
CU_K = np.array([0, 5, 100, 103, 103, 350], np.int32)

# (Hq, Hkv) = (4, 2): a loop body of both kv heads and all three tiles; (8, 1): bodies of
# two tiles (VARLEN_MAX_SLOTS) and a remainder body of one
CASES = [
    ("legacy", dict(causal="bottom_right"), "bfloat16", (4, 2)),
    ("nki", dict(causal="bottom_right"), "bfloat16", (4, 2)),
    ("nki", dict(), "float32", (4, 2)),
    ("nki", dict(causal="top_left", window=(20, -1)), "float32", (8, 1)),
    ("legacy", dict(window=(7, 3)), "float32", (8, 1)),
]


@pytest.mark.parametrize("api,mask,dtype,heads", CASES,
                         ids=lambda x: x if isinstance(x, str) else
                         "x".join(map(str, x)) if isinstance(x, tuple) else
                         "-".join(f"{k}={v}" for k, v in x.items()) or "plain")
def test_matches_reference(monkeypatch, api, mask, dtype, heads):
    monkeypatch.setenv(binding.API_ENV_VAR, api)
    dt = BF16 if dtype == "bfloat16" else np.dtype(np.float32)
    q, k, v = _packed_inputs(CU_Q, CU_K, *heads, 64, dt)
    o, lse = host.flash_attention(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K,
                                  mixed_precision=False, return_lse=True, **mask)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.dtype == np.float32
    check(q, k, v, CU_Q, CU_K, o, lse, dt, **mask)


# score modifiers apply per sequence as they do to one sequence alone: ALiBi's distances
# inside the sequence, aligned as its band (bottom_right also without causal: two-sided),
# and sinks give the rows without keys (the sequence of 20 rows) lse = sink
SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
SLOPES = np.array([0.3, 0.1, 0.05, 0.5], np.float32)
MOD_CASES = [
    ("legacy", dict(causal="bottom_right", softcap=2.0, sinks=SINKS), "bfloat16"),
    ("nki", dict(causal="bottom_right", softcap=2.0, sinks=SINKS), "bfloat16"),
    ("nki", dict(window=(7, 3), sinks=SINKS), "float32"),
    ("legacy", dict(causal="top_left", softcap=3.0), "float32"),
    ("nki", dict(causal="top_left", alibi_slopes=SLOPES, sinks=SINKS), "float32"),
    ("legacy", dict(alibi_slopes=SLOPES, softcap=2.0), "bfloat16"),
]


@pytest.mark.parametrize("api,mask,dtype", MOD_CASES,
                         ids=lambda x: x if isinstance(x, str) else
                         "-".join(k if k in ("sinks", "alibi_slopes") else f"{k}={v}"
                                  for k, v in x.items()))
def test_score_mods_match_reference(monkeypatch, api, mask, dtype):
    monkeypatch.setenv(binding.API_ENV_VAR, api)
    dt = BF16 if dtype == "bfloat16" else np.dtype(np.float32)
    q, k, v = _packed_inputs(CU_Q, CU_K, 4, 2, 32, dt)
    q = (3 * q.astype(np.float32)).astype(dt)       # scores beyond the caps
    o, lse = host.flash_attention(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K,
                                  mixed_precision=False, return_lse=True, **mask)
    check(q, k, v, CU_Q, CU_K, o, lse, dt, **mask)


BWD_CASES = [
    ("legacy", dict(causal="bottom_right"), "float32", (4, 2)),
    ("nki", dict(causal="bottom_right"), "bfloat16", (4, 2)),
    ("nki", dict(causal="top_left", window=(20, -1)), "float32", (4, 1)),
]


@pytest.mark.parametrize("api,mask,dtype,heads", BWD_CASES,
                         ids=lambda x: x if isinstance(x, str) else
                         "x".join(map(str, x)) if isinstance(x, tuple) else
                         "-".join(f"{k}={v}" for k, v in x.items()))
def test_backward_matches_reference(monkeypatch, api, mask, dtype, heads):
    """dq, dk, dv of packed sequences (empty ones, one without keys, GQA and MQA) against the
    float64 gradients of each sequence alone, within 2x the plain low-precision backward's
    error plus the floor (the rule of tests/kernels/test_backward.py)."""
    monkeypatch.setenv(binding.API_ENV_VAR, api)
    dt = BF16 if dtype == "bfloat16" else np.dtype(np.float32)
    q, k, v = _packed_inputs(CU_Q, CU_K, *heads, 32, dt)
    do = np.random.default_rng(5).standard_normal(q.shape).astype(dt)
    packed = dict(cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, mixed_precision=False, **mask)
    o, lse = host.flash_attention(q, k, v, return_lse=True, **packed)
    got = host.flash_attention_backward(do, q, k, v, o, lse, **packed)
    exact = R.per_sequence_grads(R.attention_backward, do, q, k, v, CU_Q, CU_K, **mask)
    base = R.per_sequence_grads(R.attention_backward_baseline_lowp, do, q, k, v, CU_Q, CU_K,
                                dtype=dt, out_dtype=dt, **mask)
    for name, g, e, b in zip(("dq", "dk", "dv"), got, exact, base):
        assert g.shape == e.shape and g.dtype == dt, name
        err, tol = R.max_abs_err(g, e), R.tolerance(e, b, floor=R.atol_floor(dt))
        assert err <= tol, f"{name}: max abs error {err:.3e} > tolerance {tol:.3e}"


@pytest.mark.parametrize("mask", [dict(causal="bottom_right", softcap=2.0, sinks=SINKS,
                                       alibi_slopes=SLOPES),
                                  dict(window=(7, 3), softcap=3.0, alibi_slopes=SLOPES)],
                         ids=["causal-softcap-sinks-alibi", "window-softcap-alibi"])
def test_backward_with_score_mods(monkeypatch, mask):
    """Soft-capping (dS times 1 - t^2), ALiBi (one- and two-sided) and sinks (dsinks summed
    over the sequences) in the packed backward: the float64 gradients of each sequence alone
    within 3e-5 of their largest magnitude (fp32 operands, the rule of
    tests/kernels/test_score_mods.py), and nki.* bit for bit against legacy."""
    q, k, v = _packed_inputs(CU_Q, CU_K, 4, 2, 32, np.dtype(np.float32))
    q = 3 * q
    do = np.random.default_rng(5).standard_normal(q.shape).astype(np.float32)
    packed = dict(cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, mixed_precision=False, **mask)
    monkeypatch.setenv(binding.API_ENV_VAR, "legacy")
    o, lse = host.flash_attention(q, k, v, return_lse=True, **packed)
    got = {}
    for api in ("legacy", "nki"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        got[api] = host.flash_attention_backward(do, q, k, v, o, lse, **packed)
    exact = R.per_sequence_grads(R.attention_backward, do, q, k, v, CU_Q, CU_K, **mask)
    assert len(got["nki"]) == len(exact) == (4 if "sinks" in mask else 3)
    for a, b, e in zip(got["legacy"], got["nki"], exact):
        assert np.array_equal(a, b)
        assert R.max_abs_err(b, e) <= 3e-5 * max(1.0, float(np.abs(e).max()))


def test_one_sequence_is_dense_attention(monkeypatch):
    """One packed sequence gives the dense kernel's attention (causal True = bottom_right,
    total_q != total_k), within the rule, through nki.*."""
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    cu_q, cu_k = np.array([0, 200], np.int32), np.array([0, 260], np.int32)
    q, k, v = _packed_inputs(cu_q, cu_k, 2, 1, 32, BF16, seed=3)
    o, lse = host.flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                  return_lse=True)
    check(q, k, v, cu_q, cu_k, o, lse, BF16, causal="bottom_right")


def _estimate(cu_q, cu_k, Hq=2, D=64):
    q, k, v = _packed_inputs(cu_q, cu_k, Hq, Hq, D, BF16)
    with simulate.measure(target="trn2") as m:
        host.flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    return m


def test_tiles_skip_other_sequences(monkeypatch):
    """nki.*: each query tile sweeps only its sequence's keys (a runtime step count), so four
    causal sequences of 256 packed into 1024 issue the TensorE work of four separate packed
    calls of one sequence of 256 (half that of one causal sequence of 1024)."""
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    cu4 = np.arange(0, 1025, 256, dtype=np.int32)
    cu1 = np.array([0, 256], np.int32)
    pe = lambda m: m.engine_cycles["tensor"]
    assert pe(_estimate(cu4, cu4)) <= 4 * pe(_estimate(cu1, cu1))


def test_program_does_not_grow_with_the_totals(monkeypatch):
    """The same program size for 9 and 17 query tiles (full groups in a loop, one remainder
    group) and 5x the keys, under both namespaces."""
    for api in ("legacy", "nki"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        sizes = set()
        for n in (1100, 2100):
            cu_q, cu_k = np.array([0, 7, n], np.int32), np.array([0, 7, 5 * n], np.int32)
            q, k, v = _packed_inputs(cu_q, cu_k, 1, 1, 32, BF16)
            sizes.add(program_size(varlen_attention_fwd, varlen_grid(1, 1, n, 1, api), q, k, v,
                                   cu_q, cu_k, causal="bottom_right"))
        assert len(sizes) == 1, (api, sizes)


def test_one_program_for_every_packing(monkeypatch):
    """The offsets are device data: the same program (and size) for two packings of the same
    totals, under both namespaces."""
    cu_k = np.array([0, 300, 400], np.int32)
    q, k, v = _packed_inputs(np.array([0, 300], np.int32), cu_k, 2, 1, 32, BF16)
    for api in ("legacy", "nki"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        grid = varlen_grid(1, 2, 300, 1, api)
        sizes = {program_size(varlen_attention_fwd, grid, q, k, v, cu_q, cu_k, causal="top_left")
                 for cu_q in (np.array([0, 1, 300], np.int32),
                              np.array([0, 299, 300], np.int32))}
        assert len(sizes) == 1


def test_runtime_trip_counts_are_nki_only():
    """Legacy NKI has no runtime trip count: port.loop_between refuses a register bound and
    port.register refuses to make one."""
    from nki_kernels import port

    with port.tracing(binding.namespace("legacy")):
        with pytest.raises(NotImplementedError, match="legacy NKI has no runtime trip count"):
            port.loop_between(0, object(), lambda i: None)
        with pytest.raises(NotImplementedError, match="virtual registers are an nki.. feature"):
            port.register(None)


def test_two_cores_give_the_same_outputs(monkeypatch):
    """lnc=2 spreads the (kv head pair) instances over two cores: the same outputs bit for
    bit, in less modeled time."""
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    q, k, v = _packed_inputs(CU_Q, CU_K, 4, 4, 32, BF16)
    outs, est = {}, {}
    for lnc in (1, 2):
        with simulate.measure(target="trn2") as m:
            outs[lnc] = host.flash_attention(q, k, v, causal=True, cu_seqlens_q=CU_Q,
                                             cu_seqlens_k=CU_K, lnc=lnc, return_lse=True)
        est[lnc] = m.estimated_seconds
    assert all(np.array_equal(a, b) for a, b in zip(outs[1], outs[2]))
    assert est[2] < est[1]


def test_kernel_refuses_per_batch_slopes():
    """The packed kernels take ALiBi slopes (Hq,) only: a (1, Hq) table is refused naming
    alibi_slopes (the host reshapes its validated slopes before the launch)."""
    cu = np.array([0, 40], np.int32)
    q, k, v = _packed_inputs(cu, cu, 2, 1, 16, np.dtype(np.float32))
    with pytest.raises(ValueError, match=r"alibi_slopes: packed sequences take one slope per "
                                         r"query head, shape \(Hq,\); got shape \(1, 2\)"):
        program_size(varlen_attention_fwd, varlen_grid(1, 2, 40, 1, "legacy"), q, k, v, cu, cu,
                     alibi_slopes=np.ones((1, 2), np.float32))
