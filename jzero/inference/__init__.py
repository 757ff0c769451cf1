"""Inference: generation from trained params. `engine` (KV-cached prefill/insert/generate),
`scheduler` (continuous batching), `storage`, `sampling`, `text`, `uncached` (the reference).
Imports the layers below it: config, zero, models, train.
"""
