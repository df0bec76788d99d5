"""Functional kernels shared by every model (attention over the paged KV cache)."""
