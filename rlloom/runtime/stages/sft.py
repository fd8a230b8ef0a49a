"""Supervised fine-tuning on worked solutions: the warm start before RL."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.data.synthetic import Problem
from rlloom.models.transformer import CausalLM
from rlloom.runtime.device import model_device
from rlloom.runtime.outputs.progress import progress_bar
from rlloom.runtime.stages.batch import response_logprobs, teacher_forced


def mix_direct_answers(problems: list[Problem], fraction: float, seed: int) -> list[Problem]:
    """Replace the worked solution by its bare final-answer line ("A:...") in `fraction` of
    the problems, as in distilled data that mixes reasoning traces with short answers."""
    rng = random.Random(seed)
    return [replace(p, solution=p.solution[p.solution.rfind("A:"):])
            if rng.random() < fraction and "A:" in p.solution else p for p in problems]


def supervised_finetune(model: CausalLM, tokenizer: PreTrainedTokenizerBase,
                        problems: list[Problem], steps: int, batch_size: int, lr: float,
                        seed: int) -> list[float]:
    """Minimise the NLL of `solution + EOS` given the prompt; returns the loss per step.

    Warm-up then cosine decay: a short run must still end at a small learning rate. Trains
    on the model's device.
    """
    if any(not p.solution for p in problems):
        raise ValueError("supervised fine-tuning needs a 'solution' for every problem")
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    losses = []
    device = model_device(model)
    with progress_bar("sft", steps) as bar:
        for _ in range(steps):
            # with fewer problems than a batch, some repeat
            batch = (rng.sample(problems, batch_size) if len(problems) >= batch_size
                     else rng.choices(problems, k=batch_size))
            seqs = teacher_forced(tokenizer, [p.prompt for p in batch],
                                  [p.solution for p in batch]).to(device)
            logp, _, _ = response_logprobs(model, seqs, temperature=1.0)
            loss = -(logp * seqs.response_mask).sum() / seqs.response_mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            bar.advance(loss=losses[-1])
    return losses
