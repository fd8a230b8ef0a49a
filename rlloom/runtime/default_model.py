"""The built-in tiny model: a char-level tokenizer and a few-hundred-thousand-parameter decoder,
warm-started by SFT on the task and cached on disk so later runs reuse it."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import torch

from rlloom.config import RunConfig
from rlloom.config_sections import ModelSection
from rlloom.data.prompts import DataError, read_prompt_file
from rlloom.data.synthetic import generate
from rlloom.models.config import ModelConfig
from rlloom.models.hf_io import load_model, load_tokenizer, save_checkpoint
from rlloom.models.lora import apply_lora
from rlloom.models.tokenizer import build_char_tokenizer
from rlloom.models.transformer import CausalLM
from rlloom.runtime.device import resolve_device
from rlloom.runtime.executor.policy import save_final
from rlloom.runtime.stages.sft import mix_direct_answers, supervised_finetune

# SFT problems come from their own seed so they do not overlap the RL prompt stream by design.
SFT_SEED_OFFSET = 7_777_777
SFT_PROBLEMS = 50_000


def cache_root() -> Path:
    return Path(os.environ.get("RLLOOM_CACHE", Path.home() / ".cache" / "rlloom"))


def tiny_model_config(m: ModelSection, vocab_size: int) -> ModelConfig:
    head_dim = m.hidden_size // m.heads
    moe = m.family == "qwen3_moe"
    experts = dict(n_experts=m.experts, experts_per_token=m.experts_per_token,
                   moe_intermediate_size=m.hidden_size, norm_topk_prob=True) if moe else {}
    return ModelConfig(family=m.family, vocab_size=vocab_size, hidden_size=m.hidden_size,
                       intermediate_size=3 * m.hidden_size, num_layers=m.layers,
                       num_heads=m.heads, num_kv_heads=m.kv_heads, head_dim=head_dim,
                       max_position_embeddings=512, qk_norm=m.family.startswith("qwen3"),
                       qkv_bias=m.family == "qwen2", bos_token_id=1, eos_token_id=2,
                       pad_token_id=0, **experts)


def default_model_key(cfg: RunConfig) -> str:
    """Everything the built-in checkpoint depends on, hashed."""
    dense = set() if cfg.model.family == "qwen3_moe" else {"experts", "experts_per_token"}
    recipe = {"model": cfg.model.model_dump(exclude={"path", "dtype", *dense}),
              "task": cfg.data.task, "difficulty": cfg.data.difficulty,
              "sft": cfg.sft.model_dump(), "seed": cfg.seed, "version": 1}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def warm_start(cfg: RunConfig, out: Path, device: torch.device | None = None) -> Path:
    """SFT `model.path` (or a freshly initialised tiny model when it is null) on worked
    solutions (the prompt file's `solution` fields, else the built-in task), save to `out`.
    Trains on `device` (default: `train.device` resolved here); the weights initialise on
    the CPU, so they are the same whichever device trains them."""
    device = device or resolve_device(cfg.train.device)
    if cfg.model.path:
        tokenizer = load_tokenizer(cfg.model.path, cfg.data.chat_template)
        model = load_model(cfg.model.path)
    else:
        tokenizer = build_char_tokenizer()
        model = CausalLM(tiny_model_config(cfg.model, len(tokenizer)))
        model.init_weights(seed=cfg.seed)
    if cfg.data.prompt_file:
        d = cfg.data
        problems = read_prompt_file(d.prompt_file, d.task, d.columns, d.transform,
                                    d.system_prompt)
        unsolved = [p for p in problems if not p.solution.strip()]
        if unsolved:
            raise DataError(f"{unsolved[0].source}: no 'solution' field ({len(unsolved)} of "
                            f"{len(problems)} rows lack one); supervised warm-starting trains on "
                            "worked solutions: add a 'solution' column, or map yours with "
                            "data.columns={solution: <column>}")
    else:  # only the built-in tasks' own solutions get a share of bare answers
        problems = mix_direct_answers(
            generate(cfg.data.task, SFT_PROBLEMS, seed=cfg.seed + SFT_SEED_OFFSET,
                     difficulty=cfg.data.difficulty), cfg.sft.direct_fraction, seed=cfg.seed)
    lora = cfg.model.lora
    if lora is not None:  # only the adapters train, as in an RL run with model.lora
        if not cfg.model.path:
            raise DataError("LoRA SFT adapts a checkpoint: set model.path (the built-in model "
                            "trains every weight)")
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, tuple(lora.targets), cfg.seed)
    supervised_finetune(model.to(device), tokenizer, problems, cfg.sft.steps, cfg.sft.batch_size,
                        cfg.sft.lr, seed=cfg.seed)
    if lora is None:
        save_checkpoint(model, tokenizer, out)
    else:  # the merged model, and the adapters alone in PEFT's format in out/adapter
        save_final(cfg, Path(cfg.model.path), {k: v.detach().cpu() for k, v in
                                               model.state_dict().items()}, out)
    return out


def ensure_default_model(cfg: RunConfig, device: torch.device | None = None) -> Path:
    """The built-in model's checkpoint, built on `device` (see `warm_start`) unless cached."""
    path = cache_root() / "models" / f"tiny-{cfg.data.task}-{default_model_key(cfg)}"
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # one process builds while the others starting at the same moment wait, then read it
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            print(f"building the built-in model (cached at {path})")
            warm_start(cfg.model_copy(update={
                "data": cfg.data.model_copy(update={"prompt_file": None}),
                "model": cfg.model.model_copy(update={"lora": None})}), path, device)
    return path
