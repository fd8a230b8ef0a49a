"""Log-probs and entropies of chosen tokens, computed from hidden states a chunk of tokens at
a time.

A whole micro-batch's logits in fp32 are [tokens, vocab] x 4 B: 20 GB for 32k tokens at a
152k vocabulary, and log_softmax, exp and the entropy's product each make one more of them.
Here the output head runs on `LOGIT_CHUNK_TOKENS` tokens at a time, and under autograd each
chunk is checkpointed: forward keeps only the chunk's hidden states, and backward recomputes
the chunk's logits when it reaches them, so one chunk's logits are alive at a time in either
direction. The results are those of the unchunked computation (same ops per token).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlloom.rollout.sampling import policy_logprobs

# Tokens per chunk. 1,024 x 152k logits are 0.6 GB in fp32; the head's matmul over 1,024
# tokens is still ~1 TFLOP at a 7B model's width, enough to keep a GPU busy.
LOGIT_CHUNK_TOKENS = 1024


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy -sum_v p log p over the last dim of log-probs; zero-probability entries (from
    -inf logits) add exactly 0 and no NaN gradient."""
    probs = logp.exp()
    return -(probs * torch.where(probs > 0, logp, 0)).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                         with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` [...] under softmax(logits [..., V] / temperature) in fp32,
    and the entropies of those distributions when asked."""
    logp = policy_logprobs(logits, temperature)
    chosen = logp.gather(-1, targets[..., None]).squeeze(-1)
    return chosen, entropy_from_logprobs(logp) if with_entropy else None


def token_logprobs(head: nn.Module, hidden: torch.Tensor,
                   targets: torch.Tensor, temperature: float, with_entropy: bool = False,
                   chunk: int = LOGIT_CHUNK_TOKENS
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [...] of `targets` [...] given the hidden states [..., d] that predict them,
    `head` (the output head) mapping hidden states to logits, and entropies [...] when asked; `chunk` tokens'
    logits at a time (see the module's docstring)."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, not {chunk}")
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    # One chunk's saved tensors are what its recompute would hold at the same moment (the
    # head's backward comes first): checkpoint only when there are several.
    recompute = flat_t.numel() > chunk and torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters()))

    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logp, ent = logprobs_from_logits(head(h), t, temperature, with_entropy)
        return torch.stack([logp, ent]) if ent is not None else logp[None]

    parts = [checkpoint(piece, flat_h[i:i + chunk], flat_t[i:i + chunk], use_reentrant=False)
             if recompute else piece(flat_h[i:i + chunk], flat_t[i:i + chunk])
             for i in range(0, flat_t.numel(), chunk)]
    out = torch.cat(parts, 1) if parts else flat_h.new_zeros(1 + with_entropy, 0,
                                                             dtype=torch.float32)
    logp = out[0].reshape(targets.shape)
    return logp, out[1].reshape(targets.shape) if with_entropy else None
