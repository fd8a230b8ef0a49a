"""Teacher-forced passes that compute each distinct prompt once.

The K samples of a GRPO group share their prompt, and under causal attention a prompt's
hidden states, keys and values do not depend on what follows it. So the prompt pass runs once
per distinct prompt; each response then runs alone, attending to its prompt's keys and values
as a cache, and the logits that predict the first response token come from the prompt pass.
The arithmetic of every response token is the one the joined prompt+response forward does
(same keys, positions and mask), so log-probs match it to rounding.

For training, the prompt's keys, values and last logits become leaves: each response
micro-batch's backward accumulates their gradients, and `backward()` then pushes those through
the prompt pass once, which gives the same parameter gradients as K separate forwards.
"""
from __future__ import annotations

import torch

from rlloom.models.transformer import CausalLM
from rlloom.rollout.generate import Rollout


class _Record:
    """A cache with nothing in it that keeps each layer's keys and values (the prompt pass)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.key_mask = torch.zeros(rows, 0, dtype=torch.long, device=device)
        self.length = 0
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def append_mask(self, new_mask: torch.Tensor) -> None:
        pass

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.kv.append((k, v))
        return k, v

    def advance(self, n: int) -> None:
        pass


class _Prefix:
    """A cache that holds each row's prompt keys and values (the response pass)."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]], key_mask: torch.Tensor
                 ) -> None:
        self.kv, self.key_mask, self.length = kv, key_mask, key_mask.shape[1]

    def append_mask(self, new_mask: torch.Tensor) -> None:
        pass

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        pk, pv = self.kv[layer]
        return torch.cat([pk, k], 2), torch.cat([pv, v], 2)

    def advance(self, n: int) -> None:
        pass


class SharedPrompts:
    """The prompt pass of a batch of rows `r`, once per distinct prompt."""

    def __init__(self, model: CausalLM, r: Rollout, train: bool) -> None:
        width = max(int(r.prompt_mask.sum(1).max()), 1)
        ids, mask = r.prompt_ids[:, -width:], r.prompt_mask[:, -width:]
        unique, self.of_row = torch.unique(torch.cat([ids, mask], 1), dim=0,
                                           return_inverse=True)
        self.ids, self.mask = unique[:, :width], unique[:, width:]
        record = _Record(len(unique), ids.device)
        hidden = model.model(self.ids, self.mask, record)
        last = model.lm_head(hidden[:, -1])           # predicts each response's first token
        self._graph = [t for kv in record.kv for t in kv] + [last]
        self.leaves = [t.detach().requires_grad_(train) for t in self._graph]
        self.model = model

    @property
    def distinct(self) -> int:
        return len(self.ids)

    def logits(self, rows: torch.Tensor, r: Rollout) -> torch.Tensor:
        """Logits [m, T, vocab] predicting the responses of batch rows `rows` [m], whose
        response part is `r` (a micro-batch of those rows)."""
        g = self.of_row[rows]
        kv = [(self.leaves[2 * i][g], self.leaves[2 * i + 1][g])
              for i in range(len(self.leaves) // 2)]
        first = self.leaves[-1][g][:, None]
        if r.response_ids.shape[1] == 1:
            return first
        rest = self.model(r.response_ids[:, :-1], r.response_mask[:, :-1],
                          _Prefix(kv, self.mask[g]))
        return torch.cat([first, rest], 1)

    def backward(self) -> None:
        """Push the gradients the response passes left on the prompt outputs through the
        prompt pass (once)."""
        pairs = [(out, leaf.grad) for out, leaf in zip(self._graph, self.leaves)
                 if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
