"""Intra-model parallelism applied to plain models from outside (docs/design.md).

`mesh` builds the device mesh of a `Layout` and validates it against a model; the other
modules each apply one technique (tensor + sequence parallel, activation checkpointing, data
parallel with ZeRO 0-3) and `apply.parallelize` composes them in the right order. Everything
runs on CPU with gloo, so the tests check each layout against a single process.
"""
