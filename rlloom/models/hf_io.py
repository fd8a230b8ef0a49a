"""Load and save Hugging Face checkpoint directories (config.json, safetensors, tokenizer)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlloom.models.config import CheckpointError, ModelConfig
from rlloom.models.families import FAMILIES, language_model_state
from rlloom.models.heads import ValueModel
from rlloom.models.lora import peft_state
from rlloom.models.transformer import CausalLM


def _require_dir(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist; set model.path to a "
                              "Hugging Face checkpoint directory, or leave it null for the "
                              "built-in tiny model")


# `model.dtype` names -> torch dtypes of the weights a checkpoint is loaded in
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def read_model_config(path: Path) -> ModelConfig:
    """The architecture of the checkpoint at `path` (its config.json), without its weights."""
    _require_dir(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing: {path} is not a Hugging Face checkpoint "
                              "directory (expected config.json and *.safetensors)")
    return ModelConfig.from_hf(json.loads(cfg_file.read_text()))


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {path}; rlloom reads safetensors "
                              "only (convert .bin weights with transformers' save_pretrained)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(str(path / name)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{path / name} cannot be read ({type(e).__name__}: {e}); "
                                  "the file is truncated or damaged: copy or save it again"
                                  ) from None
    return state


def _split_fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One tensor per expert, as `save_pretrained` writes Qwen3-MoE checkpoints.

    transformers 5 holds a layer's experts as fused 3D tensors (`mlp.experts.gate_up_proj`
    [experts, 2 * moe_intermediate, hidden], `mlp.experts.down_proj` [experts, hidden,
    moe_intermediate]); a checkpoint written from that state dict directly arrives in this form.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
            for e in range(t.shape[0]):
                if leaf == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e]
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}.{e}.up_proj.weight"] = up
        else:
            out[name] = t
    return out


def _load_into(model: nn.Module, path: Path, dtype: torch.dtype) -> None:
    cfg = model.config
    state = language_model_state(_read_state(path))
    state = _split_fused_experts(FAMILIES[cfg.family].from_checkpoint(state, cfg))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(f"weights in {path} do not match a {cfg.family} "
                              f"{type(model).__name__}: missing {sorted(missing)[:5]}, "
                              f"unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False)
    model.to(dtype)


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build rlloom's language model from a checkpoint directory and load its weights."""
    model = CausalLM(read_model_config(Path(path)))
    _load_into(model, Path(path), dtype)
    return model


def load_value_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> ValueModel:
    """A reward model / critic: a `*ForSequenceClassification` checkpoint with one label."""
    path = Path(path)
    cfg = read_model_config(path)
    labels = json.loads((path / "config.json").read_text()).get("id2label", {"0": ""})
    if len(labels) != 1:
        raise CheckpointError(f"{path} has {len(labels)} labels; a reward model has one scalar "
                              "output (num_labels=1)")
    model = ValueModel(cfg)
    _load_into(model, path, dtype)
    return model


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | os.PathLike, chat_template: str = "auto"
                   ) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, with `chat_template` (`data.chat_template`: auto keeps the
    checkpoint's, none drops it, else a jinja file replaces it); one without a pad token pads
    with EOS (as TRL does: padded positions are masked, so the id never counts)."""
    _require_dir(Path(path))
    if not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        raise CheckpointError(f"{path} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)});"
                              " save the base model's beside the weights: AutoTokenizer."
                              f"from_pretrained(BASE).save_pretrained({str(path)!r})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load a tokenizer from {path}: {e}") from e
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template == "none":
        tokenizer.chat_template = None
    elif chat_template != "auto":
        tokenizer.chat_template = Path(chat_template).read_text()
    return tokenizer


def require_tokenizer_fits(path: str | os.PathLike, tokenizer: PreTrainedTokenizerBase) -> None:
    """The policy's tokenizer must not hand out ids past the model's embedding."""
    rows = read_model_config(Path(path)).vocab_size
    if len(tokenizer) > rows:
        raise CheckpointError(f"the tokenizer in {path} has {len(tokenizer)} tokens, more than "
                              f"the model's vocab_size {rows}: ids from {rows} on would index "
                              "past its embedding; save the tokenizer the model was trained "
                              "with, or resize the embedding (model.resize_token_embeddings)")


def require_policy_tokenizer(path: str | os.PathLike, rows: int,
                             tokenizer: PreTrainedTokenizerBase, what: str) -> None:
    """A model that reads the policy's token ids (a reward model, a critic) must share its
    tokenizer: the checkpoint's own tokenizer, when it has one, maps the same strings to the
    same ids and its embedding (`rows`) covers them; without one, its embedding must have
    exactly the policy tokenizer's size, the only evidence there is."""
    has_own = any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    theirs = load_tokenizer(path).get_vocab() if has_own else None
    ours = tokenizer.get_vocab()
    if theirs == ours and rows >= len(tokenizer) or theirs is None and rows == len(tokenizer):
        return
    raise CheckpointError(f"{what} {path} has a vocabulary of {rows} rows"
                          + (" and another tokenizer" if theirs not in (None, ours) else "")
                          + f", the policy's tokenizer {len(tokenizer)}; they must share the "
                          "tokenizer (start it from a model of the policy's family)")


def save_checkpoint(model: CausalLM, tokenizer: PreTrainedTokenizerBase | None,
                    path: str | os.PathLike) -> None:
    """Write config.json, model.safetensors and tokenizer files atomically."""
    with atomic_dir(Path(path)) as tmp:
        # Only the language model: a shared actor-critic's value head is training state.
        state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
                 if k.startswith(("model.", "lm_head."))}
        dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
        config = {**model.config.to_hf(), "torch_dtype": dtype, "dtype": dtype}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        c = model.config
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
             "pad_token_id": c.pad_token_id}, indent=2))
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight")
        state = FAMILIES[c.family].to_checkpoint(state, c)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))


def save_adapter(weights: dict[str, torch.Tensor], config: dict[str, Any],
                 path: str | os.PathLike) -> None:
    """A LoRA model's adapters, from its whole `weights`, as PEFT writes them:
    adapter_config.json and adapter_model.safetensors, atomically."""
    with atomic_dir(Path(path)) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.detach().cpu() for k, v in peft_state(weights).items()}
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})


@contextmanager
def atomic_dir(path: Path, prefix: str | None = None) -> Iterator[Path]:
    """A temporary directory beside `path` to write into; it becomes `path` when the block
    ends, or is removed if the block raises, so readers never see a partial `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=prefix or f".{path.name}."))
    try:
        yield tmp
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(src: Path, dst: Path) -> None:
    """Move the finished directory `src` to `dst` so readers never see a partial `dst`."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old)
    else:
        os.rename(src, dst)
