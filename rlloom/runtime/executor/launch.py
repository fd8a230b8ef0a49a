"""`rlloom train`, one launch path for every runtime: check everything, claim the run
directory, then run the step loop (`loop.StepLoop`) over this process as a colocated group of
one rank or over a torchrun world (`local.LocalExecutor`), or over Ray actors
(`ray/executor.py`)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.algos.presets import PRESETS
from rlloom.config import RunConfig, dump_config
from rlloom.data.chat import is_chat
from rlloom.data.preferences import read_preference_file
from rlloom.data.prompts import DataError, load_prompt_sets
from rlloom.models.hf_io import load_tokenizer, read_model_config, require_tokenizer_fits
from rlloom.runtime.checkpoint import checkpoint_step
from rlloom.runtime.default_model import ensure_default_model
from rlloom.runtime.device import resolve_device, torchrun_device
from rlloom.runtime.executor.groups import check_group_layouts, group_specs, world_size
from rlloom.runtime.executor.interface import RunOptions, WorkerFailure
from rlloom.runtime.executor.local import LocalExecutor, join_torchrun
from rlloom.runtime.executor.loop import StepLoop
from rlloom.runtime.executor.preflight import Runtime, preflight
from rlloom.runtime.outputs.files import write_atomic
from rlloom.runtime.ranks import leave_world
from rlloom.runtime.run_dir import INPUTS, claim, fingerprints, record_resume, rewind
from rlloom.runtime.stages.batch import encode
from rlloom.runtime.stages.evaluate import eval_problems


def check_prompts(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse, before any work, an online run without training prompts, and prompts the
    tokenizer cannot render (chat turns without a chat template) or longer than
    `data.max_prompt_tokens` once rendered."""
    d, online = cfg.data, PRESETS[cfg.algo.name].online
    problems: list = load_prompt_sets(d, cfg.seed).train if online else []
    if online and not problems:
        raise DataError(f"data.task={d.task} has no built-in problems to train on; set "
                        "data.prompt_file")
    problems += eval_problems(cfg)
    for pairs in (d.preference_file, None if online else d.eval_file):
        if pairs:
            problems += read_preference_file(pairs, d.transform, d.system_prompt)
    source = d.prompt_file or d.preference_file or f"built-in task {d.task}"
    chat = next((p for p in problems if is_chat(p.prompt)), None)
    if chat is not None and not tokenizer.chat_template:
        why = ("data.system_prompt makes every prompt chat turns" if d.system_prompt else
               f"{getattr(chat, 'source', '') or source} has a prompt of chat turns")
        raise DataError(f"{why}, but the tokenizer has no chat template (data.chat_template="
                        f"{d.chat_template}); set data.chat_template to a jinja template file "
                        "or give text prompts")
    lengths = [len(ids) for ids in encode(tokenizer, [p.prompt for p in problems])]
    too_long = [(i, n) for i, n in enumerate(lengths) if n > d.max_prompt_tokens]
    if too_long:
        i, n = too_long[0]
        where = getattr(problems[i], "source", "") or f"{source} prompt #{i}"
        templated = " (chat template included)" if tokenizer.chat_template else ""
        raise DataError(f"{where}: prompt has {n} tokens{templated}, more than "
                        f"data.max_prompt_tokens={d.max_prompt_tokens} ({len(too_long)} "
                        f"prompts of {source} do); raise data.max_prompt_tokens or shorten "
                        "the prompts")


def new_run_dir(cfg: RunConfig) -> Path:
    if cfg.run_dir:
        return Path(cfg.run_dir)
    name = [time.strftime("%Y%m%d-%H%M%S")]
    if world_size() > 1:  # every process must write where rank 0 does
        join_torchrun(cfg.train.device)
        torch.distributed.broadcast_object_list(name, src=0)
    return Path("runs") / name[0]


def _default_model(cfg: RunConfig, device: torch.device) -> Path:
    """The built-in model, built (and cached) by one process while the others wait."""
    if world_size() == 1:
        return ensure_default_model(cfg, device)
    if torch.distributed.get_rank() == 0:
        ensure_default_model(cfg, device)
    torch.distributed.barrier()
    return ensure_default_model(cfg, device)


def prepare(cfg: RunConfig, runtime: Runtime, opts: RunOptions) -> tuple[Path, torch.device]:
    """Every check before work (`preflight`, then the model's tokenizer, layouts and the
    prompts), joining the torchrun world first under torchrun; the model the run starts from
    and this process's device (the CPU for a Ray driver, which builds the default model)."""
    world = world_size()
    preflight(cfg, runtime, opts, world)
    if runtime == "ray":
        device = torch.device("cpu")
    elif runtime == "torchrun":
        device = torchrun_device(cfg.train.device)
        join_torchrun(cfg.train.device)
    else:
        device = resolve_device(cfg.train.device)
    model_path = Path(cfg.model.path) if cfg.model.path else _default_model(cfg, device)
    tokenizer = load_tokenizer(model_path, cfg.data.chat_template)
    require_tokenizer_fits(model_path, tokenizer)
    if tokenizer.eos_token_id is None:
        raise DataError(f"the tokenizer in {model_path} has no EOS token; set eos_token in "
                        "its tokenizer_config.json (responses end at EOS)")
    if runtime != "process":
        check_group_layouts(cfg, read_model_config(model_path))
    check_prompts(cfg, tokenizer)
    return model_path, device


def local_loop(cfg: RunConfig, run_dir: Path, opts: RunOptions | None = None) -> StepLoop:
    """The step loop over this process (and its torchrun peers), after every check; nothing
    is built until it starts."""
    opts = opts or RunOptions()
    model_path, device = prepare(cfg, "torchrun" if world_size() > 1 else "process", opts)
    specs = group_specs(cfg)  # colocated: one group, every stage on these ranks
    ex = LocalExecutor(cfg, model_path, specs[0], device)
    return StepLoop(cfg, run_dir, ex, model_path, specs, opts)


def train(cfg: RunConfig, resume_dir: Path | None = None, opts: RunOptions | None = None,
          overwrite: bool = False, changes: dict[str, list] | None = None,
          rewind_to: int | None = None, ray: bool = False) -> dict[str, float]:
    """Run `cfg` to its last step here (and on the torchrun peers) or, with `ray`, on Ray
    groups; the run summary. Everything is checked before the run directory is claimed.
    `changes`: what `--resume`'s overrides change (`run_dir.resume_changes`); `rewind_to`:
    the checkpoint step `--resume` named, when it named one."""
    opts = opts or RunOptions()
    lock = None
    try:
        run_dir = resume_dir or new_run_dir(cfg)  # under torchrun: joins the world
        if ray:
            model_path, main = prepare(cfg, "ray", opts)[0], True
        else:
            loop = local_loop(cfg, run_dir, opts)
            model_path, main = loop.model_path, loop.main
        if main:  # one writer
            lock = claim(run_dir, resume_dir is not None, overwrite)
            if rewind_to is not None:
                rewind(run_dir, rewind_to)
            architecture = read_model_config(model_path).describe()
            write_atomic(run_dir / "config.yaml", dump_config(cfg, architecture))
            write_atomic(run_dir / INPUTS, json.dumps(fingerprints(cfg), indent=1))
            if resume_dir is not None:
                record_resume(run_dir, checkpoint_step(run_dir), changes or {})
        if not ray:
            return loop.run(resume=resume_dir is not None)
        from rlloom.runtime.executor.ray.executor import ray_loop  # Ray only when asked for
        with ray_loop(cfg, run_dir, opts, model_path) as loop:
            return loop.run(resume=resume_dir is not None)
    except WorkerFailure as e:
        e.run_dir = run_dir
        raise
    finally:
        if lock is not None:
            lock.release()
        loop = None  # its models go before the process groups they reference
        leave_world()
