"""Tokenising prompts, decoding responses, and scoring token sequences with a model."""
from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.data.chat import Prompt, is_chat
from rlloom.models.heads import ActorCritic, ValueModel
from rlloom.models.logprobs import token_logprobs
from rlloom.models.transformer import CausalLM
from rlloom.parallel.context_parallel import on_shards
from rlloom.rollout.generate import Rollout, left_pad, right_pad
from rlloom.runtime.stages.shared_prompt import SharedPrompts


def encode(tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt]) -> list[list[int]]:
    """Token ids of each prompt, rendered by the tokenizer's chat template when it has one
    (instruction-tuned checkpoints expect it; a text prompt is one user turn), else as plain
    text. Chat turns need a template: `check_prompts` refuses them before a run."""
    if not tokenizer.chat_template:
        return [tokenizer(p)["input_ids"] for p in prompts]
    return [tokenizer.apply_chat_template(
        p if is_chat(p) else [{"role": "user", "content": p}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"] for p in prompts]


def decode_responses(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    # one copy to the host instead of one per row
    ids, mask = rollout.response_ids.cpu(), rollout.response_mask.cpu()
    return [tokenizer.decode(row[keep.bool()].tolist(), skip_special_tokens=True)
            for row, keep in zip(ids, mask)]


def teacher_forced(tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt],
                   responses: list[str]) -> Rollout:
    """Prompt + given response (+ EOS) rows in generation's layout, for SFT and DPO (on the
    CPU: move them to the model's device)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    p_ids, p_mask = left_pad(encode(tokenizer, prompts), pad)
    r_ids, r_mask = right_pad([tokenizer(r, add_special_tokens=False)["input_ids"] + [eos]
                               for r in responses], pad)
    return Rollout(p_ids, p_mask, r_ids, r_mask, torch.zeros(r_ids.shape),
                   torch.ones(len(prompts), dtype=torch.bool))


def joined(r: Rollout) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """Prompt+response ids and mask, and the slice of positions that predict the response.

    The layout (left-padded prompt, right-padded response) is the one generation used, so
    positions and numerics match the log-probs recorded while sampling.
    """
    p, t = r.prompt_ids.shape[1], r.response_ids.shape[1]
    return (torch.cat([r.prompt_ids, r.response_ids], 1),
            torch.cat([r.prompt_mask, r.response_mask], 1), slice(p - 1, p + t - 1))


def response_logprobs(model: CausalLM, r: Rollout, temperature: float,
                      with_entropy: bool = False, prompts: SharedPrompts | None = None,
                      rows: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs [n, T] of the response tokens, entropies [n, T] (when asked; with gradient)
    and, for a shared actor-critic, values [n, T] of the state before each token.

    With `prompts` (the prompt pass of a batch, see shared_prompt.py) `r` holds that batch's
    rows `rows` and only their responses are run."""
    if prompts is not None:
        hidden = prompts.hidden(rows, r)
    else:
        ids, mask, span = joined(r)
        hidden = on_shards(model, model.hidden, ids, mask)[:, span]
    # the value head and the (chunked) output head see response positions only
    values = model.score(hidden).squeeze(-1) if isinstance(model, ActorCritic) else None
    logp, entropy = token_logprobs(model.lm_head, hidden, r.response_ids, temperature,
                                   with_entropy)
    return logp, entropy, values


def response_values(critic: ValueModel | ActorCritic, r: Rollout) -> torch.Tensor:
    """Critic values [n, T] of the state before each response token (without computing
    logits, also for a shared actor-critic)."""
    ids, mask, span = joined(r)
    if isinstance(critic, ActorCritic):
        return on_shards(critic, critic.values, ids, mask)[:, span]
    return on_shards(critic, critic, ids, mask)[:, span]


def sequence_scores(model: ValueModel, r: Rollout) -> torch.Tensor:
    """A reward model's score [n] of each prompt + response, read at the last response token."""
    ids, mask, _ = joined(r)
    last = r.prompt_ids.shape[1] + r.response_lengths - 1
    return model(ids, mask).gather(1, last[:, None]).squeeze(1)
