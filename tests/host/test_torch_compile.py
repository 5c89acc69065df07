"""The torch entry points under torch.compile, torch.export and torch.func: the kernels are
``torch.library`` custom ops (``nki_flash::attention_fwd``, ``nki_flash::attention_bwd``) with
fake implementations and an autograd formula."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from host.torch_ops import flash_attention, scaled_dot_product_attention  # noqa: E402


def _qkv(seed=0, Hq=2, Hkv=2, N=64, D=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, Hq, N, D, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(1, Hkv, N, D, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(1, Hkv, N, D, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


def _run(fn, q, k, v):
    for x in (q, k, v):
        x.grad = None
    o = fn(q, k, v)
    (o * torch.linspace(-1, 1, o.shape[-1])).sum().backward()
    return o.detach(), [x.grad.clone() for x in (q, k, v)]


def test_ops_pass_opcheck():
    """torch.library.opcheck: schema, fake (meta) implementation and autograd registration are
    consistent with the real kernels."""
    q, k, v = (x.detach() for x in _qkv(N=40, D=16))
    seed = torch.zeros((), dtype=torch.int64)
    args = (q, k, v, 0.25, "top_left", None, None, None, False, 0.0, seed)
    torch.library.opcheck(torch.ops.nki_flash.attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    o, lse = torch.ops.nki_flash.attention_fwd(*args)
    torch.library.opcheck(torch.ops.nki_flash.attention_bwd.default,
                          (torch.ones_like(o), q, k, v, o, lse) + args[3:],
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend):
    q, k, v = _qkv(Hq=4, Hkv=2)

    def f(q, k, v):
        return flash_attention(q, k, v, causal=True, mixed_precision=False)

    want = _run(f, q, k, v)
    got = _run(torch.compile(f, fullgraph=True, backend=backend), q, k, v)
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_sdpa_and_lse():
    q, k, v = _qkv()

    def f(q, k, v):
        o = scaled_dot_product_attention(q, k, v, is_causal=True)
        o2, lse = flash_attention(q, k, v, window=(8, 0), return_lse=True,
                                  mixed_precision=False)
        return o + o2 + lse[..., None]

    want = _run(f, q, k, v)
    got = _run(torch.compile(f, fullgraph=True, backend="eager"), q, k, v)
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)


def test_export_contains_the_custom_op():
    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (x.detach() for x in _qkv())
    ep = torch.export.export(Attn(), (q, k, v))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "nki_flash.attention_fwd.default" in targets
    torch.testing.assert_close(ep.module()(q, k, v), Attn()(q, k, v))


def test_double_backward_raises_instead_of_returning_zeros():
    q, k, v = _qkv(N=16, D=8)
    o = flash_attention(q, k, v, mixed_precision=False)
    (dq,) = torch.autograd.grad((o ** 2).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        torch.autograd.grad(dq.sum(), (q,))


def test_vmap_runs_each_sample():
    """No batching rule: vmap falls back to one call per sample (correct, not fast)."""
    q, k, v = (x.detach() for x in _qkv(N=16, D=8))
    qs = torch.stack([q, 2 * q])
    got = torch.func.vmap(lambda x: flash_attention(x, k, v, mixed_precision=False))(qs)
    want = torch.stack([flash_attention(x, k, v, mixed_precision=False) for x in qs])
    torch.testing.assert_close(got, want)


def test_func_grad_raises_rather_than_being_wrong():
    q, k, v = (x.detach() for x in _qkv(N=16, D=8))
    with pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.grad(lambda x: flash_attention(x, k, v, mixed_precision=False).sum())(q)


def test_eager_dropout_under_compile_draws_from_the_generator():
    q, k, v = _qkv()

    def f(q, k, v):
        return flash_attention(q, k, v, dropout_p=0.2, mixed_precision=False)

    torch.manual_seed(7)
    a = f(q, k, v)
    torch.manual_seed(7)
    b = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    torch.testing.assert_close(a, b)
    assert np.isfinite(a.detach().numpy()).all()


def test_block_sparse_through_torch_eager_compile_and_both_layouts():
    """``block_mask=`` in the torch API: the dense bool pattern and FlexAttention's index form
    give the same output and gradients, eagerly and under torch.compile(fullgraph=True); the
    custom ops pass opcheck with the pattern arguments."""
    from host import block_sparse as bs
    from host import reference as ref

    q, k, v = _qkv(seed=3, Hq=2, Hkv=1, N=300, D=16)
    mask = torch.rand(1, 2, 3, 3, generator=torch.Generator().manual_seed(1)) < 0.6
    mask[..., 0] = True
    idx = bs.dense_to_index(mask.numpy(), max_blocks=3)
    index = (torch.as_tensor(idx.num_blocks), torch.as_tensor(idx.indices))

    def fn(m):
        return lambda q, k, v: flash_attention(q, k, v, causal=True, block_mask=m,
                                               mixed_precision=False)

    o, grads = _run(fn(mask), q, k, v)
    want = ref.attention_forward(*(x.detach().numpy() for x in (q, k, v)),
                                 causal="bottom_right", block_mask=mask.numpy())[0]
    assert np.abs(o.numpy() - want).max() < 1e-5
    o2, grads2 = _run(fn(index), q, k, v)
    compiled = torch.compile(lambda q, k, v, m: fn(m)(q, k, v), fullgraph=True, backend="eager")
    o3, grads3 = _run(lambda q, k, v: compiled(q, k, v, mask), q, k, v)
    for other, other_grads in ((o2, grads2), (o3, grads3)):
        torch.testing.assert_close(other, o, rtol=0, atol=1e-6)
        for a, b in zip(other_grads, grads):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    seed = torch.zeros((), dtype=torch.int64)
    args = (q.detach(), k.detach(), v.detach(), 0.25, "bottom_right", None, None, None, False,
            0.0, seed, mask, None)
    torch.library.opcheck(torch.ops.nki_flash.attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_packed_sequences_through_torch_eager_and_compile():
    """``cu_seqlens_q``/``cu_seqlens_k`` in the torch API: output and gradients match the
    float64 per-sequence references, eagerly and under torch.compile(fullgraph=True), where the
    offsets are op inputs; the ops pass opcheck with them."""
    from host import reference as ref

    cu = torch.tensor([0, 1, 130, 130, 140], dtype=torch.int32)
    q, k, v = _qkv(seed=4, Hq=2, Hkv=1, N=140, D=16)

    def f(q, k, v, cu):
        return flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                               mixed_precision=False)

    o, grads = _run(lambda q, k, v: f(q, k, v, cu), q, k, v)
    qn, kn, vn = (x.detach().numpy() for x in (q, k, v))
    want = ref.per_sequence(ref.attention_forward, qn, kn, vn, cu.numpy(), cu.numpy(),
                            causal="bottom_right")[0]
    do = np.ascontiguousarray(np.broadcast_to(np.linspace(-1, 1, 16), o.shape))
    want_grads = ref.per_sequence_grads(ref.attention_backward, do, qn, kn, vn, cu.numpy(),
                                        cu.numpy(), causal="bottom_right")
    assert np.abs(o.numpy() - want).max() < 1e-5
    for a, b in zip(grads, want_grads):
        assert np.abs(a.numpy() - b).max() < 1e-4
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    o2, grads2 = _run(lambda q, k, v: compiled(q, k, v, cu), q, k, v)
    torch.testing.assert_close(o2, o, rtol=0, atol=0)
    for a, b in zip(grads2, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    seed = torch.zeros((), dtype=torch.int64)
    args = (q.detach(), k.detach(), v.detach(), 0.25, "bottom_right", None, None, None, False,
            0.0, seed, None, None, None, None, None, cu, cu)
    torch.library.opcheck(torch.ops.nki_flash.attention_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
