"""Speculative decoding, every layer side by side.

- `scheduler`: who speculates, the n-gram proposer, the counters (scheduler side).
- `tree`: EAGLE-2 draft trees (no torch; shared by scheduler, verifier and worker).
- `eagle`: the EAGLE draft head, its loading (heads shipped as package data under `heads/`) and
  the proposer worker rank 0 runs; `paged_draft`: its native drafter over the target's paged KV.
- `drafter`: the drafter actor (drafts out of process).
- `training`: offline self-distillation of a head (`axonserve train-eagle`).
"""
