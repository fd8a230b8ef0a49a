"""The fast generation engine: group prefix sharing and continuous batching over preallocated,
per-slot KV caches, behind the interface of `rlloom.rollout.generate.generate`.

`generate` stays the simple reference (one left-padded batch, one shared cache length); this
engine must return the same `Rollout` for the same greedy inputs, and tests check that it does.

How one call runs:
- prompts are split into groups of equal consecutive prompts (the trainer repeats each prompt
  K times); each group's prompt is prefilled once and its keys/values are copied into the
  slots of its K samples, which all sample their first token from the one set of logits;
- a fixed number of slots (`max_batch`, or as many as `kv_budget_bytes` allows) each hold one
  sequence left-aligned in a preallocated cache, so a slot has its own length and rotary
  position and no padding ever enters it; when a sequence ends (EOS, a stop, or the token
  limit) the next waiting sequence is placed into its slot before the next decode step, so
  the live batch stays full;
- every (sequence, step) gets its uniform from a hash of one seed drawn per call, so what a
  sequence samples does not depend on which slot it got or what else shared the batch;
- with a `Dialogue` (multi-turn rollouts with tools), a sequence whose turn ends in a tool
  call keeps its slot, parked, while the other slots go on decoding; when the tool answers,
  the call's last token and the result are forwarded over the slot's cached keys in one
  extend forward (no re-prefill of the conversation) and the next turn samples from its
  logits.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from rlloom.models.moe import routing
from rlloom.models.embeddings import check_positions
from rlloom.models.transformer import CausalLM, layer_masks, rope_kind, rope_tables
from rlloom.perf.model.memory import PREFILL_TOKENS
from rlloom.rollout.engine_forward import (
    Forwarded,
    FusedWeights,
    Prefilled,
    SlotWrite,
    decode_forward,
    is_plain,
    prefill_forward,
    prompt_groups,
)
from rlloom.rollout.generate import Rollout, cat_rollouts, generate, left_pad
from rlloom.rollout.routes import RouteLog
from rlloom.rollout.multi_turn import Dialogue
from rlloom.rollout.sampling import (
    Decode,
    SamplingParams,
    StopMatcher,
    sample_with_uniforms,
    seen_tokens,
    uniforms,
)
from rlloom.rollout.slot_cache import SlotKVCache, agreed, kv_slots
from rlloom.rollout.tools import Pending


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 0             # live sequences (KV slots); 0 = every sequence at once
    kv_budget_bytes: int = 0       # fewer slots if their KV cache would exceed this; 0 = no cap
    prefix_sharing: bool = True    # prefill each distinct prompt once for all its samples
    continuous: bool = True        # refill a finished slot at once; False = static waves
    prefill_tokens: int = PREFILL_TOKENS  # padded prompt tokens per prefill forward
    n_samples: int = 0             # samples per prompt; 0 = detect equal consecutive prompts
    kv_chunk: int = 16             # KV capacity grows by this many positions at a time
    record_routes: bool = False    # an MoE model's experts per token (rollout/routes.py)

    def __post_init__(self) -> None:
        if min(self.max_batch, self.kv_budget_bytes, self.n_samples) < 0:
            raise ValueError(f"EngineConfig fields must be >= 0, got {self}")
        if self.prefill_tokens < 1 or self.kv_chunk < 1:
            raise ValueError(f"prefill_tokens and kv_chunk must be >= 1, got {self}")


class Engine:
    """Generation for one model; `generate` has the reference `generate`'s interface."""

    def __init__(self, model: CausalLM, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.forwarded = Forwarded()  # of the last `generate` call

    def generate(self, prompts: list[list[int]], params: SamplingParams, eos_id: int,
                 pad_id: int, generator: torch.Generator | None = None,
                 decode: Decode | None = None, dialogue: Dialogue | None = None) -> Rollout:
        """Sample up to `params.max_new_tokens` per prompt; rows end at EOS or a stop.

        `decode` turns response token ids into text for `params.stop` strings. With a
        `dialogue`, a row is a conversation: a turn ending in a tool call (`params.stop`
        must hold the call end) goes on after the tool's result, which the returned
        Rollout marks `injected`.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generation needs at least one prompt and no empty prompt")
        if params.stop and decode is None:
            raise ValueError("stop strings need a `decode` callback (token ids -> text)")
        if not is_plain(self.model):
            # A parallel layout (TP / FSDP / replicate) runs inside the modules' own forwards,
            # which the fast path bypasses (as it does latent attention's cache of latents):
            # the reference drives those forwards instead, in waves of as many rows as the KV
            # budget holds (`perf.model` prices them as such)
            def turn(rows: list[list[int]], room: int) -> Rollout:
                prompt = max(map(len, rows))
                cfg = self.config
                wave = kv_slots(self.model, len(rows), prompt, prompt + room, cfg.max_batch,
                                cfg.kv_budget_bytes, True, routes=cfg.record_routes)
                if cfg.kv_budget_bytes:  # budgets are each rank's own; max_batch is shared
                    wave = agreed(self.model, wave)
                return cat_rollouts([generate(self.model, rows[i:i + wave],
                                              replace(params, max_new_tokens=room), eos_id,
                                              pad_id, generator, decode=decode,
                                              record_routes=cfg.record_routes)
                                     for i in range(0, len(rows), wave)], pad_id)
            if dialogue is not None:
                return dialogue.converse(turn, prompts, pad_id)
            return turn(prompts, params.max_new_tokens)
        record = self.config.record_routes
        with torch.inference_mode(), routing(self.model) if record else nullcontext() as routes:
            run = _Run(self.model, prompts, params, eos_id, pad_id, generator, self.config,
                       decode, dialogue)
            if record:
                run.log = RouteLog(self.model, routes, run.n + 1,
                                   run.prompt_width + params.max_new_tokens + 1, run.device)
            run.loop()
        self.forwarded = run.forwarded
        return run.rollout(prompts)


def engine_generate(model: CausalLM, prompts: list[list[int]], params: SamplingParams,
                    eos_id: int, pad_id: int, generator: torch.Generator | None = None,
                    config: EngineConfig | None = None, decode: Decode | None = None,
                    dialogue: Dialogue | None = None) -> Rollout:
    """`Engine(model, config).generate(...)`: a drop-in for the reference `generate`."""
    return Engine(model, config).generate(prompts, params, eos_id, pad_id, generator, decode,
                                          dialogue)


class _Run:
    """State of one `Engine.generate` call."""

    def __init__(self, model: CausalLM, prompts: list[list[int]], params: SamplingParams,
                 eos_id: int, pad_id: int, generator: torch.Generator | None,
                 cfg: EngineConfig, decode: Decode | None, dialogue: Dialogue | None
                 ) -> None:
        self.model, self.params, self.cfg, self.decode = model, params, cfg, decode
        self.dialogue = dialogue
        self.forwarded = Forwarded()
        self.eos, self.pad = eos_id, pad_id
        p = next(model.parameters())
        dev = self.device = p.device
        n = self.n = len(prompts)
        t = self.t_max = params.max_new_tokens
        groups = (prompt_groups(prompts, cfg.n_samples) if cfg.prefix_sharing
                  else list(range(n)))
        self.group_of = groups
        self.group_prompt: dict[int, list[int]] = {}
        self.group_left: dict[int, int] = {}
        for i, g in enumerate(groups):
            self.group_prompt.setdefault(g, prompts[i])
            self.group_left[g] = self.group_left.get(g, 0) + 1
        self.prefilled: dict[int, tuple[Prefilled, int]] = {}
        self.prompt_len = torch.tensor([len(q) for q in prompts], device=dev)
        self.prompt_width = max(len(q) for q in prompts)
        self.log: RouteLog | None = None          # set when routes are recorded
        self.group_routes: dict[int, torch.Tensor] = {}

        # A sequence feeds back at most prompt + t - 1 tokens; a finished one keeps length
        # prompt + t - 1, whose rotary row an idle slot still looks up.
        prompt = max(len(q) for q in prompts)
        max_len = prompt + t
        check_positions(model.config, prompt, t)
        slots = self.slots = kv_slots(model, n, prompt, max_len, cfg.max_batch,
                                      cfg.kv_budget_bytes, False, cfg.prefill_tokens,
                                      cfg.record_routes)
        self.cache = SlotKVCache(model, slots, max_len, cfg.kv_chunk)
        self.fused = [FusedWeights.of(layer) for layer in model.model.layers]
        c = model.config
        self.ropes = [(cos[0, 0], sin[0, 0]) for cos, sin in     # [max_len, head_dim]
                      rope_tables(torch.arange(max_len, device=dev)[None], c, p.dtype)]
        self.key_pos = torch.arange(max_len, device=dev)

        # One seed per call; each (sequence, step) hashes it into its own uniform, so what a
        # sequence samples does not depend on its slot or on what shares its batch.
        self.seed = (None if params.greedy else int(torch.randint(
            0, 2 ** 32, (1,), generator=generator,
            device=generator.device if generator is not None else "cpu")))
        # row n and column t are targets for idle slots, so no step needs a branch for them
        self.out_tok = torch.full((n + 1, t + 1), pad_id, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(n + 1, t + 1, dtype=torch.float32, device=dev)
        self.out_inj = torch.zeros(n + 1, t + 1, dtype=torch.long, device=dev)
        zeros = torch.zeros(slots, dtype=torch.long, device=dev)
        self.next_tok, self.lens, self.gen = zeros.clone(), zeros.clone(), zeros.clone()
        # active: decoding; held: holding a sequence, decoding or parked on a tool call
        self.active, self.held = zeros.clone(), zeros.clone()
        self.seq = torch.full((slots,), n, dtype=torch.long, device=dev)
        # [n + 1, vocab]: the tokens each sequence holds (prompt, response, tool output), for
        # a repetition penalty only; row n is the idle slots' target
        self.seen = (seen_tokens(prompts, c.vocab_size, dev, n + 1)
                     if params.repetition_penalty != 1.0 else None)

        self.slot_seq = [-1] * slots
        self.free = list(range(slots))        # kept sorted: low slots first keep rows small
        self.waiting = 0                      # sequences [waiting, n) are not placed yet
        self.live = 0
        self.rows = 0                         # decode runs over slots [0, rows)
        self.width = 0                        # key positions the next decode step reads
        self.resp_len = [0] * n
        self.finished = [False] * n
        self.stops = StopMatcher(params, decode)
        self.tails: list[list[int]] = [[] for _ in range(slots)]  # the current turn's tokens
        self.turn_start = [0] * n             # response index of each sequence's turn
        self.parked: dict[int, Pending] = {}  # slot -> the tool call it waits on

    # -- main loop --------------------------------------------------------------------------

    def loop(self) -> None:
        while True:
            if self.waiting < self.n and (self.cfg.continuous or self.live == 0):
                self._admit()
            if self.parked and self._resume():
                continue  # a resumed conversation ended: its slot is refilled first
            if self.live:
                self._decode_step()
            elif not self.parked and self.waiting == self.n:
                break

    def _admit(self) -> None:
        """Place waiting sequences into free slots (their first token comes from the prompt's
        prefill logits); a sequence that ends at once frees its slot for the next."""
        while self.free and self.waiting < self.n:
            m = min(len(self.free), self.n - self.waiting)
            slots, self.free = self.free[:m], self.free[m:]
            seqs = list(range(self.waiting, self.waiting + m))
            self.waiting += m
            self._prefill_missing([self.group_of[s] for s in seqs])
            by_batch: dict[int, tuple[Prefilled, list[int], list[int], list[int]]] = {}
            for slot, s in zip(slots, seqs):
                g = self.group_of[s]
                batch, row = self.prefilled[g]
                entry = by_batch.setdefault(id(batch), (batch, [], [], []))
                entry[1].append(slot)
                entry[2].append(row)
                entry[3].append(s)
                self.group_left[g] -= 1
                if self.group_left[g] == 0:
                    del self.prefilled[g]
            order_slots, order_seqs, logits = [], [], []
            for batch, b_slots, rows, b_seqs in by_batch.values():
                rows_t = torch.tensor(rows, device=self.device)
                slots_t = torch.tensor(b_slots, device=self.device)
                self.cache.place(slots_t, batch.k, batch.v, rows_t)
                logits.append(batch.logits[rows_t])
                order_slots += b_slots
                order_seqs += b_seqs
            idx = torch.tensor(order_slots, device=self.device)
            seq_t = torch.tensor(order_seqs, device=self.device)
            self.seq[idx] = seq_t
            self.lens[idx] = self.prompt_len[seq_t]
            self.gen[idx] = 0
            self.active[idx] = self.held[idx] = 1
            for slot, s in zip(order_slots, order_seqs):
                self.slot_seq[slot] = s
                self.tails[slot] = []
            self.live += len(order_slots)
            self._dirty = True
            self._commit(idx, order_slots, torch.cat(logits), torch.ones_like(idx))
        self._reshape()

    def _prefill_missing(self, groups: list[int]) -> None:
        """Prefill the prompts of `groups` not prefilled yet, in token-budgeted forwards."""
        todo = list(dict.fromkeys(g for g in groups if g not in self.prefilled))
        chunk: list[int] = []
        for g in todo:
            width = max(len(self.group_prompt[h]) for h in chunk + [g])
            if chunk and width * (len(chunk) + 1) > self.cfg.prefill_tokens:
                self._prefill(chunk)
                chunk = []
            chunk.append(g)
        if chunk:
            self._prefill(chunk)

    def _prefill(self, groups: list[int]) -> None:
        prompts = [self.group_prompt[g] for g in groups]
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((b, width), self.pad, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        plen = torch.tensor([len(p) for p in prompts], device=self.device)
        batch = prefill_forward(self.model, ids.to(self.device), plen, self.ropes)
        self.forwarded.prefill += int(plen.sum())
        if self.log is not None:
            routed = self.log.taken().view(b, width, self.log.layers, self.log.k)
            for row, p in enumerate(prompts):
                self.group_routes[groups[row]] = routed[row, :len(p)]
        for row, g in enumerate(groups):
            self.prefilled[g] = (batch, row)

    def _decode_step(self) -> None:
        rows = self.rows
        self.cache.ensure(self.width)
        logits = decode_forward(self.model, self.fused, self.cache, self.next_tok[:rows],
                                self.lens[:rows], self.held[:rows], self.width, self.ropes)
        if self.log is not None:  # the token fed is the last sampled: response token gen - 1
            act = self.active[:rows].bool()
            self.log.log[self.seq[:rows][act], self.prompt_width + self.gen[:rows][act] - 1] \
                = self.log.taken()[act]
        self.lens[:rows] += self.active[:rows]
        self.width += 1
        self.forwarded.decode += self.live
        self._commit(slice(0, rows), None, logits, self.active[:rows])
        self._reshape()

    def _commit(self, idx: torch.Tensor | slice, slots: list[int] | None,
                logits: torch.Tensor, act: torch.Tensor) -> None:
        """Sample from logits [r, V] for slots `idx`, record the tokens and retire the rows
        that ended. `slots` lists the slot of each row when `idx` is a tensor."""
        seq, gen = self.seq[idx], self.gen[idx]
        u = None if self.seed is None else uniforms(self.seed, seq, gen)
        seen = None if self.seen is None else self.seen[seq]
        tok, lp = sample_with_uniforms(logits, self.params, u, seen)
        if self.seen is not None:  # parked and idle rows decode along; their tokens are not
            live = act.bool()
            self.seen[seq[live], tok[live]] = True
        self.out_tok[seq, gen] = tok
        self.out_lp[seq, gen] = lp
        self.next_tok[idx] = tok
        gen = gen + act
        self.gen[idx] = gen
        done = act.bool() & ((tok == self.eos) | (gen >= self.t_max))
        ended = done.nonzero().squeeze(1).tolist()      # the one host sync of a step
        stopped: set[int] = set()
        if self.stops:
            stopped = self._stops(tok.tolist(), slots)
        if not ended and not stopped:
            return
        rows = sorted(set(ended) | stopped)
        rows_t = torch.tensor(rows, device=self.device)
        lens = gen[rows_t].tolist()
        eos = (tok[rows_t] == self.eos).tolist()
        turns = (self.out_tok[seq[rows_t]].tolist() if self.dialogue is not None
                 else [None] * len(rows))
        for r, n_tok, hit, out in zip(rows, lens, eos, turns):
            slot = slots[r] if slots is not None else r
            s = self.slot_seq[slot]
            pending = None if out is None else self.dialogue.turn_end(
                s, out[self.turn_start[s]:n_tok], hit or r in stopped)
            if pending is not None:
                self.parked[slot] = pending
            else:
                self._retire(slot, s, n_tok, hit or r in stopped)
        slot_t = rows_t if slots is None else torch.tensor(
            [slots[r] for r in rows], device=self.device)
        self.active[slot_t] = 0
        self.seq[slot_t] = self.n
        self.live -= len(rows)
        self._dirty = True

    def _retire(self, slot: int, s: int, n_tok: int, finished: bool) -> None:
        self.resp_len[s] = n_tok
        self.finished[s] = finished
        self.slot_seq[slot] = -1
        self.held[slot] = 0
        self.free.append(slot)
        self.free.sort()
        self._dirty = True

    def _resume(self) -> bool:
        """Go on with the parked conversations whose tool has answered (waiting for one when
        nothing else could run): extend each slot by the call's last token and the result,
        then sample its next turn's first token; a result with no room after it ends the
        conversation. Whether a slot was freed for a waiting sequence."""
        freed = False
        while self.parked:
            ready = [slot for slot, p in self.parked.items() if p.done()]
            if not ready:
                if self.live or (freed and self.waiting < self.n):
                    break
                next(iter(self.parked.values())).wait(0.005)
                continue
            freed |= self._extend_ready(ready)
        self._reshape()
        return freed and self.waiting < self.n

    def _extend_ready(self, ready: list[int]) -> bool:
        """`_resume` for the slots `ready`; whether one of them ended."""
        free = len(self.free)
        for slot in ready:
            s, used = self.slot_seq[slot], int(self.gen[slot])
            ids = self.dialogue.result(s, self.parked.pop(slot), used)
            if ids is None:
                self._retire(slot, s, used, False)
                continue
            m = len(ids)
            self.out_tok[s, used:used + m] = torch.tensor(ids, device=self.device)
            self.out_inj[s, used:used + m] = 1
            if self.seen is not None:
                self.seen[s, torch.tensor(ids, device=self.device)] = True
            logits = self._extend(slot, [int(self.out_tok[s, used - 1]), *ids])
            idx = torch.tensor([slot], device=self.device)
            self.gen[idx] = used + m
            self.seq[idx] = s
            self.active[idx] = 1
            self.turn_start[s] = used + m
            self.tails[slot] = []
            self.live += 1
            self._dirty = True
            self._commit(idx, [slot], logits, torch.ones_like(idx))
        return len(self.free) > free

    def _extend(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Forward `tokens` at the end of the slot's sequence, their keys and values written
        into its cache; the last token's logits [1, V]."""
        start, m = int(self.lens[slot]), len(tokens)
        end = start + m
        self.cache.ensure(end)
        ids = torch.tensor([tokens], device=self.device)
        causal = self.key_pos[:end][None] <= self.key_pos[start:end, None]      # [m, end]
        masks = layer_masks(self.model.config, causal[None, None], start)
        ropes = [(cos[start:end].view(1, 1, m, -1), sin[start:end].view(1, 1, m, -1))
                 for cos, sin in self.ropes]
        backbone = self.model.model
        cache = SlotWrite(self.cache, slot, start)
        x = backbone.embed_tokens(ids, torch.arange(start, end, device=self.device)[None])
        for i, layer in enumerate(backbone.layers):
            x = layer(x, *ropes[rope_kind(self.model.config, i)], masks[i], cache, i)
        self.lens[slot] = end
        self.forwarded.extend += m
        if self.log is not None:  # a tool's output is not replayed (rollout/routes.py)
            self.log.routes.recorded.clear()
        return self.model.lm_head(backbone.norm(x[:, -1]))

    def _stops(self, toks: list[int], slots: list[int] | None) -> set[int]:
        """Rows whose response now ends with a stop token sequence or contains a stop string."""
        hits = set()
        for r, tok in enumerate(toks):
            slot = slots[r] if slots is not None else r
            if self.slot_seq[slot] < 0 or slot in self.parked:
                continue
            tail = self.tails[slot]
            tail.append(tok)
            if self.stops.hit(tail):
                hits.add(r)
        return hits

    _dirty = True

    def _reshape(self) -> None:
        """After slots change: the rows decode must cover, the key width it must read, and
        moving the live slots to the front once most of the rows would be idle."""
        if not self._dirty:
            return
        self._dirty = False
        used = [i for i, s in enumerate(self.slot_seq) if s >= 0]
        if not used:
            self.rows = self.width = 0
            return
        self.rows = used[-1] + 1
        held = self.held[:self.rows]
        self.width = int(torch.where(held > 0, self.lens[:self.rows], 0).max()) + 1
        no_refill = self.waiting == self.n or not self.cfg.continuous
        if no_refill and len(used) <= self.rows // 2 and self.rows >= 8:
            keep = torch.tensor(used, device=self.device)
            m = len(used)
            self.cache.compact(keep)
            for t in (self.next_tok, self.lens, self.gen, self.active, self.held, self.seq):
                t[:m] = t[keep].clone()
            self.active[m:] = self.held[m:] = 0
            self.seq[m:] = self.n
            self.slot_seq = [self.slot_seq[i] for i in used] + [-1] * (self.slots - m)
            self.tails = [self.tails[i] for i in used] + [[] for _ in range(self.slots - m)]
            self.parked = {new: self.parked[old] for new, old in enumerate(used)
                           if old in self.parked}
            self.free = list(range(m, self.slots))
            self.rows = m

    def rollout(self, prompts: list[list[int]]) -> Rollout:
        """The results as the reference returns them (cloned out of inference mode)."""
        n = self.n
        lens = torch.tensor(self.resp_len, device=self.device)
        used = int(lens.max())
        prompt_ids, prompt_mask = left_pad(prompts, self.pad)
        mask = (torch.arange(used, device=self.device)[None] < lens[:, None]).long()
        finished, injected = torch.tensor(self.finished), None
        if self.dialogue is not None:
            finished, injected = self.dialogue.finished(), self.out_inj[:n, :used].clone()
        routes = None
        if self.log is not None:
            p = self.prompt_width
            routes = self.log.log[:n, :p + used].clone()
            for s, g in enumerate(self.group_of):
                routed = self.group_routes[g]
                routes[s, p - len(routed):p] = routed
        return Rollout(prompt_ids.to(self.device), prompt_mask.to(self.device),
                       self.out_tok[:n, :used].clone(), mask,
                       self.out_lp[:n, :used].clone(), finished.to(self.device), injected,
                       routes)
