"""Architecture description of the supported decoder families (rlloom/models/families: dense,
and routed experts), read from and written to Hugging Face `config.json` dictionaries."""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import re

from rlloom.models.families import (FAMILIES, UnsupportedArchitectureError, shared_names,
                                    text_config)

# Hugging Face architecture name -> family (a module of rlloom/models/families each; a
# family that changes the block adds a flag to ModelConfig below)
SUPPORTED_ARCHITECTURES = {f.arch: name for name, f in FAMILIES.items()}
FAMILY_TO_ARCH = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
# The same families with one scalar output: reward models and critics.
SCORING_ARCHITECTURES = {re.sub("(ForCausalLM|LMHeadModel)$", "ForSequenceClassification", arch):
                         family for arch, family in SUPPORTED_ARCHITECTURES.items()}


# the gate activations the supported families use (transformers' ACT2FN names;
# rlloom.models.activations holds their functions)
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
# rotary embeddings: plain, or scaled as Hugging Face's rope_parameters say
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


class CheckpointError(ValueError):
    """A model directory that cannot be read (defined here, without torch, for the CLI)."""


@dataclass
class ModelConfig:
    family: str                    # a module of rlloom/models/families: "llama", "qwen3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Hugging Face's rope_parameters beyond the default (rope_type llama3, linear, dynamic,
    # yarn with their factors); empty = default rotary embeddings
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions rotated (Phi-4)
    nope_layers: tuple[int, ...] = ()  # SmolLM3: layers without positional embeddings
    hidden_act: str = "silu"       # the MLP's gate activation (SwiGLU with silu by default)
    sliding_window: int | None = None  # keys a query sees on a sliding-attention layer
    sliding_layers: tuple[int, ...] = ()  # the layers that attend within sliding_window
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False         # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool = False           # Llama/Qwen3 attention_bias also biases o_proj
    mlp_bias: bool = False
    layer_norm: bool = False       # GPT-2: LayerNorm with a bias instead of RMSNorm
    gated_mlp: bool = True         # False (GPT-2): down(act(up(x))), no gate_proj
    learned_positions: bool = False  # GPT-2: a position table added to the embeddings, no rope
    qk_norm: bool = False          # Qwen3 RMSNorm on per-head queries and keys ...
    qk_norm_whole: bool = False    # ... OLMo2: on all heads' queries and keys at once
    post_norms: bool = False       # OLMo2: x + norm(sublayer(x)), no norm before it
    sandwich_norms: bool = False   # Gemma2: x + norm(sublayer(norm(x)))
    norm_offset: bool = False      # Gemma: norms scale by 1 + weight
    embed_scale: bool = False      # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None     # the scores' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None   # Gemma2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma2: logits -> cap * tanh(logits / cap)
    local_rope_theta: float | None = None  # Gemma3: the sliding layers' own rotary base
    attn_sinks: bool = False       # gpt-oss: a learned logit per head in each softmax's sum
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # Qwen3-MoE: routed SwiGLU experts replace the dense MLP in the sparse layers.
    n_experts: int = 0             # experts per MoE layer; 0 = every layer dense
    experts_per_token: int = 0     # top-k experts each token is routed to
    moe_intermediate_size: int = 0  # hidden width of one expert
    norm_topk_prob: bool = False   # renormalise the k chosen router probabilities to sum to 1
    decoder_sparse_step: int = 1   # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    router_bias: bool = False      # gpt-oss: the router and ...
    expert_bias: bool = False      # ... every expert projection biased
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU experts (moe.Expert)
    swiglu_alpha: float = 1.702
    # DeepSeek-V3: routing by sigmoid scores plus a per-expert correction bias (choice only),
    # within the best topk_group of n_group expert groups, weights times a scaling factor
    moe_scoring: str = "softmax"   # or "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0      # experts every token also runs (one MLP n times as wide)
    # DeepSeek-V3's multi-head latent attention (kv_lora_rank > 0): keys and values expanded
    # from a compressed latent (what the KV cache keeps) and a shared rotary key of head_dim
    # (transformers' head_dim is the rotary part's), queries through a q_lora_rank bottleneck
    kv_lora_rank: int = 0
    q_lora_rank: int = 0           # 0: one q_proj
    qk_nope_head_dim: int = 0      # a query/key head's unrotated part ...
    v_head_dim: int = 0            # ... and a value head's width
    rope_interleave: bool = False  # rotary pairs (x0, x1), (x2, x3), ... not halves
    # the checkpoint's own config.json, written back on export with rlloom's fields on top,
    # so fields rlloom does not read survive a round trip
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILY_TO_ARCH:
            raise UnsupportedArchitectureError(
                f"unknown model family {self.family!r}; supported: {sorted(FAMILY_TO_ARCH)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        self.sliding_layers = tuple(self.sliding_layers)
        self.nope_layers = tuple(self.nope_layers)
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"hidden_act={self.hidden_act!r} is not supported; rlloom implements "
                f"{', '.join(ACTIVATIONS)}")
        kind = self.rope_scaling.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope_type {kind!r} is not supported; rlloom implements "
                f"{', '.join(ROPE_TYPES)}")
        if self.n_experts:
            if not FAMILIES[self.family].moe:
                raise UnsupportedArchitectureError(
                    f"n_experts={self.n_experts} needs an MoE family "
                    f"({', '.join(n for n, f in FAMILIES.items() if f.moe)}), not "
                    f"{self.family!r}")
            if not 1 <= self.experts_per_token <= self.n_experts:
                raise ValueError(f"experts_per_token={self.experts_per_token} must be in "
                                 f"1..n_experts={self.n_experts}")
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError("an MoE model needs moe_intermediate_size > 0 and "
                                 "decoder_sparse_step > 0")
            if self.moe_scoring not in ("softmax", "sigmoid"):
                raise UnsupportedArchitectureError(
                    f"moe_scoring={self.moe_scoring!r}: rlloom routes by softmax or sigmoid")
            per_group = self.n_experts // max(self.n_group, 1)
            if (self.n_group < 1 or self.n_experts % self.n_group
                    or not 1 <= self.topk_group <= self.n_group
                    or self.experts_per_token > self.topk_group * per_group):
                raise ValueError(f"n_group={self.n_group}, topk_group={self.topk_group}: the "
                                 f"{self.n_experts} experts must split into n_group equal "
                                 f"groups of which topk_group hold the top "
                                 f"{self.experts_per_token}")

    @functools.cached_property  # read by every forward's rotary tables
    def local_rope(self) -> "ModelConfig | None":
        """The config whose default rotary embedding the sliding layers use (Gemma3)."""
        if self.local_rope_theta is None:
            return None
        return replace(self, rope_theta=self.local_rope_theta, rope_scaling={},
                       local_rope_theta=None)

    @property
    def rope_by_length(self) -> bool:
        """Whether the rotary frequencies depend on the sequence's length: dynamic NTK, and
        longrope's long factors past the original length (Phi-3/3.5)."""
        return self.rope_scaling.get("rope_type") in ("dynamic", "longrope")

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """A query's (and key's) head width: the unrotated part and the rotary head_dim."""
        return self.qk_nope_head_dim + self.head_dim

    @property
    def cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of what a KV cache keeps per token and layer as its "keys" and
        "values": the KV heads' keys and values, or latent attention's compressed latent and
        its rotary key (one of each, shared by every head)."""
        if self.latent:
            return (1, self.kv_lora_rank), (1, self.head_dim)
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (Hugging Face's Qwen3-MoE rule)."""
        return (self.n_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_params(self) -> int:
        d, hd, f = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = 2 * d * (q + kv) + (q + 2 * kv) * self.qkv_bias + d * self.o_bias
        if self.latent:
            attn = latent_attention_params(self)
        dense = (3 if self.gated_mlp else 2) * d * f \
            + ((2 if self.gated_mlp else 1) * f + d) * self.mlp_bias
        fe = self.moe_intermediate_size   # experts, biases (gpt-oss), router rows and biases
        moe = self.n_experts * (3 * d * fe + (2 * fe + d) * self.expert_bias + d
                                + self.router_bias)
        moe += 3 * d * fe * self.n_shared_experts
        mlp = sum(moe if self.is_moe_layer(i) else dense for i in range(self.num_layers))
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        positions = self.max_position_embeddings * d if self.learned_positions else 0
        norm = 2 * d if self.layer_norm else d  # a LayerNorm's bias beside its weight
        norms = (4 if self.sandwich_norms else 2) * norm
        if self.latent:  # the latents' norms
            norms += self.kv_lora_rank + self.q_lora_rank
        if self.qk_norm:  # per head, or (OLMo2) over all heads
            norms += (self.num_heads + self.num_kv_heads) * hd if self.qk_norm_whole else 2 * hd
        norms += self.num_heads * self.attn_sinks
        return self.num_layers * (attn + norms) + mlp + embed + positions + norm

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        hf = text_config(hf)  # an image-text checkpoint: its language model
        archs = hf.get("architectures") or []
        known = {**SUPPORTED_ARCHITECTURES, **SCORING_ARCHITECTURES}
        family = next((known[a] for a in archs if a in known), None)
        if family is None:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; rlloom supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (and their *ForSequenceClassification "
                "forms with one label as reward models)")
        quant = hf.get("quantization_config")
        if quant:
            raise UnsupportedArchitectureError(
                f"this {family} checkpoint is quantised ({quant.get('quant_method', quant)}); "
                "rlloom trains full-precision weights: dequantise it first, e.g. load it in "
                "transformers with the quantisation's dequantize option (Mxfp4Config("
                "dequantize=True) for gpt-oss) and save_pretrained in bf16")
        hf = shared_names(hf, family)
        heads = hf["num_attention_heads"]
        # transformers' own config class normalises what checkpoints spell in several ways
        # (rope_scaling vs rope_parameters, Qwen2's use_sliding_window + max_window_layers)
        norm = normalised_hf_config(hf, family)
        rope = dict(getattr(norm, "rope_parameters", None) or {})  # GPT-2: none
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope.pop("partial_rotary_factor", None)  # a field of its own (Phi-3 reads it)
        if rope.get("rope_type", "default") == "default":
            rope = {}
        window = getattr(norm, "sliding_window", None)
        types = getattr(norm, "layer_types", None)
        sliding = (tuple(i for i, t in enumerate(types) if t == "sliding_attention") if types
                   else tuple(range(hf["num_hidden_layers"])) if window else ())
        shared = dict(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size"),  # GPT-2 reads its n_inner
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope,
            hidden_act=hf.get("hidden_act", hf.get("hidden_activation", "silu")),
            sliding_window=window if sliding else None,
            sliding_layers=sliding if window else (),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )
        # a family's own reading wins (Gemma2 ties its head unless told otherwise)
        return cls(**{**shared, **FAMILIES[family].read(hf, norm)}, source=dict(hf))

    def to_hf(self) -> dict[str, Any]:
        hf: dict[str, Any] = {
            **self.source,
            "architectures": [FAMILY_TO_ARCH[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", **self.rope_scaling,
                                "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        hf.pop("rope_scaling", None)  # rope_parameters holds it
        if self.learned_positions:
            for key in ("rope_theta", "rope_parameters"):
                hf.pop(key)
        for own, shared in FAMILIES[self.family].hf_names.items():  # GPT-2's names
            hf[own] = hf.pop(shared)
        hf.update(FAMILIES[self.family].write(self))
        return hf

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "source"}

    def describe(self) -> str:
        """One line naming what a run trains: family, shape and the settings that matter."""
        heads = (f"{self.num_heads} heads of {self.qk_head_dim} (latent attention: kv rank "
                 f"{self.kv_lora_rank}, q rank {self.q_lora_rank or 'none'}, rotary "
                 f"{self.head_dim})" if self.latent else
                 f"{self.num_heads} heads ({self.num_kv_heads} kv) of {self.head_dim}")
        parts = [FAMILY_TO_ARCH[self.family], f"{self.num_layers} layers",
                 f"hidden {self.hidden_size}", heads, f"vocab {self.vocab_size}",
                 f"hidden_act {self.hidden_act}",
                 f"learned positions ({self.max_position_embeddings})" if self.learned_positions
                 else f"rope {self.rope_scaling.get('rope_type', 'default')} theta "
                      f"{self.rope_theta:g}"]
        if self.attn_sinks:
            parts.append("attention sinks")
        if self.n_experts:
            parts.append(f"{self.n_experts} experts, top {self.experts_per_token}"
                         + (f", {self.n_shared_experts} shared" if self.n_shared_experts else ""))
        if self.sliding_window is not None:
            parts.append(f"sliding window {self.sliding_window} on layers "
                         f"{list(self.sliding_layers)}")
        return ", ".join(parts) + f"; {self.num_params / 1e6:.3g}M parameters"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None where it attends to all keys."""
        return self.sliding_window if layer in self.sliding_layers else None


def latent_attention_params(cfg: ModelConfig) -> int:
    """One latent attention's weights (the q and kv latents' norms not counted)."""
    d, h, rope, nope = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.qk_nope_head_dim
    qk = h * (nope + rope)
    q = d * cfg.q_lora_rank + cfg.q_lora_rank * qk if cfg.q_lora_rank else d * qk
    kv = d * (cfg.kv_lora_rank + rope) + cfg.kv_lora_rank * h * (nope + cfg.v_head_dim)
    bias = (cfg.q_lora_rank + cfg.kv_lora_rank + rope + d) * cfg.qkv_bias
    return q + kv + h * cfg.v_head_dim * d + bias


def normalised_hf_config(hf: dict[str, Any], family: str) -> Any:
    """`hf` read by transformers' config class of `family` (whose names are transformers'
    model types; imported here: it is slow to import, and the CLI reads configs without it)."""
    from transformers import CONFIG_MAPPING

    keep = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    return CONFIG_MAPPING[family](**keep)
