"""Offline preference optimisation (DPO / IPO): no generation, no reward model."""
from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.algos.preference import PREFERENCE_LOSSES, preference_accuracy
from rlloom.config import AlgoSection
from rlloom.data.preferences import PreferencePair
from rlloom.models.lora import adapters_disabled
from rlloom.models.transformer import CausalLM
from rlloom.rollout.generate import Rollout
from rlloom.runtime.device import model_device
from rlloom.runtime.stages import nonfinite
from rlloom.runtime.stages.batch import response_logprobs, teacher_forced


def pair_batch(tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair]) -> Rollout:
    """Chosen responses in rows [0, n), rejected in [n, 2n), each ending with EOS."""
    return teacher_forced(tokenizer, [p.prompt for p in pairs] * 2,
                          [p.chosen for p in pairs] + [p.rejected for p in pairs])


def sequence_logprobs(model: CausalLM, batch: Rollout) -> torch.Tensor:
    logp, _, _ = response_logprobs(model, batch, temperature=1.0)
    return (logp * batch.response_mask).sum(1)


def preference_step(policy: CausalLM, reference: CausalLM, optimizer: torch.optim.Optimizer,
                    tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair],
                    algo: AlgoSection, grad_clip: float, on_nonfinite: str = "stop"
                    ) -> dict[str, float]:
    batch = pair_batch(tokenizer, pairs).to(model_device(policy))
    n = len(pairs)
    # a LoRA policy is its own reference, with its adapters off
    with torch.no_grad(), adapters_disabled(reference):
        ref = sequence_logprobs(reference, batch)
    pol = sequence_logprobs(policy, batch)
    loss = PREFERENCE_LOSSES.get(algo.preference_loss)(pol[:n], pol[n:], ref[:n], ref[n:],
                                                       algo.beta).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
    if not nonfinite.finite(grad_norm):  # train.on_nonfinite (stages/nonfinite.py)
        optimizer.zero_grad(set_to_none=True)
        return ({"nonfinite": nonfinite.code("preference loss or gradient norm")}
                if on_nonfinite == "stop" else {"nonfinite_skips": 1.0})
    optimizer.step()
    margin = ((pol[:n] - ref[:n]) - (pol[n:] - ref[n:])).detach()
    return {"loss": loss.item(), "grad_norm": grad_norm.item(),
            "pref_accuracy": preference_accuracy(pol[:n], pol[n:], ref[:n], ref[n:]).item(),
            "margin": algo.beta * margin.mean().item()}
