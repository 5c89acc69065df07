"""The torch form of flash_attention_with_kvcache: a chunk over a paged cache against the float64
reference (its errors: test_torch_decode_and_padding.py)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from host import reference as ref  # noqa: E402
from host.torch_ops import flash_attention_with_kvcache  # noqa: E402
from nki_kernels import tiles  # noqa: E402


def test_chunk_over_a_paged_cache_matches_the_reference():
    T = tiles.kvcache_decode_max_tokens(4) + 1
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 16, generator=g)
    kc = torch.randn(2, 1, 192, 16, generator=g)
    vc = torch.randn(2, 1, 192, 16, generator=g)
    lens = torch.tensor([T, 170])
    want, want_lse = ref.attention_forward(q.numpy(), kc.numpy(), vc.numpy(),
                                           causal="bottom_right", kv_lens=lens.numpy())
    (kp, vp), table = ref.contiguous_to_paged((kc.numpy(), vc.numpy()), lens.numpy(), 32,
                                              np.random.default_rng(1), spare=3)
    o, lse = flash_attention_with_kvcache(q, torch.from_numpy(kp), torch.from_numpy(vp),
                                          cache_lens=lens, block_table=torch.from_numpy(table),
                                          mixed_precision=False, return_lse=True)
    assert o.dtype == torch.float32 and o.shape == q.shape and lse.shape == (2, 4, T)
    assert np.abs(o.numpy() - want).max() < 1e-5
    assert np.abs(lse.numpy() - want_lse).max() < 1e-5

