"""The flash attention backward kernel against the float64 reference gradients.

Tolerance rule (docs/semantics.md, FlashAttention's): for each of dq, dk, dv the kernel's max
abs error against ``host.reference.attention_backward`` (float64, exact P) must be at most
``2 * err_baseline + atol_floor``, where ``err_baseline`` is the error of
``attention_backward_baseline_lowp`` (plain autograd-style backward with operands, S, P, dP and
dS rounded to the kernel's matmul operand dtype) and ``atol_floor`` is 1e-3 for bf16/fp16
operands, 1e-5 for fp32. The kernel gets o and lse from the float64 reference forward, o rounded
to the input dtype and lse to float32 (what the forward kernel returns).

The kernel is launched directly (grid ``[B, Hkv]``) with per-sequence lengths as runtime
``(B,)`` int32 tensors, as host.flash_attention_backward does: one compiled kernel serves every
set of lengths.

Every case traces through the legacy namespace (``NKI_FLASH_API=legacy``, autouse fixture);
the section "nki.*" at the end runs a representative subset through nki.* (NKI 0.7) and checks
it against the legacy trace bit for bit (same instructions but the band masks' distances, read
as data under nki.*): the program loop over (sequence, kv head), partial query and key tiles,
head-dim chunks, GQA, dtypes and unusual scales, causal and window bands (loop-index offsets),
the dQ-in-HBM and DMA-transpose variants, wide key tiles, the two-kernel split, dropout and
the score modifiers, runtime lengths (both key-mask paths), several passes, LNC=2, and the
program size flat in N; plus the int32 row and unit numbers of lengths or passes over 2^24
rows and dropout over 2^24 units (the bound lowered). The rest of this module covers the
shared code paths once, in legacy.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from host import reference as ref
from host._launch import launch
from nki_kernels import nki as binding
from nki_kernels import tiles as T
from nki_kernels.attention.backward import backward_grid, flash_attn_bwd
from nki_kernels.nki import BACKEND
from nki_kernels.tiles import PMAX

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

needs_measure = pytest.mark.skipif(BACKEND != "simulate",
                                   reason="simulate.measure needs the bundled simulator")


@pytest.fixture(autouse=True)
def _legacy_namespace(monkeypatch):
    """The kernel traces through the legacy namespace unless a test says otherwise."""
    monkeypatch.setenv(binding.API_ENV_VAR, "legacy")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype=BF16, seed=0, *, scale=None, causal=None,
                window=None, q_lens=None, kv_lens=None, k_gain=1.0):
    """Random q, k, v, do (standard normal, cast to dtype) and the reference forward's o, lse."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Nq, D)).astype(dtype)
    k = (k_gain * rng.standard_normal((B, Hkv, Nk, D))).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
    do = rng.standard_normal((B, Hq, Nq, D)).astype(dtype)
    o, lse = ref.attention_forward(q, k, v, scale=scale, causal=causal, window=window,
                                   q_lens=q_lens, kv_lens=kv_lens)
    return q, k, v, do, o.astype(dtype), lse.astype(np.float32)


def run_kernel(q, k, v, do, o, lse, *, scale=None, causal=None, window=None, q_lens=None,
               kv_lens=None, **kernel_opts):
    """Launch the kernel on :func:`backward_grid` of the namespace selected now (legacy: [B,
    Hkv]); lengths as (B,) int32 runtime tensors."""
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    opts = dict(scale=float(scale), causal=causal, window=window, **kernel_opts)
    as_int32 = (lambda x: None if x is None else np.ascontiguousarray(x, dtype=np.int32))
    grid = backward_grid(B, Hkv, 1, api=binding.select_api())
    return launch(flash_attn_bwd, grid, q, k, v, o, do, lse, kv_lens=as_int32(kv_lens),
                  q_lens=as_int32(q_lens), **opts)


def op_dtype_of(dtype, mixed_precision=True):
    dtype = np.dtype(dtype)
    if dtype == F32:
        return BF16 if mixed_precision else F32
    return dtype


def check_grads(got, q, k, v, do, *, mixed_precision=True, scale=None, causal=None,
                window=None, q_lens=None, kv_lens=None):
    """Assert the tolerance rule for (dq, dk, dv); returns the errors and tolerances."""
    mask_opts = dict(scale=scale, causal=causal, window=window, q_lens=q_lens, kv_lens=kv_lens)
    exact = ref.attention_backward(do, q, k, v, **mask_opts)
    op = op_dtype_of(q.dtype, mixed_precision)
    base = ref.attention_backward_baseline_lowp(do, q, k, v, dtype=op, out_dtype=q.dtype,
                                                **mask_opts)
    floor = ref.atol_floor(op)
    report = {}
    for name, g, e, bl in zip(("dq", "dk", "dv"), got, exact, base):
        assert g.shape == e.shape, (name, g.shape, e.shape)
        assert g.dtype == q.dtype, (name, g.dtype)
        assert np.all(np.isfinite(g.astype(np.float64))), f"{name} has NaN/inf"
        err = ref.max_abs_err(g, e)
        tol = ref.tolerance(e, bl, floor=floor)
        report[name] = (err, tol)
        assert err <= tol, f"{name}: max abs err {err:.3g} > tolerance {tol:.3g}"
    return report


def run_and_check(B, Hq, Hkv, Nq, Nk, D, dtype=BF16, seed=0, *, scale=None, causal=None,
                  window=None, q_lens=None, kv_lens=None, mixed_precision=True,
                  **kernel_opts):
    mask_opts = dict(scale=scale, causal=causal, window=window, q_lens=q_lens, kv_lens=kv_lens)
    q, k, v, do, o, lse = make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed, **mask_opts)
    got = run_kernel(q, k, v, do, o, lse, mixed_precision=mixed_precision, **mask_opts,
                     **kernel_opts)
    return check_grads(got, q, k, v, do, mixed_precision=mixed_precision, **mask_opts), got


# --------------------------------------------------------------------------------------------
# shapes and dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Nq,Nk,D", [
    (1, 1, 16),
    (17, 17, 64),
    (127, 129, 80),
    (129, 127, 128),
    (130, 600, 64),     # two key tiles, a partial 128-key block
    (200, 72, 256),     # D > 128: two contraction chunks, 256-key tiles
])
def test_shapes_bf16(Nq, Nk, D):
    run_and_check(1, 2, 1, Nq, Nk, D, BF16, seed=Nq + Nk + D)


def test_batch_and_fp16():
    run_and_check(2, 2, 2, 96, 160, 64, F16, seed=3)


@pytest.mark.parametrize("mixed_precision", [True, False])
def test_fp32_inputs(mixed_precision):
    run_and_check(1, 2, 1, 70, 140, 32, F32, seed=4, mixed_precision=mixed_precision)


def test_custom_scale_negative_and_zero():
    run_and_check(1, 1, 1, 40, 50, 32, BF16, seed=5, scale=-0.3, causal="top_left")
    run_and_check(1, 1, 1, 40, 50, 32, BF16, seed=6, scale=0.0, causal="bottom_right")


# --------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("Nq,Nk,D", [(200, 200, 64), (150, 400, 64), (300, 170, 64),
                                     (128, 128, 128), (1000, 1000, 64), (300, 300, 256)])
def test_causal(causal, Nq, Nk, D):
    run_and_check(1, 1, 1, Nq, Nk, D, BF16, seed=Nq * 7 + Nk, causal=causal)


@pytest.mark.parametrize("causal,window", [
    ("bottom_right", (40, 0)),
    (None, (30, 20)),
    (None, (-1, 7)),
    (None, (50, -1)),
    ("top_left", (0, -1)),
])
def test_window(causal, window):
    run_and_check(1, 2, 1, 180, 260, 32, BF16, seed=11, causal=causal, window=window)


def test_masked_keys_never_reach_the_exp():
    """Huge scores on masked (future) keys: computed before masking they would overflow the exp
    (inf * 0 = NaN); the kernel masks the scores first."""
    rng = np.random.default_rng(12)
    B, H, N, D = 1, 1, 160, 32
    q = rng.standard_normal((B, H, N, D)).astype(BF16)
    k = rng.standard_normal((B, H, N, D)).astype(np.float32)
    k[:, :, N // 2:] = 300.0 * np.asarray(q[:, :, :1], np.float32)  # aligned with row 0
    k = k.astype(BF16)
    v = rng.standard_normal((B, H, N, D)).astype(BF16)
    do = rng.standard_normal((B, H, N, D)).astype(BF16)
    o, lse = ref.attention_forward(q, k, v, causal="top_left")
    got = run_kernel(q, k, v, do, o.astype(BF16), lse.astype(np.float32), causal="top_left")
    check_grads(got, q, k, v, do, causal="top_left")


# --------------------------------------------------------------------------------------------
# GQA / MQA
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Hq,Hkv,causal", [(8, 2, None), (4, 1, "bottom_right")])
def test_gqa_mqa(Hq, Hkv, causal):
    run_and_check(1, Hq, Hkv, 65, 140, 32, BF16, seed=Hq, causal=causal)


# --------------------------------------------------------------------------------------------
# padded batches and fully masked rows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [None, "bottom_right", "top_left"])
def test_lengths(causal):
    q_lens, kv_lens = np.array([130, 0, 57]), np.array([90, 140, 0])
    _, got = run_and_check(3, 2, 1, 140, 150, 32, BF16, seed=21, causal=causal,
                           q_lens=q_lens, kv_lens=kv_lens)
    dq, dk, dv = (np.asarray(x, np.float64) for x in got)
    assert not dq[0, :, 130:].any() and not dq[1].any() and not dq[2].any()
    assert not dk[0, :, 90:].any() and not dv[0, :, 90:].any()
    assert not dk[2].any() and not dv[2].any()


def test_padding_is_never_read():
    """NaN in padded rows of q/do/o/lse and padded keys of k/v: the kernel never loads them."""
    q_lens, kv_lens = np.array([70]), np.array([100])
    q, k, v, do, o, lse = make_inputs(1, 2, 1, 128, 256, 32, BF16, 22, causal="bottom_right",
                                      q_lens=q_lens, kv_lens=kv_lens)
    for x in (q, do, o):
        x[:, :, 70:] = np.nan
    lse[:, :, 70:] = np.nan
    k[:, :, 100:] = np.nan
    v[:, :, 100:] = np.nan
    got = run_kernel(q, k, v, do, o, lse, causal="bottom_right", q_lens=q_lens, kv_lens=kv_lens)
    clean = [np.nan_to_num(np.asarray(x, np.float32)).astype(BF16) for x in (q, k, v, do)]
    check_grads(got, *clean, causal="bottom_right", q_lens=q_lens, kv_lens=kv_lens)


def _poison_padding(q_lens, kv_lens, *arrays):
    """NaN into every padding row of q, do, o, lse and padding key of k, v (in place)."""
    q, k, v, do, o, lse = arrays
    for b in range(q.shape[0]):
        nq, nk = int(q_lens[b]), int(kv_lens[b])
        for x in (q, do, o):
            x[b, :, nq:] = np.nan
        lse[b, :, nq:] = np.nan
        k[b, :, nk:] = np.nan
        v[b, :, nk:] = np.nan


@pytest.mark.parametrize("causal,window,Hq,Hkv,kernel_opts", [
    (None, None, 2, 1, {}),
    ("top_left", None, 4, 2, {}),                        # static band + runtime key row
    ("bottom_right", None, 2, 1, {}),                    # runtime band (off = kv_len - q_len)
    ("bottom_right", (20, 0), 2, 2, {}),                 # runtime band, both edges
    (None, (30, 10), 2, 1, {"rows_per_pass": PMAX}),     # runtime window, several passes
    ("top_left", (-1, -1), 2, 1, {"ds_transpose": "pe", "dq_accumulate": "hbm"}),
])
def test_lengths_vary_across_calls_of_one_kernel(causal, window, Hq, Hkv, kernel_opts):
    """The same compiled kernel (shapes and static options) for several sets of lengths, 0 and
    full included: each call's gradients follow the tolerance rule, padding rows and keys (NaN
    in HBM) get exact zeros, nothing is NaN, and the instruction stream is identical for every
    set of lengths (the lengths are data, not part of the program)."""
    import simulate
    B, Nq, Nk, D = 3, 200, 330, 32
    sets = [([200, 0, 77], [330, 150, 0]),
            ([0, 200, 128], [17, 330, 330]),
            ([200, 200, 200], [330, 330, 330]),
            ([1, 129, 199], [1, 129, 329])]
    programs = []
    for n, (q_lens, kv_lens) in enumerate(sets):
        q_lens, kv_lens = np.array(q_lens), np.array(kv_lens)
        mask = dict(causal=causal, window=window, q_lens=q_lens, kv_lens=kv_lens)
        q, k, v, do, o, lse = make_inputs(B, Hq, Hkv, Nq, Nk, D, BF16, 70 + n, **mask)
        _poison_padding(q_lens, kv_lens, q, k, v, do, o, lse)
        with simulate.measure(target="trn2") as m:
            got = run_kernel(q, k, v, do, o, lse, **mask, **kernel_opts)
        programs.append((dict(m.instructions), dict(m.engine_cycles)))
        clean = [np.nan_to_num(np.asarray(x, np.float32)).astype(BF16) for x in (q, k, v, do)]
        check_grads(got, *clean, **mask)
        dq, dk, dv = (np.asarray(x, np.float64) for x in got)
        for b in range(B):
            assert not dq[b, :, q_lens[b]:].any()
            assert not dk[b, :, kv_lens[b]:].any() and not dv[b, :, kv_lens[b]:].any()
            if q_lens[b] == 0 or kv_lens[b] == 0:
                assert not dq[b].any() and not dk[b].any() and not dv[b].any()
    assert all(p == programs[0] for p in programs[1:])


@pytest.mark.parametrize("scale,causal", [(0.0, None), (-0.4, "top_left"), (1e-9, "bottom_right"),
                                          (3e7, "top_left")])
def test_lengths_with_scales_outside_the_fold_range(scale, causal):
    """Runtime masks add MASK_NEG on TensorE; scales the exp cannot carry it with (zero,
    negative, tiny, huge) go into Q^T instead, so masked keys still get P = 0."""
    mask = dict(scale=scale, causal=causal, q_lens=np.array([50, 9]), kv_lens=np.array([61, 0]))
    inputs = make_inputs(2, 2, 1, 64, 80, 32, BF16, 77, k_gain=1e-6 if scale > 1e6 else 1.0,
                         **mask)
    q, k, v, do, o, lse = inputs
    check_grads(run_kernel(*inputs, **mask), q, k, v, do, **mask)


@pytest.mark.parametrize("D,dtype,mixed_precision", [
    (128, BF16, True),     # rank-1 mask matmul (no spare contraction partition)
    (80, BF16, True),      # mask row on partition 80 of Q^T / K^T, inside the S matmul
    (200, BF16, True),     # ... on partition 72 of the second head-dim chunk
    (48, F16, True),       # fp16 operands cannot hold MASK_NEG: separate bf16 matmul
    (48, F32, False),      # fp32 operands, mask row in the fp32 S matmul
])
def test_key_mask_paths(D, dtype, mixed_precision):
    """Every way the kv_lens mask reaches S, with NaN in the padding."""
    q_lens, kv_lens = np.array([130, 0, 77]), np.array([300, 140, 1])
    mask = dict(causal="top_left", q_lens=q_lens, kv_lens=kv_lens)
    q, k, v, do, o, lse = make_inputs(3, 2, 1, 150, 300, D, dtype, D, **mask)
    _poison_padding(q_lens, kv_lens, q, k, v, do, o, lse)
    got = run_kernel(q, k, v, do, o, lse, mixed_precision=mixed_precision, **mask)
    clean = [np.nan_to_num(np.asarray(x, np.float32)).astype(dtype) for x in (q, k, v, do)]
    check_grads(got, *clean, mixed_precision=mixed_precision, **mask)
    dk = np.asarray(got[1], np.float64)
    assert not dk[0, :, 300:].any() and not dk[1, :, 140:].any() and not dk[2, :, 1:].any()


def test_only_one_length_array():
    """kv_lens alone (key mask, every row valid) and q_lens alone (rows only)."""
    run_and_check(2, 2, 1, 150, 140, 64, BF16, seed=78, causal="top_left",
                  kv_lens=np.array([3, 140]))
    run_and_check(2, 2, 1, 150, 140, 64, BF16, seed=79, causal="bottom_right",
                  q_lens=np.array([150, 20]))
    run_and_check(2, 2, 1, 150, 140, 64, BF16, seed=80, causal="bottom_right",
                  kv_lens=np.array([100, 140]))


def test_rows_without_keys_have_zero_gradient():
    """bottom_right with Nq > Nk: the first Nq - Nk rows see no key (LSE = -inf)."""
    _, got = run_and_check(1, 1, 1, 300, 100, 32, BF16, seed=23, causal="bottom_right")
    dq = np.asarray(got[0], np.float64)
    assert not dq[:, :, :200].any()


# --------------------------------------------------------------------------------------------
# multi-pass and the dQ-in-HBM variant
# --------------------------------------------------------------------------------------------


def test_several_passes_match_one():
    """Forcing one 128-row query tile per pass (dK/dV partial sums through HBM) gives the
    same gradients as a single pass, up to fp32 summation order."""
    q, k, v, do, o, lse = make_inputs(1, 4, 2, 200, 300, 32, BF16, 31, causal="bottom_right")
    one = run_kernel(q, k, v, do, o, lse, causal="bottom_right")
    many = run_kernel(q, k, v, do, o, lse, causal="bottom_right", rows_per_pass=PMAX)
    check_grads(many, q, k, v, do, causal="bottom_right")
    for a, b in zip(one, many):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=1e-2, rtol=1e-2)


def test_dq_accumulated_in_hbm():
    run_and_check(1, 2, 1, 150, 700, 32, BF16, seed=32, causal="top_left",
                  dq_accumulate="hbm")


@pytest.mark.parametrize("ds_transpose,act_evac_blocks", [("pe", 0), ("pe", 2), ("dma", 0)])
def test_ds_transpose_paths(ds_transpose, act_evac_blocks):
    """dS^T on TensorE (PSUM copies on ScalarE and/or VectorE) or by DMA transpose, over the
    blocks of 256-key visits; the DMA path falls back to TensorE for visits with a partial
    128-key block (Nk = 300)."""
    run_and_check(1, 2, 1, 150, 300, 64, BF16, seed=34, causal="bottom_right",
                  ds_transpose=ds_transpose, act_evac_blocks=act_evac_blocks, key_tile=256)


@needs_measure
def test_runs_on_trn1():
    """trn1 defaults (PE transposes, fp32 PSUM transposes) under the trn1 capacity checks."""
    import simulate
    with simulate.measure(target="trn1"):
        run_and_check(1, 2, 1, 200, 260, 128, BF16, seed=35, causal="top_left")


def test_two_kernel_split():
    """grads=("dk", "dv") then grads=("dq",) (the two-kernel design, for measurement) give the
    single pass's gradients exactly."""
    q, k, v, do, o, lse = make_inputs(1, 4, 2, 150, 260, 32, BF16, 36, causal="top_left")
    dq, dk, dv = run_kernel(q, k, v, do, o, lse, causal="top_left")
    dk2, dv2 = run_kernel(q, k, v, do, o, lse, causal="top_left", grads=("dk", "dv"))
    dq2 = run_kernel(q, k, v, do, o, lse, causal="top_left", grads=("dq",))
    for a, b in ((dq, dq2), (dk, dk2), (dv, dv2)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_wide_key_tile():
    """Visits of several 128-key blocks (the default is one): K^T, V^T and the dK/dV
    accumulators per block, V in wide rows, a partial last block."""
    run_and_check(1, 1, 1, 100, 1100, 64, BF16, seed=33, window=(50, 10), key_tile=512)


# --------------------------------------------------------------------------------------------
# HBM traffic (exact, from the simulator's byte counts)
# --------------------------------------------------------------------------------------------


def backward_io_bytes(B, Hq, Hkv, Nq, Nk, D, itemsize, *, nq=None, nk=None, passes=1,
                      length_arrays=0):
    """Exact HBM bytes of the kernel: (read, written).

    Reads: q, do, o of the valid rows, lse (fp32) of the valid rows, and k, v of the valid keys
    once per pass (padding is skipped by the gathers, never read), plus one int32 per program
    (B Hkv of them) for each runtime length array; with P > 1 passes an fp32 dK/dV scratch per
    program is zeroed, read-add-written by every pass and read once at the end (every key seen
    by some row, as in the shapes used here). Writes: dq, dk, dv in full (padding rows as
    zeros).
    """
    nq = Nq if nq is None else nq
    nk = Nk if nk is None else nk
    read = itemsize * (3 * B * Hq * nq * D + passes * 2 * B * Hkv * nk * D) + 4 * B * Hq * nq
    read += 4 * B * Hkv * length_arrays
    written = itemsize * (B * Hq * Nq * D + 2 * B * Hkv * Nk * D)
    scratch = (passes + 1) * 2 * B * Hkv * Nk * D * 4 if passes > 1 else 0
    return read + scratch, written + scratch


@needs_measure
@pytest.mark.parametrize("causal,rows_per_pass", [(None, None), ("top_left", None),
                                                  ("bottom_right", 256)])
def test_io_bytes(causal, rows_per_pass):
    import simulate
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 300, 200, 64
    q, k, v, do, o, lse = make_inputs(B, Hq, Hkv, Nq, Nk, D, BF16, 41, causal=causal)
    with simulate.measure(target="trn2") as m:
        run_kernel(q, k, v, do, o, lse, causal=causal, rows_per_pass=rows_per_pass)
    G = Hq // Hkv
    passes = 1 if rows_per_pass is None else -(-G * -(-Nq // PMAX) * PMAX // rows_per_pass)
    read, written = backward_io_bytes(B, Hq, Hkv, Nq, Nk, D, 2, passes=passes)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)


@needs_measure
def test_io_bytes_with_lengths():
    import simulate
    q_lens, kv_lens = np.array([100, 7]), np.array([150, 33])
    B, Hq, Hkv, Nq, Nk, D = 2, 2, 1, 130, 160, 32
    q, k, v, do, o, lse = make_inputs(B, Hq, Hkv, Nq, Nk, D, BF16, 42, q_lens=q_lens,
                                      kv_lens=kv_lens)
    with simulate.measure(target="trn1") as m:
        run_kernel(q, k, v, do, o, lse, q_lens=q_lens, kv_lens=kv_lens)
    read = written = 0
    for b in range(B):
        r, w = backward_io_bytes(1, Hq, Hkv, Nq, Nk, D, 2, nq=int(q_lens[b]), nk=int(kv_lens[b]),
                                 length_arrays=2)
        read, written = read + r, written + w
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)


@needs_measure
@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_dma_chunks_of_the_fast_path(target, causal):
    """Without lengths, whole tiles move in few DMAs: Q, dO, O, LSE, dQ 8 query tiles per DMA
    (one row = one 256 B chunk per partition and tile; LSE 4-byte elements), K, dK, dV a whole
    key tile per DMA, V in wide rows (nb consecutive keys = one nb 256 B chunk per partition,
    for nb 128-key blocks per tile: 1 by default, 4 with ``key_tile=512``, run here without a
    mask); dS^T by TensorE, no DMA transposes. The HBM bytes stay the minimum; the gradients
    pass the tolerance rule."""
    import simulate
    B, Hq, Hkv, N, D = 1, 2, 1, 1024, 128
    G = Hq // Hkv
    key_tile = 512 if causal is None else T.bwd_key_tile(D)
    q, k, v, do, o, lse = make_inputs(B, Hq, Hkv, N, N, D, BF16, 43, causal=causal)
    with simulate.measure(target=target) as m:
        got = run_kernel(q, k, v, do, o, lse, causal=causal, key_tile=key_tile)
    check_grads(got, q, k, v, do, causal=causal)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == backward_io_bytes(B, Hq, Hkv, N, N, D, 2)
    row_chunks = (3 * G + 1) * N + G * N + 2 * N    # q, do, o, k in; dq, dk, dv out: 256 B
    v_chunks = N // (key_tile // PMAX)              # nb 256 B
    lse_chunks = G * N                              # 4 B elements
    assert m.dma_chunks == row_chunks + v_chunks + lse_chunks
    assert m.dma_average_chunk_bytes == pytest.approx(
        (m.hbm_bytes_read + m.hbm_bytes_written) / m.dma_chunks)
    if causal is None:
        # per head 3 loads, 1 LSE load, 1 dQ store; per key tile K, V, dK, dV
        assert m.dma_transfers == G * 5 + (N // key_tile) * 4


# --------------------------------------------------------------------------------------------
# nki.* (NKI 0.7): the same source traced through the other namespace
# --------------------------------------------------------------------------------------------

#: The representative subset of the module docstring: (B, Hq, Hkv, Nq, Nk, D, options).
NKI_CASES = [
    (1, 1, 1, 1, 1, 16, {}),
    (2, 4, 2, 129, 300, 64, {"causal": "bottom_right"}),
    (1, 2, 1, 200, 1100, 256, {"causal": "top_left"}),
    (1, 1, 1, 400, 1300, 64, {"window": (100, 30)}),
    (1, 1, 1, 300, 500, 64, {"causal": "bottom_right", "window": (200, 0)}),
    (1, 1, 1, 200, 300, 80, {"causal": "bottom_right", "dtype": F32, "mixed_precision": False}),
    (1, 2, 1, 150, 300, 64, {"causal": "top_left", "dtype": F16, "scale": -0.3}),
    (1, 2, 1, 150, 700, 32, {"causal": "top_left", "dq_accumulate": "hbm"}),
    (1, 1, 1, 150, 512, 128, {"ds_transpose": "dma", "key_tile": 512}),
    (1, 2, 1, 150, 300, 64, {"causal": "bottom_right", "act_evac_blocks": 2, "key_tile": 256}),
    (1, 1, 1, 100, 1100, 64, {"window": (50, 10), "key_tile": 512}),
    (1, 4, 2, 150, 260, 32, {"causal": "top_left", "grads": ("dk", "dv")}),
    (1, 4, 2, 150, 260, 32, {"causal": "top_left", "grads": ("dq",)}),
    # several passes: the query rows gathered and scattered by flat row numbers under nki.*
    (1, 4, 2, 200, 300, 32, {"causal": "bottom_right", "rows_per_pass": PMAX}),
    (1, 2, 1, 400, 300, 64, {"causal": "top_left", "rows_per_pass": 256,
                             "dq_accumulate": "hbm"}),
    # runtime lengths: rotated and in-place rows and keys, the key mask in the S contraction
    # (D % 128 != 0) or its own rank-1 matmul (D = 128, fp16)
    (2, 2, 1, 129, 200, 64, {"causal": "bottom_right", "q_lens": [129, 5],
                             "kv_lens": [200, 77]}),
    (2, 2, 1, 200, 300, 128, {"causal": "top_left", "kv_lens": [3, 300]}),
    (1, 2, 1, 150, 300, 64, {"window": (100, 30), "kv_lens": [151], "dtype": F16}),
    (2, 2, 1, 200, 700, 80, {"causal": "top_left", "q_lens": [150, 0]}),
    (1, 2, 1, 300, 200, 32, {"q_lens": [77], "rows_per_pass": 256}),
]


def _run_in(api, monkeypatch, q, k, v, do, o, lse, **opts):
    import simulate

    monkeypatch.setenv(binding.API_ENV_VAR, api)
    with simulate.measure(target="trn2") as m:
        got = run_kernel(q, k, v, do, o, lse, **opts)
    assert m.api == api
    return (got if isinstance(got, tuple) else (got,)), m


@needs_measure
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,opts", NKI_CASES)
def test_nki_namespace_matches_legacy(B, Hq, Hkv, Nq, Nk, D, opts, monkeypatch):
    """Through nki.* the gradients are the legacy trace's bit for bit (and so follow the
    tolerance rule, checked here for the full-gradient cases), with the same HBM bytes."""
    opts = dict(opts)
    dtype = opts.pop("dtype", BF16)
    mask = {n: opts.pop(n) for n in ("scale", "causal", "window") if n in opts}
    for name in ("q_lens", "kv_lens"):
        if name in opts:
            mask[name] = np.array(opts.pop(name))
    q, k, v, do, o, lse = make_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, Nq + Nk + D, **mask)
    got, m = _run_in("nki", monkeypatch, q, k, v, do, o, lse, **mask, **opts)
    ref_got, m0 = _run_in("legacy", monkeypatch, q, k, v, do, o, lse, **mask, **opts)
    for a, b in zip(got, ref_got):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (m0.hbm_bytes_read, m0.hbm_bytes_written)
    if "grads" not in opts:
        check_grads(got, q, k, v, do, mixed_precision=opts.get("mixed_precision", True),
                    **mask)


@needs_measure
@pytest.mark.parametrize("mods", [dict(dropout_p=0.2, causal="bottom_right"),
                                  dict(softcap=20.0),
                                  dict(alibi=True, causal="top_left"),
                                  dict(alibi=True, window=(64, 64)),
                                  dict(sinks=True, causal="bottom_right")])
def test_nki_namespace_dropout_and_score_modifiers(mods, monkeypatch):
    """Dropout (unit numbers from the loop-index table), soft-capping, ALiBi (its distance tile
    from the runtime distance columns) and sinks (dsinks) through nki.*, by the host API: the
    legacy trace's gradients bit for bit."""
    import host

    kw = dict(mods)
    q, k, v, do, _, _ = make_inputs(1, 2, 1, 300, 500, 64, BF16, 9)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = np.array([0.5, 0.125], np.float32)
    if kw.pop("sinks", None):
        kw["sinks"] = np.array([1.5, -2.0], np.float32)
    if kw.get("dropout_p"):
        kw["seed"] = 11
    monkeypatch.setenv(binding.API_ENV_VAR, "legacy")
    o, lse = host.flash_attention(q, k, v, return_lse=True, lnc=1, **kw)
    outs = {}
    for api in ("legacy", "nki"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        outs[api] = host.flash_attention_backward(do, q, k, v, o, lse, lnc=1, **kw)
    for a, b in zip(outs["legacy"], outs["nki"]):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@needs_measure
@pytest.mark.parametrize("B,Hkv,lnc", [(2, 1, 2), (1, 1, 2), (3, 1, 1)])
def test_nki_namespace_programs_and_cores(B, Hkv, lnc, monkeypatch):
    """0.7 launches ``kernel[lnc]``: the kernel loops over the (sequence, kv head) programs,
    the two cores of LNC=2 taking half of them each (an even count; an odd one stays on one
    core, as the legacy grid does)."""
    import host
    import simulate

    q, k, v, do, o, lse = make_inputs(B, 2 * Hkv, Hkv, 200, 300, 64, BF16, B + lnc,
                                      causal="bottom_right")
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    cores = 2 if lnc == 2 and B * Hkv % 2 == 0 else 1
    assert backward_grid(B, Hkv, lnc, api="nki") == (cores,)
    with simulate.measure(target="trn2") as m:
        got = host.flash_attention_backward(do, q, k, v, o, lse, causal="bottom_right", lnc=lnc)
    assert m.api == "nki" and m.kernels[0].cores == cores
    check_grads(got, q, k, v, do, causal="bottom_right")


@needs_measure
@pytest.mark.parametrize("api", ["legacy", "nki"])
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_program_size_does_not_grow_with_n(api, causal):
    """Every loop over sequence tiles is a compiled loop in both namespaces: the program has
    the same size at N = 8192 + 100 and 16384 + 100 (the key spans saturate at
    ``BWD_K_SPANS``; ``simulate.program_size`` traces every loop body once)."""
    import simulate
    from nki_kernels import port

    ns = binding.namespace(api)
    grid = backward_grid(1, 1, 1, api=api)
    sizes = []
    for N in (8192 + 100, 16384 + 100):
        q = np.zeros((1, 1, N, 64), BF16)
        lse = np.zeros((1, 1, N), np.float32)
        with port.tracing(ns):
            kernel = flash_attn_bwd.jitted(ns)[grid[0] if api == "nki" else grid]
            sizes.append(simulate.program_size(kernel, q, q, q, q, q, lse, scale=0.125,
                                               causal=causal))
    assert sizes[0] == sizes[1] < 5000


@pytest.mark.parametrize("opts", [
    dict(kv_lens=[100, 256], q_lens=[50, 256], causal="bottom_right"),
    dict(dropout_p=0.1, seed=2 ** 31 - 9, causal="top_left"),
], ids=["lengths", "dropout"])
def test_nki_namespace_exact_integer_indices(opts, monkeypatch):
    """Flat row numbers of the gathers (runtime lengths, several passes) and dropout unit
    numbers that may reach 2^24 are summed in int32 under nki.* (``port.OffsetColumns(
    exact=True)``; fp32 would round them): with that bound lowered to 4 here, the nki.* trace
    takes that path and still gives the legacy trace's gradients bit for bit (GQA, two
    sequences); ``auto`` on trn2 traces such calls through nki.* (nothing of the backward is
    left to legacy)."""
    import host
    import simulate

    monkeypatch.setattr(T, "FP32_EXACT_INT", 4)
    monkeypatch.setattr("nki_kernels.attention.backward.FP32_EXACT_INT", 4)
    q, k, v, do, o, lse = make_inputs(2, 2, 1, 256, 256, 32, BF16, 1)
    kw = {n: np.array(x, np.int32) if n.endswith("lens") else x for n, x in opts.items()}
    runs = {}
    for api in ("legacy", "nki", "auto"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        with simulate.measure(target="trn2") as m:
            runs[api] = host.flash_attention_backward(do, q, k, v, o, lse, lnc=1, **kw)
        assert m.api == ("legacy" if api == "legacy" else "nki")
    for a, b in zip(runs["legacy"], runs["nki"]):
        np.testing.assert_array_equal(a, b)
