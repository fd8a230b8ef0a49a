"""Teacher-forced passes that compute each distinct prompt once.

The K samples of a GRPO group share their prompt, and under causal attention a prompt's
hidden states, keys and values do not depend on what follows it. So the prompt pass runs once
per distinct prompt; each response then runs alone, attending to its prompt's keys and values
as a cache, and the hidden state that predicts the first response token comes from the prompt pass.
The arithmetic of every response token is the one the joined prompt+response forward does
(same keys, positions and mask), so log-probs match it to rounding.

For training, the prompt's keys, values and last hidden state become leaves: each response
micro-batch's backward accumulates their gradients, and `backward()` then pushes those through
the prompt pass once, which gives the same parameter gradients as K separate forwards.
"""
from __future__ import annotations

import torch

from rlloom.models.transformer import CausalLM
from rlloom.rollout.generate import Rollout


class _PromptCache:
    """The model's cache interface over one forward: with no `prefix` (the prompt pass) it
    keeps each layer's keys and values in `kv`; with a prefix (the response pass) each layer
    attends to the rows' prompt keys and values before its own. `key_mask` [rows, prefix]."""

    def __init__(self, key_mask: torch.Tensor,
                 prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.key_mask, self.length, self.prefix = key_mask, key_mask.shape[1], prefix
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def append_mask(self, new_mask: torch.Tensor) -> None:
        pass  # one forward: the mask of the new tokens is the forward's own

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.prefix is None:
            self.kv.append((k, v))
            return k, v
        pk, pv = self.prefix[layer]
        return torch.cat([pk, k], 2), torch.cat([pv, v], 2)

    def advance(self, n: int) -> None:
        pass


def _distinct(r: Rollout) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Distinct (prompt ids | mask) rows [g, 2 w], each row's index among them [n], and w."""
    width = max(int(r.prompt_mask.sum(1).max()), 1)
    both = torch.cat([r.prompt_ids[:, -width:], r.prompt_mask[:, -width:]], 1)
    unique, of_row = torch.unique(both, dim=0, return_inverse=True)
    return unique, of_row, width


def prompt_chunks(r: Rollout, budget: int | None) -> list[torch.Tensor]:
    """Row positions of `r` in chunks whose distinct prompts take at most `budget` padded
    tokens in one prompt pass (a longer prompt gets a chunk of its own; None: one chunk).
    Prompts go in length order, so a chunk's prompts pad little."""
    if budget is None:
        return [torch.arange(len(r.finished), device=r.finished.device)]
    unique, of_row, width = _distinct(r)
    lens = unique[:, width:].sum(1)
    chunks, members, longest = [], [], 0
    ordered, order = torch.sort(lens, stable=True)
    for g, n in zip(order.tolist(), ordered.tolist()):
        if members and (len(members) + 1) * max(longest, n) > budget:
            chunks.append(members)
            members, longest = [], 0
        members.append(g)
        longest = max(longest, n)
    chunks.append(members)
    return [torch.isin(of_row, torch.tensor(c, device=of_row.device)).nonzero().squeeze(1)
            for c in chunks]


class SharedPrompts:
    """The prompt pass of a batch of rows `r`, once per distinct prompt."""

    def __init__(self, model: CausalLM, r: Rollout, train: bool) -> None:
        unique, self.of_row, width = _distinct(r)
        self.ids, self.mask = unique[:, :width], unique[:, width:]
        record = _PromptCache(self.mask[:, :0])
        hidden = model.model(self.ids, self.mask, record)
        last = hidden[:, -1]                          # predicts each response's first token
        self._graph = [t for kv in record.kv for t in kv] + [last]
        self.leaves = [t.detach().requires_grad_(train) for t in self._graph]
        self.model = model

    @property
    def distinct(self) -> int:
        return len(self.ids)

    def hidden(self, rows: torch.Tensor, r: Rollout) -> torch.Tensor:
        """Final-norm hidden states [m, T, d] predicting the responses of batch rows `rows`
        [m], whose response part is `r` (a micro-batch of those rows)."""
        g = self.of_row[rows]
        first = self.leaves[-1][g][:, None]
        if r.response_ids.shape[1] == 1:
            return first
        # keys of these rows' own longest prompt only (prompts are left-padded): a trimmed
        # `r` (packing.trim) is that wide, with no device sync to find it
        p = min(r.prompt_mask.shape[1], self.mask.shape[1])
        kv = [(self.leaves[2 * i][g, :, -p:], self.leaves[2 * i + 1][g, :, -p:])
              for i in range(len(self.leaves) // 2)]
        rest = self.model.model(r.response_ids[:, :-1], r.response_mask[:, :-1],
                                _PromptCache(self.mask[g, -p:], kv))
        return torch.cat([first, rest], 1)

    def backward(self) -> None:
        """Push the gradients the response passes left on the prompt outputs through the
        prompt pass (once)."""
        pairs = [(out, leaf.grad) for out, leaf in zip(self._graph, self.leaves)
                 if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
