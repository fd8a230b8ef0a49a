"""The rehearsal held to a real GPU (issue 53, item 8): one training step of rlloom's model on
CUDA, as a one-device run takes it (fp32 weights and AdamW, bf16 autocast, the runtime's
log-prob path), and one generation call of its engine (bf16 weights, every rollout to its
full length), beside their rehearsals on fake tensors and the cost model, in one run.

    python bench/rehearsal_check.py        # on a GPU; without one it rehearses and says so

The GPU's figure is `torch.cuda.max_memory_allocated` over a second step (the AdamW moments
exist from the first on, as the rehearsal's peak assumes), the rehearsal's and the model's
are `rlloom rehearse`'s. The ratios are what the first lent GPU checks."""
from __future__ import annotations

import dataclasses

import torch

from rlloom.parallel.apply import make_optimizer
from rlloom.perf.model.shapes import MODELS, ModelShape
from rlloom.plan import Layout
from rlloom.models.transformer import CausalLM
from rlloom.rehearsal.compare import predicted_generation, predicted_training
from rlloom.rehearsal.generation import rehearse_generation
from rlloom.rehearsal.train import _rollout, model_config, rehearse_training
from rlloom.rollout.engine import EngineConfig, engine_generate
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.stages.batch import response_logprobs

# (name, shape, rows, prompt, response): widths of real models, sized for one H100
CASES = [("qwen2.5-0.5b, 8 layers", dataclasses.replace(MODELS["qwen2.5-0.5b"], layers=8),
          2, 512, 3584),
         ("qwen2.5-1.5b", MODELS["qwen2.5-1.5b"], 1, 1024, 7168)]
# (name, shape, slots, rollouts, prompt, response, samples per prompt)
GEN_CASES = [("qwen2.5-1.5b, engine", MODELS["qwen2.5-1.5b"], 32, 64, 512, 1024, 8)]
GIB = 2 ** 30


def cuda_peak(shape: ModelShape, rows: int, prompt: int, response: int) -> int:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = CausalLM(model_config(shape)).to(dev)
    optim = make_optimizer(model, Layout(), None, lr=1e-6)
    r = _rollout(rows, prompt, response, shape.vocab).to(dev)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, entropy, _ = response_logprobs(model, r, 1.0, with_entropy=True)
            loss = -(logp * torch.randn_like(logp)).mean() - 1e-3 * entropy.mean()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model, optim, r
    torch.cuda.empty_cache()
    return peak


def cuda_generation_peak(shape: ModelShape, slots: int, rollouts: int, prompt: int,
                         response: int, samples: int) -> int:
    """The engine's peak over one call, weights included: every rollout runs to `response`
    tokens (no end-of-sequence id), its slots grown to the longest context."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    model = CausalLM(model_config(shape)).to(dev, torch.bfloat16).eval()
    prompts = [torch.randint(3, shape.vocab, (prompt,), generator=g).tolist()
               for _ in range(rollouts // samples) for _ in range(samples)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine_generate(model, prompts, SamplingParams(max_new_tokens=response), -1, 0,
                    config=EngineConfig(max_batch=slots, n_samples=samples))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model
    torch.cuda.empty_cache()
    return peak


def main() -> None:
    gpu = torch.cuda.is_available()
    print(f"{'case':<24} {'tokens':>7} {'model GiB':>9} {'rehearsed':>9} {'GPU GiB':>8} "
          f"{'rehearsed/GPU':>13} {'model/GPU':>9}")
    for name, shape, rows, prompt, response in CASES:
        model = predicted_training(shape, Layout(), rows, prompt, response)["peak"]
        rehearsed = rehearse_training(shape, Layout(), rows, prompt, response).peak
        real = cuda_peak(shape, rows, prompt, response) if gpu else None
        tail = (f"{real / GIB:8.2f} {rehearsed / real:13.3f} {model / real:9.3f}" if real
                else f"{'-':>8} {'-':>13} {'-':>9}")
        print(f"{name:<24} {rows * (prompt + response):7d} {model / GIB:9.2f} "
              f"{rehearsed / GIB:9.2f} {tail}")
    for name, shape, *args in GEN_CASES:
        model = predicted_generation(shape, 1, *args)["peak"]
        rehearsed = rehearse_generation(shape, 1, *args).peak
        real = cuda_generation_peak(shape, *args) if gpu else None
        tail = (f"{real / GIB:8.2f} {rehearsed / real:13.3f} {model / real:9.3f}" if real
                else f"{'-':>8} {'-':>13} {'-':>9}")
        slots, _, prompt, response, _ = args
        print(f"{name:<24} {slots * (prompt + response):7d} {model / GIB:9.2f} "
              f"{rehearsed / GIB:9.2f} {tail}")
    if not gpu:
        print("no GPU (torch.cuda.is_available() is False): rehearsal and model only")


if __name__ == "__main__":
    main()
