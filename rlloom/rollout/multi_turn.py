"""Multi-turn rollouts: the model writes a turn; a turn that ends in a tool call gets the
tool's result appended (tokens the model reads but is not trained on), and the model writes
the next turn, up to `max_turns` turns or `max_new_tokens` response tokens in all.

`Dialogue` holds the rules (why a conversation ends, what a call's result inserts) and the
per-conversation stats; two drivers apply them. The engine (rollout/engine.py) keeps each
conversation in its KV slot across turns: a slot waiting on its tool is parked while the
other slots decode, and the result is extended onto the cached keys. `Dialogue.converse` is
the reference for models the engine cannot drive (sharded layouts, `rollout.engine: plain`):
each turn decodes the whole conversation so far as its prompt, and the next turn starts when
all of a turn's calls have answered. Either way the sampled log-probs are those of the same
tokens at the same positions the trainer scores them at.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from rlloom.rollout.generate import Rollout, left_pad, right_pad
from rlloom.rollout.tools import CALL_END, RESULT, Pending, ToolRunner, load_tools, parse_call

# why a conversation ended
ENDS = ("answer", "length", "max_turns", "context")


@dataclass
class Conversation:
    """One conversation's stats and why it ended."""
    turns: int = 0
    calls: int = 0
    errors: int = 0
    tool_s: float = 0.0
    end: str = ""        # one of ENDS once it has ended

    @property
    def finished(self) -> bool:
        """Ended by EOS or a stop string in a turn that is not a call."""
        return self.end == "answer"


@dataclass
class Tools:
    """A run's tools and how its turns call them (`rollout.tools`, `rollout.max_turns`);
    `span` opens a trace span, held while any of a generation call's tools runs."""
    runner: ToolRunner
    max_turns: int
    fmt: str
    span: Callable[[], AbstractContextManager] = nullcontext

    @classmethod
    def of(cls, rollout: Any, isolation: str = "strict") -> "Tools | None":
        """The tools of a RolloutSection, or None for single-turn rollouts; `isolation` is
        the sandbox's for the python tool (`reward.sandbox_isolation`)."""
        if rollout.max_turns == 1:
            return None
        return cls(ToolRunner(load_tools(rollout.tools, isolation), rollout.tool_timeout_s,
                              rollout.tool_output_chars), rollout.max_turns, rollout.tool_format)


# generate(prompts, max_new_tokens) -> a Rollout of one turn per prompt
Generate = Callable[[list[list[int]], int], Rollout]


class Dialogue:
    """The conversations of one generation call: `n` of them, `max_new_tokens` response
    tokens each (turns and results). `decode` reads a turn's text; `encode` tokenises a
    result turn."""

    def __init__(self, tools: Tools, n: int, max_new_tokens: int,
                 decode: Callable[[list[int]], str], encode: Callable[[str], list[int]]) -> None:
        self.tools, self.max_new_tokens = tools, max_new_tokens
        self.decode, self.encode = decode, encode
        self.convs = [Conversation() for _ in range(n)]
        self._running = 0
        self._span: AbstractContextManager | None = None

    def turn_end(self, i: int, turn: list[int], finished: bool) -> Pending | None:
        """Conversation `i`'s model turn `turn` ended, by EOS or a stop (`finished`) or by
        the response budget: the tool call it makes, started, or None once it has ended."""
        c = self.convs[i]
        c.turns += 1
        text = self.decode(turn)
        if not finished:
            c.end = "length"
        elif not text.rstrip().endswith(CALL_END):
            c.end = "answer"
        elif c.turns == self.tools.max_turns:
            c.end = "max_turns"
        if c.end:
            return None
        try:
            call = parse_call(text, self.tools.fmt)
        except ValueError as e:
            call = str(e)
        if self._running == 0:
            self._span = self.tools.span()
            self._span.__enter__()
        self._running += 1
        return self.tools.runner.start(call)

    def result(self, i: int, pending: Pending, used: int) -> list[int] | None:
        """The tokens conversation `i` reads back for its call (waiting for it if need be),
        `used` response tokens in; None when they leave no room for a turn after them (the
        conversation ends)."""
        r = pending.result()
        self._running -= 1
        if self._running == 0:
            self._span.__exit__(None, None, None)
        c = self.convs[i]
        c.calls += 1
        c.errors += r.error
        c.tool_s += r.seconds
        ids = self.encode(RESULT.format(r.text))
        if used + len(ids) >= self.max_new_tokens:
            c.end = "context"
            return None
        return ids

    def stats(self) -> torch.Tensor:
        """[n, 4] per conversation: turns, tool calls, tool errors, tool seconds."""
        return torch.tensor([[c.turns, c.calls, c.errors, c.tool_s] for c in self.convs],
                            dtype=torch.float64)

    def finished(self) -> torch.Tensor:
        return torch.tensor([c.finished for c in self.convs])

    def converse(self, generate: Generate, prompts: list[list[int]], pad_id: int) -> Rollout:
        """The reference driver: every turn re-decodes each live conversation from its
        prompt (`generate` one turn per row, ended by EOS, a stop string, the call end or its
        token limit), and waits for all of the turn's calls."""
        n, budget = len(prompts), self.max_new_tokens
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        injected: list[list[int]] = [[] for _ in range(n)]
        while live := [i for i in range(n) if not self.convs[i].end]:
            room = max(budget - len(tokens[i]) for i in live)
            r = generate([prompts[i] + tokens[i] for i in live], room)
            calls: list[tuple[int, Pending]] = []
            for i, ids, keep, lp, done in zip(live, r.response_ids.tolist(),
                                              r.response_mask.tolist(), r.logprobs.tolist(),
                                              r.finished.tolist()):
                n_tok = min(int(sum(keep)), budget - len(tokens[i]))
                tokens[i] += ids[:n_tok]
                logprobs[i] += lp[:n_tok]
                injected[i] += [0] * n_tok
                # cut: the response budget ran out inside this turn
                pending = self.turn_end(i, ids[:n_tok], done and n_tok == int(sum(keep)))
                if pending is not None:
                    calls.append((i, pending))
            for i, pending in calls:
                ids = self.result(i, pending, len(tokens[i]))
                if ids is not None:
                    tokens[i] += ids
                    logprobs[i] += [0.0] * len(ids)
                    injected[i] += [1] * len(ids)
        prompt_ids, prompt_mask = left_pad(prompts, pad_id)
        # an empty response keeps one masked pad column
        response_ids, response_mask = right_pad([t or [pad_id] for t in tokens], pad_id)
        response_mask *= torch.tensor([[bool(t)] for t in tokens])
        width = response_ids.shape[1]
        return Rollout(prompt_ids, prompt_mask, response_ids, response_mask,
                       torch.tensor([lp + [0.0] * (width - len(lp)) for lp in logprobs]),
                       self.finished(),
                       torch.tensor([x + [0] * (width - len(x)) for x in injected]))
