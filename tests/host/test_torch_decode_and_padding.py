"""The torch decode API (contiguous and paged caches) and left-padded SDPA masks."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from host import reference as ref  # noqa: E402
from host.torch_ops import (flash_attention_with_kvcache, flash_decode,  # noqa: E402
                             scaled_dot_product_attention)


def test_flash_decode_contiguous_and_paged_match_the_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 32, generator=g)
    kc = torch.randn(2, 2, 300, 32, generator=g)
    vc = torch.randn(2, 2, 300, 32, generator=g)
    lens = torch.tensor([300, 70])
    want, want_lse = ref.decode(q.numpy(), kc.numpy(), vc.numpy(), cache_lens=lens.numpy())
    o, lse = flash_decode(q, kc, vc, cache_lens=lens, mixed_precision=False, return_lse=True)
    assert o.dtype == torch.float32 and o.shape == q.shape
    assert np.abs(o.numpy() - want).max() < 1e-5
    assert np.abs(lse.numpy() - want_lse).max() < 1e-5
    (kp, vp), table = ref.contiguous_to_paged((kc.numpy(), vc.numpy()), lens.numpy(), 32,
                                              np.random.default_rng(1), spare=3)
    op = flash_decode(q, torch.from_numpy(kp), torch.from_numpy(vp), cache_lens=lens,
                      block_table=torch.from_numpy(table), mixed_precision=False)
    torch.testing.assert_close(op, o, rtol=0, atol=1e-6)


@pytest.mark.parametrize("entry", [flash_decode, flash_attention_with_kvcache])
def test_cache_entries_refuse_autograd_and_name_bad_arguments(entry):
    q = torch.randn(1, 1, 1, 16, requires_grad=True)
    kc = torch.randn(1, 1, 20, 16)
    with pytest.raises(RuntimeError, match=f"{entry.__name__}: has no autograd"):
        entry(q, kc, kc, cache_lens=[20])
    with torch.no_grad():
        with pytest.raises(TypeError, match="cache_lens: expected an integer tensor"):
            entry(q, kc, kc, cache_lens=torch.tensor([20.0]))
        with pytest.raises(TypeError, match="return_lse"):
            entry(q, kc, kc, cache_lens=[20], return_lse="yes")
    if entry is flash_attention_with_kvcache:
        with torch.no_grad(), pytest.raises(ValueError, match="causal: .*got 'top_left'"):
            entry(q, kc, kc, cache_lens=[20], causal="top_left")


@pytest.mark.parametrize("L", [1, 150])
def test_sdpa_left_padding_is_rotated_exactly(L):
    """A left-padded batch (valid keys at the end of each row, padding query rows fully masked)
    gives PyTorch's result on the valid rows and zeros on the padding rows, with gradients."""
    g = torch.Generator().manual_seed(2)
    B, H, S, D = 3, 2, 150, 16
    q = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    k = torch.randn(B, H, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, H, S, D, generator=g, requires_grad=True)
    pad = torch.tensor([0, 17, 90])
    i = torch.arange(L)[None, :, None] + (S - L)
    j = torch.arange(S)[None, None, :]
    m = ((j <= i) & (j >= pad[:, None, None]))[:, None]
    o = scaled_dot_product_attention(q, k, v, attn_mask=m, mixed_precision=False)
    want = torch.nan_to_num(F.scaled_dot_product_attention(q, k, v, attn_mask=m))
    rows = m.any(-1, keepdim=True)
    torch.testing.assert_close(o, want * rows, rtol=0, atol=2e-6)
    assert torch.all(o[~rows.expand_as(o)] == 0)
    gout = torch.randn(o.shape, generator=g)
    grads = torch.autograd.grad((o * gout).sum(), (q, k, v))
    wgrads = torch.autograd.grad((want * rows * gout).sum(), (q, k, v))
    for a, b in zip(grads, wgrads):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
