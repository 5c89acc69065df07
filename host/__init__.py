"""Host side of nki-flash: validation, launching, references, PyTorch wrappers and the CLI."""

# Fused kernels and the unfused attention baseline (issue #6).
from host.api import attention_unfused, linear_gelu, online_softmax  # noqa: E402,F401

# Split-KV flash decoding over a KV cache (issue #5).
from host.api import flash_decode, flash_decode_hbm_bytes, plan_flash_decode  # noqa: E402,F401

# Flash attention forward (issue #3).
from host.api import flash_attention, plan_attention_forward  # noqa: E402,F401

# Flash attention backward (issue #4).
from host.api import (  # noqa: E402,F401
    flash_attention_backward,
    flash_attention_backward_hbm_bytes,
    plan_attention_backward,
)
