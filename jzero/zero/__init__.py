"""ZeRO: the rules and their collectives. The mesh, the ZeRO table (`sharding`), the per-layer
hooks and ZeRO++'s int8 wire, precision and loss scaling, remat policies, DeepSpeed's optimizers
and schedules as optax, the Pallas fused step. Imports only `jzero.config` (and its own modules).
"""
