"""Host side of nki-flash: validation, launching, references, PyTorch wrappers and the CLI."""

# Fused kernels and the unfused attention baseline (issue #6).
from host.api import attention_unfused, linear_gelu, online_softmax  # noqa: E402,F401
