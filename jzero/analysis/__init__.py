"""Analysis: reading the compiled program. HLO parsing, memory / collectives / FLOPs reports
(`profile`), AOT planning (`estimate`), the autotuner, the lr range test and the batch tuner.
Imports the layers below it: config, zero, models, train, inference, tasks.
"""
