"""Plain-PyTorch decoder of the supported families (rlloom/models/families: Llama, Qwen2/3,
Mistral, Phi-3, OLMo 2, Gemma 2/3, GPT-2, SmolLM3; dense, and Qwen3-MoE / Mixtral / gpt-oss /
DeepSeek-V3 with routed experts).

Module names mirror the Hugging Face checkpoints (`model.layers.0.self_attn.q_proj`, ...) so a
state dict loads without renaming. No distributed code lives here (docs/design.md): parallel
layouts are applied to these modules from outside.
"""
from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right

from rlloom.models.activations import ACT_FNS
from rlloom.models.cache import KVCache
from rlloom.models.config import ModelConfig, normalised_hf_config
from rlloom.models.embeddings import embedding
from rlloom.models.mla import LatentAttention
from rlloom.models.primitives import apply_rotary, norm
from rlloom.models.moe import MoEBlock, local


class SoftcappedLinear(nn.Linear):
    """Gemma2's output head: logits soft-capped to (-cap, cap) by cap * tanh(logits / cap)."""

    def __init__(self, d_in: int, d_out: int, cap: float) -> None:
        super().__init__(d_in, d_out, bias=False)
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softcap(super().forward(x), self.cap)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


def rotary_cos_sin(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype,
                   longest: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin  # [batch, 1, seq, head_dim] for integer positions [batch, seq], with the
    model's rope scaling; head_dim is the rotated dimensions' (`rotary_dim`). Dynamic NTK
    and longrope scale by the sequence's length, `longest` (default: the last position here
    + 1, as Hugging Face counts a forward pass over these positions; a sequence shard passes
    its whole sequence's). Learned positions (GPT-2): no rotation, cos 1 and sin 0, which
    attention does not read."""
    if cfg.learned_positions:  # views of one element each: nothing allocated per pass
        shape = (positions.shape[0], 1, positions.shape[1], cfg.head_dim)
        return tuple(torch.full((), v, dtype=dtype, device=positions.device).expand(shape)
                     for v in (1.0, 0.0))
    if longest is None and cfg.rope_by_length:
        longest = int(positions.max()) + 1 if positions.numel() else 0  # a device sync
    inv_freq, scale = rope_frequencies(cfg, longest or 0)
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [b, seq, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rope_tables(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype,
                longest: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`rotary_cos_sin` of the model's rotary embedding, and (Gemma3) of its sliding layers'
    own base after it; `rope_kind` says which a layer reads."""
    tables = [rotary_cos_sin(positions, cfg, dtype, longest)]
    if cfg.local_rope is not None:
        tables.append(rotary_cos_sin(positions, cfg.local_rope, dtype, longest))
    return tables


def rope_kind(cfg: ModelConfig, layer: int) -> int:
    """Which of `rope_tables` decoder layer `layer` reads."""
    return int(cfg.local_rope_theta is not None and cfg.layer_window(layer) is not None)


@functools.lru_cache(maxsize=64)
def _scaled_frequencies(fields: str, seq_len: int | None) -> tuple[torch.Tensor, float]:
    # transformers' rope module costs ~0.5 s to import: only scaled-rope models pay it
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = json.loads(fields)
    # Llama's config class carries every field the rope functions read, in the flat form
    # they read it in (Gemma3's would nest it by layer type)
    norm = normalised_hf_config(hf, "llama")
    return ROPE_INIT_FUNCTIONS[hf["rope_parameters"]["rope_type"]](norm, torch.device("cpu"),
                                                                  seq_len)


def rope_frequencies(cfg: ModelConfig, longest: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] and the attention scale of the rotary embedding:
    theta's default, or transformers' scaled ones (llama3, linear, yarn, dynamic, longrope)
    for the config's rope parameters (computed once per distinct setting: this runs every
    forward)."""
    kind = cfg.rope_scaling.get("rope_type", "default")
    if kind == "default":
        rd = cfg.rotary_dim
        return 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd), 1.0
    # dynamic NTK rescales only past the trained length, and then by the current length;
    # longrope takes its long factors past the original length (one key each side of it)
    seq_len = None
    if kind == "dynamic" and longest > cfg.max_position_embeddings:
        seq_len = longest
    elif kind == "longrope" and longest > cfg.rope_scaling["original_max_position_embeddings"]:
        seq_len = cfg.rope_scaling["original_max_position_embeddings"] + 1
    # the fields transformers' rope functions read, and nothing else: the cache's key
    fields = {"rope_parameters": {**cfg.rope_scaling, "rope_theta": cfg.rope_theta,
                                  "partial_rotary_factor": cfg.partial_rotary_factor},
              "head_dim": cfg.head_dim, "hidden_size": cfg.hidden_size,
              "num_attention_heads": cfg.num_heads,
              "max_position_embeddings": cfg.max_position_embeddings}
    return _scaled_frequencies(json.dumps(fields, sort_keys=True), seq_len)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, d, bias=cfg.o_bias)
        if cfg.qk_norm:  # per head, or (OLMo2) over all heads at once
            whole = cfg.qk_norm_whole
            self.q_norm = norm(cfg, self.hd * (self.n_heads if whole else 1))
            self.k_norm = norm(cfg, self.hd * (self.n_kv if whole else 1))
        self.qk_norm, self.qk_norm_whole = cfg.qk_norm, cfg.qk_norm_whole
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.hd ** -0.5
        self.softcap = cfg.attn_softcap
        # GPT-2's positions are learned; SmolLM3's NoPE layers have none
        self.rotary = not cfg.learned_positions and layer not in cfg.nope_layers
        # gpt-oss: each head's sink logit joins its softmax's denominator (tensor
        # parallelism splits them with the heads)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.attn_sinks else None

    def normed_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [..., heads, hd], k [..., kv, hd] through the q/k norms, if the family has
        them."""
        if not self.qk_norm:
            return q, k
        if self.qk_norm_whole:
            return (self.q_norm(q.flatten(-2)).view_as(q),
                    self.k_norm(k.flatten(-2)).view_as(k))
        return self.q_norm(q), self.k_norm(k)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: KVCache | None, layer: int) -> torch.Tensor:
        """`mask` None: causal over packed rows (`packed_order`), which fused kernels run
        without any [seq, seq] tensor and skip the masked-out half of."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.hd)
        k = self.k_proj(x).view(b, s, self.n_kv, self.hd)
        v = self.v_proj(x).view(b, s, self.n_kv, self.hd).transpose(1, 2)
        q, k = self.normed_qk(q, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)      # [b, heads, s, hd]
        if self.rotary:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        gqa = self.n_heads != self.n_kv
        if mask is None and k.shape[2] > s:
            # the queries are the last of the keys (a context-parallel shard): causal aligned
            # to the last key, still without a mask tensor
            mask = causal_lower_right(s, k.shape[2])
        if mask is not None and not isinstance(mask, CausalBias) and gqa and s > 1:
            # A GPU's fused kernels take a mask or grouped KV heads, not both, and SDPA's
            # fallback would keep [heads, s, s] scores per layer: expand the KV heads, as
            # transformers does. One decoded token's scores are small either way.
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
            gqa = False
        if self.softcap is not None or self.sinks is not None:  # no fused kernel for these
            out = eager_attention(q, k, v, mask, self.scale, self.softcap, local(self.sinks))
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 is_causal=mask is None, enable_gqa=gqa,
                                                 scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.hd))


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | CausalBias | None, scale: float, cap: float | None,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention as SDPA's math would run it, for what no fused kernel here takes: scores
    soft-capped before the mask and softmax (Gemma2), a sink logit per head [heads] in each
    softmax whose column is then dropped (gpt-oss). q [b, heads, s, hd], k and v [b, kv,
    keys, hd]; `mask` None or a CausalBias is causal aligned to the last key."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if mask is None or isinstance(mask, CausalBias):
        s, keys = q.shape[2], k.shape[2]
        mask = torch.ones(s, keys, dtype=torch.bool, device=q.device).tril(keys - s)
    scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * scale, cap)
    scores = scores.masked_fill(~mask, float("-inf"))
    sinks = None if sinks is None else sinks.view(-1, 1)  # [heads, 1]: over the queries
    return torch.matmul(sink_softmax(scores, sinks).to(q.dtype), v)


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the keys (dim -1) of `scores` in fp32 (fp64 kept), with a sink logit
    in each sum when `sinks` (broadcast to scores.shape[:-1]) is given."""
    wide = torch.promote_types(scores.dtype, torch.float32)
    if sinks is None:
        return scores.softmax(-1, dtype=wide)
    sink = sinks.to(scores.dtype).unsqueeze(-1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1, dtype=wide)[..., :-1]


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), or (GPT-2, not `gated_mlp`) down(act(up(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        if cfg.gated_mlp:
            self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)
        self.act, self.gated = ACT_FNS[cfg.hidden_act], cfg.gated_mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm (x + attn(norm(x)), then x + mlp(norm(x))), with `post_norms` (OLMo2)
    x + norm(attn(x)), then x + norm(mlp(x)), with `sandwich_norms` (Gemma2) both. The
    engine's decode step reads the same pieces: `attn_input`, `attn_output`, `mlp_input`,
    `mlp_output`."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        # norms after the sublayers (OLMo2 alone, Gemma2 beside the ones before them)
        self.post_norms, self.sandwich = cfg.post_norms or cfg.sandwich_norms, cfg.sandwich_norms
        if not cfg.post_norms:
            self.input_layernorm = norm(cfg)
        self.self_attn = LatentAttention(cfg, layer) if cfg.latent else Attention(cfg, layer)
        self.post_attention_layernorm = norm(cfg)
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(cfg)
        if self.post_norms:
            self.post_feedforward_layernorm = norm(cfg)
        self.mlp = (MoEBlock(cfg, sum(map(cfg.is_moe_layer, range(layer))))
                    if cfg.is_moe_layer(layer) else MLP(cfg))

    def attn_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x) if hasattr(self, "input_layernorm") else x

    def attn_output(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return x + (self.post_attention_layernorm(out) if self.post_norms else out)

    def mlp_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.sandwich:
            return self.pre_feedforward_layernorm(x)
        return x if self.post_norms else self.post_attention_layernorm(x)

    def mlp_output(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return x + (self.post_feedforward_layernorm(out) if self.post_norms else out)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: KVCache | None, layer: int) -> torch.Tensor:
        x = self.attn_output(x, self.self_attn(matmul_input(self.attn_input(x)), cos, sin,
                                               mask, cache, layer))
        h = self.mlp_input(x)
        # an MoE block sums its experts' outputs in its input's dtype: left as it was
        return self.mlp_output(x, self.mlp(matmul_input(h) if isinstance(self.mlp, MLP)
                                           else h))


def matmul_input(x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype autocast gives the matmuls it feeds. Cast once here, not by each of
    q/k/v (gate/up) on its own: each cast copy would be kept for backward, 5 extra copies of
    the stream per layer with fp32 weights under bf16 autocast. The same values either way."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def local_kv_heads(model: nn.Module) -> int:
    """The key/value heads this rank computes and caches: under tensor parallelism its share
    (`parallel.tensor_parallel` localises each attention's head counts), else all."""
    layers, cfg = model.model.layers, model.config
    if cfg.latent or not len(layers):  # a latent cache is one shared "head" of each
        return cfg.cache_dims[0][0]
    return layers[0].self_attn.n_kv


def kv_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a KV cache stores: the one keys and values come out of their projections
    in, autocast's when it is on (a cache in fp32 weights' dtype would store bf16 values in
    twice the bytes)."""
    p = next(model.parameters())
    if torch.is_autocast_enabled(p.device.type):
        return torch.get_autocast_dtype(p.device.type)
    return p.dtype


class Backbone(nn.Module):
    """Embeddings, decoder layers and the final norm: everything but the output head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = embedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm(cfg)
        self.unpack = Unpack()
        self.routes = None  # an MoE model's `moe.Routes` while `moe.routing` is on

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states [batch, seq, hidden]; extends `cache` when given."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if cache is None:
            return self._teacher_forced(input_ids, attention_mask)
        past = cache.key_mask[:, :cache.length]
        positions, mask = positions_and_mask(attention_mask, past)
        masks = layer_masks(self.config, mask, past.shape[1])
        cache.append_mask(attention_mask)
        x = self.embed_tokens(input_ids, positions)
        ropes = rope_tables(positions, self.config, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, *ropes[rope_kind(self.config, i)], masks[i], cache, i)
        cache.advance(input_ids.shape[1])
        return matmul_input(self.unpack(self.norm(x), None))

    def _teacher_forced(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                        ) -> torch.Tensor:
        """A pass without a cache, on packed rows: causal attention needs no mask there, so
        no layer holds a [seq, seq] tensor (2 B per query-key pair and layer, kept for
        backward, in a masked fused kernel: 2 GiB per layer at 32k tokens)."""
        order = packed_order(attention_mask)
        if self.routes is not None:  # a replay reads the recorded routes in this order
            self.routes.order = order
        positions = packed_positions(attention_mask, order)
        x = self.embed_tokens(input_ids.gather(1, order), positions)
        ropes = rope_tables(positions, self.config, x.dtype)
        masks = window_masks(self.config, input_ids.shape[1], x.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, *ropes[rope_kind(self.config, i)], masks[i], None, i)
        return matmul_input(self.unpack(self.norm(x), order))


def packed_order(attention_mask: torch.Tensor) -> torch.Tensor:
    """[batch, seq] indices that put each row's real tokens first, in their order, and its
    padding after them. Real tokens then sit at their own positions (0, 1, ...) and no real
    token comes after a pad, so plain causal attention is exact for them."""
    return torch.argsort((attention_mask == 0).to(torch.int32), dim=1, stable=True)


def packed_positions(attention_mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rotary positions of the rows packed by `order`: 0, 1, ... over the real tokens;
    padding repeats the last (so the longest position is the longest real sequence's, as
    dynamic rope needs)."""
    return (attention_mask.gather(1, order).cumsum(1) - 1).clamp(min=0)


class Unpack(nn.Module):
    """Hidden states [batch, seq, hidden] of packed rows back in the input's token order
    (`packed_order`; None: already in it). A module, so that tensor parallelism can hand it
    the whole sequence: the stream before it is split over the sequence."""

    def forward(self, x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
        return x if order is None else unpack(x, order)


def unpack(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Packed rows [batch, seq, ...] back in the token order `packed_order` took them from."""
    back = order.argsort(dim=1)
    return x.gather(1, back.view(*back.shape, *[1] * (x.dim() - 2)).expand_as(x))


def window_masks(cfg: ModelConfig, seq: int, device: torch.device
                 ) -> list[torch.Tensor | None]:
    """Each layer's mask over packed rows: None (causal) on full-attention layers, the causal
    band of `sliding_window` keys on sliding-window ones (one [seq, seq] mask for all rows)."""
    if cfg.sliding_window is None:
        return [None] * cfg.num_layers
    q = torch.arange(seq, device=device)[:, None]
    k = torch.arange(seq, device=device)[None, :]
    band = ((k <= q) & (q - k < cfg.sliding_window))[None, None]
    return [band if cfg.layer_window(i) else None for i in range(cfg.num_layers)]


def positions_and_mask(new_mask: torch.Tensor, past_mask: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions [batch, new] and attention mask [batch, 1, new, past+new].

    Masks are 1 for real tokens and 0 for padding, so left-padded prompts and finished rows
    keep the positions of an unpadded sequence. A query always sees itself, which keeps
    padding rows finite without changing any real token's output.
    """
    b, s = new_mask.shape
    past = past_mask if past_mask is not None else new_mask.new_zeros(b, 0)
    keys = torch.cat([past, new_mask], dim=1).bool()                     # [b, p+s]
    positions = past.sum(1, keepdim=True) + new_mask.cumsum(1) - 1
    p = past.shape[1]
    causal = torch.ones(s, p + s, dtype=torch.bool, device=new_mask.device).tril(p)
    own = torch.zeros_like(causal)
    own[:, p:] = torch.eye(s, dtype=torch.bool, device=new_mask.device)
    mask = (causal & keys[:, None, :]) | own
    return positions.clamp(min=0), mask[:, None]


def layer_masks(cfg: ModelConfig, mask: torch.Tensor, first_query: int) -> list[torch.Tensor]:
    """Each layer's attention mask: `mask` [batch, 1, queries, keys], with query i at key
    index first_query + i, narrowed on sliding-window layers to the keys less than the window
    behind the query (by index, as Hugging Face counts it; left padding keeps real tokens
    contiguous, so that is their distance in positions too)."""
    if cfg.sliding_window is None:
        return [mask] * cfg.num_layers
    q = torch.arange(mask.shape[-2], device=mask.device)[:, None] + first_query
    k = torch.arange(mask.shape[-1], device=mask.device)[None, :]
    narrow = mask & (q - k < cfg.sliding_window)
    return [narrow if cfg.layer_window(i) else mask for i in range(cfg.num_layers)]


class CausalLM(nn.Module):
    """Decoder with a language-model head; `forward` returns logits [batch, seq, vocab]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = (nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
                        if cfg.final_softcap is None
                        else SoftcappedLinear(cfg.hidden_size, cfg.vocab_size, cfg.final_softcap))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: KVCache | None = None, last: bool = False) -> torch.Tensor:
        """Logits [batch, seq, vocab]; with `last`, of the last position only [batch, 1,
        vocab] (what sampling reads: a prefill's at every prompt position would be [batch,
        prompt, vocab]). Through the module, so a data-parallel wrapper's hooks run."""
        h = self.model(input_ids, attention_mask, cache)
        return self.lm_head(h[:, -1:] if last else h)

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [batch, seq, hidden], for heads applied to chosen
        positions only (`models.logprobs.token_logprobs`, the value head)."""
        return self.model(input_ids, attention_mask)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                # the identity: 1, or 0 where the norm scales by 1 + weight
                (nn.init.zeros_ if self.config.norm_offset else nn.init.ones_)(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)
