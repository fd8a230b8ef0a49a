"""One GRPO step, rlloom's trainer against TRL's `GRPOTrainer` on the same work:
``python bench/grpo_step.py [--prompts 8] [--k 8] [--new 64] [--steps 5] [--warmup 2]``.

Needs the benchmark extra (``pip install -e '.[bench]'``, which brings TRL).

Both start from the same Hugging Face checkpoint directory (the built-in warm-started tiny
qwen3 model and its char tokenizer, or `--model`), take the same plain-text prompts in the
same order (the arith task as rlloom's prompt stream yields them; the char tokenizer has no
chat template, so neither applies one), sample K completions per prompt at temperature 1 with
no top-k / top-p for at most `--new` tokens (stopping at EOS), score them with rlloom's
verifier (`task_terms`, weighted by `reward.weights`, as `Rewarder` does), and take
`algo.epochs` x `algo.minibatches` AdamW steps on mini-batches of B*K/minibatches samples:
group-normalised advantages, PPO clip, k3 KL to a frozen reference in the loss with the same
coefficient, sequence-mean of token-means, the same lr, grad clip and weight decay, fp32, the
same device (`--device`, CPU by default), no vLLM, the same number of torch threads.

Mapping of the step onto TRL: generation_batch_size = B*K through steps_per_generation =
minibatches with per_device_train_batch_size = B*K/minibatches and no gradient accumulation,
num_iterations = epochs, loss_type "grpo", constant lr. So a GRPO step is epochs x minibatches
of TRL's optimizer steps. TRL generates with `model.generate`, which returns no log-probs, so
it spends one more forward pass on the old policy's log-probs; rlloom's engine records them
while sampling. That difference is part of what is measured.

The two run interleaved in one process, a TRL step then an rlloom step, so load from other
jobs on a shared machine hits both alike. The first `--warmup` steps of each are dropped.
Split: rlloom's own gen_s / assess_s / train_s metrics; for TRL, generation is
`_generate`, assessment the rest of `_generate_and_score_completions` (rewards, old and
reference log-probs, advantages) and training the remainder of the step.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
import warnings
from importlib.metadata import version
from pathlib import Path

import torch

from rlloom.config import RunConfig, load_config
from rlloom.rewards.tasks import task_terms
from rlloom.runtime.default_model import ensure_default_model
from rlloom.runtime.executor.launch import local_loop


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def fmt(row: dict) -> str:
    return (f"{row['step_s']:>7.2f} {row['gen_s']:>6.2f} {row['assess_s']:>6.2f} "
            f"{row['train_s']:>6.2f} {row['cpu_s']:>6.2f} {row['response_len']:>5.1f} "
            f"{row['reward']:>6.3f}")


def rlloom_config(a: argparse.Namespace, run_dir: str) -> RunConfig:
    overrides = [f"train.prompts_per_step={a.prompts}", f"rollout.n_samples={a.k}",
                 f"rollout.max_new_tokens={a.new}", "rollout.temperature=1.0",
                 "rollout.top_p=1.0", "rollout.top_k=0", f"algo.epochs={a.epochs}",
                 f"algo.minibatches={a.minibatches}", f"train.threads={a.threads}",
                 f"seed={a.seed}", f"run_dir={run_dir}", f"train.device={a.device}"]
    if a.model:
        overrides.append(f"model.path={a.model}")
    if a.lr is not None:
        overrides.append(f"train.lr={a.lr}")
    cfg = load_config(None, overrides)
    alg = cfg.algo
    # The comparison is only meaningful for the settings TRL's loss_type "grpo" reproduces.
    assert (alg.name, alg.advantage, alg.policy_loss, alg.loss_agg, alg.kl_estimator) == (
        "grpo", "grpo", "ppo", "seq-mean-token-mean", "k3"), alg
    assert alg.clip_low == alg.clip_high and not alg.kl_in_reward and alg.kl_target is None
    assert not alg.dynamic_sampling and alg.overlong == "none" and not alg.entropy_coef
    return cfg


class TRLTimer:
    """Wraps the trainer's generation and scoring methods to split a step's time."""

    def __init__(self, trainer) -> None:
        self.gen_s = self.score_s = 0.0
        self.lengths: list[int] = []
        self.rewards: list[float] = []
        generate, score = trainer._generate, trainer._generate_and_score_completions

        def timed_generate(prompts):
            t0 = time.perf_counter()
            out = generate(prompts)
            self.gen_s += time.perf_counter() - t0
            self.lengths += [len(ids) for ids in out[1]]  # completion_ids_list
            return out

        def timed_score(inputs):
            t0 = time.perf_counter()
            out = score(inputs)
            self.score_s += time.perf_counter() - t0
            return out

        trainer._generate = timed_generate
        trainer._generate_and_score_completions = timed_score

    def take(self) -> dict[str, float]:
        row = {"gen_s": self.gen_s, "assess_s": self.score_s - self.gen_s,
               "response_len": statistics.fmean(self.lengths) if self.lengths else 0.0,
               "reward": statistics.fmean(self.rewards) if self.rewards else 0.0}
        self.gen_s = self.score_s = 0.0
        self.lengths, self.rewards = [], []
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (B)")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt (group size)")
    ap.add_argument("--new", type=int, default=64, help="max new tokens per sample")
    ap.add_argument("--epochs", type=int, default=2, help="passes over each step's samples")
    ap.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass")
    ap.add_argument("--lr", type=float, default=None, help="default: rlloom's train.lr")
    ap.add_argument("--steps", type=int, default=5, help="measured steps of each")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads, both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both sides, fp32)")
    ap.add_argument("--model", default=None, help="HF checkpoint dir; default: the built-in "
                    "tiny model (built and cached on first use)")
    a = ap.parse_args()
    try:
        import datasets
        import transformers
        from transformers import PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        sys.exit(f"{e}: this benchmark needs TRL; pip install -e '.[bench]'")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore")

    tmp = tempfile.TemporaryDirectory()
    cfg = rlloom_config(a, str(Path(tmp.name) / "rlloom"))
    model_path = Path(cfg.model.path) if cfg.model.path else ensure_default_model(cfg)
    ours = local_loop(cfg, Path(cfg.run_dir))
    ours.ex.start()
    worker = ours.ex.worker
    total = a.warmup + a.steps
    b, k = cfg.train.prompts_per_step, cfg.rollout.n_samples
    # A copy of the stream yields exactly the prompts the trainer will draw, in its order.
    problems = copy.deepcopy(worker.generation.stream).next(b * total)
    weights = cfg.reward.weights

    def verifier(prompts, completions, row, **_):
        terms = task_terms([problems[i] for i in row], completions, cfg.data.task, worker.pool)
        scores = [sum(w * terms[name][j] for name, w in weights.items())
                  for j in range(len(completions))]
        timer.rewards += scores
        return scores

    n, mb = b * k, cfg.algo.minibatches
    targs = GRPOConfig(
        output_dir=str(Path(tmp.name) / "trl"), use_cpu=a.device == "cpu", bf16=False,
        fp16=False,
        gradient_checkpointing=False, model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=n // mb, gradient_accumulation_steps=1,
        steps_per_generation=mb, num_iterations=cfg.algo.epochs, num_generations=k,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=1.0, top_k=0, use_vllm=False, beta=cfg.algo.kl_coef, epsilon=cfg.algo.clip_low,
        loss_type="grpo", scale_rewards="group", mask_truncated_completions=False,
        learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.train.weight_decay, max_grad_norm=cfg.train.grad_clip,
        optim="adamw_torch", max_steps=total * cfg.algo.epochs * mb, shuffle_dataset=False,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none",
        disable_tqdm=True, log_completions=False, seed=cfg.seed, dataloader_num_workers=0)
    data = datasets.Dataset.from_dict({"prompt": [p.prompt for p in problems],
                                       "row": list(range(len(problems)))})
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    theirs = GRPOTrainer(model=str(model_path), reward_funcs=verifier, args=targs,
                         train_dataset=data, processing_class=tokenizer)
    timer = TRLTimer(theirs)
    torch.set_num_threads(a.threads)
    rows: list[tuple[dict, dict]] = []

    class Interleave(TrainerCallback):
        """After each whole TRL GRPO step, one rlloom step, kept out of TRL's clock."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.mark = clocks()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % (cfg.algo.epochs * mb):
                return
            w, c = clocks()
            trl_row = {"step_s": w - self.mark[0], "cpu_s": c - self.mark[1], **timer.take()}
            trl_row["train_s"] = trl_row["step_s"] - trl_row["gen_s"] - trl_row["assess_s"]
            assert torch.get_num_threads() == a.threads
            c0 = time.process_time()
            row = ours.train_step()
            row["cpu_s"] = time.process_time() - c0
            rows.append((row, trl_row))
            print(f"  step {len(rows)}/{total}: rlloom {row['step_s']:.2f} s, "
                  f"TRL {trl_row['step_s']:.2f} s", flush=True)
            self.mark = clocks()

    theirs.remove_callback(PrinterCallback)  # its end-of-training log dict is noise here
    theirs.add_callback(Interleave())
    theirs.train()
    tmp.cleanup()

    n_params = sum(p.numel() for p in worker.training.policy.parameters())
    print(f"\nGRPO step: {model_path.name} ({n_params / 1e3:.0f}k params, fp32), B={b} prompts "
          f"x K={k}, <= {cfg.rollout.max_new_tokens} new tokens, temperature 1, "
          f"{cfg.algo.epochs} epochs x {mb} minibatches = {cfg.algo.epochs * mb} optimizer "
          f"steps of {n // mb} samples, lr {cfg.train.lr:g}, KL coef {cfg.algo.kl_coef:g}, "
          + (f"{a.threads} CPU thread(s)" if a.device == "cpu" else a.device))
    print("versions: " + ", ".join(f"{m} {version(m)}" for m in
                                   ("torch", "transformers", "trl", "accelerate")))
    side = (f"{'step s':>7} {'gen':>6} {'assess':>6} {'train':>6} {'cpu s':>6} {'len':>5} "
            f"{'reward':>6}")
    print(f"{'':>4} | {'rlloom':^47} | {'TRL':^47} |")
    print(f"{'step':>4} | {side} | {side} | {'TRL/rlloom':>10}")
    for i, (r, t) in enumerate(rows):
        tag = f"{i + 1}" + ("w" if i < a.warmup else "")
        print(f"{tag:>4} | {fmt(r)} | {fmt(t)} | {t['step_s'] / r['step_s']:>9.2f}x")
    measured = rows[a.warmup:]

    def med(side: int, key: str) -> float:
        return statistics.median(row[side][key] for row in measured)

    ratios = [t["step_s"] / r["step_s"] for r, t in measured]
    cpu_ratios = [t["cpu_s"] / r["cpu_s"] for r, t in measured]
    print(f"median over {len(measured)} measured steps (w = warm-up, not counted):")
    for side, name in ((0, "rlloom"), (1, "TRL")):
        print(f"  {name:>6}: step {med(side, 'step_s'):.2f} s = gen {med(side, 'gen_s'):.2f} + "
              f"assess {med(side, 'assess_s'):.2f} + train {med(side, 'train_s'):.2f} "
              f"(cpu {med(side, 'cpu_s'):.2f} s)")
    print(f"  TRL/rlloom step time: median ratio {statistics.median(ratios):.2f}x wall, "
          f"{statistics.median(cpu_ratios):.2f}x cpu; split ratios gen "
          f"{med(1, 'gen_s') / med(0, 'gen_s'):.2f}x, assess "
          f"{med(1, 'assess_s') / med(0, 'assess_s'):.2f}x, train "
          f"{med(1, 'train_s') / med(0, 'train_s'):.2f}x")


if __name__ == "__main__":
    main()
