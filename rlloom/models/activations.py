"""The gate activations of the supported families, by their Hugging Face names.

Plain torch rather than `transformers.activations.ACT2FN`: importing that module pulls in
transformers' kernel hub and torch.compile (about 1.3 s), which every worker process would pay
at start-up for five one-line functions. tests/models/test_activations.py holds them equal to
transformers' own.
"""
from __future__ import annotations

import functools

import torch.nn.functional as F

_TANH_GELU = functools.partial(F.gelu, approximate="tanh")
# keys: rlloom.models.config.ACTIVATIONS (config stays torch-free for the CLI)
ACT_FNS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": _TANH_GELU,
           "gelu_new": _TANH_GELU, "relu": F.relu}
