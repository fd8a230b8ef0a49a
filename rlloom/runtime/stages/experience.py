"""What assessment hands to training: the samples with their reference log-probs, values,
advantages and returns. Its own module, below the stages that read it (`online.py`,
`objective.py`, `pipelined.py`), so that none of them imports another for it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlloom.runtime.stages.generation import Samples


@dataclass
class Experience:
    samples: Samples
    loss_mask: torch.Tensor         # [n, T] response tokens that train (overlong filter applied)
    ref_logp: torch.Tensor | None   # [n, T]
    old_values: torch.Tensor | None  # [n, T]
    advantages: torch.Tensor        # [n, T]
    returns: torch.Tensor           # [n, T]

    def to(self, device: torch.device | str) -> "Experience":
        def move(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device)
        return Experience(self.samples.to(device), self.loss_mask.to(device),
                          move(self.ref_logp), move(self.old_values),
                          self.advantages.to(device), self.returns.to(device))
