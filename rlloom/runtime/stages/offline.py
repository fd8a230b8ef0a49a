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


EVAL_PAIRS = 64  # held-out pairs per forward pass


def _logratios(policy: CausalLM, reference: CausalLM, tokenizer: PreTrainedTokenizerBase,
               pairs: list[PreferencePair]) -> tuple[torch.Tensor, ...]:
    """Sequence log-probs [n] of the chosen and rejected responses under the policy, then
    under the reference."""
    batch = pair_batch(tokenizer, pairs).to(model_device(policy))
    n = len(pairs)
    # a LoRA policy is its own reference, with its adapters off
    with torch.no_grad(), adapters_disabled(reference):
        ref = sequence_logprobs(reference, batch)
    pol = sequence_logprobs(policy, batch)
    return pol[:n], pol[n:], ref[:n], ref[n:]


def _pair_stats(algo: AlgoSection, pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor,
                rr: torch.Tensor) -> dict[str, float]:
    """Sums over the pairs (TRL's rewards/*: beta times the log-ratio to the reference)."""
    chosen, rejected = algo.beta * (pc - rc).detach(), algo.beta * (pr - rr).detach()
    return {"pref_accuracy": preference_accuracy(pc, pr, rc, rr).item() * len(pc),
            "margin": (chosen - rejected).sum().item(),
            "chosen_reward": chosen.sum().item(), "rejected_reward": rejected.sum().item()}


def preference_step(policy: CausalLM, reference: CausalLM, optimizer: torch.optim.Optimizer,
                    tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair],
                    algo: AlgoSection, grad_clip: float, on_nonfinite: str = "stop"
                    ) -> dict[str, float]:
    pc, pr, rc, rr = _logratios(policy, reference, tokenizer, pairs)
    loss = PREFERENCE_LOSSES.get(algo.preference_loss)(pc, pr, rc, rr, algo.beta).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
    if not nonfinite.finite(grad_norm):  # train.on_nonfinite (stages/nonfinite.py)
        optimizer.zero_grad(set_to_none=True)
        return ({"nonfinite": nonfinite.code("preference loss or gradient norm")}
                if on_nonfinite == "stop" else {"nonfinite_skips": 1.0})
    optimizer.step()
    stats = {k: v / len(pairs) for k, v in _pair_stats(algo, pc, pr, rc, rr).items()}
    return {"loss": loss.item(), "grad_norm": grad_norm.item(), **stats}


@torch.no_grad()
def preference_eval(policy: CausalLM, reference: CausalLM, tokenizer: PreTrainedTokenizerBase,
                    pairs: list[PreferencePair], algo: AlgoSection) -> dict[str, float]:
    """Held-out pairs as TRL's DPO evaluates them: `eval/loss`, `eval/pref_accuracy` (the
    run's score), `eval/margin`, `eval/chosen_reward` and `eval/rejected_reward`, means over
    the pairs."""
    sums: dict[str, float] = {}
    for start in range(0, len(pairs), EVAL_PAIRS):
        part = pairs[start:start + EVAL_PAIRS]
        pc, pr, rc, rr = _logratios(policy, reference, tokenizer, part)
        losses = PREFERENCE_LOSSES.get(algo.preference_loss)(pc, pr, rc, rr, algo.beta)
        for k, v in {"loss": losses.sum().item(), **_pair_stats(algo, pc, pr, rc, rr)}.items():
            sums[k] = sums.get(k, 0.0) + v
    out = {f"eval/{k}": v / len(pairs) for k, v in sums.items()}
    return {**out, "score": out["eval/pref_accuracy"]}
