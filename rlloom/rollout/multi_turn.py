"""Multi-turn rollouts: the model writes a turn; a turn that ends in a tool call gets the
tool's result appended (tokens the model reads but is not trained on), and the model writes
the next turn, up to `max_turns` turns or `max_new_tokens` response tokens in all.

Each turn decodes the whole conversation so far as its prompt, so the sampled log-probs are
those of the same tokens at the same positions the trainer scores them at. The calls of a
turn run concurrently (`tools.ToolRunner`); the next turn starts when they have all answered
(or timed out).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from rlloom.rollout.generate import Rollout, left_pad, right_pad
from rlloom.rollout.tools import CALL_END, RESULT, ToolCall, ToolRunner, load_tools, parse_call

# why a conversation ended
ENDS = ("answer", "length", "max_turns", "context")


@dataclass
class Conversation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)     # the response: turns and results
    logprobs: list[float] = field(default_factory=list)  # 0 for inserted tokens
    injected: list[int] = field(default_factory=list)    # 1 for inserted tokens
    turns: int = 0
    calls: int = 0
    errors: int = 0
    tool_s: float = 0.0
    end: str = ""        # one of ENDS once it has ended
    finished: bool = False  # ended by EOS

    def add(self, tokens: list[int], logprobs: list[float], injected: bool) -> None:
        self.tokens += tokens
        self.logprobs += logprobs if not injected else [0.0] * len(tokens)
        self.injected += [int(injected)] * len(tokens)


@dataclass
class Tools:
    """A run's tools and how its turns call them (`rollout.tools`, `rollout.max_turns`);
    `span` wraps each turn's calls (a trace span)."""
    runner: ToolRunner
    max_turns: int
    fmt: str
    span: Callable[[], AbstractContextManager] = nullcontext

    @classmethod
    def of(cls, rollout: Any) -> "Tools | None":
        """The tools of a RolloutSection, or None for single-turn rollouts."""
        if rollout.max_turns == 1:
            return None
        return cls(ToolRunner(load_tools(rollout.tools), rollout.tool_timeout_s,
                              rollout.tool_output_chars), rollout.max_turns, rollout.tool_format)


# generate(prompts, max_new_tokens) -> a Rollout of one turn per prompt
Generate = Callable[[list[list[int]], int], Rollout]


def converse(generate: Generate, prompts: list[list[int]], max_new_tokens: int, tools: Tools,
             decode: Callable[[list[int]], str], encode: Callable[[str], list[int]]
             ) -> list[Conversation]:
    """The conversations of `prompts`. `generate` decodes one turn (ended by EOS, a stop
    string, the call end `</call>` or its token limit); `encode` tokenises a result turn."""
    max_turns, fmt, runner, span = tools.max_turns, tools.fmt, tools.runner, tools.span
    convs = [Conversation(p) for p in prompts]
    for turn in range(max_turns):
        live = [c for c in convs if not c.end]
        if not live:
            break
        room = max(max_new_tokens - len(c.tokens) for c in live)
        r = generate([c.prompt + c.tokens for c in live], room)
        calls: list[tuple[Conversation, ToolCall | str]] = []
        for c, ids, keep, lp, done in zip(live, r.response_ids.tolist(),
                                          r.response_mask.tolist(), r.logprobs.tolist(),
                                          r.finished.tolist()):
            n = min(int(sum(keep)), max_new_tokens - len(c.tokens))
            c.add(ids[:n], lp[:n], injected=False)
            c.turns += 1
            text = decode(ids[:n])
            cut = n < int(sum(keep))  # the response budget ran out inside this turn
            if cut or not text.rstrip().endswith(CALL_END):
                # ended by EOS or a stop string (finished), or by the token limit
                c.end, c.finished = ("answer", True) if done and not cut else ("length", False)
            elif turn == max_turns - 1:
                c.end = "max_turns"
            else:
                try:
                    calls.append((c, parse_call(text, fmt)))
                except ValueError as e:
                    calls.append((c, str(e)))
        if not calls:
            continue
        with span():
            results = runner.run([call for _, call in calls])
        for (c, _), result in zip(calls, results):
            c.calls += 1
            c.errors += result.error
            c.tool_s += result.seconds
            ids = encode(RESULT.format(result.text))
            if len(c.tokens) + len(ids) >= max_new_tokens:
                c.end = "context"  # no room for the result and a turn after it
            else:
                c.add(ids, [], injected=True)
    return convs


def as_rollout(convs: list[Conversation], pad_id: int) -> Rollout:
    """The conversations as one Rollout: prompts left-padded, responses (turns and inserted
    results, `Rollout.injected` marking the latter) right-padded."""
    prompt_ids, prompt_mask = left_pad([c.prompt for c in convs], pad_id)
    response_ids, response_mask = right_pad([c.tokens or [pad_id] for c in convs], pad_id)
    width = response_ids.shape[1]
    for i, c in enumerate(convs):  # an empty response keeps one masked pad column
        if not c.tokens:
            response_mask[i] = 0
    logprobs = torch.tensor([c.logprobs + [0.0] * (width - len(c.logprobs)) for c in convs])
    injected = torch.tensor([c.injected + [0] * (width - len(c.injected)) for c in convs])
    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask, logprobs,
                   torch.tensor([c.finished for c in convs]), injected)


def tool_stats(convs: list[Conversation]) -> torch.Tensor:
    """[n, 4] per conversation: turns, tool calls, tool errors, tool seconds."""
    return torch.tensor([[c.turns, c.calls, c.errors, c.tool_s] for c in convs],
                        dtype=torch.float64)
