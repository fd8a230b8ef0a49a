"""`rollout.engine: vllm`: generation on a vLLM engine in a process of its own.

vLLM pins its own torch-adjacent stack (transformers, numpy, fastapi), so it lives in a
virtual environment of its own (`rollout.vllm_python`; see docs/vllm.md) and rlloom talks to
it over a pipe (`vllm_server.py`). The engine gets the policy's weights at start and again
whenever they have changed since (a safetensors directory it reloads in place, stamped with
a version: a generate call never runs on a mix of two versions, as the server handles one
request at a time). Whether weights changed is read from the parameters' in-place version
counters, so the trainer need not say when it stepped.

Log-probs follow rlloom's convention (`sampling.policy_logprobs`: the tempered, unfiltered
distribution): vLLM reports them after temperature when nothing filters the distribution
(top_p 1, top_k 0, min_p 0, repetition_penalty 1), and before temperature (its raw ones) at
temperature 1; other settings are refused before the run starts (`vllm_env.config_problems`).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.models.hf_io import save_checkpoint
from rlloom.models.transformer import CausalLM
from rlloom.perf.model.memory import vllm_kv_bytes
from rlloom.perf.model.shapes import ModelShape
from rlloom.plan import Plan, engine_problems
from rlloom.rollout.generate import Rollout, left_pad, right_pad
from rlloom.rollout.sampling import SamplingParams
from rlloom.rollout.vllm_env import logprobs_mode
from rlloom.rollout.vllm_server import read_frame, write_frame

SERVER = Path(__file__).with_name("vllm_server.py")


class VLLMError(RuntimeError):
    pass


def gpu_memory_args(policy: CausalLM, budget: int, total: int, max_model_len: int
                    ) -> dict[str, float]:
    """vLLM's memory arguments for `budget` bytes of a `total`-byte GPU: the share it may use
    (`gpu_memory_utilization`, which it checks is free when it starts: its default, 0.9,
    is not, beside a trainer) and its KV cache in it (`kv_cache_memory_bytes`:
    `perf.model.memory.vllm_kv_bytes`, as the cost model prices it)."""
    shape = ModelShape.from_hf_config(policy.config.to_hf())
    kv = int(vllm_kv_bytes(shape, 1, budget))
    one = shape.kv_bytes_per_token() * max_model_len
    if kv < one:
        raise VLLMError(f"vLLM would have {kv / 2**30:.2f} GiB for its KV cache beside its "
                        f"weights in the {budget / 2**30:.2f} GiB this GPU has left; one "
                        f"sequence of {max_model_len} positions needs {one / 2**30:.2f}: shorten "
                        "the model's max_position_embeddings or the responses, or generate on "
                        "devices of their own (placement: disaggregated)")
    return {"gpu_memory_utilization": budget / total, "kv_cache_memory_bytes": kv}


def weights_version(model: torch.nn.Module) -> int:
    """A number that changes whenever a parameter is written in place (an optimizer step,
    a weight load)."""
    return sum(p._version for p in model.parameters())


@dataclass
class SyncRecord:
    version: int
    bytes: int
    seconds: float


class VLLMEngine:
    """A vLLM server process serving the weights of `policy` (which may be replaced by
    another model of the same architecture: the next call reloads from it)."""

    def __init__(self, policy: CausalLM, tokenizer: PreTrainedTokenizerBase, python: str,
                 temperature: float, max_model_len: int, max_num_seqs: int, seed: int,
                 kv_gib: int = 1, gpu_memory: dict[str, float] | None = None) -> None:
        """`kv_gib`: a CPU server's KV cache; `gpu_memory`: a GPU server's memory arguments
        (`gpu_memory_args`)."""
        # what the planner asks too, checked before anything starts
        problems = engine_problems("vllm", Plan(), policy.config.latent)
        if problems:
            raise VLLMError("; ".join(problems))
        self.policy, self.syncs = policy, 0
        self.last_sync: SyncRecord | None = None
        self._records: list[SyncRecord] = []
        self._dir = Path(tempfile.mkdtemp(prefix="rlloom-vllm-"))
        model_dir = self._dir / "model"
        save_checkpoint(policy, tokenizer, model_dir)
        self._seen = self._state()
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
        args = {"model": str(model_dir), "dtype": dtype, "seed": seed,
                "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                "kv_gib": kv_gib, "gpu_memory": gpu_memory or {},
                "logprobs_mode": logprobs_mode(temperature)}
        try:
            self.proc = subprocess.Popen([python, str(SERVER), json.dumps(args)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except OSError as e:
            raise VLLMError(f"rollout.vllm_python={python!r} cannot be started ({e}); point it "
                            "at the Python of an environment with vLLM (docs/vllm.md)") from e
        ready = self._reply()
        self.start_s = ready["seconds"]

    def _reply(self) -> Any:
        try:
            reply = read_frame(self.proc.stdout)
        except EOFError:
            code = self.proc.wait()
            raise VLLMError(f"the vLLM server exited with code {code}; its log is above "
                            "(stderr). Is vLLM installed for rollout.vllm_python "
                            "(docs/vllm.md)?") from None
        if isinstance(reply, dict) and "error" in reply:
            raise VLLMError(f"the vLLM server failed:\n{reply['error']}")
        return reply

    def _call(self, request: dict) -> Any:
        write_frame(self.proc.stdin, request)
        return self._reply()

    def _state(self) -> tuple[int, int]:
        # another object (a double-buffered copy's other model) or the same one written
        return id(self.policy), weights_version(self.policy)

    def sync(self) -> SyncRecord | None:
        """Send the policy's weights if they are not the ones the engine holds (another
        object, or changed in place since)."""
        seen = self._state()
        if seen == self._seen:
            return None
        t0 = time.perf_counter()
        path = self._dir / f"v{self.syncs + 1}"
        save_checkpoint(self.policy, None, path)
        nbytes = (path / "model.safetensors").stat().st_size
        self._call({"op": "load", "path": str(path), "version": self.syncs + 1})
        shutil.rmtree(path)
        self.syncs += 1
        self._seen = seen
        self.last_sync = SyncRecord(self.syncs, nbytes, time.perf_counter() - t0)
        self._records.append(self.last_sync)
        return self.last_sync

    def take_syncs(self) -> list[SyncRecord]:
        """The reloads since the last call."""
        records, self._records = self._records, []
        return records

    def generate(self, prompts: list[list[int]], params: SamplingParams, eos_id: int,
                 pad_id: int, generator: torch.Generator | None) -> Rollout:
        """As `generate.generate`: one response per prompt with the policy's current weights,
        each prompt sampled with its own seed drawn from `generator` (reproducible runs)."""
        self.sync()
        seeds = (torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
                 if generator is not None else [None] * len(prompts))
        if any(len(s) > 1 for s in params.stop_token_ids):
            raise VLLMError("vLLM stops on single tokens; give rollout.stop_token_ids of one "
                            "token each, or a stop string (rollout.stop)")
        base = {"max_tokens": params.max_new_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k if params.top_k > 0 else -1,
                "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
                "stop_token_ids": [eos_id, *(s[0] for s in params.stop_token_ids)],
                "stop": list(params.stop), "include_stop_str_in_output": True}
        outs = self._call({"op": "generate", "prompts": prompts,
                           "sampling": [{**base, "seed": s} for s in seeds]})
        dev = next(self.policy.parameters()).device
        prompt_ids, prompt_mask = left_pad(prompts, pad_id)
        ids, mask = right_pad([o[0] or [pad_id] for o in outs], pad_id)
        mask = mask * torch.tensor([len(o[0]) > 0 for o in outs])[:, None]
        logprobs = torch.zeros(mask.shape)
        for i, (_, lps, _) in enumerate(outs):
            logprobs[i, :len(lps)] = torch.tensor(lps)
        finished = torch.tensor([reason == "stop" for _, _, reason in outs])
        return Rollout(prompt_ids, prompt_mask, ids, mask, logprobs, finished).to(dev)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                write_frame(self.proc.stdin, {"op": "exit"})
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
