"""Training: a model bound to the rules. `resolve` checks a config against the model it trains,
`state` builds the born-sharded TrainState, `step` is the jitted train/eval step. Imports
`jzero.config`, `jzero.zero` and `jzero.models`.
"""
