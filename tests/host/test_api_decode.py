"""host.flash_decode: the public decode API (validation, split planning, results, IO) on the
active backend. Kernel-level numerics are in tests/kernels/test_decode.py; the tolerance rule
here is the same (o error <= 2 * baseline error + floor, docs/semantics.md).
"""
from __future__ import annotations

import numpy as np
import pytest

import host
from host import api, reference
from nki_kernels import tiles
from nki_kernels.nki import BACKEND

from _decode_helpers import BF16, F32, assert_within_rule, inputs


def shapes(B, Hq, Hkv, T, S_max, D, dtype=BF16):
    """Zero q and caches: enough for plan_flash_decode and validation (cheap at 32K)."""
    return (np.zeros((B, Hq, T, D), dtype), np.zeros((B, Hkv, S_max, D), dtype),
            np.zeros((B, Hkv, S_max, D), dtype))


# --------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------
def test_flash_decode_matches_reference_and_returns_lse():
    q, k, v = inputs()
    lens = np.array([3, 101])
    o, lse = host.flash_decode(q, k, v, cache_lens=lens, return_lse=True)
    assert o.shape == q.shape and o.dtype == BF16
    assert lse.shape == (2, 8, 3) and lse.dtype == F32
    assert_within_rule(q, k, v, lens, o)
    ref_lse = reference.decode(q, k, v, cache_lens=lens)[1]
    assert reference.max_abs_err(lse, ref_lse) < 1e-2
    assert isinstance(host.flash_decode(q, k, v, cache_lens=lens), np.ndarray)


@pytest.mark.skipif(BACKEND != "simulate", reason="traces both namespaces on the simulator")
@pytest.mark.parametrize("paged", [False, True])
def test_nki_namespace_sums_large_cache_rows_in_int32(paged, monkeypatch):
    """Through nki.* the split kernel's flat cache rows ``(b Hkv + h) S_max + position``
    (paged: block-table entries ``b MB + block``) take their program-index part from a table;
    for a cache of 2^24 rows or more (the bound lowered here to 4) summed in int32 on GpSimd
    (``port.OffsetColumns(exact=True)``; fp32 would round them): ``auto`` on trn2 traces such a
    call through nki.*, which gives the legacy trace's outputs bit for bit, with more GpSimd
    instructions than the fp32 path below the bound."""
    import simulate
    from nki_kernels import nki as binding

    q, k, v = inputs()
    lens = np.array([3, 101])
    kw = {}
    if paged:
        (k, v), kw["block_table"] = reference.contiguous_to_paged(
            (k, v), lens, 32, np.random.default_rng(1))
    gpsimd, runs = {}, {}
    for api_env, bound in (("nki", tiles.FP32_EXACT_INT), ("legacy", 4), ("auto", 4)):
        monkeypatch.setattr(tiles, "FP32_EXACT_INT", bound)
        monkeypatch.setenv(binding.API_ENV_VAR, api_env)
        with simulate.measure(target="trn2") as m:
            runs[api_env] = host.flash_decode(q, k, v, cache_lens=lens, lnc=1, return_lse=True,
                                              **kw)
        assert m.api == ("legacy" if api_env == "legacy" else "nki")
        gpsimd[api_env] = m.instructions["gpsimd"]
    for got, want in zip(runs["auto"], runs["legacy"]):
        np.testing.assert_array_equal(got, want)
    assert gpsimd["auto"] > gpsimd["nki"]
    assert_within_rule(q, k, v, lens, runs["auto"][0], table=kw.get("block_table"))


def test_flash_decode_accepts_lists_and_tree_masks():
    q, k, v = inputs(T=4, S_max=64)
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 1, 1]], dtype=bool)
    o = host.flash_decode(q, k, v, cache_lens=[4, 64], tree_mask=tree)
    assert_within_rule(q, k, v, [4, 64], o, tree=tree)


def test_flash_decode_full_precision():
    q, k, v = inputs(dtype=F32, D=48)
    o = host.flash_decode(q, k, v, cache_lens=[50, 128], mixed_precision=False, scale=0.2)
    ref = reference.decode(q, k, v, cache_lens=[50, 128], scale=0.2)[0]
    assert reference.max_abs_err(o, ref) < 1e-5


def test_equals_flash_attention_bottom_right_when_cache_is_the_sequence():
    """Semantics: without a tree mask, decode == flash_attention(causal="bottom_right") over
    the first cache_len positions (here the whole cache)."""
    q, k, v = inputs(B=1, Hq=8, Hkv=2, T=5, S_max=77, D=64, dtype=F32)
    o_dec, lse_dec = host.flash_decode(q, k, v, cache_lens=[77], mixed_precision=False,
                                       return_lse=True)
    o_fa, lse_fa = host.flash_attention(q, k, v, causal="bottom_right", mixed_precision=False,
                                        return_lse=True)
    assert reference.max_abs_err(o_dec, o_fa) < 1e-5
    assert reference.max_abs_err(lse_dec, lse_fa) < 1e-5


# --------------------------------------------------------------------------------------------
# split planning
# --------------------------------------------------------------------------------------------
def test_split_count_comes_from_the_real_lengths_not_the_capacity():
    q, k, v = shapes(B=1, Hq=32, Hkv=8, T=1, S_max=32768, D=128)
    short = host.plan_flash_decode(q, k, v, cache_lens=[100])
    full = host.plan_flash_decode(q, k, v, cache_lens=[32768])
    assert short.num_splits == 1 and short.split_keys <= 1024
    # one sequence: splits of DECODE_SINGLE_SEQUENCE_SPLIT_KEYS positions, streamed through the
    # programs' two buffers
    assert full.split_keys == tiles.DECODE_SINGLE_SEQUENCE_SPLIT_KEYS == 8192
    assert full.num_splits == 4 and full.split_keys * full.num_splits >= 32767
    assert host.plan_flash_decode(q, k, v, cache_lens=[1]).num_splits == 0


def test_plan_is_stable_within_a_length_bucket():
    """Consecutive decode steps reuse the compiled kernels until the longest sequence crosses
    a bucket (DECODE_BUCKETS_PER_OCTAVE per doubling)."""
    q, k, v = shapes(B=1, Hq=4, Hkv=1, T=1, S_max=65536, D=64)
    plans = {host.plan_flash_decode(q, k, v, cache_lens=[n]) for n in range(20000, 24577, 64)}
    assert len(plans) <= 2
    distinct = {host.plan_flash_decode(q, k, v, cache_lens=[n])
                for n in range(2048, 65537, 512)}
    assert len(distinct) <= 5 * tiles.DECODE_BUCKETS_PER_OCTAVE


def test_work_list_follows_the_real_lengths():
    """Splits are scheduled per sequence: one long and three tiny sequences run the long one's
    splits plus one (empty) split each, not B times the longest, sequence by sequence, padded
    to a bucket of whole programs."""
    q, k, v = shapes(B=4, Hq=32, Hkv=8, T=1, S_max=32768, D=128)
    lens = [1, 32768, 1, 40]
    p = host.plan_flash_decode(q, k, v, cache_lens=lens)
    work, per_program, splits = api.decode_work_list(lens, 1, p)
    per_split = p.split_keys
    assert splits.tolist() == [1, -(-32767 // per_split), 1, 1]
    real = [(b, s) for b in range(4) for s in range(splits[b])]
    total, per = tiles.decode_work_items(len(real))
    assert (len(work), per_program) == (total, per) and total % per == 0
    assert total >= tiles.decode_bucket(len(real))
    assert [tuple(x) for x in work[:len(real)]] == real
    assert all(tuple(x) == (4, 0) for x in work[len(real):])
    assert len(work) < 4 * p.num_splits
    q, k, v = inputs(B=4, Hq=8, Hkv=2, T=1, S_max=4096, D=32, seed=3)
    lens = [1, 4096, 1, 40]
    assert_within_rule(q, k, v, lens, host.flash_decode(q, k, v, cache_lens=lens))


def test_num_splits_is_honoured_including_more_than_needed():
    q, k, v = inputs(S_max=256)
    for ns in (1, 3, 50):
        assert host.plan_flash_decode(q, k, v, cache_lens=[3, 256], num_splits=ns).num_splits \
            == ns
    o = host.flash_decode(q, k, v, cache_lens=[3, 256], num_splits=50)
    assert_within_rule(q, k, v, [3, 256], o)


def test_num_splits_above_the_merge_limit_is_a_clear_error():
    from nki_kernels import tiles

    q, k, v = inputs(S_max=256)
    D = q.shape[-1]
    most = tiles.decode_max_splits(D)
    assert host.plan_flash_decode(q, k, v, cache_lens=[3, 256], num_splits=most).num_splits \
        == most
    with pytest.raises(ValueError, match=rf"num_splits: at most {most} splits at head dim "
                                         rf"D={D} .*got 1000"):
        host.flash_decode(q, k, v, cache_lens=[3, 256], num_splits=1000)
    assert tiles.decode_max_splits(128) == 126


# --------------------------------------------------------------------------------------------
# IO
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(BACKEND != "simulate", reason="simulate.measure needs the bundled simulator")
def test_hbm_bytes_formula_is_exact():
    import simulate

    q, k, v = inputs(B=3, Hq=8, Hkv=2, T=2, S_max=512, D=64)
    lens = [2, 300, 512]
    p = host.plan_flash_decode(q, k, v, cache_lens=lens)
    with simulate.measure(target="trn1") as m:
        host.flash_decode(q, k, v, cache_lens=lens)
    read, written = host.flash_decode_hbm_bytes(3, 8, 2, 64, 2, lens, 2, p)
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)
    assert m.per_tensor["k_cache"]["read"] == 2 * 64 * 2 * sum(lens)


@pytest.mark.skipif(BACKEND != "simulate", reason="simulate.measure needs the bundled simulator")
@pytest.mark.parametrize("Hkv,lens,axis", [
    (2, [2, 300, 512], 0),            # two head groups: one per core
    (1, [2, 300, 512], 1),            # one head group: the programs are split
    (1, [300, 512], 1),               # ... an odd program count gets a padding chunk
])
def test_lnc2_spreads_the_split_programs_over_both_cores(Hkv, lens, axis):
    """trn2 LNC=2: the same outputs as LNC=1 (bit for bit: the same programs), the exact HBM
    formula, and both cores busy: the split kernel's scheduled estimate drops below LNC=1's
    (well below with whole head groups per core; with the programs split, each program's DMA
    latencies do not halve, so a small launch gains only a few %) (an indirect scatter covers its whole tensor in the model, so tracking dependencies
    across cores would serialize them: 0.99x for two head groups)."""
    import simulate

    B = len(lens)
    q, k, v = inputs(B=B, Hq=4 * Hkv, Hkv=Hkv, T=1, S_max=8192, D=64)
    p = host.plan_flash_decode(q, k, v, cache_lens=lens)
    assert api.decode_launch(lens, 1, Hkv, p, 2).core_axis == axis
    runs = []
    for lnc in (1, 2):
        with simulate.measure(target="trn2") as m:
            o = host.flash_decode(q, k, v, cache_lens=lens, lnc=lnc)
        read, written = host.flash_decode_hbm_bytes(B, 4 * Hkv, 1, 64, Hkv, lens, 2, p,
                                                    lnc=lnc, api=m.api)
        assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)
        runs.append((o, m.kernels[0].estimated_seconds))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert_within_rule(q, k, v, lens, runs[1][0])
    # small launches: the programs' fixed costs do not halve; whole head groups per core do.
    # With the programs split, [2, 300, 512] models 20.2 us against LNC=1's 20.6 (the nki.*
    # chunk program runs the tails beside its splits, and LNC=2 pads the one chunk program
    # with a second one of padding items: 23.2 against 25.5 while the tails ran first)
    assert runs[1][1] < (0.7 if axis == 0 else 1.0) * runs[0][1]


# --------------------------------------------------------------------------------------------
# validation: every error path names the argument
# --------------------------------------------------------------------------------------------
def _bad_calls():
    q, k, v = inputs(T=3, S_max=64)
    lens = [10, 64]
    big = np.broadcast_to(np.zeros((), BF16), (1, 1, api.DECODE_MAX_CACHE_POSITIONS + 1, 32))
    return [
        # (kwargs overrides, exception, message fragment)
        (dict(q=q[0]), ValueError, "q: expected a 4-D array"),
        (dict(q=q.astype(np.float64)), TypeError, "q"),
        (dict(k_cache=k[:, :, :, :16]), ValueError, "k_cache: expected shape (B, Hkv, S_max, D)"),
        (dict(v_cache=v[:, :, :32]), ValueError, "v_cache: expected the same shape as k_cache"),
        (dict(k_cache=k.astype(np.float16)), TypeError, "k_cache"),
        (dict(q=np.concatenate([q, q[:, :1]], axis=1)), ValueError, "must divide q's Hq=9"),
        (dict(q=np.zeros((2, 8, 129, 32), BF16)), ValueError, "T (new tokens per sequence)"),
        (dict(q=np.zeros((2, 8, 3, 257), BF16), k_cache=np.zeros((2, 2, 64, 257), BF16),
              v_cache=np.zeros((2, 2, 64, 257), BF16)), ValueError, "q"),
        (dict(cache_lens=None), TypeError, "cache_lens: required"),
        (dict(cache_lens=[10]), ValueError, "cache_lens: expected length B=2"),
        (dict(cache_lens=np.array([10.0, 20.0])), TypeError, "cache_lens: expected an integer"),
        (dict(cache_lens=[2, 64]), ValueError, "cache_lens: each value must be in [T=3, "
                                               "S_max=64]"),
        (dict(cache_lens=[10, 65]), ValueError, "cache_lens: values must be in [0, S_max=64]"),
        (dict(tree_mask=np.ones((3, 3), np.int8)), TypeError, "tree_mask: expected dtype bool"),
        (dict(tree_mask=np.ones((2, 2), bool)), ValueError, "tree_mask: expected shape (T, T)"),
        (dict(tree_mask=~np.eye(3, dtype=bool)), ValueError, "tree_mask: the diagonal"),
        (dict(scale="x"), TypeError, "scale"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(num_splits=0), ValueError, "num_splits: expected an int in [1, inf]"),
        (dict(num_splits=2.0), TypeError, "num_splits: expected an int"),
        (dict(mixed_precision=1), TypeError, "mixed_precision: expected True or False"),
        (dict(return_lse="yes"), TypeError, "return_lse: expected True or False"),
        (dict(q=np.zeros((1, 1, 1, 32), BF16), k_cache=big, v_cache=big, cache_lens=[1]),
         ValueError, "k_cache: B * Hkv * S_max"),
    ], (q, k, v, lens)


@pytest.mark.parametrize("index", range(len(_bad_calls()[0])))
def test_validation_errors(index):
    cases, (q, k, v, lens) = _bad_calls()
    overrides, exc, fragment = cases[index]
    kw = dict(q=q, k_cache=k, v_cache=v, cache_lens=lens)
    kw.update(overrides)
    args = (kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache"))
    with pytest.raises(exc) as info:
        host.flash_decode(*args, **kw)
    assert fragment in str(info.value)


def test_num_splits_too_small_names_the_minimum():
    q, k, v = shapes(B=1, Hq=32, Hkv=8, T=1, S_max=32768, D=128)
    with pytest.raises(ValueError, match=r"num_splits: 1 split\(s\) cannot hold .* num_splits "
                                         r"must be >= 4"):
        host.flash_decode(q, k, v, cache_lens=[32768], num_splits=1)
    with pytest.raises(ValueError, match="num_splits"):
        host.plan_flash_decode(q, k, v, cache_lens=[32768], num_splits=1)
