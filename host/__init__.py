"""Host side of nki-flash: validation, launching, references, PyTorch wrappers and the CLI."""
