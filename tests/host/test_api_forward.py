"""host.flash_attention: outputs, tile choice, launch plan, and every validation error.

Numerics use the tolerance rule of docs/semantics.md (see tests/kernels/test_forward.py for the
kernel-level cases); here the API's own behaviour is tested: dtypes, shapes, return_lse,
mixed_precision, the (kernel, grid, options) plan shared with torch_ops, tile overrides, and the
error messages (argument name, what was given, what is allowed).
"""
import ml_dtypes
import numpy as np
import pytest

import host
from host import api
from host import reference as R
from nki_kernels import tiles as T
from nki_kernels.attention.forward import flash_attention_fwd
from nki_kernels.nki import API_ENV_VAR

BF16 = np.dtype(ml_dtypes.bfloat16)


def _qkv(B=1, Hq=2, Hkv=1, Nq=40, Nk=70, D=16, dtype=BF16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Nq, D)).astype(dtype),
            rng.standard_normal((B, Hkv, Nk, D)).astype(dtype),
            rng.standard_normal((B, Hkv, Nk, D)).astype(dtype))


def _within_rule(q, k, v, o, lse, mm, **mask):
    ref_o, ref_lse = R.attention_forward(q, k, v, **mask)
    base_o, base_lse = R.attention_baseline_lowp(q, k, v, dtype=mm, out_dtype=q.dtype,
                                                 return_lse=True, **mask)
    floor = R.atol_floor(mm)
    assert R.max_abs_err(o, ref_o) <= R.tolerance(ref_o, base_o, floor=floor)
    assert R.max_abs_err(lse, ref_lse) <= R.tolerance(ref_lse, base_lse, floor=floor)


def test_exported():
    assert host.flash_attention is api.flash_attention


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32)])
def test_outputs_dtype_shape(dtype):
    q, k, v = _qkv(dtype=dtype)
    o = host.flash_attention(q, k, v)
    assert isinstance(o, np.ndarray) and o.shape == q.shape and o.dtype == dtype
    o2, lse = host.flash_attention(q, k, v, return_lse=True)
    assert lse.shape == q.shape[:3] and lse.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(o, np.float64), np.asarray(o2, np.float64))


@pytest.mark.parametrize("mixed,mm", [(True, BF16), (False, np.dtype(np.float32))])
def test_mixed_precision_fp32(mixed, mm):
    q, k, v = _qkv(dtype=np.float32, seed=1)
    o, lse = host.flash_attention(q, k, v, causal=True, mixed_precision=mixed, return_lse=True)
    _within_rule(q, k, v, o, lse, mm, causal=True)


def test_causal_true_is_bottom_right():
    q, k, v = _qkv(Nq=30, Nk=90, seed=2)
    a = host.flash_attention(q, k, v, causal=True)
    b = host.flash_attention(q, k, v, causal="bottom_right")
    c = host.flash_attention(q, k, v, causal="top_left")
    np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert not np.array_equal(np.asarray(a, np.float64), np.asarray(c, np.float64))


def test_all_options_together():
    q, k, v = _qkv(B=3, Hq=4, Hkv=2, Nq=150, Nk=260, D=48, seed=3)
    mask = dict(causal=True, window=(40, -1), kv_lens=np.array([260, 0, 100]),
                q_lens=[150, 20, 0])
    o, lse = host.flash_attention(q, k, v, scale=0.2, return_lse=True, **mask)
    _within_rule(q, k, v, o, lse, BF16, scale=0.2, **mask)
    assert np.all(np.isneginf(lse[1])) and np.all(np.isneginf(lse[2]))
    assert np.all(np.asarray(o[2], np.float64) == 0.0)


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(dtype=np.float32, seed=4)
    o = host.flash_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v))
    ref = host.flash_attention(q, k, v)
    np.testing.assert_array_equal(o, ref)


def test_plan_attention_forward(monkeypatch):
    q, k, v = _qkv(B=2, Hq=8, Hkv=2, Nq=300, Nk=500, D=64, dtype=np.float32)
    for name, grid_want in (("legacy", (2, 2)), ("nki", (1,))):
        # the grid of the namespace the kernel traces through: 0.7 launches kernel[lnc]
        monkeypatch.setenv(API_ENV_VAR, name)
        kernel, grid, kw = api.plan_attention_forward(q, k, v, causal=True, window=(10, 5),
                                                      mixed_precision=False, lnc=1)
        assert kernel == flash_attention_fwd.on(name) and grid == grid_want
        assert kw["lnc"] == 1
    assert kw["causal"] == "bottom_right" and kw["window"] == (10, 5)
    assert kw["mm_dtype"] == "float32" and kw["scale"] == pytest.approx(1 / 8)
    assert isinstance(kw["tiles"], T.ForwardTiles) and kw["tiles"].kv_resident
    _, _, kw = api.plan_attention_forward(q, k, v, sbuf_budget=20_000)
    assert not kw["tiles"].kv_resident
    forced = T.ForwardTiles(kv_resident=False, q_group=2)
    _, _, kw = api.plan_attention_forward(q, k, v, tiles=forced)
    assert kw["tiles"] is forced


def test_plan_under_dropout_puts_p_transposes_on_dma(monkeypatch):
    """Through nki.* the planner gives attention dropout its own share of DMA-engine P^T
    transposes (tiles.FWD_NKI_DROPOUT_P_DMA_SHARE), other calls the target's; legacy none."""
    q, k, v = _qkv(B=1, Hq=2, Hkv=1, Nq=256, Nk=256, D=64)
    monkeypatch.setenv(API_ENV_VAR, "nki")
    share = {p: api.plan_attention_forward(q, k, v, dropout_p=p, seed=1 if p else None,
                                           lnc=1)[2]["tiles"].p_dma_transpose_share
             for p in (0.0, 0.1)}
    assert share[0.1] == T.FWD_NKI_DROPOUT_P_DMA_SHARE
    assert share[0.0] == T.FWD_NKI_P_DMA_SHARE.get(api.active_target(),
                                                    T.FWD_NKI_P_DMA_SHARE["trn2"])
    monkeypatch.setenv(API_ENV_VAR, "legacy")
    kw = api.plan_attention_forward(q, k, v, dropout_p=0.1, seed=1, lnc=1)[2]
    assert kw["tiles"].p_dma_transpose_share == 0.0


def test_auto_runs_lengths_through_nki(monkeypatch):
    """Under NKI_FLASH_API=auto (trn2 here) runtime lengths trace through nki.*, with ALiBi
    or dropout too (their key-length mask row is ported)."""
    q, k, v = _qkv(B=2, Hq=2, Hkv=1, Nq=100, Nk=200, D=32)
    monkeypatch.setenv(API_ENV_VAR, "auto")
    if api.select_api() != "nki" or api.active_target() != "trn2":
        pytest.skip("auto does not select nki.* on this target")
    for lens in (dict(kv_lens=[200, 7]), dict(q_lens=[3, 100]),
                 dict(kv_lens=[5, 0], q_lens=[100, 1])):
        kernel, grid, _ = api.plan_attention_forward(q, k, v, causal=True, lnc=1, **lens)
        assert kernel == flash_attention_fwd.on("nki") and grid == (1,)
    for mod in (dict(alibi_slopes=np.ones(2, np.float32)), dict(dropout_p=0.1, seed=3)):
        kernel, _, _ = api.plan_attention_forward(q, k, v, kv_lens=[200, 7], **mod)
        assert kernel == flash_attention_fwd.on("nki")


def test_plan_does_not_depend_on_length_values():
    """Lengths are runtime tensors: the launch plan (kernel, grid, compile-time options, tiling)
    depends on whether they are given, never on their values."""
    q, k, v = _qkv(B=3, Hq=4, Hkv=2, Nq=300, Nk=500, D=64)
    plans = [api.plan_attention_forward(q, k, v, causal=True, window=(64, -1), q_lens=ql,
                                        kv_lens=kl)
             for ql, kl in (([300, 0, 1], [500, 17, 0]), ([1, 2, 3], [500, 500, 500]),
                            (np.array([300] * 3), np.array([250] * 3)))]
    assert all(p == plans[0] for p in plans[1:])
    assert "kv_lens" not in plans[0][2] and "q_lens" not in plans[0][2]


def test_causal_true_with_lengths_is_bottom_right_and_ignores_padding():
    """causal=True (bottom_right) in a padded batch: the diagonal moves with each sequence's
    valid lengths; NaN in the padding changes nothing."""
    q, k, v = _qkv(B=3, Hq=2, Hkv=1, Nq=150, Nk=260, D=32, seed=6)
    q_lens, kv_lens = [150, 40, 0], [260, 100, 7]
    clean = [x.copy() for x in (q, k, v)]
    for b in range(3):
        q[b, :, q_lens[b]:] = np.nan
        k[b, :, kv_lens[b]:] = np.nan
        v[b, :, kv_lens[b]:] = np.nan
    o, lse = host.flash_attention(q, k, v, causal=True, q_lens=q_lens, kv_lens=kv_lens,
                                  return_lse=True)
    o2, lse2 = host.flash_attention(q, k, v, causal="bottom_right", q_lens=q_lens,
                                    kv_lens=kv_lens, return_lse=True)
    np.testing.assert_array_equal(np.asarray(o, np.float64), np.asarray(o2, np.float64))
    np.testing.assert_array_equal(lse, lse2)
    _within_rule(*clean, o, lse, BF16, causal="bottom_right", q_lens=q_lens, kv_lens=kv_lens)
    assert not np.isnan(np.asarray(o, np.float64)).any() and not np.isnan(lse).any()
    assert np.all(np.asarray(o[2], np.float64) == 0.0) and np.all(np.isneginf(lse[2]))


def test_tiles_override_gives_same_result():
    q, k, v = _qkv(Nq=300, Nk=2300, D=32, seed=5)
    a = host.flash_attention(q, k, v, causal="top_left")
    b = host.flash_attention(q, k, v, causal="top_left",
                             tiles=T.ForwardTiles(kv_resident=False, q_group=2))
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-2)


# --------------------------------------------------------------------------------------------
# Validation: every error path, with its message
# --------------------------------------------------------------------------------------------

def _bad_inputs(case):
    q, k, v = _qkv(B=2, Hq=4, Hkv=2, Nq=10, Nk=12, D=8)
    if case == "q_rank":
        return (q[0], k, v), {}
    if case == "q_list":
        return (q.tolist(), k, v), {}
    if case == "q_int":
        return (q.astype(np.int32), k, v), {}
    if case == "k_dtype":
        return (q, k.astype(np.float16), v), {}
    if case == "v_shape":
        return (q, k, v[:, :, :5]), {}
    if case == "k_batch":
        return (q, k[:1], v[:1]), {}
    if case == "head_dim":
        q2, k2, v2 = _qkv(Nq=4, Nk=4, D=300)
        return (q2, k2, v2), {}
    if case == "groups":
        q2, k2, v2 = _qkv(Hq=4, Hkv=3, Nq=4, Nk=4, D=8)
        return (q2, k2, v2), {}
    raise AssertionError(case)


@pytest.mark.parametrize("case,exc,message", [
    ("q_rank", ValueError, "q: expected a 4-D array of shape (B, Hq, Nq, D), got a 3-D array"),
    ("q_list", TypeError, "q: expected a numpy.ndarray or torch.Tensor, got"),
    ("q_int", TypeError, "q: dtype int32 is not supported; allowed: float32, bfloat16, float16"),
    ("k_dtype", TypeError, "k: dtype float16 does not match q's dtype bfloat16"),
    ("v_shape", ValueError, "v: expected the same shape as k (2, 2, 12, 8)"),
    ("k_batch", ValueError, "k: expected shape (B, Hkv, Nk, D) with B=2 and D=8 matching q"),
    ("head_dim", ValueError, "q: head dim D must be in [1, 256], got D=300"),
    ("groups", ValueError, "k: Hkv=3 kv heads must divide q's Hq=4 query heads"),
])
def test_input_errors(case, exc, message):
    args, kw = _bad_inputs(case)
    with pytest.raises(exc) as info:
        host.flash_attention(*args, **kw)
    assert message in str(info.value)


@pytest.mark.parametrize("kwargs,exc,message", [
    ({"scale": float("nan")}, ValueError, "scale: expected a finite real number, got nan"),
    ({"scale": "0.5"}, TypeError, "scale: expected None or a finite real number, got '0.5'"),
    ({"causal": "diagonal"}, ValueError, "causal: expected None, False, True (= 'bottom_right'), "
                                         "'top_left' or 'bottom_right', got 'diagonal'"),
    ({"causal": 1}, TypeError, "causal: expected None, False, True"),
    ({"window": 5}, TypeError, "window: expected None or a (left, right) pair of ints"),
    ({"window": (1, 2, 3)}, ValueError, "window: expected a (left, right) pair of ints "
                                        "(-1 = unbounded), got 3 values"),
    ({"window": (-2, 3)}, ValueError, "window: left must be >= -1 (-1 = unbounded), got -2"),
    ({"window": (1.5, 3)}, TypeError, "window: left must be an int >= -1, got 1.5 (float)"),
    ({"kv_lens": [1, 2, 3]}, ValueError, "kv_lens: expected length B=2 (one per sequence), got "
                                         "length 3"),
    ({"kv_lens": [5, 13]}, ValueError, "kv_lens: values must be in [0, Nk=12], got 13 at index 1"),
    ({"kv_lens": np.array([1.0, 2.0])}, TypeError, "kv_lens: expected an integer array, got "
                                                   "dtype float64"),
    ({"kv_lens": [[1, 2]]}, TypeError, "kv_lens: expected integers, got [1, 2] (list) at index 0"),
    ({"q_lens": [-1, 3]}, ValueError, "q_lens: values must be in [0, Nq=10], got -1 at index 0"),
    ({"q_lens": 3}, TypeError, "q_lens: expected None, a 1-D integer array or a list of ints"),
    ({"mixed_precision": "yes"}, TypeError, "mixed_precision: expected True or False, got 'yes'"),
    ({"return_lse": 1}, TypeError, "return_lse: expected True or False, got 1 (int)"),
    ({"tiles": {"q_tile": 64}}, TypeError, "tiles: expected None or a "
                                          "nki_kernels.tiles.ForwardTiles, got"),
    ({"sbuf_budget": 0}, ValueError, "sbuf_budget: expected an int in [1, "),
    ({"sbuf_budget": 1.5e5}, TypeError, "sbuf_budget: expected an int, got 150000.0 (float)"),
])
def test_option_errors(kwargs, exc, message):
    q, k, v = _qkv(B=2, Hq=4, Hkv=2, Nq=10, Nk=12, D=8)
    with pytest.raises(exc) as info:
        host.flash_attention(q, k, v, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("kwargs,message", [
    ({"q_tile": 0}, "q_tile: expected 1..128, got 0"),
    ({"v_chunk": 64}, "v_chunk: expected 128, got 64"),
    ({"k_tile": 200}, "k_tile: expected a multiple of 128 up to 512, got 200"),
    ({"softmax_block": 2560}, "softmax_block: expected 1 to 4 times k_tile=512, got 2560"),
    ({"kv_chunk": 1000}, "kv_chunk: expected a multiple of softmax_block=2048, got 1000"),
    ({"kv_load_block": 100}, "kv_load_block: expected a multiple of 128, got 100"),
    ({"q_group": 0}, "q_group: expected >= 1, got 0"),
    ({"span_tiles": 0}, "span_tiles: expected >= 1, got 0"),
    ({"act_evac_share": 1.5}, "act_evac_share: expected None or a fraction in [0, 1], got 1.5"),
    ({"p_dma_transpose_share": -0.1}, "p_dma_transpose_share: expected a fraction in [0, 1], "
                                      "got -0.1"),
    ({"target": "trn3"}, "target: expected one of ['trn1', 'trn2'], got 'trn3'"),
])
def test_forward_tiles_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        T.ForwardTiles(**kwargs)
    assert message in str(info.value)


def test_choose_tiles_target_error():
    with pytest.raises(ValueError, match="target: expected one of"):
        T.choose_forward_tiles(10, 10, 8, 1, 2, 2, target="gen4")


def test_lnc_grids_and_results():
    """LNC=2 (trn2): kv heads, else batches, go to the two cores through nl.spmd_dim; with one
    (batch, kv head) the kernel splits its query tiles over an nl.nc(2) dimension. Both follow
    the tolerance rule; the default follows the target."""
    import simulate

    from nki_kernels.attention.forward import forward_grid

    assert forward_grid(3, 4, 1) == ((3, 4), 1)
    (b, hd), kl = forward_grid(3, 4, 2)
    assert (b, int(hd), kl) == (3, 4, 1)
    (bd, h), kl = forward_grid(4, 3, 2)
    assert (int(bd), h, kl) == (4, 3, 1)
    grid, kl = forward_grid(3, 3, 2)
    assert grid[:2] == (3, 3) and len(grid) == 3 and kl == 2
    # odd group count (the middle group on both cores) + partial tile (both cores); causal
    # spans of 2 tiles (one per core); heads split by spmd_dim
    cases = [dict(B=1, Hq=2, Hkv=1, Nq=1000, Nk=700, causal=None),
             dict(B=1, Hq=1, Hkv=1, Nq=2048, Nk=2048, causal="top_left"),
             dict(B=2, Hq=4, Hkv=2, Nq=300, Nk=500, causal=None)]
    for c in cases:
        causal = c.pop("causal")
        q, k, v = _qkv(dtype=ml_dtypes.bfloat16, D=64, **c)
        with simulate.measure(target="trn2") as m1:
            o1, l1 = api.flash_attention(q, k, v, causal=causal, return_lse=True, lnc=1)
        with simulate.measure(target="trn2") as m2:
            o2, l2 = api.flash_attention(q, k, v, causal=causal, return_lse=True)
        for o, lse in ((o1, l1), (o2, l2)):
            _within_rule(q, k, v, o, lse, "bfloat16", causal=causal)
        assert m1.kernels[0].cores == 1 and m2.kernels[0].cores == 2
        assert m2.modeled_seconds[0] < 0.75 * m1.modeled_seconds[0]
    with simulate.measure(target="trn1"):
        _, grid, kw = api.plan_attention_forward(q, k, v)
    assert grid == (2, 2) and kw["lnc"] == 1
    with pytest.raises(ValueError, match="lnc: expected None, 1 or 2"):
        api.plan_attention_forward(q, k, v, lnc=4)


@pytest.mark.parametrize("namespace", ["legacy", "nki"])
def test_lnc_split_hbm_bytes_match_plan(monkeypatch, namespace):
    """fp32 without mixed precision (fp32 matmuls; K^T by DMA transposes under nki.*), one
    (batch, kv head) on trn2: the default LNC=2 splits the query-tile groups over the two
    cores, each with its own SBUF, so each reads all of K and V (twice per instance), the
    rows of its own groups (the middle one of an odd count, and the partial tile, on both)
    and writes their outputs: exactly ``forward.plan_hbm_bytes(..., lnc=2)``. LNC=1 reads
    Q, K, V once, ``tiles.forward_hbm_bytes``."""
    import simulate

    from nki_kernels.attention.forward import plan_hbm_bytes

    monkeypatch.setenv(API_ENV_VAR, namespace)
    Nq, Nk, D = 700, 300, 64
    q, k, v = _qkv(Hq=1, Nq=Nq, Nk=Nk, D=D, dtype=np.float32, seed=5)
    for lnc in (None, 1):
        with simulate.measure(target="trn2") as m:
            kw = api.plan_attention_forward(q, k, v, mixed_precision=False, lnc=lnc)[2]
            api.flash_attention(q, k, v, mixed_precision=False, lnc=lnc)
        split = 2 if lnc is None else 1
        assert kw["lnc"] == split and kw["tiles"].kv_resident
        measured = (m.hbm_bytes_read, m.hbm_bytes_written)
        assert measured == plan_hbm_bytes(1, 1, 1, Nq, Nk, D, 4, kw["tiles"], lnc=split)
        assert m.per_tensor["k"]["read"] == m.per_tensor["v"]["read"] == split * Nk * D * 4
        if split == 1:
            assert measured == T.forward_hbm_bytes(1, 1, 1, Nq, Nk, D, 4, kw["tiles"])
        else:
            # 5 full tiles: two groups of 2 (one per core) and a group of 1 that both cores
            # run, and the partial tile (60 rows) on both: 128 + 60 rows read twice
            assert m.per_tensor["q"]["read"] == (Nq + 128 + 60) * D * 4
    with pytest.raises(ValueError, match="lnc: expected 1 or 2, got 3"):
        plan_hbm_bytes(1, 1, 1, Nq, Nk, D, 4, kw["tiles"], lnc=3)
