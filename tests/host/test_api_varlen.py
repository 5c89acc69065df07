"""Bad input to flash_attention's packed sequences (cu_seqlens_q / cu_seqlens_k) is refused
before any kernel runs, with a message naming the argument, what was given and what is
allowed. The kernel itself: tests/kernels/test_varlen.py."""
import numpy as np
import pytest

import host

I32 = np.int32


def _qkv(B=1, Nq=10, Nk=12):
    q = np.zeros((B, 2, Nq, 16), np.float32)
    k = np.zeros((B, 1, Nk, 16), np.float32)
    return q, k, k.copy()


GOOD_Q, GOOD_K = np.array([0, 4, 10], I32), np.array([0, 5, 12], I32)

BAD = [
    (dict(cu_seqlens_q=np.array([0, 4, 10], np.int64)), TypeError,
     "cu_seqlens_q: expected dtype int32"),
    (dict(cu_seqlens_q=[0, 4, 10]), TypeError, "cu_seqlens_q: expected a 1-D int32 array"),
    (dict(cu_seqlens_q=np.array([[0, 4, 10]], I32)), ValueError,
     r"cu_seqlens_q: expected shape \(num_seqs \+ 1,\)"),
    (dict(cu_seqlens_q=np.array([10], I32)), ValueError, "num_seqs >= 1"),
    (dict(cu_seqlens_q=np.array([1, 4, 10], I32)), ValueError,
     "cu_seqlens_q: must start at 0, got 1"),
    (dict(cu_seqlens_k=np.array([0, 6, 5, 12], I32), cu_seqlens_q=np.array([0, 4, 4, 10], I32)),
     ValueError, "cu_seqlens_k: offsets must be non-decreasing, got 5 at index 2 after 6"),
    (dict(cu_seqlens_q=np.array([0, 4, 9], I32)), ValueError,
     "cu_seqlens_q: must end at total_q=10, got 9"),
    (dict(cu_seqlens_k=np.array([0, 12], I32)), ValueError,
     r"cu_seqlens_k: expected the shape of cu_seqlens_q \(3,\)"),
    (dict(cu_seqlens_k=None), ValueError, "cu_seqlens_k: packed sequences need both"),
    (dict(kv_lens=[12]), ValueError, "kv_lens: not supported with packed sequences"),
    (dict(q_lens=[10]), ValueError, "q_lens: not supported with packed sequences"),
    (dict(block_mask=np.ones((1, 1, 1, 1), bool)), ValueError,
     "block_mask: not supported with packed sequences"),
    (dict(dropout_p=0.1), ValueError, "seed: required when dropout_p > 0"),
    (dict(alibi_slopes=np.ones((1, 2), np.float32)), ValueError,
     r"alibi_slopes: packed sequences .* take one slope per query head, shape \(Hq,\) = "
     r"\(2,\); got shape \(1, 2\)"),
]


@pytest.mark.parametrize("kw,exc,msg", BAD, ids=lambda x: str(x)[:40] if isinstance(x, str)
                         else None)
def test_bad_packing_is_refused(kw, exc, msg):
    q, k, v = _qkv()
    args = {"cu_seqlens_q": GOOD_Q, "cu_seqlens_k": GOOD_K, **kw}
    with pytest.raises(exc, match=msg):
        host.flash_attention(q, k, v, **args)


def test_packing_needs_batch_one():
    q, k, v = _qkv(B=2)
    with pytest.raises(ValueError, match="packed sequences .* take batch 1"):
        host.flash_attention(q, k, v, cu_seqlens_q=GOOD_Q, cu_seqlens_k=GOOD_K)


def test_packed_backward_refuses_wide_heads():
    q = np.zeros((1, 1, 10, 130), np.float32)
    k = np.zeros((1, 1, 12, 130), np.float32)
    lse = np.zeros((1, 1, 10), np.float32)
    with pytest.raises(ValueError, match="packed backward .* head dims up to 128, got D=130"):
        host.flash_attention_backward(q, q, k, k, q, lse, cu_seqlens_q=GOOD_Q,
                                      cu_seqlens_k=GOOD_K)


def test_packed_backward_validates_like_the_forward():
    q, k, v = _qkv()
    lse = np.zeros(q.shape[:3], np.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q: must start at 0"):
        host.flash_attention_backward(q, q, k, v, q, lse, cu_seqlens_q=np.array([1, 4, 10], I32),
                                      cu_seqlens_k=GOOD_K)
