"""Transformer shapes the cost model prices: parameter counts and per-token sizes."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

ACT_PER_LAYER = (50, 5)  # non-matmul elements moved per token and layer: x hidden, x ffn


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder-only transformer (dense, or MoE when n_experts > 0)."""
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True  # SwiGLU: three d x d_ff matrices instead of a plain MLP's two
    qkv_bias: bool = False
    n_experts: int = 0
    experts_per_token: int = 0
    moe_ffn: int = 0
    post_norms: bool = False  # OLMo2's norms after the sublayers
    layer_norms: int = 2      # RMSNorms per layer (Gemma2's before and after each sublayer: 4)
    attn_softcap: bool = False  # Gemma2's capped scores: attention without a fused kernel
    attn_sinks: bool = False  # gpt-oss's sink logit per head: without a fused kernel too
    o_bias: bool = False      # o_proj biased (GPT-2, gpt-oss, Llama's attention_bias)
    mlp_bias: bool = False    # the MLP's, or every expert's and the router's, projections too
    layer_norm: bool = False  # GPT-2: LayerNorms (a bias beside each weight)
    positions: int = 0        # GPT-2: rows of a learned position table
    qk_norm_params: int = 0   # per layer: Qwen3's per-head q/k norms (2 head_dim), OLMo2's
    #                           over all heads ((heads + kv_heads) head_dim)
    dense_layers: int = 0     # an MoE model's layers with a dense MLP of ffn instead
    shared_ffn: int = 0       # DeepSeek-V3: the shared experts' width on each MoE layer
    # DeepSeek-V3's latent attention (kv_lora_rank > 0): head_dim is a query's (and key's)
    # whole width, rope_dim its rotary part, v_head_dim a value's; the cache keeps the
    # kv_lora_rank latent and the rope_dim key per token and layer
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0

    @property
    def norm_params(self) -> int:
        """One norm's parameters: RMSNorm's weight, or a LayerNorm's weight and bias."""
        return self.hidden * (2 if self.layer_norm else 1)

    @property
    def eager_attention(self) -> bool:
        """Attention whose [heads, keys] scores are materialised (no fused kernel here)."""
        return self.attn_softcap or self.attn_sinks

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def latent(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def active_ffn(self) -> float:
        """The MLP width one token runs through, averaged over the layers: the dense
        MLP's, or the routed experts' (experts_per_token x moe_ffn) and the shared ones'."""
        if not self.moe:
            return self.ffn
        return self._per_layer(self.experts_per_token * self.moe_ffn + self.shared_ffn,
                               self.ffn)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def v_width(self) -> int:
        """Width of the values the query heads read per token and layer (under GQA each
        query head reads a whole value head: q_width; latent attention's v_head_dim wide)."""
        return self.heads * self.v_head_dim if self.latent else self.q_width

    @property
    def kv_width(self) -> float:
        """Width of K (or V) per token per layer; smaller than hidden under GQA. Latent
        attention's expanded keys and values: their mean width."""
        if self.latent:
            return (self.q_width + self.v_width) / 2
        return self.kv_heads * self.head_dim

    @property
    def cache_width(self) -> float:
        """Elements a KV cache keeps per token and layer: keys and values, or latent
        attention's latent and rotary key."""
        return self.kv_lora_rank + self.rope_dim if self.latent else 2 * self.kv_width

    @cached_property  # read a million times by one planner search
    def attn_params(self) -> int:
        """Per layer: Q, K, V, O projections (4 d^2 when there is no GQA)."""
        d = self.hidden
        if self.latent:  # the latents' norms beside the projections
            q = (d + self.q_width + 1) * self.q_lora_rank if self.q_lora_rank \
                else d * self.q_width
            kv = (d * (self.kv_lora_rank + self.rope_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * (self.q_width - self.heads * self.rope_dim
                                         + self.v_width))
            bias = (self.q_lora_rank + self.kv_lora_rank + self.rope_dim + d) * self.qkv_bias
            return q + kv + self.v_width * d + bias
        bias = self.q_width + 2 * self.kv_width if self.qkv_bias else 0
        return (2 * d * self.q_width + 2 * d * self.kv_width + bias + d * self.o_bias
                + self.heads * self.attn_sinks)

    def lora_params(self, rank: int) -> int:
        """LoRA adapters of rank `rank` on every projection (q, k, v, o and the MLP's, routed
        experts' included): r (d_in + d_out) each, the runtime's default `model.lora.targets`."""
        d, mlp = self.hidden, 3 if self.gated_mlp else 2
        attn = 2 * (d + self.q_width) + 2 * (d + self.kv_width)
        if self.latent:  # of q/k/v/o, latent attention has o_proj (and q_proj without a q
            attn = (d + self.v_width) + (0 if self.q_lora_rank else d + self.q_width)
        if not self.moe:
            return rank * self.layers * (attn + mlp * (d + self.ffn))
        moe = mlp * ((d + self.moe_ffn) * self.n_experts + (d + self.shared_ffn)
                     * bool(self.shared_ffn))
        return rank * (self.layers * attn + self.moe_layers * moe
                       + self.dense_layers * mlp * (d + self.ffn))

    def _mlp(self, width: int) -> int:
        bias = ((2 if self.gated_mlp else 1) * width + self.hidden) * self.mlp_bias
        return (3 if self.gated_mlp else 2) * self.hidden * width + bias

    def _per_layer(self, moe: float, dense: float) -> float:
        """An MoE layer's `moe` and a dense layer's `dense`, averaged over the layers."""
        return (self.moe_layers * moe + self.dense_layers * dense) / self.layers

    @cached_property
    def mlp_params(self) -> float:
        """Per layer, all experts counted (what has to be stored); averaged over the layers
        where some are dense."""
        if self.moe:
            shared = self._mlp(self.shared_ffn) if self.shared_ffn else 0
            return self._per_layer(self.n_experts * (self._mlp(self.moe_ffn) + self.hidden
                                                     + self.mlp_bias) + shared,
                                   self._mlp(self.ffn))
        return self._mlp(self.ffn)

    @property
    def routed_params(self) -> float:
        """Every layer's routed experts (what expert parallelism spreads): not their router,
        the shared experts or the dense layers' MLPs."""
        return self.moe_layers * self.n_experts * self._mlp(self.moe_ffn)

    @property
    def router_params(self) -> float:
        """Per layer, averaged over the layers: the routers' weights and biases."""
        return self.moe_layers * self.n_experts * (self.hidden + self.mlp_bias) / self.layers

    @cached_property
    def active_mlp_params(self) -> float:
        """Per layer and token: only the routed (and shared) experts do work."""
        if self.moe:
            shared = self._mlp(self.shared_ffn) if self.shared_ffn else 0
            return self._per_layer(self.experts_per_token * self._mlp(self.moe_ffn)
                                   + self.hidden * self.n_experts + shared,
                                   self._mlp(self.ffn))
        return self._mlp(self.ffn)

    @cached_property
    def params(self) -> float:
        """|M|. Adds to the plain L (4 d^2 + 2 d d_ff) + V d: GQA K/V widths, gated MLPs,
        QKV biases, MoE experts and router, the RMSNorm vectors of each layer plus a final one,
        and a separate output embedding when it is not tied; GPT-2's and gpt-oss's biases,
        gpt-oss's sinks, GPT-2's position table."""
        per_layer = (self.attn_params + self.mlp_params + self.layer_norms * self.norm_params
                     + self.qk_norm_params)
        embeddings = (self.vocab * (1 if self.tied_embeddings else 2) + self.positions) \
            * self.hidden
        return round(self.layers * per_layer + embeddings + self.norm_params)

    @cached_property
    def active_matmul_params(self) -> int:
        """Weights one token multiplies through in the layers (excludes embeddings and logits)."""
        return self.layers * (self.attn_params + self.active_mlp_params)

    def attention_flops(self, context: float) -> float:
        """Attention FLOPs per teacher-forced token: causal attention sees context/2 keys on
        average, and QK^T and AV give L context (q_width + v_width); an eager attention
        multiplies every key, masked or not (twice that)."""
        return (self.layers * context * (self.q_width + self.v_width)
                * (2 if self.eager_attention else 1))

    def layer_matmul_flops(self) -> float:
        """Forward FLOPs per token of the layers' weight matmuls."""
        return 2 * self.active_matmul_params

    def down_proj_flops(self) -> float:
        """Forward FLOPs per token of the layers' last matmul, the MLP's down projection (a
        checkpointed layer's recompute stops before it: backward needs nothing it makes)."""
        return 2 * self.layers * self.hidden * self.active_ffn

    @property
    def head_flops(self) -> float:
        """Forward FLOPs per token of the output head."""
        return 2 * self.vocab * self.hidden

    def forward_flops(self, context: float, logits: bool = True) -> float:
        """C_f: forward FLOPs per token when teacher-forcing a sequence of length `context`."""
        head = 2 * self.vocab * self.hidden if logits else 2 * self.hidden
        return 2 * self.active_matmul_params + self.attention_flops(context) + head

    def decode_flops(self, position: float, logits: bool = True) -> float:
        """FLOPs of one decode step for a token at `position` (attends to all earlier keys;
        latent attention over its latents as they are: `models.mla`'s absorbed form)."""
        per_key = (self.heads * (2 * self.kv_lora_rank + self.rope_dim) if self.latent
                   else self.q_width + self.v_width)
        attn = 2 * self.layers * position * per_key
        head = 2 * self.vocab * self.hidden if logits else 2 * self.hidden
        return 2 * self.active_matmul_params + attn + head

    def activation_elems_per_token(self) -> float:
        """Elements read and written by the non-matmul operators (norms, rotary, SwiGLU,
        residuals, softmax) of one forward, per token: `ACT_PER_LAYER` counted on rlloom's
        eager implementation (tests/perf/test_validate.py recounts them). Attention's scores
        stay inside the fused SDPA kernel, so the context length barely matters."""
        per_d, per_ffn = ACT_PER_LAYER
        return self.layers * (per_d * self.hidden + per_ffn * self.active_ffn)

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """K and V of every layer for one token: L cache_width elements (bf16 by default)."""
        return round(self.layers * self.cache_width * bytes_per_elem)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> "ModelShape":
        """Read a Hugging Face `config.json`: a supported family's with the runtime's own
        reader of its fields (rlloom/models/families), another's from the keys most
        families share."""
        from rlloom.models.families import FAMILIES, shared_names, text_config
        cfg = text_config(cfg)  # an image-text checkpoint: its language model
        model_type = cfg.get("model_type", "")
        cfg = shared_names(cfg, model_type)
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        fam = FAMILIES[model_type].read(cfg, None) if model_type in FAMILIES else {}
        n_experts = fam.get("n_experts",
                            cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
        return cls(
            name=name or cfg.get("_name_or_path", model_type),
            layers=cfg["num_hidden_layers"], hidden=hidden,
            ffn=fam.get("intermediate_size", cfg.get("intermediate_size")),
            heads=heads, kv_heads=fam.get("num_kv_heads", cfg.get("num_key_value_heads", heads)),
            head_dim=(fam["qk_nope_head_dim"] + fam["head_dim"] if fam.get("kv_lora_rank")
                      else fam.get("head_dim", cfg.get("head_dim") or hidden // heads)),
            vocab=cfg["vocab_size"],
            tied_embeddings=bool(fam.get("tie_word_embeddings",
                                         cfg.get("tie_word_embeddings", False))),
            qkv_bias=fam.get("qkv_bias", bool(cfg.get("attention_bias", False))),
            n_experts=n_experts,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if n_experts else 0,
            moe_ffn=fam.get("moe_intermediate_size", cfg.get("moe_intermediate_size",
                                                            cfg["intermediate_size"]))
            if n_experts else 0,
            post_norms=fam.get("post_norms", False),
            layer_norms=4 if fam.get("sandwich_norms") else 2,
            attn_softcap=fam.get("attn_softcap") is not None,
            attn_sinks=fam.get("attn_sinks", False),
            o_bias=fam.get("o_bias", bool(cfg.get("attention_bias", False))),
            mlp_bias=fam.get("mlp_bias", False) or fam.get("expert_bias", False),
            gated_mlp=fam.get("gated_mlp", True), layer_norm=fam.get("layer_norm", False),
            positions=cfg["max_position_embeddings"] if fam.get("learned_positions") else 0,
            qk_norm_params=_qk_norm_params(fam, heads, cfg),
            **(_moe_layers(fam, cfg["num_hidden_layers"]) if n_experts else {}),
            **(_latent(fam) if fam.get("kv_lora_rank") else {}))


def _moe_layers(fam: dict[str, Any], layers: int) -> dict[str, int]:
    """The dense layers of an MoE model (the runtime's `ModelConfig.is_moe_layer` rule) and
    its shared experts' width."""
    step, dense = fam.get("decoder_sparse_step", 1), set(fam.get("mlp_only_layers", ()))
    moe = sum(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return dict(dense_layers=layers - moe,
                shared_ffn=fam.get("n_shared_experts", 0) * fam.get("moe_intermediate_size", 0))


def _latent(fam: dict[str, Any]) -> dict[str, int]:
    # transformers' head_dim of an MLA model: the rotary part's
    return dict(rope_dim=fam["head_dim"],
                kv_lora_rank=fam["kv_lora_rank"], q_lora_rank=fam["q_lora_rank"],
                v_head_dim=fam["v_head_dim"])


def _qk_norm_params(fam: dict[str, Any], heads: int, cfg: dict[str, Any]) -> int:
    if not fam.get("qk_norm"):
        return 0
    head_dim = fam.get("head_dim", cfg.get("head_dim") or cfg["hidden_size"] // heads)
    if fam.get("qk_norm_whole"):
        return (heads + fam.get("num_kv_heads", cfg.get("num_key_value_heads", heads))) \
            * head_dim
    return 2 * head_dim


def _qwen2(name: str, layers: int, hidden: int, ffn: int, heads: int, kv: int,
           tied: bool) -> ModelShape:
    vocab = 151936 if tied else 152064
    return ModelShape(name, layers, hidden, ffn, heads, kv, hidden // heads, vocab,
                      tied_embeddings=tied, qkv_bias=True)


# Numbers from each model's config.json on the Hugging Face Hub (Qwen/Qwen2.5-*,
# meta-llama/Meta-Llama-3-*, Qwen/Qwen3-30B-A3B).
MODELS: dict[str, ModelShape] = {m.name: m for m in [
    _qwen2("qwen2.5-0.5b", 24, 896, 4864, 14, 2, tied=True),
    _qwen2("qwen2.5-1.5b", 28, 1536, 8960, 12, 2, tied=True),
    _qwen2("qwen2.5-7b", 28, 3584, 18944, 28, 4, tied=False),
    _qwen2("qwen2.5-14b", 48, 5120, 13824, 40, 8, tied=False),
    _qwen2("qwen2.5-32b", 64, 5120, 27648, 40, 8, tied=False),
    _qwen2("qwen2.5-72b", 80, 8192, 29568, 64, 8, tied=False),
    ModelShape("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256),
    ModelShape("llama-3-70b", 80, 8192, 28672, 64, 8, 128, 128256),
    # Every Qwen3-MoE layer is sparse (decoder_sparse_step=1), so the dense ffn is unused.
    ModelShape("qwen3-30b-a3b", 48, 2048, 6144, 32, 4, 128, 151936, n_experts=128,
               experts_per_token=8, moe_ffn=768),
]}


def model_shape(name: str) -> ModelShape:
    """A named preset (any case: `Qwen2.5-7B` as Hugging Face spells it), or a Hugging Face
    `config.json` (the file, or a checkpoint directory holding it); the error lists the
    known names."""
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return ModelShape.from_hf_config(json.loads(path.read_text()), name=str(name))
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}, or a checkpoint "
                       "directory / config.json") from None
