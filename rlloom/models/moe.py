"""Routed-expert blocks: a router over SwiGLU experts, by softmax top k (Qwen3-MoE, Mixtral,
gpt-oss) or DeepSeek-V3's sigmoid scores chosen within the best expert groups, with shared
experts every token runs.

Module names mirror the Hugging Face checkpoint on disk (`mlp.gate.weight`,
`mlp.experts.{i}.gate_proj.weight`, ...), so the block loads without renaming. Plain torch: expert
parallelism (rlloom.parallel.expert_parallel) reuses `route` and `run_experts` from outside.

The router's load-balancing auxiliary loss is not computed: RL post-training here optimises the
policy loss only (as Hugging Face does unless `output_router_logits` is set).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlloom.models.activations import ACT_FNS
from rlloom.models.config import ModelConfig


class Expert(nn.Module):
    """One SwiGLU expert: act(gate(x)) * up(x) through down, without biases (Qwen3-MoE,
    Mixtral), or gpt-oss's with biases and a clamped gate: (clamp(up, -limit, limit) + 1) *
    g * sigmoid(alpha * g) with g = min(gate, limit)."""

    def __init__(self, cfg: ModelConfig, ffn: int = 0) -> None:
        """`ffn`: the hidden width (default: one expert's; DeepSeek's shared experts are one
        of n_shared_experts times it)."""
        super().__init__()
        hidden, ffn, bias = cfg.hidden_size, ffn or cfg.moe_intermediate_size, cfg.expert_bias
        self.gate_proj = nn.Linear(hidden, ffn, bias=bias)
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)
        self.act, self.limit, self.alpha = ACT_FNS[cfg.hidden_act], cfg.swiglu_limit, \
            cfg.swiglu_alpha
        self.tp_group: dist.ProcessGroup | None = None   # set by tensor parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under tensor parallelism the weights are DTensor shards (gate/up by output features,
        # down by input features): each rank computes its part of the output's sum.
        gate, up = (F.linear(x, local(m.weight), local(m.bias))
                    for m in (self.gate_proj, self.up_proj))
        if self.limit is None:
            h = self.act(gate) * up
        else:
            g = gate.clamp(max=self.limit)
            h = (up.clamp(-self.limit, self.limit) + 1) * g * torch.sigmoid(g * self.alpha)
        bias = local(self.down_proj.bias)
        if bias is not None and self.tp_group is not None:
            # each rank's output is a part of the sum: each adds its share of the whole bias,
            # whose gradient is then the sum of the shares' (the same on every rank)
            bias = _SumGrads.apply(bias, self.tp_group) / dist.get_world_size(self.tp_group)
        return F.linear(h, local(self.down_proj.weight), bias)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a parameter tensor parallelism made a DTensor (else itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


class _SumGrads(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over a process group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def split_expert_inputs(flat: torch.Tensor, weights: torch.Tensor,
                        tp_group: dist.ProcessGroup | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and combine weights the experts of a block use. When tensor parallelism
    splits every expert's features over `tp_group`, each rank's experts give a part of the
    output's sum, so the gradients reaching the (replicated) tokens and weights through
    them are parts too: summed over the group, they are the whole. The router's own
    path is replicated and is left alone."""
    if tp_group is None:
        return flat, weights
    return _SumGrads.apply(flat, tp_group), _SumGrads.apply(weights, tp_group)


@dataclass(frozen=True)
class Routing:
    """How a block picks its k experts from router logits and weights them: softmax
    probabilities' top k (Qwen3-MoE, Mixtral, gpt-oss), or DeepSeek-V3's sigmoid scores,
    chosen by score plus the block's correction bias among the experts of the `topk_group`
    groups (of `n_group`) whose two best biased scores sum highest, weighted by their
    unbiased scores; renormalised to sum to 1 when `norm_topk_prob`, times `scale`."""
    k: int
    norm_topk_prob: bool
    sigmoid: bool = False
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Routing":
        return cls(cfg.experts_per_token, cfg.norm_topk_prob, cfg.moe_scoring == "sigmoid",
                   cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """In at least fp32 like the references, fp64 kept in fp64 (tight parallel tests)."""
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return wide.sigmoid() if self.sigmoid else wide.softmax(-1)

    def top(self, scores: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The k chosen experts [tokens, k] of `scores` [tokens, experts]."""
        if not self.sigmoid:
            return scores.topk(self.k, dim=-1).indices
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        if self.n_group > 1:
            groups = choice.view(choice.shape[0], self.n_group, -1)
            best = groups.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        return choice.topk(self.k, dim=-1).indices

    def weights(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        w = scores.gather(-1, experts)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + (1e-20 if self.sigmoid else 0.0))
        return w * self.scale if self.scale != 1.0 else w


def route(router_logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None = None,
          forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine weights [tokens, k] and expert indices [tokens, k] from logits [tokens,
    experts]: `routing`'s choice (with DeepSeek's correction `bias`), or the experts `forced`
    [tokens, k] names (routing replay; -1: the own choice)."""
    scores = routing.scores(router_logits)
    experts = routing.top(scores, bias)
    if forced is not None:
        experts = torch.where(forced >= 0, forced, experts)
    return routing.weights(scores, experts).to(router_logits.dtype), experts


class Routes:
    """The experts each token was routed to, shared by a model's MoE blocks for one pass:
    recorded while generating (`recorded`, each block's last [tokens, k]), or replayed while
    training (`replay` [batch, seq, moe layers, k] in the input's token order, -1 where none
    was recorded; `order` the packed order of the pass's tokens, set by the backbone).
    `matched` / `counted` count the tokens whose own top k equals the replayed set."""

    def __init__(self, replay: torch.Tensor | None = None) -> None:
        self.replay, self.order = replay, None
        self.recorded: dict[int, torch.Tensor] = {}
        self.matched = self.counted = 0

    def choose(self, index: int, logits: torch.Tensor, routing: Routing,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of MoE layer `index`'s flat tokens from their router logits."""
        if self.replay is None:
            weights, experts = route(logits, routing, bias)
            self.recorded[index] = experts.detach()
            return weights, experts
        k = routing.k
        forced = self.replay[:, :, index]
        if self.order is not None:
            forced = forced.gather(1, self.order[..., None].expand(-1, -1, k))
        forced = forced.reshape(-1, k).to(torch.long)
        own = routing.top(routing.scores(logits), bias)
        known = (forced >= 0).all(-1)
        same = (own.sort(-1).values == forced.sort(-1).values).all(-1)
        self.matched += (same & known).sum()
        self.counted += known.sum()
        return route(logits, routing, bias, forced)


@contextmanager
def routing(model: nn.Module, replay: torch.Tensor | None = None) -> Iterator[Routes]:
    """Every MoE block of `model` records its routing (`replay` None) or replays `replay`
    for the duration; the backbone tells them how its pass packs the tokens."""
    routes = Routes(replay)
    users = [m for m in model.modules() if hasattr(m, "routes")]
    for m in users:
        m.routes = routes
    try:
        yield routes
    finally:
        for m in users:
            m.routes = None


def run_experts(experts: Iterable[tuple[int, nn.Module]], x: torch.Tensor,
                expert_ids: torch.Tensor) -> torch.Tensor:
    """Each row of x [rows, hidden] through the expert named by expert_ids [rows].

    `experts` yields (expert index, module) pairs; rows whose expert is not among them stay zero,
    which is what expert parallelism relies on when it passes only the local experts. Experts
    with no rows still run (on zero rows) so the autograd graph has the same shape on every
    rank: distributed backward passes must issue the same collectives everywhere.
    """
    experts = list(experts)
    out = torch.zeros_like(x)
    for (_, expert), rows in zip(experts, rows_by_expert(expert_ids, [e for e, _ in experts])):
        out = out.index_copy(0, rows, expert(x[rows]))
    return out


def rows_by_expert(expert_ids: torch.Tensor, experts: list[int]) -> list[torch.Tensor]:
    """The indices of the rows routed to each of `experts` (the rehearsal replaces this
    data-dependent step with an even split)."""
    return [(expert_ids == e).nonzero(as_tuple=True)[0] for e in experts]


def choose(block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE block's (`MoEBlock`, or its expert-parallel form) routing of its flat tokens:
    its top k, recorded or replaced by a replay while `routing` is on."""
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if block.routes is None:
        return route(logits, block.routing, bias)
    return block.routes.choose(block.moe_index, logits, block.routing, bias)


class CorrectedRouter(nn.Linear):
    """DeepSeek-V3's router: logits in at least fp32 (autocast's bf16 would move which
    experts win), beside the per-expert correction bias its choice adds
    (`e_score_correction_bias`, a buffer set by DeepSeek's load balancing, not trained) that
    stays in at least fp32 when the model is cast to bf16 (a reference, a generation copy),
    as transformers and vLLM keep it."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__(hidden, experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(wide), local(self.weight).to(wide))

    def _apply(self, fn: Any, recurse: bool = True) -> "CorrectedRouter":
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias  # cast, maybe rounded: taken from the original
        self.e_score_correction_bias = bias.to(
            moved.device, torch.promote_types(moved.dtype, torch.float32))
        return self


class MoEBlock(nn.Module):
    """Router `gate` + `experts` (+ `shared_experts`); forward maps hidden [batch, seq, d] to
    [batch, seq, d]."""

    def __init__(self, cfg: ModelConfig, moe_index: int = 0) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.routing = Routing.of(cfg)
        self.gate = (CorrectedRouter(cfg.hidden_size, cfg.n_experts) if self.routing.sigmoid
                     else nn.Linear(cfg.hidden_size, cfg.n_experts, bias=cfg.router_bias))
        self.tp_group: dist.ProcessGroup | None = None   # set by tensor parallelism
        self.moe_index = moe_index                       # among the model's MoE layers
        self.routes: Routes | None = None                # set by `routing`
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_experts))
        self.shared_experts = (Expert(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """weights, expert indices  # [tokens, k] for flat tokens x [tokens, d]."""
        return choose(self, self.gate(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                       # [tokens, d]
        weights, chosen = self.route(flat)
        flat, weights = split_expert_inputs(flat, weights, self.tp_group)
        # One row per (token, slot) pair, so each expert sees a dense batch of its rows.
        token = torch.arange(flat.shape[0], device=x.device).repeat_interleave(self.top_k)
        out = run_experts(enumerate(self.experts), flat[token], chosen.reshape(-1))
        out = out * weights.reshape(-1, 1)
        out = torch.zeros_like(flat).index_add(0, token, out).view_as(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)
