"""Score modifiers (softcap, ALiBi, sinks) through the torch API: the custom ops' schemas and
fake implementations, gradients (the sinks' included) against the float64 reference, the
LSE gradient, torch.compile, and the torch decode."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from host import reference as ref  # noqa: E402
from host.torch_ops import flash_attention, flash_decode  # noqa: E402


def _inputs(B=1, Hq=4, Hkv=2, N=150, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, N, D, generator=g, requires_grad=True)
               for h in (Hq, Hkv, Hkv))
    sinks = torch.randn(Hq, generator=g, requires_grad=True)
    slopes = torch.rand(Hq, generator=g) * 0.3
    return q, k, v, sinks, slopes


def _np(kw):
    return {n: x.detach().numpy() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}


@pytest.mark.parametrize("which", [("softcap",), ("alibi_slopes",), ("sinks",),
                                   ("softcap", "alibi_slopes", "sinks")])
def test_gradients_match_the_reference(which):
    q, k, v, sinks, slopes = _inputs()
    kw = {"softcap": 3.0, "alibi_slopes": slopes, "sinks": sinks}
    kw = {n: kw[n] for n in which}
    o = flash_attention(q, k, v, causal=True, mixed_precision=False, **kw)
    do = torch.randn_like(o)
    wrt = [q, k, v] + ([sinks] if "sinks" in kw else [])
    grads = torch.autograd.grad(o, wrt, do)
    arrays = [x.detach().numpy() for x in (q, k, v)]
    want_o, _ = ref.attention_forward(*arrays, causal=True, **_np(kw))
    want = ref.attention_backward(do.numpy(), *arrays, causal=True, **_np(kw))
    np.testing.assert_allclose(o.detach().numpy(), want_o, atol=2e-5)
    assert len(grads) == len(want)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.numpy(), w, atol=3e-5 * max(1.0, np.abs(w).max()))


def test_packed_sequences_take_every_modifier():
    """The torch op passes softcap, ALiBi ((Hq,) slopes) and sinks through with packed
    sequences (cu_seqlens): o and the gradients (the sinks' summed over the sequences) against
    the float64 reference of each sequence alone."""
    q, k, v, sinks, slopes = _inputs(N=140)
    cu = torch.tensor([0, 1, 130, 130, 140], dtype=torch.int32)
    kw = dict(causal=True, softcap=3.0, alibi_slopes=slopes, sinks=sinks)
    o = flash_attention(q, k, v, mixed_precision=False, cu_seqlens_q=cu, cu_seqlens_k=cu,
                        **kw)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, [q, k, v, sinks], do)
    arrays = [x.detach().numpy() for x in (q, k, v)]
    cu_np = cu.numpy()
    kw_np = dict(_np(kw), causal="bottom_right")
    want_o, _ = ref.per_sequence(ref.attention_forward, *arrays, cu_np, cu_np, **kw_np)
    want = ref.per_sequence_grads(ref.attention_backward, do.numpy(), *arrays, cu_np, cu_np,
                                  **kw_np)
    np.testing.assert_allclose(o.detach().numpy(), want_o, atol=2e-5)
    assert len(grads) == len(want) == 4
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.numpy(), w, atol=3e-5 * max(1.0, np.abs(w).max()))


def _lse64(q, k, sinks, cap, slopes):
    """float64 torch reference of the causal (bottom_right) LSE with the modifiers."""
    q64, k64 = q.double(), k.double()
    G = q.shape[1] // k.shape[1]
    k64 = k64.repeat_interleave(G, dim=1)
    s = q64 @ k64.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = cap * torch.tanh(s / cap)
    Nq, Nk = s.shape[-2:]
    i = torch.arange(Nq, dtype=torch.float64)[:, None] + (Nk - Nq)
    j = torch.arange(Nk, dtype=torch.float64)[None, :]
    s = s - slopes.double()[None, :, None, None] * (i - j).abs()
    s = s.masked_fill(j > i, float("-inf"))
    sink = sinks.double()[None, :, None, None].expand(*s.shape[:-1], 1)
    return torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)


def test_lse_gradient_with_every_modifier():
    """A loss on the returned lse: dq, dk and dsinks against float64 autograd of the
    reference LSE (soft-cap, ALiBi and sinks together; one extra backward-kernel call)."""
    q, k, v, sinks, slopes = _inputs(seed=3)
    g = torch.randn(1, 4, 150, generator=torch.Generator().manual_seed(9))
    _, lse = flash_attention(q, k, v, causal=True, mixed_precision=False, softcap=4.0,
                             alibi_slopes=slopes, sinks=sinks, return_lse=True)
    got = torch.autograd.grad((lse * g).sum(), [q, k, sinks])
    want = torch.autograd.grad((_lse64(q, k, sinks, 4.0, slopes) * g.double()).sum(),
                               [q, k, sinks])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=2e-4, atol=2e-4)


def test_ops_pass_opcheck_with_modifiers():
    q, k, v, sinks, slopes = (x.detach() for x in _inputs(N=40, D=16))
    seed = torch.zeros((), dtype=torch.int64)
    args = (q, k, v, 0.25, "top_left", None, None, None, False, 0.0, seed, None, None, 4.0,
            slopes, sinks)
    torch.library.opcheck(torch.ops.nki_flash.attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    o, lse = torch.ops.nki_flash.attention_fwd(*args)
    bwd = (torch.ones_like(o), q, k, v, o, lse) + args[3:]
    torch.library.opcheck(torch.ops.nki_flash.attention_bwd.default, bwd,
                          test_utils=("test_schema", "test_faketensor"))
    assert torch.ops.nki_flash.attention_bwd(*bwd)[3].shape == (4,)


def test_compile_fullgraph_matches_eager():
    q, k, v, sinks, slopes = _inputs(seed=7)

    def f(q, k, v, sinks):
        return flash_attention(q, k, v, causal=True, softcap=5.0, alibi_slopes=slopes,
                               sinks=sinks, mixed_precision=False)

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    results = []
    for fn in (f, compiled):
        o = fn(q, k, v, sinks)
        results.append((o.detach(), torch.autograd.grad(o.sum(), [q, sinks])))
    (oe, ge), (oc, gc) = results
    torch.testing.assert_close(oc, oe, rtol=0, atol=0)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_decode_with_modifiers():
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, T, D, S = 2, 4, 2, 2, 32, 300
    q = torch.randn(B, Hq, T, D, generator=g)
    kc, vc = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    lens = torch.tensor([300, 45])
    kw = dict(softcap=4.0, alibi_slopes=torch.rand(B, Hq, generator=g) * 0.2,
              sinks=torch.randn(Hq, generator=g))
    o, lse = flash_decode(q, kc, vc, cache_lens=lens, mixed_precision=False, return_lse=True,
                          **kw)
    want_o, want_l = ref.decode(q.numpy(), kc.numpy(), vc.numpy(), cache_lens=lens.numpy(),
                                **_np(kw))
    np.testing.assert_allclose(o.numpy(), want_o, atol=5e-5)
    np.testing.assert_allclose(lse.numpy(), want_l, atol=5e-5)
