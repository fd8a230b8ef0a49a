"""Per-layer activation checkpointing: keep each decoder layer's input, recompute the rest.

Activation memory during training drops from every intermediate of every layer to one
[batch, seq, hidden] tensor per layer plus one layer's intermediates, for about one extra
forward pass of compute.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

from rlloom.parallel.tensor_parallel import backbone_of


def apply_activation_checkpointing(model: nn.Module,
                                   layers: nn.ModuleList | nn.ModuleDict | None = None
                                   ) -> nn.Module:
    """Wrap every decoder layer of `model` (or of `layers`, a pipeline stage's) in a
    non-reentrant checkpoint, in place.

    Apply after tensor parallelism and before data parallelism, so FSDP's per-layer groups
    are the checkpointed layers and recomputation re-gathers a layer's parameters (ZeRO-3)
    just before using them. The wrapper's state-dict hooks strip its `_checkpoint_wrapped_module`
    prefix, so `state_dict()` keys are unchanged; `named_parameters()` names carry it.
    """
    layers = backbone_of(model).layers if layers is None else layers
    for key in list(layers.keys() if isinstance(layers, nn.ModuleDict) else range(len(layers))):
        if not isinstance(layers[key], CheckpointWrapper):
            # Non-reentrant: works with keyword arguments, DTensors and FSDP2 hooks, and
            # under no_grad (generation) it simply runs the layer.
            layers[key] = checkpoint_wrapper(layers[key],
                                             checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model
