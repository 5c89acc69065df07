"""The transformers attention backend (``host.integrations.transformers``): tiny random models
built from configs (no downloads) compared with ``attn_implementation="sdpa"`` -- logits,
gradients and greedy generation, with left and right padding, GQA and sliding windows; Gemma 2
(logit soft-capping) and gpt-oss (attention sinks) against their eager attention."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import host.integrations.transformers as nki_tf  # noqa: E402
from host import torch_ops  # noqa: E402

V, N = 97, 24


def _model(kind, **extra):
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    common.update(extra)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(sliding_window=7, **common)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.Qwen2Config(use_sliding_window=True, sliding_window=9,
                                       max_window_layers=1, **common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    ref = cls._from_config(cfg, attn_implementation="sdpa").eval()
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(nki_tf.register())
    return ref, ours


def _batch(padding):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, N), generator=g)
    am = torch.ones(3, N, dtype=torch.long)
    if padding == "left":
        am[1, :5] = 0
        am[2, :15] = 0
    elif padding == "right":
        am[1, N - 5:] = 0
        am[2, N - 15:] = 0
    return ids, am


def _compare_logits_and_gradients(ref, ours, padding):
    """Logits (valid positions) and every parameter gradient of the two models on one batch
    agree; returns the names of the parameters that got a gradient."""
    ids, am = _batch(padding)
    valid = am.bool()
    outs = []
    for model in (ref, ours):
        model.zero_grad()
        logits = model(ids, attention_mask=am).logits
        (logits[valid] * torch.linspace(-1, 1, V)).sum().backward()
        outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                       if p.grad is not None}))
    (la, ga), (lb, gb) = outs
    assert (la - lb)[valid].abs().max() < 2e-5
    assert set(ga) == set(gb)
    for name in ga:
        assert (ga[name] - gb[name]).abs().max() < 2e-4 * max(1.0, ga[name].abs().max()), name
    return set(ga)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_logits_and_gradients_match_sdpa(kind, padding):
    ref, ours = _model(kind)
    _compare_logits_and_gradients(ref, ours, padding)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_generate_left_padded_batch_uses_the_decode_kernel(kind, monkeypatch):
    ref, ours = _model(kind)
    ids, am = _batch("left")
    calls = []
    real = torch_ops.flash_decode

    def counting(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(torch_ops, "flash_decode", counting)
    want = ref.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False)
    got = ours.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False)
    assert torch.equal(want, got)
    assert calls and all(shape[2] == 1 for shape in calls)


def test_training_mode_dropout_runs_and_unsupported_options_raise():
    ref, ours = _model("llama", attention_dropout=0.1)
    ours.train()
    ids, am = _batch("right")
    loss = ours(ids, attention_mask=am, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="position_bias: an additive position bias"):
        nki_tf.attention_forward(ours.model.layers[0].self_attn, q, q, q, None,
                                 position_bias=torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match="contains 'flash'"):
        nki_tf.register("my_flash")


def _modified_model(kind):
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  head_dim=16, sliding_window=7)
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(attn_logit_softcapping=20.0,
                                        final_logit_softcapping=None, query_pre_attn_scalar=16,
                                        **common)
        cls = transformers.Gemma2ForCausalLM
    else:
        cfg = transformers.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        cls = transformers.GptOssForCausalLM
    torch.manual_seed(0)
    # eager is these models' reference attention (SDPA has no soft-cap or sink)
    ref = cls._from_config(cfg, attn_implementation="eager").eval()
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in ref.model.layers:
                layer.self_attn.sinks.normal_()     # initialised to zeros otherwise
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(nki_tf.register())
    return ref, ours


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_softcap_and_sink_models_match_eager(kind):
    """Gemma 2's logit soft-capping and gpt-oss's attention sinks run in the kernels: logits and
    every gradient (the sinks' included) match eager attention on a left-padded batch, and
    greedy generation (decode kernel steps) gives the same tokens."""
    ref, ours = _modified_model(kind)
    names = _compare_logits_and_gradients(ref, ours, "left")
    if kind == "gpt_oss":
        assert any(name.endswith("self_attn.sinks") for name in names)
    ids, am = _batch("left")
    want = ref.generate(ids, attention_mask=am, max_new_tokens=5, do_sample=False)
    got = ours.generate(ids, attention_mask=am, max_new_tokens=5, do_sample=False)
    assert torch.equal(want, got)


def test_packed_batch_matches_sdpa_on_the_unpacked_sequences():
    """A padding-free packed batch from ``DataCollatorWithFlattening`` (position_ids and, with
    ``return_flash_attn_kwargs``, the cu_seq_lens keywords: the backend reads the latter when
    given) through the nki backend: logits and parameter gradients equal sdpa's on each
    sequence run alone (Mistral: a sliding window per sequence)."""
    ref, ours = _model("mistral")
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 11, 1)]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": s} for s in seqs])
    keep = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
            "max_length_k")
    inputs = {name: batch[name] for name in keep if name in batch}
    weights = torch.linspace(-1, 1, V)
    ours.zero_grad()
    packed = ours(**inputs).logits[0]
    (packed * weights).sum().backward()
    ref.zero_grad()
    alone = torch.cat([ref(torch.tensor([s])).logits[0] for s in seqs])
    (alone * weights).sum().backward()
    assert (packed - alone).abs().max() < 2e-5
    for (name, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
        assert (a.grad - b.grad).abs().max() < 2e-4 * max(1.0, a.grad.abs().max()), name


def test_packed_offsets_from_position_ids_alone():
    """Without the cu_seq_lens keywords the offsets come from where position_ids restart (from
    their minimum, as transformers' flash backend finds them); an unpacked row has none; a
    mask that is neither the packed nor the row's causal one is refused."""
    q = torch.zeros(1, 2, 7, 4)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    cu_q, cu_k = nki_tf._packed_offsets(q, q, {"position_ids": pos})
    assert cu_q.tolist() == cu_k.tolist() == [0, 3, 5, 7] and cu_q.dtype == torch.int32
    assert nki_tf._packed_offsets(q, q, {"position_ids": torch.arange(7)[None]}) is None
    padding = torch.ones(1, 1, 7, 7, dtype=torch.bool).tril()
    padding[..., 0] = False
    with pytest.raises(ValueError, match="attention_mask: a packed batch"):
        nki_tf._check_packed_mask(padding, cu_q, "bottom_right", None, 7)
