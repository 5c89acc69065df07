"""The flash attention forward kernel (nki_kernels/attention/forward.py) against the references.

Every case runs through the active backend's ``nki.simulate_kernel`` and is checked with the
tolerance rule of docs/semantics.md: the max abs error of o and of lse against the float64
reference (host.reference.attention_forward) must be at most ``2 * err_baseline + floor``, where
``err_baseline`` is the error of the plain low-precision implementation in the kernel's matmul
operand precision (host.reference.attention_baseline_lowp) and the floor is 1e-5 for fp32
operands, 1e-3 otherwise. No output may be NaN; rows without a visible key must be exactly
o = 0, lse = -inf.

IO and quality claims use ``simulate.measure`` (simulate backend only).

The kernel is one source for both NKI namespaces (nki_kernels.port). These tests run it through
the legacy namespace (``NKI_FLASH_API=legacy``, autouse fixture); the section "nki.*" at the end
runs a representative subset through nki.* (NKI 0.7) and checks it against the legacy trace.
"""
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from host import reference as R
from host._launch import launch
from nki_kernels import nki as binding
from nki_kernels import tiles as T
from nki_kernels.attention import forward as F
from nki_kernels.attention.masks import MaskSpec
from nki_kernels.nki import BACKEND

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bfloat16": BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}

needs_measure = pytest.mark.skipif(BACKEND != "simulate",
                                   reason="simulate.measure exists only in the bundled simulator")


@pytest.fixture(autouse=True)
def _legacy_namespace(monkeypatch):
    """The kernel traces through the legacy namespace unless a test says otherwise."""
    monkeypatch.setenv(binding.API_ENV_VAR, "legacy")


def launch_fwd(q, k, v, *lens, lnc=1, **kw):
    """flash_attention_fwd on :func:`forward.forward_grid` of the namespace selected now."""
    grid, kernel_lnc = F.forward_grid(q.shape[0], k.shape[1], lnc, api=binding.select_api())
    return launch(F.flash_attention_fwd, grid, q, k, v, *lens, lnc=kernel_lnc, **kw)


def _inputs(rng, B, Hq, Hkv, Nq, Nk, D, dtype, scale=1.0):
    dt = DTYPES[dtype]
    q = (scale * rng.standard_normal((B, Hq, Nq, D))).astype(dt)
    k = rng.standard_normal((B, Hkv, Nk, D)).astype(dt)
    v = rng.standard_normal((B, Hkv, Nk, D)).astype(dt)
    return q, k, v


def _mm_dtype(dtype, mixed_precision):
    return DTYPES[T.fwd_mm_dtype_name(dtype, mixed_precision)]


def run_kernel(q, k, v, *, scale=None, causal=None, window=None, kv_lens=None, q_lens=None,
               mixed_precision=True, tiles=None):
    """Launch flash_attention_fwd (LNC=1) on the active backend."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    mm = T.fwd_mm_dtype_name(q.dtype.name, mixed_precision)
    if tiles is None:
        tiles = T.choose_forward_tiles(Nq, Nk, D, Hq // Hkv, q.dtype.itemsize,
                                       T.fwd_itemsize(mm), kv_lens=kv_lens is not None,
                                       q_lens=q_lens is not None, api=binding.select_api(),
                                       device=binding.active_target(),
                                       band=causal is not None or window is not None)
    kv32 = None if kv_lens is None else np.asarray(kv_lens, dtype=np.int32)
    q32 = None if q_lens is None else np.asarray(q_lens, dtype=np.int32)
    o, lse = launch_fwd(q, k, v, kv32, q32, scale=float(scale), causal=causal, window=window,
                        mm_dtype=mm, tiles=tiles)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == np.float32
    return o, lse


def check(q, k, v, o, lse, *, mixed_precision=True, **mask):
    """Tolerance rule for o and lse; no NaN; masked rows exactly (0, -inf). Returns errors."""
    mm = _mm_dtype(q.dtype.name, mixed_precision)
    ref_o, ref_lse = R.attention_forward(q, k, v, **mask)
    base_o, base_lse = R.attention_baseline_lowp(q, k, v, dtype=mm, out_dtype=q.dtype,
                                                 return_lse=True, **mask)
    floor = R.atol_floor(mm)
    o64 = np.asarray(o, dtype=np.float64)
    assert not np.isnan(o64).any() and not np.isnan(lse).any()
    err_o, tol_o = R.max_abs_err(o, ref_o), R.tolerance(ref_o, base_o, floor=floor)
    err_l, tol_l = R.max_abs_err(lse, ref_lse), R.tolerance(ref_lse, base_lse, floor=floor)
    assert err_o <= tol_o, f"o: max abs error {err_o:.3e} > tolerance {tol_o:.3e}"
    assert err_l <= tol_l, f"lse: max abs error {err_l:.3e} > tolerance {tol_l:.3e}"
    empty = np.isneginf(ref_lse)
    assert np.all(np.isneginf(lse[empty])), "rows without a visible key must have lse = -inf"
    assert np.all(o64[empty] == 0.0), "rows without a visible key must output 0"
    return err_o, err_l


def run_and_check(rng, B, Hq, Hkv, Nq, Nk, D, dtype="bfloat16", *, mixed_precision=True,
                  tiles=None, **mask):
    q, k, v = _inputs(rng, B, Hq, Hkv, Nq, Nk, D, dtype)
    o, lse = run_kernel(q, k, v, mixed_precision=mixed_precision, tiles=tiles, **mask)
    return check(q, k, v, o, lse, mixed_precision=mixed_precision, **mask)


# --------------------------------------------------------------------------------------------
# Shapes: awkward lengths, Nq != Nk, head dims, GQA/MQA, batch
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N", [1, 17, 127, 128, 129, 1000])
def test_lengths(N):
    run_and_check(np.random.default_rng(N), 1, 2, 1, N, N, 64)


@pytest.mark.parametrize("Nq,Nk", [(1, 700), (700, 1), (129, 2100), (2100, 129), (300, 4100)])
def test_unequal_lengths(Nq, Nk):
    run_and_check(np.random.default_rng(Nq + 3 * Nk), 1, 1, 1, Nq, Nk, 64)


@pytest.mark.parametrize("D", [1, 16, 64, 80, 128, 200, 256])
def test_head_dims(D):
    run_and_check(np.random.default_rng(D), 1, 1, 1, 150, 600, D)


@pytest.mark.parametrize("B,Hq,Hkv", [(2, 8, 2), (2, 4, 1), (3, 2, 2)])
def test_gqa_mqa_batch(B, Hq, Hkv):
    run_and_check(np.random.default_rng(B * Hq + Hkv), B, Hq, Hkv, 130, 300, 64, causal=True)


@pytest.mark.parametrize("dtype,mixed", [("float32", True), ("float32", False),
                                         ("float16", True), ("bfloat16", True)])
def test_dtypes(dtype, mixed):
    run_and_check(np.random.default_rng(5), 1, 2, 1, 200, 520, 80, dtype, mixed_precision=mixed,
                  causal="top_left")


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("Nq,Nk", [(300, 300), (200, 1100), (1100, 200)])
def test_causal(causal, Nq, Nk):
    run_and_check(np.random.default_rng(Nq * Nk), 1, 2, 1, Nq, Nk, 64, causal=causal)


@pytest.mark.parametrize("causal,window", [
    (None, (100, 30)), (None, (64, -1)), (None, (-1, 5)), (None, (0, 0)),
    ("bottom_right", (130, -1)), ("top_left", (700, 3)), ("bottom_right", (0, -1)),
])
def test_windows(causal, window):
    run_and_check(np.random.default_rng(7), 1, 1, 1, 400, 1300, 64, causal=causal, window=window)


LENGTH_CASES = [
    # kv_lens, q_lens, causal, window
    ([0, 600, 257], None, None, None),
    (None, [0, 300, 129], None, None),
    ([5, 600, 200], [0, 300, 123], "bottom_right", None),
    ([600, 1, 333], [300, 300, 17], "top_left", None),
    ([300, 600, 40], [299, 7, 300], None, (20, 10)),
    ([600, 450, 3], [100, 300, 1], "bottom_right", (50, -1)),
]


@pytest.mark.parametrize("kv_lens,q_lens,causal,window", LENGTH_CASES)
def test_lengths_masks(kv_lens, q_lens, causal, window):
    run_and_check(np.random.default_rng(11), 3, 2, 1, 300, 600, 64, causal=causal,
                  window=window, kv_lens=kv_lens, q_lens=q_lens)


def test_fully_masked_rows_give_zero_and_neg_inf():
    """bottom_right with Nq > Nk: the first Nq - Nk rows see no key; kv_len 0 hides all."""
    rng = np.random.default_rng(13)
    q, k, v = _inputs(rng, 2, 1, 1, 300, 100, 32, "bfloat16")
    o, lse = run_kernel(q, k, v, causal=True, kv_lens=[100, 0])
    check(q, k, v, o, lse, causal=True, kv_lens=[100, 0])
    assert np.all(np.isneginf(lse[0, 0, :200])) and np.all(np.isfinite(lse[0, 0, 200:]))
    assert np.all(np.isneginf(lse[1])) and np.all(np.asarray(o[1], np.float64) == 0.0)


@pytest.mark.parametrize("scale", [-0.3, 0.0, 1e-9, 3e7])
def test_unusual_scales(scale):
    """Scales outside the folded range go into Q^T; negative and zero scales are valid."""
    run_and_check(np.random.default_rng(17), 1, 1, 1, 140, 600, 32, scale=scale, causal=True)


def test_seed_worked_example():
    """Seed 003's numerical example: n=6, d=2, Bq=2 (query tiles of 2 rows), causal."""
    Q = np.array([[1.0, 0.5], [0.8, -0.1], [0.2, 0.9], [-0.3, 0.4], [0.7, 0.6], [0.1, -0.5]])
    K = np.array([[0.3, 0.7], [0.6, 0.2], [-0.1, 0.8], [0.4, -0.3], [0.9, 0.1], [0.2, 0.5]])
    V = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    q, k, v = (x.astype(np.float32)[None, None] for x in (Q, K, V))
    tiles = T.ForwardTiles(q_tile=2, span_tiles=1)
    o, lse = run_kernel(q, k, v, causal=True, mixed_precision=False, tiles=tiles)
    # the seed's hand computation for query tile 0 (rows 0 and 1)
    np.testing.assert_allclose(o[0, 0, 0], [1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(o[0, 0, 1], [0.8146 / 1.8146, 1.0 / 1.8146], atol=1e-4)
    np.testing.assert_allclose(lse[0, 0, 1], 0.325 + np.log(1.8146), atol=2e-3)
    check(q, k, v, o, lse, mixed_precision=False, causal=True)
    # Bq = 2 gives three query tiles, one span each; keys 2-5 are never swept for tile 0
    plan = F.plan_forward(6, 6, 1, MaskSpec(6, 6, "bottom_right"), tiles)
    assert [(sp.t0, sp.tiles, sp.rows) for sp in plan.spans] == [(0, 1, 2), (1, 1, 2), (2, 1, 2)]
    assert plan.spans[0].regions == (F.Region(0, 2, True),)


def test_bf16_large_scores_stay_finite():
    """Scores of magnitude ~1e4 (bf16 inputs): finite outputs within the tolerance rule."""
    rng = np.random.default_rng(19)
    q, k, v = _inputs(rng, 1, 1, 1, 200, 700, 64, "bfloat16", scale=3000.0)
    s = np.abs(q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)) / 8
    assert s.max() > 1e4
    o, lse = run_kernel(q, k, v, causal=True)
    assert np.all(np.isfinite(np.asarray(o, np.float64))) and np.all(np.isfinite(lse))
    check(q, k, v, o, lse, causal=True)


# --------------------------------------------------------------------------------------------
# Runtime lengths: padding never read (gathers), bottom_right rotated so the band stays static
# --------------------------------------------------------------------------------------------

def _poison_padding(q, k, v, q_lens, kv_lens):
    """NaN into every padding row of q and every padding key of k and v (in place)."""
    for b in range(q.shape[0]):
        if q_lens is not None:
            q[b, :, int(q_lens[b]):] = np.nan
        if kv_lens is not None:
            k[b, :, int(kv_lens[b]):] = np.nan
            v[b, :, int(kv_lens[b]):] = np.nan


def _clean(*arrays):
    return [np.nan_to_num(np.asarray(x, np.float32)).astype(x.dtype) for x in arrays]


def run_poisoned(rng, B, Hq, Hkv, Nq, Nk, D, dtype="bfloat16", *, mixed_precision=True,
                 tiles=None, **mask):
    """Inputs with NaN in all padding; the kernel must match the reference of the clean inputs
    (padding rows exactly o = 0, lse = -inf; nothing NaN)."""
    q, k, v = _inputs(rng, B, Hq, Hkv, Nq, Nk, D, dtype)
    _poison_padding(q, k, v, mask.get("q_lens"), mask.get("kv_lens"))
    o, lse = run_kernel(q, k, v, mixed_precision=mixed_precision, tiles=tiles, **mask)
    errs = check(*_clean(q, k, v), o, lse, mixed_precision=mixed_precision, **mask)
    if mask.get("q_lens") is not None:
        for b, n in enumerate(mask["q_lens"]):
            assert np.all(np.asarray(o[b, :, n:], np.float64) == 0.0)
            assert np.all(np.isneginf(lse[b, :, n:]))
    return o, lse, errs


ROTATED_CASES = [
    # B, Hq, Hkv, Nq, Nk, causal, window, q_lens, kv_lens
    (4, 2, 1, 300, 300, "bottom_right", None, [0, 1, 300, 157], [300, 0, 1, 300]),
    (3, 2, 1, 200, 700, "bottom_right", None, [200, 37, 129], [700, 650, 5]),      # Nq < Nk
    (3, 2, 1, 700, 200, "bottom_right", None, [700, 600, 129], [200, 150, 128]),   # Nq > Nk
    (3, 8, 2, 260, 390, "bottom_right", (50, -1), [260, 1, 100], [390, 77, 0]),    # GQA
    (2, 4, 4, 333, 333, None, (40, 8), [333, 120], [210, 333]),                    # both edges
    (2, 2, 1, 130, 1100, None, (-1, 0), [130, 3], [1100, 640]),                    # right only
    (2, 4, 1, 300, 450, "bottom_right", (0, -1), [300, 200], [450, 250]),          # diagonal
    (2, 2, 1, 300, 500, "bottom_right", None, [256, 300], None),                   # q_lens only
    (2, 2, 1, 300, 500, "bottom_right", None, None, [129, 0]),                     # kv_lens only
]


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,causal,window,q_lens,kv_lens", ROTATED_CASES)
def test_rotated_lengths(B, Hq, Hkv, Nq, Nk, causal, window, q_lens, kv_lens):
    """bottom_right (and windows without causal) with lengths: rows and keys rotated by their
    lengths; NaN in every padding position never reaches an output."""
    spec = MaskSpec(Nq, Nk, causal, window, q_lens is not None, kv_lens is not None)
    assert spec.rotates and (spec.rotate_q, spec.rotate_k) == (q_lens is not None,
                                                               kv_lens is not None)
    run_poisoned(np.random.default_rng(Nq + Nk), B, Hq, Hkv, Nq, Nk, 64, causal=causal,
                 window=window, q_lens=q_lens, kv_lens=kv_lens)


@pytest.mark.parametrize("causal,window", [("top_left", None), ("top_left", (64, 3)),
                                           (None, None)])
def test_unrotated_lengths(causal, window):
    """top_left and no band: rows and keys gathered in place (the band does not move with the
    lengths, and the valid positions already start at its origin), padding never read."""
    q_lens, kv_lens = [0, 300, 77, 1], [450, 1, 200, 0]
    assert not MaskSpec(300, 450, causal, window, True, True).rotates
    run_poisoned(np.random.default_rng(31), 4, 2, 1, 300, 450, 64, causal=causal,
                 window=window, q_lens=q_lens, kv_lens=kv_lens)


@pytest.mark.parametrize("dtype,mixed,D", [("float32", False, 80), ("float32", True, 200),
                                           ("float16", True, 16), ("bfloat16", True, 128)])
def test_rotated_lengths_dtypes(dtype, mixed, D):
    """Gathers in the input dtype (cast on chip), the edge-key fill through fp32/fp16/bf16
    matmuls; head dims with one and two contraction passes."""
    run_poisoned(np.random.default_rng(D), 2, 2, 1, 200, 330, D, dtype, mixed_precision=mixed,
                 causal=True, q_lens=[150, 200], kv_lens=[330, 91])


@pytest.mark.parametrize("tiles", [T.ForwardTiles(kv_resident=False, q_group=3),
                                   T.ForwardTiles(q_tile=64),
                                   T.ForwardTiles(kv_resident=False, q_group=2, q_tile=96)])
def test_rotated_lengths_other_tilings(tiles):
    """Streaming K/V chunks (rotated keys per chunk) and query tiles narrower than 128 (index
    tables with that stride)."""
    run_poisoned(np.random.default_rng(37), 2, 2, 1, 700, 4300, 64, tiles=tiles, causal=True,
                 window=(2500, -1), q_lens=[700, 333], kv_lens=[2900, 4300])


@pytest.mark.parametrize("scale", [-0.3, 0.0, 1e-9, 3e7])
def test_rotated_lengths_unusual_scales(scale):
    """Scales outside the folded range (Q^T pre-scaled) with lengths: the key mask does not
    go through the scores, so it holds for any scale."""
    run_poisoned(np.random.default_rng(59), 2, 2, 1, 140, 600, 32, scale=scale, causal=True,
                 q_lens=[140, 77], kv_lens=[300, 600])


def test_edge_key_keeps_the_row_max():
    """Padding keys hold a copy of the valid key next to them: a row that sees padding and valid
    keys must not take its max from anything else. Keys whose scores are far below 0 (scale
    3000): a padding key with a score of 0 would underflow every valid exp."""
    rng = np.random.default_rng(41)
    q, k, v = _inputs(rng, 2, 1, 1, 256, 384, 32, "bfloat16")
    k = -np.abs(k.astype(np.float32)).astype(k.dtype)
    q = np.abs(q.astype(np.float32)).astype(q.dtype)
    for causal, window in (("bottom_right", (3, -1)), ("top_left", (5, -1))):
        mask = dict(scale=3000.0, causal=causal, window=window, q_lens=[256, 100],
                    kv_lens=[200, 64])
        o, lse = run_kernel(q, k, v, **mask)
        check(q, k, v, o, lse, **mask)
        assert np.isfinite(lse).sum() > 200 and lse[np.isfinite(lse)].max() < -1e3


def test_plan_is_the_same_with_lengths():
    """The schedule (skipped tiles, boundary tiles, chunks) does not depend on lengths: with
    rotation the band is the static one of the padded shapes."""
    for causal, window in (("bottom_right", None), (None, (300, 40)), ("top_left", (100, -1)),
                           ("bottom_right", (700, 0))):
        for tiles in (T.ForwardTiles(), T.ForwardTiles(kv_resident=False, q_group=2)):
            plans = [F.plan_forward(900, 3000, 2, MaskSpec(900, 3000, causal, window, ql, kl),
                                    tiles)
                     for ql, kl in ((False, False), (True, True), (True, False), (False, True))]
            assert all(p == plans[0] for p in plans[1:])


@needs_measure
@pytest.mark.parametrize("causal,window,Hq,Hkv", [
    ("bottom_right", None, 2, 1), (None, (30, 10), 4, 2), ("top_left", (50, -1), 2, 2),
    (None, None, 2, 1),
])
def test_one_program_for_every_set_of_lengths(causal, window, Hq, Hkv):
    """One launch plan (kernel, grid, compile-time arguments) and one instruction stream for
    every set of lengths (0, 1 and full included): the lengths are data. Each call follows
    the tolerance rule with NaN in all padding."""
    import simulate

    from host import api

    B, Nq, Nk, D = 3, 200, 330, 32
    sets = [([200, 0, 77], [330, 150, 0]), ([0, 200, 128], [17, 330, 330]),
            ([200, 200, 200], [330, 330, 330]), ([1, 129, 199], [1, 129, 329])]
    plans, programs = [], []
    for n, (q_lens, kv_lens) in enumerate(sets):
        mask = dict(causal=causal, window=window, q_lens=q_lens, kv_lens=kv_lens)
        q, k, v = _inputs(np.random.default_rng(50 + n), B, Hq, Hkv, Nq, Nk, D, "bfloat16")
        kernel, grid, kw = api.plan_attention_forward(q, k, v, **mask)
        plans.append((kernel, grid, kw))
        _poison_padding(q, k, v, q_lens, kv_lens)
        with simulate.measure(target="trn2") as m:
            o, lse = run_kernel(q, k, v, **mask)
        programs.append((m.instructions, m.engine_cycles, m.dma_transfers))
        check(*_clean(q, k, v), o, lse, **mask)
    assert all(p == plans[0] for p in plans[1:])
    assert all(p == programs[0] for p in programs[1:])


@needs_measure
def test_rotation_keeps_causal_tile_skipping():
    """causal=True with lengths costs what causal without lengths costs (the same tiles are
    skipped): TensorE differs by the lengths' two setup matmuls, the modeled time by the
    lengths' fixed per-program setup (< 1 us) and the finalize's select of each query tile's
    rows past q_len (VectorE, ``forward.finalize``; 5.1 us for the 16 tiles here), and both
    are well under the non-causal work (before the rotation: all of it, and more)."""
    N, D = 2048, 128
    q, k, v = _inputs(np.random.default_rng(43), 1, 1, 1, N, N, D, "bfloat16")
    plain = _measured(q, k, v, causal=True)
    lens = _measured(q, k, v, causal=True, q_lens=[N // 2], kv_lens=[N // 2])
    full = _measured(q, k, v, q_lens=[N // 2], kv_lens=[N // 2])
    extra = lens.engine_cycles["tensor"] - plain.engine_cycles["tensor"]
    assert 0 < extra <= 4 * 128
    assert lens.engine_cycles["tensor"] < 0.65 * full.engine_cycles["tensor"]
    tiles = N // 128
    assert (plain.modeled_seconds[0] <= lens.modeled_seconds[0]
            <= plain.modeled_seconds[0] + 1e-6 + tiles * 0.35e-6)


# --------------------------------------------------------------------------------------------
# Streaming regime (K/V not resident) and the schedule
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_group,mask", [
    (1, {}), (3, {}), (2, {"causal": True}), (5, {"window": (300, 40), "kv_lens": [4000, 1500]}),
])
def test_streaming_matches_reference(q_group, mask):
    tiles = T.ForwardTiles(kv_resident=False, q_group=q_group)
    run_and_check(np.random.default_rng(q_group), 2, 2, 1, 600, 4100, 64, tiles=tiles, **mask)


@needs_measure
def test_dma_transposed_p_trn2():
    """Opt-in trn2 path: half of the P^T chunk groups transposed by the DMA engines."""
    rng = np.random.default_rng(23)
    q, k, v = _inputs(rng, 1, 2, 1, 300, 1100, 64, "bfloat16")
    tiles = T.ForwardTiles(p_dma_transpose_share=0.5)
    base = _measured(q, k, v, causal=True)
    m = _measured(q, k, v, causal=True, tiles=tiles)
    assert m.instructions["dma"] > base.instructions["dma"]
    assert m.engine_cycles["tensor"] < base.engine_cycles["tensor"]
    assert m.hbm_bytes_read == base.hbm_bytes_read
    o, lse = run_kernel(q, k, v, causal=True, tiles=tiles)
    check(q, k, v, o, lse, causal=True)


def test_plan_skips_causal_tiles():
    """Causal: the query tiles form at most FWD_Q_SPANS (16) spans of at least ``span_tiles`` (4)
    tiles when that leaves FWD_MIN_Q_SPANS (4), else of one tile (plus the partial tile); each
    span sweeps keys up to its last row's diagonal, unmasked up to its first row's
    (128-aligned), so the swept area is about (1 + 1/spans) / 2 of the square."""
    tiles = T.ForwardTiles()
    for N, spans in ((1000, 7), (2048, 4), (4096, 8), (16384, 16)):
        plan = F.plan_forward(N, N, 1, MaskSpec(N, N, "top_left"), tiles)
        assert len(plan.spans) == spans + (N % 128 > 0)
        swept = 0
        for sp in plan.spans:
            r0, r1 = sp.t0 * 128, sp.t0 * 128 + sp.tiles * sp.rows
            assert sp.regions[-1].k1 == r1 and sp.regions[-1].masked
            assert all(not rg.masked for rg in sp.regions[:-1])
            assert sp.regions[0].k0 == 0 and (len(sp.regions) == 1 or sp.regions[0].k1 <= r0)
            swept += (r1 - r0) * sum(rg.k1 - rg.k0 for rg in sp.regions)
        assert swept < (0.5 + 0.5 / spans + 0.07) * N * N


def test_choose_tiles_streams_when_kv_does_not_fit():
    assert T.choose_forward_tiles(4096, 4096, 128, 1, 2, 2).kv_resident
    big = T.choose_forward_tiles(4096, 65536, 128, 8, 2, 2)
    assert not big.kv_resident and big.q_group >= 64
    small = T.choose_forward_tiles(4096, 4096, 128, 1, 2, 2, sbuf_bytes=60_000)
    assert not small.kv_resident and small.q_group >= 1


# --------------------------------------------------------------------------------------------
# IO (simulate.measure)
# --------------------------------------------------------------------------------------------

def _measured(q, k, v, **kw):
    import simulate

    with simulate.measure(target="trn2") as m:
        run_kernel(q, k, v, **kw)
    return m


@needs_measure
@pytest.mark.parametrize("N", [1000, 4096, pytest.param(8192, marks=pytest.mark.slow)])
def test_hbm_bytes_at_lower_bound(N):
    """One head, D = 128, bf16: K/V stay resident; HBM traffic is the IO lower bound."""
    q, k, v = _inputs(np.random.default_rng(N), 1, 1, 1, N, N, 128, "bfloat16")
    m = _measured(q, k, v)
    bound = R.io_lower_bound_bytes(1, 1, 1, N, N, 128, 2)
    total = m.hbm_bytes_read + m.hbm_bytes_written
    assert total <= 1.05 * bound
    assert total == bound
    tiles = T.choose_forward_tiles(N, N, 128, 1, 2, 2, kv_lens=False, masks=False)
    assert m.peak_sbuf_bytes_per_partition <= T.SBUF_USABLE_BYTES["trn1"]
    assert m.peak_sbuf_bytes_per_partition <= (T.fwd_kv_bytes(N, 128, 2)
                                               + T.fwd_working_bytes(128, 2, 2, tiles, False)
                                               + tiles.q_group * T.fwd_q_state_bytes(128, 2, 2)
                                               + T.fwd_stage_bytes(tiles.stage, tiles, 2))


@needs_measure
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,q_group", [
    (1, 1, 1, 1024, 1024, 2), (1, 1, 1, 1000, 3000, 3), (2, 4, 2, 300, 2500, 2),
])
def test_streaming_hbm_bytes_match_formula(B, Hq, Hkv, Nq, Nk, q_group):
    """Streaming regime (forced): K/V is read once per group of q_group query tiles, exactly
    ``tiles.forward_hbm_bytes`` (the Theta(N^2 d^2 / M) regime)."""
    D = 128
    q, k, v = _inputs(np.random.default_rng(Nq), B, Hq, Hkv, Nq, Nk, D, "bfloat16")
    tiles = T.ForwardTiles(kv_resident=False, q_group=q_group)
    m = _measured(q, k, v, tiles=tiles)
    read, written = T.forward_hbm_bytes(B, Hq, Hkv, Nq, Nk, D, 2, tiles)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)
    assert (read, written) == F.plan_hbm_bytes(B, Hq, Hkv, Nq, Nk, D, 2, tiles)
    passes = T.forward_kv_passes(Nq, Hq // Hkv, tiles)
    # a group: the same q_group // G tiles of every head; the partial tile alone
    per_head = max(1, q_group // (Hq // Hkv))
    assert passes == -(-(Nq // 128) // per_head) + (Nq % 128 > 0) and passes > 1
    assert m.per_tensor["k"]["read"] == B * Hkv * passes * Nk * D * 2


@needs_measure
def test_streaming_budget_forces_streaming():
    """A small SBUF budget makes choose_forward_tiles stream K/V; the query tiles that fit the
    rest of the budget share each pass, and the bytes follow the formula."""
    Nq, Nk, D, budget = 2048, 8192, 64, 40_000
    tiles = T.choose_forward_tiles(Nq, Nk, D, 1, 2, 2, sbuf_bytes=budget, masks=False)
    assert not tiles.kv_resident and 1 < tiles.q_group < Nq // 128
    q, k, v = _inputs(np.random.default_rng(2), 1, 1, 1, Nq, Nk, D, "bfloat16")
    m = _measured(q, k, v, tiles=tiles)
    read, written = T.forward_hbm_bytes(1, 1, 1, Nq, Nk, D, 2, tiles)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)
    assert T.forward_kv_passes(Nq, 1, tiles) > 1
    assert m.peak_sbuf_bytes_per_partition <= budget


@needs_measure
@pytest.mark.parametrize("mask", [{"causal": "top_left"}, {"causal": True, "window": (200, -1)},
                                  {"kv_lens": [700], "q_lens": [90]}])
def test_masked_hbm_bytes_match_plan(mask):
    """With masks the kernel moves exactly what its schedule says (skipped tiles/chunks)."""
    q, k, v = _inputs(np.random.default_rng(3), 1, 2, 1, 900, 3000, 64, "bfloat16")
    tiles = T.ForwardTiles(kv_resident=False, q_group=2)
    m = _measured(q, k, v, tiles=tiles, **mask)
    lens = {"q_lens": mask.get("q_lens"), "kv_lens": mask.get("kv_lens")}
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == F.plan_hbm_bytes(
        1, 2, 1, 900, 3000, 64, 2, tiles, causal=mask.get("causal"), window=mask.get("window"),
        **lens)


@needs_measure
@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"causal": True, "window": (200, -1)},
                                  {"causal": "top_left"}, {"window": (100, 20)}])
@pytest.mark.parametrize("tiles", [T.ForwardTiles(), T.ForwardTiles(kv_resident=False,
                                                                     q_group=2)])
def test_hbm_bytes_with_lengths_count_valid_positions_only(mask, tiles):
    """The gathers skip padding: reads count the valid rows of the query tiles that run and the
    valid keys of the chunks they load (plus the edge key per program with kv_len > 0), i.e.
    traffic proportional to the valid lengths; writes cover every row. Exactly
    ``forward.plan_hbm_bytes`` (and ``tiles.forward_hbm_bytes`` without a band)."""
    B, Hq, Hkv, Nq, Nk, D = 3, 4, 2, 300, 2500, 64
    q_lens, kv_lens = [300, 0, 131], [2500, 1, 1000]
    q, k, v = _inputs(np.random.default_rng(47), B, Hq, Hkv, Nq, Nk, D, "bfloat16")
    _poison_padding(q, k, v, q_lens, kv_lens)
    m = _measured(q, k, v, tiles=tiles, q_lens=q_lens, kv_lens=kv_lens, **mask)
    causal = {True: "bottom_right"}.get(mask.get("causal"), mask.get("causal"))
    plan = F.plan_hbm_bytes(B, Hq, Hkv, Nq, Nk, D, 2, tiles, causal=causal,
                            window=mask.get("window"), q_lens=q_lens, kv_lens=kv_lens)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == plan
    if not mask:
        passes = T.forward_kv_passes(Nq, Hq // Hkv, tiles)
        assert plan == T.forward_hbm_bytes(B, Hq, Hkv, Nq, Nk, D, 2, tiles, q_lens=q_lens,
                                           kv_lens=kv_lens)
        assert m.per_tensor["q"]["read"] == Hq * sum(q_lens) * D * 2
        edge = Hkv * sum(n > 0 for n in kv_lens) * D * 2
        assert m.per_tensor["k"]["read"] == passes * Hkv * sum(kv_lens) * D * 2 + edge
        assert m.per_tensor["v"]["read"] == passes * Hkv * sum(kv_lens) * D * 2
    # all positions valid: the same as without lengths but for the two length arrays and the
    # edge keys
    full = F.plan_hbm_bytes(B, Hq, Hkv, Nq, Nk, D, 2, tiles, causal=causal,
                            window=mask.get("window"), q_lens=True, kv_lens=True)
    none = F.plan_hbm_bytes(B, Hq, Hkv, Nq, Nk, D, 2, tiles, causal=causal,
                            window=mask.get("window"))
    assert full[0] == none[0] + B * Hkv * (8 + D * 2) and full[1] == none[1]


@needs_measure
def test_hbm_bytes_halve_with_half_lengths():
    """N = 4096 causal (rotated), lengths N/2: Q, K, V reads are exactly half of the full
    lengths' (the benchmark's case)."""
    N, D = 4096, 128
    q, k, v = _inputs(np.random.default_rng(53), 1, 1, 1, N, N, D, "bfloat16")
    full = _measured(q, k, v, causal=True, q_lens=[N], kv_lens=[N])
    half = _measured(q, k, v, causal=True, q_lens=[N // 2], kv_lens=[N // 2])
    for name in ("q", "v"):
        assert 2 * half.per_tensor[name]["read"] == full.per_tensor[name]["read"] == N * D * 2
    assert half.per_tensor["k"]["read"] == (N // 2 + 1) * D * 2
    assert half.hbm_bytes_written == full.hbm_bytes_written == N * (D * 2 + 4)
    tiles = T.ForwardTiles()
    for m, n in ((full, N), (half, N // 2)):
        assert (m.hbm_bytes_read, m.hbm_bytes_written) == F.plan_hbm_bytes(
            1, 1, 1, N, N, D, 2, tiles, causal="bottom_right", q_lens=[n], kv_lens=[n])


@needs_measure
def test_modeled_time_goal_trn2():
    """N = 4096, D = 128, bf16, non-causal on trn2: modeled TensorE utilization >= 50 % (the
    perfect-overlap time at most 218 us); TensorE itself is not the bottleneck by much."""
    N, D = 4096, 128
    q, k, v = _inputs(np.random.default_rng(0), 1, 1, 1, N, N, D, "bfloat16")
    m = _measured(q, k, v)
    lower, upper = m.modeled_seconds
    util = 4 * N * N * D / (lower * 78.6e12)
    assert lower <= 218e-6 and util >= 0.5
    assert m.engine_seconds["tensor"] >= 0.85 * lower


# --------------------------------------------------------------------------------------------
# Program size: the kernel is a fixed nest of NKI loops
# --------------------------------------------------------------------------------------------

@needs_measure
@pytest.mark.parametrize("Nq,Nk_small,Nk_big,mask", [
    (None, 2048 + 100, 8192 + 100, {}),
    (None, 2048 + 100, 8192 + 100, {"kv_lens": True, "q_lens": True}),
    (1024, 4096 + 1024, 16384 + 1024, {"causal": "bottom_right"}),
    (1024, 4096 + 1000, 16384 + 1000, {"window": (700, 0)}),
])
def test_program_size_does_not_grow_with_n(Nq, Nk_small, Nk_big, mask):
    """``program_instructions`` (loop bodies once) is the same at two sequence lengths whose
    tails (N mod the tile sizes) match -- every loop over query tiles, key blocks and K/V pieces
    is an NKI loop -- and far below the 20,000 budget, while the executed instructions grow
    (except for a window, whose work does not depend on Nk)."""
    sizes = []
    for Nk in (Nk_small, Nk_big):
        nq = Nk if Nq is None else Nq
        q, k, v = _inputs(np.random.default_rng(Nk), 1, 2, 1, nq, Nk, 64, "bfloat16")
        kw = dict(mask)
        for name, n in (("kv_lens", Nk), ("q_lens", nq)):
            if kw.get(name) is True:
                kw[name] = [n - 7]
        m = _measured(q, k, v, **kw)
        sizes.append((m.program_instructions, sum(m.instructions.values())))
    (p_small, run_small), (p_big, run_big) = sizes
    assert p_small == p_big < 20_000
    assert run_big > (1 if "window" in mask else 2) * run_small


@needs_measure
@pytest.mark.parametrize("Nq,Nk,D,G,lens", [
    (128, 33280, 128, 1, False), (128, 15232, 256, 1, False), (128, 45952, 64, 1, False),
    (128, 33000, 128, 1, True), (1024, 33408, 128, 8, False),
])
def test_peak_sbuf_within_90_percent(Nq, Nk, D, G, lens):
    """At the largest resident K/V (and just past it, streaming with the largest query group the
    budget allows) the measured peak SBUF stays within 90 % of trn1's capacity, the compiler's
    headroom (``tiles.FWD_SBUF_BUDGET_BYTES``)."""
    q, k, v = _inputs(np.random.default_rng(Nk), 1, G, 1, Nq, Nk, D, "bfloat16")
    kw = dict(kv_lens=[Nk - 5], q_lens=[Nq - 3]) if lens else {}
    tiles = T.choose_forward_tiles(Nq, Nk, D, G, 2, 2, kv_lens=lens, q_lens=lens)
    import simulate

    with simulate.measure(target="trn1") as m:
        run_kernel(q, k, v, tiles=tiles, **kw)
    assert m.peak_sbuf_bytes_per_partition <= T.FWD_SBUF_BUDGET_BYTES["trn1"]
    assert m.peak_sbuf_bytes_per_partition <= 0.9 * 192 * 1024


# --------------------------------------------------------------------------------------------
# LNC=2: the query tiles of one (batch, kv head) split over the two cores of a trn2 logical core
# --------------------------------------------------------------------------------------------

@needs_measure
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,mask,tiles", [
    (1, 1, 1, 1000, 700, 64, {"causal": "bottom_right"}, None),
    (1, 2, 1, 2048, 2048, 64, {"causal": "top_left"}, None),
    (1, 4, 1, 700, 1300, 256, {"window": (300, 40), "kv_lens": [1100], "q_lens": [650]}, None),
    (2, 2, 1, 900, 2200, 32, {"causal": "bottom_right", "kv_lens": [2000, 5]},
     T.ForwardTiles(kv_resident=False, q_group=3)),
    (1, 1, 1, 4096, 4096, 128, {}, None),
])
def test_lnc2_query_split_matches_one_core(B, Hq, Hkv, Nq, Nk, D, mask, tiles):
    """``lnc=2`` on the grid ``(B, Hkv, nl.nc(2))``: correct outputs (spans of at least two
    tiles, so a causal band's blocks may fall differently than with one core) computed on both
    cores in parallel: the modeled time drops, and the program does not grow much."""
    import simulate

    from nki_kernels.nki import nl

    q, k, v = _inputs(np.random.default_rng(Nq + D), B, Hq, Hkv, Nq, Nk, D, "bfloat16")
    mm = "bfloat16"
    if tiles is None:
        tiles = T.choose_forward_tiles(Nq, Nk, D, Hq // Hkv, 2, 2, kv_lens="kv_lens" in mask,
                                       q_lens="q_lens" in mask)
    lens = [None if mask.get(n) is None else np.asarray(mask[n], np.int32)
            for n in ("kv_lens", "q_lens")]
    kw = dict(scale=1 / np.sqrt(D), causal=mask.get("causal"), window=mask.get("window"),
              mm_dtype=mm, tiles=tiles)
    runs = []
    for grid, lnc in (((B, Hkv), 1), ((B, Hkv, nl.nc(2)), 2)):
        with simulate.measure(target="trn2") as m:
            out = launch(F.flash_attention_fwd, grid, q, k, v, *lens, lnc=lnc, **kw)
        runs.append((out, m))
    (o1, l1), m1 = runs[0]
    (o2, l2), m2 = runs[1]
    check(q, k, v, o1, l1, **mask)
    check(q, k, v, o2, l2, **mask)
    assert m2.kernels[0].cores == 2
    assert m2.modeled_seconds[0] < 0.8 * m1.modeled_seconds[0]
    assert m2.program_instructions <= 1.1 * m1.program_instructions + 50


@pytest.mark.parametrize("Nq,Nk,causal,window,lens", [
    (4000, 4000, None, (2500, 300), False),           # wider than a block: full-block loop
    (3000, 3100, "bottom_right", (700, 0), True),     # static tail indicators, rotated lengths
    (2000, 2000, "top_left", (300, -1), False),       # one-sided: no sliding span
])
def test_sliding_window_spans(Nq, Nk, causal, window, lens):
    """A band bounded on both sides sweeps, for every interior query tile, a key range that
    moves with the tile (one sliding span: its regions relative to the tile); edge tiles keep
    fixed spans. Results follow the tolerance rule."""
    spec = MaskSpec(Nq, Nk, causal, window, lens, lens)
    plan = F.plan_forward(Nq, Nk, 1, spec, T.ForwardTiles())
    sliding = [sp for sp in plan.spans if sp.slide is not None]
    two_sided = window[0] >= 0 and (window[1] >= 0 or causal is not None)
    assert len(sliding) == (1 if two_sided else 0)
    if sliding:
        sp = sliding[0]
        assert sp.tiles >= 2 and sp.slide % 128 == 0 and sp.regions[0].k0 == 0
        covered = sorted((sp.t0, sp.t0 + sp.tiles) if s is sp else (s.t0, s.t0 + s.tiles)
                         for s in plan.spans)
        assert [a for a, _ in covered][1:] == [b for _, b in covered][:-1]   # tiles partitioned
    kw = dict(causal=causal, window=window)
    if lens:
        kw.update(kv_lens=[Nk - 40], q_lens=[Nq - 3])
    run_and_check(np.random.default_rng(Nq), 1, 1, 1, Nq, Nk, 32, **kw)


# --------------------------------------------------------------------------------------------
# Schedule-shaping structure: staged key blocks and deferred output stores
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("Hq,Hkv,Nq,Nk,mask", [
    (1, 1, 1100, 1300, {"causal": "bottom_right"}),             # spans, a partial tile
    (4, 2, 600, 700, {"window": (200, 30), "kv_lens": [650], "q_lens": [590]}),
    (2, 1, 1024, 2300, {}),                                      # GQA: heads staged together
])
def test_staging_and_deferred_stores_change_nothing(Hq, Hkv, Nq, Nk, mask):
    """Staging (ForwardTiles.stage: the first halves of several tiles' key blocks before their
    second halves) only reorders the same instructions, each group's outputs are stored by the
    next group, and preloaded query rows are the same rows: the results are bit-identical to
    the unstaged kernel, with one group per loop and with several (the loop's peeled first
    group stores the previous loop's last), query rows preloaded or not."""
    q, k, v = _inputs(np.random.default_rng(Nq + Nk), 1, Hq, Hkv, Nq, Nk, 64, "bfloat16")
    base = T.choose_forward_tiles(Nq, Nk, 64, Hq // Hkv, 2, 2, kv_lens="kv_lens" in mask,
                                  q_lens="q_lens" in mask)
    assert base.stage > 1 and base.q_preload
    runs = [run_kernel(q, k, v, tiles=dataclasses.replace(base, stage=s, q_group=g,
                                                          q_preload=pre), **mask)
            for s, g, pre in ((1, base.q_group, False), (base.stage, base.q_group, True),
                              (2, 2, True), (1, 1, False))]
    for o, lse in runs[1:]:
        np.testing.assert_array_equal(o.view(np.uint16), runs[0][0].view(np.uint16))
        np.testing.assert_array_equal(lse, runs[0][1])
    check(q, k, v, *runs[0], **mask)


@pytest.mark.parametrize("api", ["legacy", "nki"])
def test_causal_tiles_sweep_only_their_own_key_units(api, monkeypatch):
    """A causal span's masked keys are swept per query tile (forward.sweep_slots), joined with
    the unmasked region's partial last block (forward._joins): each tile of the top-left
    square band sweeps exactly the 128-key units its rows see, t + 1 for tile t -- 136 for 16
    tiles, where 4-tile spans swept 160 -- in one softmax block (N = 2048: no full 2048-key
    block before it). The keys are loaded span by span, still once each."""
    import simulate

    monkeypatch.setenv(binding.API_ENV_VAR, api)
    swept = []
    attend = F.attend_block

    def spy(*args, **kw):
        if kw.get("part", "all") != "back":
            swept.append(args[7])
        return attend(*args, **kw)

    monkeypatch.setattr(F, "attend_block", spy)
    N, D = 2048, 32
    q, k, v = _inputs(np.random.default_rng(11), 1, 1, 1, N, N, D, "bfloat16")
    plan = F.plan_forward(N, N, 1, MaskSpec(N, N, "top_left", None), T.ForwardTiles())
    assert [sp.tiles for sp in plan.spans] == [4, 4, 4, 4]
    with simulate.measure(target="trn2") as m:
        o, lse = run_kernel(q, k, v, causal="top_left")
    check(q, k, v, o, lse, causal="top_left")
    # every span's blocks are per-tile (unrolled) blocks here: one per tile, in either namespace
    assert sorted(swept) == sorted(128 * (t + 1) for t in range(16))
    assert m.hbm_bytes_read == 3 * N * D * 2


# --------------------------------------------------------------------------------------------
# nki.* (NKI 0.7): the same source traced through the other namespace
# --------------------------------------------------------------------------------------------

#: A representative subset (the shapes and options whose code paths differ under nki.*: the
#: program loop over (batch, kv head), partial tiles, head-dim passes, GQA, dtypes, masked
#: regions with loop-index offsets (runtime distance columns), sliding spans (compile-time
#: offsets), streamed K/V, unusual scales, score modifiers); each is also run through legacy.
NKI_CASES = [
    (1, 1, 1, 1, 1, 16, {}),
    (2, 4, 2, 129, 300, 64, {"causal": True}),
    (1, 2, 1, 200, 1100, 256, {"causal": "top_left"}),
    (1, 1, 1, 1100, 200, 80, {"causal": "bottom_right", "dtype": "float32", "mixed": False}),
    (1, 1, 1, 400, 1300, 64, {"window": (100, 30)}),
    (1, 1, 1, 3000, 3100, 64, {"causal": "bottom_right", "window": (700, 0)}),
    (2, 2, 1, 600, 4100, 64, {"causal": True, "tiles": T.ForwardTiles(kv_resident=False,
                                                                       q_group=2)}),
    (1, 2, 1, 300, 500, 64, {"causal": True, "scale": -0.3, "dtype": "float16"}),
    (1, 1, 1, 300, 500, 64, {"window": (64, 64), "scale": 3e7}),
    # runtime lengths: gathers and scatters through port.rows, rotated sequences, GQA
    (2, 4, 2, 129, 300, 64, {"causal": "bottom_right", "kv_lens": [300, 77],
                             "q_lens": [129, 5]}),
    (2, 2, 1, 300, 500, 64, {"causal": "bottom_right", "q_lens": [256, 300]}),
    (2, 2, 1, 300, 500, 64, {"causal": "bottom_right", "kv_lens": [129, 0]}),
    (2, 2, 1, 200, 700, 80, {"causal": "top_left", "kv_lens": [700, 300], "q_lens": [150, 0]}),
    (1, 2, 1, 300, 500, 64, {"kv_lens": [431], "q_lens": [77]}),
    (2, 2, 1, 600, 4100, 64, {"causal": "bottom_right", "kv_lens": [4000, 1500],
                              "q_lens": [600, 333],
                              "tiles": T.ForwardTiles(kv_resident=False, q_group=2)}),
]


def _nki_case(api, B, Hq, Hkv, Nq, Nk, D, opts, monkeypatch):
    import simulate

    opts = dict(opts)
    dtype, mixed = opts.pop("dtype", "bfloat16"), opts.pop("mixed", True)
    scale, tiles = opts.pop("scale", None), opts.pop("tiles", None)
    q, k, v = _inputs(np.random.default_rng(Nq * D + Nk), B, Hq, Hkv, Nq, Nk, D, dtype)
    monkeypatch.setenv(binding.API_ENV_VAR, api)
    with simulate.measure(target="trn2") as m:
        o, lse = run_kernel(q, k, v, scale=scale, mixed_precision=mixed, tiles=tiles, **opts)
    assert m.api == api
    if scale is not None:
        opts["scale"] = scale
    return (q, k, v), (o, lse), m, opts, mixed


@needs_measure
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,opts", NKI_CASES)
def test_nki_namespace_matches_legacy(B, Hq, Hkv, Nq, Nk, D, opts, monkeypatch):
    """Through nki.* the kernel follows the tolerance rule and gives the legacy trace's outputs
    bit for bit: band blocks that legacy predicates off run under nki.* (no predicates) with
    every score at MASK_NEG, which leaves the online softmax exactly as it was."""
    qkv, (o, lse), m, mask, mixed = _nki_case("nki", B, Hq, Hkv, Nq, Nk, D, opts, monkeypatch)
    check(*qkv, o, lse, mixed_precision=mixed, **mask)
    _, (o0, lse0), m0, _, _ = _nki_case("legacy", B, Hq, Hkv, Nq, Nk, D, opts, monkeypatch)
    assert np.array_equal(np.asarray(o, np.float32), np.asarray(o0, np.float32))
    assert np.array_equal(lse, lse0)
    assert m.hbm_bytes_read == m0.hbm_bytes_read and m.hbm_bytes_written == m0.hbm_bytes_written


@needs_measure
@pytest.mark.parametrize("mods", [dict(softcap=20.0), dict(alibi="slopes", causal=True),
                                  dict(alibi="slopes", window=(64, 64)),
                                  dict(sinks="sinks", causal="bottom_right"),
                                  dict(alibi="slopes", kv_lens=[500], q_lens=[250]),
                                  dict(alibi="slopes", softcap=5.0, causal="top_left",
                                       kv_lens=[450])])
def test_nki_namespace_score_modifiers(mods, monkeypatch):
    """Soft-capping, ALiBi (its distance tile from the runtime distance columns) and sinks
    through nki.*: the legacy trace's outputs bit for bit; with ALiBi and runtime lengths also
    the key-length mask row (its loop-index start read from the distance table), added to the
    scores in PSUM, or after the tanh with soft-capping."""
    import host

    rng = np.random.default_rng(9)
    q, k, v = _inputs(rng, 1, 2, 1, 300, 700, 64, "float32")
    kw = dict(mods)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = np.array([0.5, 0.125], np.float32)
    if kw.pop("sinks", None):
        kw["sinks"] = np.array([1.5, -2.0], np.float32)
    outs = {}
    for api in ("legacy", "nki"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        outs[api] = host.flash_attention(q, k, v, return_lse=True, lnc=1, **kw)
    assert np.array_equal(outs["legacy"][0], outs["nki"][0])
    assert np.array_equal(outs["legacy"][1], outs["nki"][1])


@needs_measure
@pytest.mark.parametrize("B,Hkv,lnc", [(2, 1, 2), (1, 1, 2), (3, 1, 1)])
def test_nki_namespace_programs_and_cores(B, Hkv, lnc, monkeypatch):
    """0.7 launches ``kernel[lnc]``: the kernel loops over the (batch, kv head) instances, the
    two cores of LNC=2 taking half of them each (an even count) or splitting every instance's
    query tiles (an odd count), as the legacy grid's cores do."""
    import host
    import simulate

    q, k, v = _inputs(np.random.default_rng(B + lnc), B, 2 * Hkv, Hkv, 600, 700, 64,
                      "bfloat16")
    monkeypatch.setenv(binding.API_ENV_VAR, "nki")
    assert F.forward_grid(B, Hkv, lnc, api="nki") == ((lnc,), 2 if lnc == 2 and B * Hkv % 2
                                                      else 1)
    with simulate.measure(target="trn2") as m:
        o, lse = host.flash_attention(q, k, v, causal=True, return_lse=True, lnc=lnc)
    assert m.api == "nki" and m.kernels[0].cores == lnc
    check(q, k, v, o, lse, causal=True)


@needs_measure
@pytest.mark.parametrize("opts", [
    dict(causal="bottom_right", kv_lens=[256, 77], q_lens=[200, 5], dropout_p=0.2,
         seed=2 ** 31 - 9),
    dict(causal="top_left", kv_lens=[150, 256], alibi_slopes=np.array([0.5, 0.25], np.float32)),
], ids=["rotated-dropout", "alibi"])
def test_nki_namespace_exact_integer_indices(opts, monkeypatch):
    """Flat row numbers of the length gathers that may reach 2^24, and dropout unit numbers
    always, are summed in int32 under nki.* (``port.OffsetColumns(exact=True)``; fp32 would
    round them): with that bound lowered to 4 here, both launches take that path and still
    give the legacy trace's outputs (and dropout mask) bit for bit, GQA and two sequences.
    ``auto`` on trn2 traces such calls through nki.* (nothing of the forward is left to
    legacy)."""
    import host
    import simulate

    monkeypatch.setattr(T, "FP32_EXACT_INT", 4)
    q, k, v = _inputs(np.random.default_rng(3), 2, 2, 1, 200, 256, 32, "float32")
    extra = dict(return_dropout_mask=True) if "dropout_p" in opts else {}
    runs = {}
    for api in ("legacy", "nki", "auto"):
        monkeypatch.setenv(binding.API_ENV_VAR, api)
        with simulate.measure(target="trn2") as m:
            runs[api] = host.flash_attention(q, k, v, return_lse=True, lnc=1, **opts, **extra)
        assert m.api == ("legacy" if api == "legacy" else "nki")
    for a, b in zip(runs["legacy"], runs["nki"]):
        np.testing.assert_array_equal(a, b)
