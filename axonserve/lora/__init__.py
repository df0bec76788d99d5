"""Multi-LoRA serving: adapter validation (adapter.py), weights and rank-local slots (weights.py),
and the segment-wise batched LoRA matmul applied inside the base layers (layers.py)."""
