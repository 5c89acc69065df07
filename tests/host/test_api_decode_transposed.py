"""flash_decode over a transposed K cache, ``k_layout="bhds"``: k_cache ``(B, Hkv, D, S_max)``
(nki-library attention_tkg's K layout), v_cache unchanged."""
from __future__ import annotations

import numpy as np
import pytest

import host
from nki_kernels import tiles
from tests.host._decode_helpers import assert_within_rule, inputs

from nki_kernels.nki import BACKEND

needs_sim = pytest.mark.skipif(BACKEND != "simulate",
                               reason="simulate.measure needs the bundled simulator")


def _kt(k):
    return np.ascontiguousarray(k.swapaxes(2, 3))


def _poisoned(k, v, lens):
    """Copies of the caches with NaN at and past every length: a K^T window reads some of
    those positions, and they must not reach a result."""
    k, v = k.copy(), v.copy()
    for b, n in enumerate(lens):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    return k, v


@needs_sim
@pytest.mark.parametrize("api_name,B,Hq,Hkv,T,S_max,D,lens,tree", [
    ("nki", 3, 8, 2, 1, 512, 64, [512, 77, 1], None),          # GQA 4:1, a tail-only row
    ("legacy", 3, 8, 2, 1, 512, 64, [512, 77, 1], None),
    ("nki", 2, 4, 2, 3, 1024, 128, [1000, 3],                  # T = 3, tree, L = T
     [[1, 0, 0], [1, 1, 0], [1, 0, 1]]),
    ("nki", 1, 2, 1, 1, 2048, 256, [2048], None),              # two head-dim tiles
    ("legacy", 2, 2, 1, 1, 12288, 64, [12288, 700], None),     # key rows of 64, 3 splits
])
def test_transposed_k_within_the_rule(monkeypatch, api_name, B, Hq, Hkv, T, S_max, D, lens,
                                      tree):
    """Within the tolerance rule of the float64 reference, NaN past the lengths (which the
    windows read) never reaching the output, and the exact HBM byte formula."""
    import simulate

    monkeypatch.setenv("NKI_FLASH_API", api_name)
    q, k, v = inputs(B=B, Hq=Hq, Hkv=Hkv, T=T, S_max=S_max, D=D)
    tree = None if tree is None else np.array(tree, bool)
    kp, vp = _poisoned(k, v, lens)
    with simulate.measure(target="trn2") as m:
        got = host.flash_decode(q, _kt(kp), vp, cache_lens=lens, tree_mask=tree, lnc=1,
                                k_layout="bhds")
    assert m.api == api_name
    assert_within_rule(q, k, v, lens, got, tree=tree)
    plan = host.plan_flash_decode(q, _kt(k), v, cache_lens=lens, tree_mask=tree,
                                  k_layout="bhds")
    assert plan.key_row == tiles.decode_transposed_key_row(S_max, max(lens) - T)
    read, written = host.flash_decode_hbm_bytes(B, Hq, T, D, Hkv, lens, 2, plan,
                                                tree_mask=tree is not None, api=m.api,
                                                k_layout="bhds")
    assert (m.hbm_bytes_read, m.hbm_bytes_written) == (read, written)


@needs_sim
def test_transposed_k_nki_equals_legacy_with_fp8_and_modifiers(monkeypatch):
    """An FP8 e5m2 cache with soft-capping and ALiBi (the selection mask kept apart from the
    tanh): nki.* and legacy agree bit for bit, and with the default layout where the plans
    agree (S_max = 96: key rows of 32, splits of one, either way)."""
    import ml_dtypes

    q, k, v = inputs(B=2, Hq=4, Hkv=2, T=1, S_max=96, D=64)
    lens = [60, 40]
    f8 = ml_dtypes.float8_e5m2
    k8, v8 = k.astype(np.float32).astype(f8), v.astype(np.float32).astype(f8)
    kw = dict(cache_lens=lens, k_scale=1.0, v_scale=1.0, softcap=20.0, lnc=1,
              alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32))
    outs = {}
    for name in ("nki", "legacy"):
        monkeypatch.setenv("NKI_FLASH_API", name)
        outs[name] = host.flash_decode(q, _kt(k8), v8, k_layout="bhds", **kw)
    np.testing.assert_array_equal(outs["nki"], outs["legacy"])
    assert (host.plan_flash_decode(q, _kt(k8), v8, cache_lens=lens, k_scale=1.0, v_scale=1.0,
                                   k_layout="bhds")
            == host.plan_flash_decode(q, k8, v8, cache_lens=lens, k_scale=1.0, v_scale=1.0))
    ref = host.flash_decode(q, k8, v8, **kw)            # the default layout, same plan
    np.testing.assert_array_equal(outs["nki"], ref)


def test_split_size_divides_the_cache_lines():
    """A K^T window must be a row of the (B Hkv D S_max / W, W) view: the split size divides
    S_max / n, else the largest legal one that does (more splits); a forced split count takes
    the smallest that does."""
    plan = tiles.decode_tiles(4, 128, 3 * 4096, 2, 3 * 4096 // 32 - 1)
    assert (3 * 4096 // 32) % plan.split_rows            # 384 rows, split 256: no
    t = tiles.decode_transposed_split(plan, 3 * 4096, 128, 4, 3 * 4096 // 32 - 1)
    assert (t.split_rows, t.num_splits) == (128, 3)
    forced = tiles.decode_tiles(4, 128, 3 * 4096, 2, 383, num_splits=3)
    assert tiles.decode_transposed_split(forced, 3 * 4096, 128, 4, 383, num_splits=3) == forced
    forced = tiles.decode_tiles(4, 128, 3 * 4096, 2, 383, num_splits=2)   # 256 rows
    with pytest.raises(ValueError, match="num_splits: 2 splits need 256 key rows each"):
        tiles.decode_transposed_split(forced, 3 * 4096, 128, 4, 383, num_splits=2)


@needs_sim
def test_transposed_program_size_is_flat_in_the_cache_length():
    """The same programs for a 16K and a 32K cache (the same split size, more work items)."""
    import simulate

    sizes = []
    for S in (16384, 32768):
        q, k, v = inputs(B=1, Hq=1, Hkv=1, T=1, S_max=S, D=64)
        with simulate.measure(target="trn2") as m:
            host.flash_decode(q, _kt(k), v, cache_lens=[S], lnc=1, k_layout="bhds")
        sizes.append(m.program_instructions_per_kernel)
    assert sizes[0] == sizes[1], sizes


def test_transposed_k_errors_name_the_argument():
    q, k, v = inputs(B=2, T=1, S_max=64)
    lens = [10, 64]
    table = np.zeros((2, 4), np.int32)
    cases = [
        (dict(k_cache=k), "k_cache: with k_layout='bhds' expected (B, Hkv, D, S_max)"),
        (dict(k_layout="bsd"), "k_layout: expected 'bhsd'"),
        (dict(block_table=table, k_cache=_kt(k)[:, :, :, :16], v_cache=v[:, :, :16]),
         "k_layout: 'bhds' (a transposed K cache) is supported for contiguous"),
        (dict(window=(8, 0)), "k_layout: 'bhds' is read by the split-KV decode kernels only"),
    ]
    for over, msg in cases:
        kw = dict(k_cache=_kt(k), v_cache=v, k_layout="bhds")
        kw.update(over)
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            host.flash_decode(q, kw.pop("k_cache"), kw.pop("v_cache"), cache_lens=lens, **kw)


def test_an_s_max_no_split_divides_is_refused_at_any_length():
    """S_max = 1000 (key rows of 8 positions, splits of at most 8 rows dividing its 125
    lines) cannot hold a full cache within the merge's splits: refused already while the
    sequences are short, so a serving loop does not meet it mid-generation; a capacity with a
    large power-of-two factor plans at every length."""
    msg = r"k_cache: with k_layout='bhds' a split must divide the .* of S_max=1000"
    for lens in ([500], [999]):
        q, k, v = inputs(B=1, Hq=8, Hkv=2, T=1, S_max=1000, D=128)
        with pytest.raises(ValueError, match=msg):
            host.plan_flash_decode(q, _kt(k), v, cache_lens=lens, k_layout="bhds")
    q, k, v = inputs(B=1, Hq=8, Hkv=2, T=1, S_max=1024, D=128)
    for lens in ([5], [1024]):
        host.plan_flash_decode(q, _kt(k), v, cache_lens=lens, k_layout="bhds")


def test_the_byte_count_refuses_a_layout_it_cannot_count():
    q, k, v = inputs(B=1, Hq=2, Hkv=1, T=1, S_max=512, D=64)
    plan = host.plan_flash_decode(q, _kt(k), v, cache_lens=[300], k_layout="bhds")
    for kw in (dict(k_layout="BHDS"), dict(k_layout="bhds", paged=True)):
        with pytest.raises(ValueError, match="k_layout: expected 'bhsd', or 'bhds' with a "
                                             "contiguous cache"):
            host.flash_decode_hbm_bytes(1, 2, 1, 64, 1, [300], 2, plan, **kw)


def test_torch_op_forwards_the_layout():
    torch = pytest.importorskip("torch")
    from host import torch_ops

    q, k, v = inputs(B=2, Hq=4, Hkv=2, T=1, S_max=128, D=32)
    lens = [128, 50]
    want = host.flash_decode(q, _kt(k), v, cache_lens=lens, k_layout="bhds")
    tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)
                  for x in (q, _kt(k), v))
    with torch.no_grad():
        got = torch_ops.flash_decode(tq, tk, tv, cache_lens=lens, k_layout="bhds")
    np.testing.assert_array_equal(got.float().numpy(), np.asarray(want, np.float32))
