"""Architecture description of the supported dense decoder family, read from and written to
Hugging Face `config.json` dictionaries."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Hugging Face architecture name -> family. Adding a family adds a line here and, if it
# changes the block, a flag below.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
FAMILY_TO_ARCH = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
# The same families with one scalar output: reward models and critics.
SCORING_ARCHITECTURES = {arch.replace("ForCausalLM", "ForSequenceClassification"): family
                         for arch, family in SUPPORTED_ARCHITECTURES.items()}


class UnsupportedArchitectureError(ValueError):
    pass


class CheckpointError(ValueError):
    """A model directory that cannot be read (defined here, without torch, for the CLI)."""


@dataclass
class ModelConfig:
    family: str                    # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False         # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool = False           # Llama/Qwen3 attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False          # Qwen3 RMSNorm on per-head queries and keys
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILY_TO_ARCH:
            raise UnsupportedArchitectureError(
                f"unknown model family {self.family!r}; supported: {sorted(FAMILY_TO_ARCH)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def num_params(self) -> int:
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * d * self.intermediate_size
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * d) + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or []
        known = {**SUPPORTED_ARCHITECTURES, **SCORING_ARCHITECTURES}
        family = next((known[a] for a in archs if a in known), None)
        if family is None:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; rlloom supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (and their *ForSequenceClassification "
                "forms with one label as reward models)")
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise UnsupportedArchitectureError(
                f"rope scaling {rope!r} is not supported; only default rotary embeddings are")
        bias = bool(hf.get("attention_bias", False))
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=True if family == "qwen2" else bias,
            o_bias=False if family == "qwen2" else bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        hf: dict[str, Any] = {
            "architectures": [FAMILY_TO_ARCH[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.family != "qwen2":
            hf["attention_bias"] = self.qkv_bias
            hf["mlp_bias"] = self.mlp_bias
        return hf

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
