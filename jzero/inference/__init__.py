"""Inference: generation from trained params. `sampling` (greedy, temperature, top-k, top-p, one
key per row); the KV-cached engine, scheduler and server come next (issue 34).
Imports the layers below it: config, zero, models, train.
"""
