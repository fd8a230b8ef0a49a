"""Partial rollouts: responses generated in chunks of at most `chunk` tokens per step, a response
still going when the chunk ends carried to the next step and continued there under that step's
weights (Kimi k1.5's partial rollouts; verl's and AReaL's interruptible generation).

A long response then no longer holds its whole step: a step's generation ends after one chunk
of decoding, and the responses that need more finish in later steps. Each token keeps the
log-prob of the weights that sampled it (the behaviour policy of the decoupled loss) and the
version of those weights. A carried response resumes by prefilling its prompt and the tokens
it has so far under the new weights (AReaL's choice: no key/value cache computed by older
weights is reused).

The pool is plain data, the same on every rank of a generation group: which rows a replica
decodes is a slice of `pending()`, and every rank absorbs every replica's results.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlloom.rollout.generate import Rollout, left_pad, right_pad
from rlloom.rollout.sampling import StopMatcher


@dataclass
class Row:
    group: int            # the pool's group (one prompt's K samples)
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token
    finished: bool = False  # ended by EOS or a stop (False at the token limit)


class PartialPool:
    """Rollouts in flight across steps, grouped by prompt, taken oldest group first."""

    def __init__(self, chunk: int, max_new_tokens: int) -> None:
        """`chunk` divides `max_new_tokens` (checked with the config: a carried response
        resumes with whole chunks)."""
        self.chunk, self.max_new = chunk, max_new_tokens
        self.rows: list[Row] = []
        self.problems: dict[int, Any] = {}  # group -> its problem
        self.next_group = 0
        self.dtype = torch.get_default_dtype()  # of the log-probs, as the engine returns them

    def admit(self, problems: list[Any], prompts: list[list[int]], samples: int) -> None:
        """New prompts (one encoded prompt per problem), `samples` rows each."""
        for problem, prompt in zip(problems, prompts):
            g = self.next_group
            self.next_group += 1
            self.problems[g] = problem
            self.rows += [Row(g, list(prompt)) for _ in range(samples)]

    def pending(self) -> list[int]:
        """Rows still generating, carried ones first (they are the oldest)."""
        return [i for i, r in enumerate(self.rows) if not self._done(r)]

    def _done(self, row: Row) -> bool:
        return row.finished or len(row.tokens) >= self.max_new

    def requests(self, rows: list[int]) -> list[list[int]]:
        """What each row feeds the engine: its prompt and the tokens it has so far."""
        return [self.rows[i].prompt + self.rows[i].tokens for i in rows]

    def absorb(self, rows: list[int], rollout: Rollout, version: int, stops: StopMatcher
               ) -> None:
        """One chunk's results for `rows` (the rollout's rows in that order), sampled by
        weights `version`."""
        self.dtype = rollout.logprobs.dtype
        lengths = rollout.response_lengths.tolist()
        ids, lps = rollout.response_ids.tolist(), rollout.logprobs.tolist()
        for k, i in enumerate(rows):
            row, n = self.rows[i], lengths[k]
            start = len(row.tokens)
            row.tokens += ids[k][:n]
            row.logprobs += lps[k][:n]
            row.versions += [version] * n
            row.finished = bool(rollout.finished[k])
            if start and not row.finished and stops:
                # a stop string across the chunk boundary: the engine saw only its end
                for j in range(start, min(start + stops.window, len(row.tokens))):
                    if stops.hit(row.tokens[:j + 1]):
                        del row.tokens[j + 1:], row.logprobs[j + 1:], row.versions[j + 1:]
                        row.finished = True
                        break

    def complete(self) -> list[int]:
        """Groups whose every row is done, oldest first."""
        open_groups = {r.group for r in self.rows if not self._done(r)}
        return sorted({r.group for r in self.rows} - open_groups)

    def take(self, groups: list[int], pad_id: int
             ) -> tuple[list[Any], Rollout, list[list[int]]]:
        """Remove `groups` from the pool: their problems, their rows as one rollout (a group's
        rows adjacent, in `groups` order) and each row's response tokens' weight versions."""
        keep = set(groups)
        taken = sorted((r for r in self.rows if r.group in keep),
                       key=lambda r: groups.index(r.group))
        self.rows = [r for r in self.rows if r.group not in keep]
        problems = [self.problems.pop(g) for g in groups]
        prompt_ids, prompt_mask = left_pad([r.prompt for r in taken], pad_id)
        response_ids, response_mask = right_pad([r.tokens for r in taken], pad_id)
        width = response_ids.shape[1]
        logprobs = torch.tensor([r.logprobs + [0.0] * (width - len(r.logprobs))
                                 for r in taken], dtype=self.dtype)
        finished = torch.tensor([r.finished for r in taken])
        rollout = Rollout(prompt_ids, prompt_mask, response_ids, response_mask, logprobs,
                          finished)
        return problems, rollout, [r.versions for r in taken]

    def state(self) -> dict[str, Any]:
        return {"rows": [vars(r).copy() for r in self.rows], "problems": dict(self.problems),
                "next_group": self.next_group, "dtype": self.dtype}

    def load_state(self, state: dict[str, Any]) -> None:
        self.rows = [Row(**r) for r in state["rows"]]
        self.problems = dict(state["problems"])
        self.next_group, self.dtype = state["next_group"], state["dtype"]
