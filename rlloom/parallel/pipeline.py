"""Pipeline parallelism: the decoder layers of a CausalLM (or of a ValueModel, a critic) in
contiguous stages, one per rank of a pipeline group, run with `torch.distributed.pipelining`.

Stage 0 holds the token embedding, the last stage the final norm and the output head. An
actor's last stage hands over its final hidden states [mb, seq, d] in the matmuls' dtype, and
the loss (or the scorer) runs the lm_head on them a chunk of tokens at a time
(`models.logprobs.token_logprobs`), so no [seq, vocab] logits exist at once; a value
model's stage gives its values [mb, seq]; a shared actor-critic's the hidden states with the
value appended, [mb, seq, d + 1], one tensor so the schedule sends and slices one output.
Training
runs the 1F1B schedule (at most `n_stages` microbatches of activations alive per stage);
scoring runs a forward-only schedule (GPipe with no loss: without a backward pass 1F1B and
GPipe issue the same forwards, and 1F1B's own `eval` path insists on a loss and a target).

Every rank passes the same whole batch: the first stage reads `input_ids`, every stage reads
`attention_mask` (it is cheap and gives each stage its rotary positions and causal mask without
sending them down the pipe), the last stage reads `target`. Microbatches are equal slices of
the batch along dim 0.

Losses are summed over microbatches, never averaged (`scale_grads=False`): the loss function
returns a microbatch's *sum* of per-token terms divided by a normaliser computed over the
whole batch (for data x pipeline parallelism, over the whole global batch), so the summed
pipelined loss and its gradients equal the single-process loss of the batch and its gradients.

Tied input and output embeddings (most small checkpoints) live on both the first and the last
stage; their two gradients are summed over the pair of them (`sync_tied_grads`), so both
copies take the same optimizer step, as the one weight does in one process.

With tensor parallelism (`tp_mesh`) each stage's decoder layers are sharded as
`tensor_parallel` shards them; the residual stream enters a stage's first layer as a DTensor
split on the sequence and leaves its last layer gathered whole, so what passes between
stages, and the embedding, final norm and head, stay plain and replicated over the tp ranks
(each tp rank of a stage talks to the same tp rank of the next).

With context parallelism (`cp_group`) each cp rank of a stage runs its contiguous shard of
every sequence (padded to a multiple of cp), attention gathering keys and values along the
sequence as `context_parallel` does; the last stage gathers its outputs back whole, so the
loss sees whole sequences on every cp rank and the gradients are cp times their share:
average them over the cp group (`ranks.Share.reduce`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from rlloom.models.heads import ActorCritic, ValueModel
from rlloom.models.transformer import (
    CausalLM,
    matmul_input,
    packed_order,
    packed_positions,
    rope_kind,
    rope_tables,
    unpack,
    window_masks,
)
from rlloom.parallel.context_parallel import KVGather, PackedShard, gather_sequence
from rlloom.parallel.data_parallel import local_tensor
from rlloom.parallel.expert_parallel import all_experts, is_expert_parameter
from rlloom.parallel.grads import scale_grads, squared_norm
from rlloom.parallel.tensor_parallel import shard_layer

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_layers(num_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage; earlier stages take one extra when uneven."""
    if not 1 <= n_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {n_stages} pipeline stages; "
                         f"use pp in 1..{num_layers}")
    base, extra = divmod(num_layers, n_stages)
    starts = [i * base + min(i, extra) for i in range(n_stages + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(n_stages)]


class StageModule(nn.Module):
    """One stage of a CausalLM or ValueModel. It shares (does not copy) the model's modules,
    and its parameter names are the full model's (`model.layers.5.mlp.up_proj.weight`), so
    per-stage state dicts merge into a checkpoint by plain union."""

    def __init__(self, model: CausalLM | ValueModel, stage: int, n_stages: int,
                 tp_mesh: DeviceMesh | None = None, cp_group: dist.ProcessGroup | None = None
                 ) -> None:
        super().__init__()
        cfg = model.config
        self.config, self.tp_mesh, self.cp_group = cfg, tp_mesh, cp_group
        self.seq = 0  # the unpadded sequence length of the call (under cp)
        self.values = isinstance(model, ValueModel)
        self.both = isinstance(model, ActorCritic)  # logits and values
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.layer_ids = stage_layers(cfg.num_layers, n_stages)[stage]
        self.model = nn.Module()
        if self.is_first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i]
                                           for i in self.layer_ids})
        if self.is_last:
            self.model.norm = model.model.norm
            if self.values or self.both:
                self.score = model.score
            if not self.values:
                self.lm_head = model.lm_head
        if tp_mesh is not None:
            for layer in self.model.layers.values():
                shard_layer(layer, tp_mesh)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids [mb, seq] (first stage) or hidden [mb, seq, d] -> hidden, on the last
        stage the final hidden states in the matmuls' dtype (values [mb, seq] of a value
        model, both as [mb, seq, d + 1] of a shared actor-critic)."""
        # packed rows, as `Backbone` runs a pass without a cache: causal, no mask; under CP
        # this rank's shard of them (`context_parallel.PackedShard`), unpacked once gathered
        cache, longest, order, shard = None, None, None, None
        if self.cp_group is not None:
            length = attention_mask.shape[1] // dist.get_world_size(self.cp_group)
            start = dist.get_rank(self.cp_group) * length
            shard = PackedShard.of(self.config, attention_mask, start, length)
            positions, masks, longest = shard.positions, shard.masks, shard.longest
            cache = KVGather(self.cp_group, shard.keys)
            if self.is_first:
                x = x.gather(1, shard.order)[:, start:start + length]
        else:
            order = packed_order(attention_mask)
            positions = packed_positions(attention_mask, order)
            masks = window_masks(self.config, attention_mask.shape[1], attention_mask.device)
            if self.is_first:
                x = x.gather(1, order)
        if self.is_first:
            x = self.model.embed_tokens(x, positions)
        ropes = rope_tables(positions, self.config, x.dtype, longest)
        if self.tp_mesh is not None:
            x = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False
                                   ).redistribute(self.tp_mesh, [Shard(1)])
        for i, layer in self.model.layers.items():
            x = layer(x, *ropes[rope_kind(self.config, int(i))], masks[int(i)], cache, int(i))
        if self.tp_mesh is not None:
            x = x.full_tensor()
        if self.is_last:
            x = self.model.norm(x)
            if order is not None:
                x = unpack(x, order)
            if self.values:
                x = self.score(x).squeeze(-1)
            else:
                x = matmul_input(x)
                if self.both:
                    x = torch.cat([x, self.score(x).to(x.dtype)], -1)
            if shard is not None:
                x = unpack(gather_sequence(x.contiguous(), 1, self.cp_group),
                           shard.order)[:, :self.seq]
        return x


class PipelinedModel:
    """Runs a CausalLM (or ValueModel) split over the ranks of `group` (default: the world).

    Gradients accumulate into the stage's parameters (`.grad`) like `loss.backward()`; zero them
    between steps. Stages are rebuilt per call with static shapes, so batches of different
    lengths need no warm-up and no re-tracing; the cost is one small handshake per call.
    """

    def __init__(self, model: CausalLM | ValueModel, group: dist.ProcessGroup | None = None,
                 n_microbatches: int | None = None, tied_group: dist.ProcessGroup | None = None,
                 tp_mesh: DeviceMesh | None = None, cp_group: dist.ProcessGroup | None = None
                 ) -> None:
        """`n_microbatches` (default: one per stage, the fewest 1F1B accepts) must divide
        every batch. `tied_group`: the first and last stage's ranks, for a model with tied
        embeddings over more than 2 stages (with 2, the pipeline group is that pair).
        `tp_mesh`: the tensor-parallel ranks that share this stage; `cp_group`: the ranks
        that each run a shard of its sequences."""
        self.group = group
        self.rank = dist.get_rank(group)
        self.n_stages = dist.get_world_size(group)
        self.n_microbatches = n_microbatches or self.n_stages
        if self.n_microbatches < self.n_stages:
            raise ValueError(f"1F1B needs at least one microbatch per stage: n_microbatches="
                             f"{self.n_microbatches} < pp={self.n_stages}")
        self.module = StageModule(model, self.rank, self.n_stages, tp_mesh, cp_group)
        self.cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.last_rank = (self.n_stages - 1 if group is None
                          else dist.get_global_rank(group, self.n_stages - 1))
        self.tied = (model.config.tie_word_embeddings and self.n_stages > 1
                     and not self.module.values)
        if self.tied and self.n_stages > 2 and tied_group is None:
            raise ValueError("tied embeddings over more than 2 stages need `tied_group`, the "
                             "process group of the first and last stage")
        self.tied_group = tied_group if self.n_stages > 2 else group

    def parameters(self) -> Iterator[nn.Parameter]:
        """This stage's parameters (what its optimizer steps)."""
        return self.module.parameters()

    def _tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of a tied embedding (None when it holds none)."""
        if not self.tied:
            return None
        if self.module.is_first:
            return self.module.model.embed_tokens.weight
        return self.module.lm_head.weight if self.module.is_last else None

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the first and last stage's gradients of a tied embedding (a collective of the
        two; no-op elsewhere)."""
        weight = self._tied_weight()
        if weight is None:
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(local_tensor(weight.grad), group=self.tied_group)

    def clip_grad_norm(self, max_norm: float, experts: dist.ProcessGroup | None = None
                       ) -> torch.Tensor:
        """Clip every stage's gradients by the norm of the whole model's (the tied embedding
        counted once); a collective of the pipeline group (and of `experts`, the ranks over
        which expert parallelism spreads the stage's routed experts, whose squares are summed
        there). Returns that norm."""
        duplicate = self._tied_weight() if self.module.is_last else None
        named = [(n, p) for n, p in self.module.named_parameters() if p is not duplicate]
        routed = experts is not None
        own = squared_norm([p for n, p in named if not (routed and is_expert_parameter(n))],
                           [p for n, p in named if routed and is_expert_parameter(n)], experts)
        dist.all_reduce(own, group=self.group)
        total = own.sqrt()
        scale_grads(list(self.parameters()), total, max_norm)
        return total

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights as plain CPU tensors on every rank of the group, under the
        plain model's names (a collective: each stage contributes its own)."""
        # not cpu_offload: that leaves the state on global rank 0 only, not on each stage
        own = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        own = {k: v.detach().to("cpu", copy=True) for k, v in own.items()}
        own.update(all_experts(self.module))  # the stage's experts held by other ep ranks
        stages: list[Any] = [None] * self.n_stages
        dist.all_gather_object(stages, own, group=self.group)
        return {k: v for stage in stages for k, v in stage.items()}

    @property
    def is_last(self) -> bool:
        return self.module.is_last

    def _stage(self, batch: int, seq: int, train: bool) -> PipelineStage:
        """The stage of a call on [batch, seq] inputs (seq padded to a multiple of cp)."""
        if batch % self.n_microbatches:
            raise ValueError(f"batch of {batch} rows does not split into "
                             f"{self.n_microbatches} equal microbatches")
        mb, cfg = batch // self.n_microbatches, self.module.config
        # Static shapes skip the schedule's metadata-inference forward; `requires_grad` on the
        # examples is what tells the stage to receive and send activation gradients.
        hidden = torch.empty(mb, seq // self.cp, cfg.hidden_size, dtype=self.dtype,
                             device="meta", requires_grad=train)
        inputs = torch.empty(mb, seq, dtype=torch.long, device="meta") if self.module.is_first \
            else hidden
        head = () if self.module.values else (cfg.hidden_size + self.module.both,)
        # under autocast the last stage's outputs are in the autocast dtype (the head's
        # input, or the score head's output); the residual stream between stages keeps the
        # parameters' (it adds to the fp32 embedding)
        kind = self.device.type
        out_dtype = (torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind)
                     else self.dtype)
        outputs = torch.empty(mb, self.module.seq or seq, *head, dtype=out_dtype,
                              device="meta", requires_grad=train) if self.module.is_last \
            else hidden
        # torch's pipelining imports torch.compile (~0.5 s): only pipelined ranks pay it
        from torch.distributed.pipelining import PipelineStage
        return PipelineStage(self.module, self.rank, self.n_stages, self.device,
                             input_args=inputs, output_args=outputs, group=self.group)

    def _padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's inputs right-padded (mask 0) to a multiple of cp; the stage cuts its
        outputs back to the call's length."""
        self.module.seq = input_ids.shape[1]
        pad = (0, -input_ids.shape[1] % self.cp)
        return F.pad(input_ids, pad), F.pad(attention_mask, pad)

    def _args(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (input_ids,) if self.module.is_first else ()

    def train_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   target: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of the batch with 1F1B; the batch loss (sum over
        microbatches of `loss_fn(logits, target_mb)`), detached float64, on every rank of the
        group. `target` [batch, ...] is sliced into microbatches along dim 0 like the inputs;
        pack several per-token tensors into one (e.g. [batch, seq, k]) when the loss needs them.
        """
        from torch.distributed.pipelining import Schedule1F1B
        input_ids, attention_mask = self._padded(input_ids, attention_mask)
        schedule = Schedule1F1B(self._stage(*input_ids.shape, train=True), self.n_microbatches,
                                loss_fn=loss_fn, scale_grads=False)
        losses: list[torch.Tensor] = []
        schedule.step(*self._args(input_ids), attention_mask=attention_mask,
                      target=target if self.module.is_last else None,
                      losses=losses if self.module.is_last else None, return_outputs=False)
        # float64 on every rank, whatever the loss dtype, so the broadcast buffers agree.
        loss = (torch.stack(losses).sum().detach().double() if self.module.is_last
                else torch.zeros((), dtype=torch.float64, device=self.device))
        if self.n_stages > 1:
            dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
              ) -> torch.Tensor | None:
        """Logits [batch, seq, vocab] (values [batch, seq]) on the last stage (None on the
        others), forward only."""
        from torch.distributed.pipelining import ScheduleGPipe
        input_ids, attention_mask = self._padded(input_ids, attention_mask)
        schedule = ScheduleGPipe(self._stage(*input_ids.shape, train=False), self.n_microbatches)
        out = schedule.step(*self._args(input_ids), attention_mask=attention_mask)
        return out if self.module.is_last else None


def tp_ranks(mesh: DeviceMesh) -> DeviceMesh | None:
    """The tensor-parallel ranks of `mesh`, None when there are none to split over."""
    return mesh["tp"] if mesh["tp"].size() > 1 else None


def cp_ranks(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The context-parallel ranks of `mesh`, None when there are none to split over."""
    return mesh["cp"].get_group() if mesh["cp"].size() > 1 else None


def first_and_last_stages(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The process group of this rank's pipeline's first and last stage, for tied embeddings
    (made by every rank, one per pipeline, in the same order; None on middle stages). With 2
    stages the pipeline group is that pair already."""
    pp = mesh["pp"].size()
    if pp <= 2:
        return None
    mine = None
    for ranks in mesh.mesh.movedim(0, -1).reshape(-1, pp).tolist():  # one row per pipeline
        group = dist.new_group([ranks[0], ranks[-1]])
        if dist.get_rank() in (ranks[0], ranks[-1]):
            mine = group
    return mine
