"""Device layer: model code, paged KV cache, sampler and the per-rank model runner."""
