"""A real model's multi-turn rollouts: the log-probs sampled turn by turn equal the trainer's
teacher-forced log-probs of the same tokens over the whole conversation (tool results
included as context, excluded from training), and a run with tools logs its tool metrics."""
import json

import torch

from rlloom.config import load_config
from rlloom.data.synthetic import Problem
from rlloom.models.tokenizer import build_char_tokenizer
from rlloom.models.transformer import CausalLM
from rlloom.rollout.multi_turn import Tools
from rlloom.runtime.default_model import tiny_model_config
from rlloom.runtime.executor.trainer import train
from rlloom.runtime.stages.batch import encode, response_logprobs
from rlloom.runtime.stages.generation import _params, respond
from rlloom.runtime.stages.sft import supervised_finetune

TRACE = "<call calculator>{a}*{b}</call><result>{c}</result>A:{c}"


def test_sampled_logprobs_equal_the_trainers_across_turns(tiny):
    cfg = load_config(None, [*tiny, "rollout.tools=[calculator]", "rollout.max_turns=3",
                             "rollout.max_new_tokens=48"])
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = CausalLM(tiny_model_config(cfg, len(tok)))
    model.init_weights(seed=0)
    # a few steps on tool-use traces, so sampled turns end in calls
    traces = [Problem(f"Q:{a}*{b}=", str(a * b), TRACE.format(a=a, b=b, c=a * b), {})
              for a in range(2, 6) for b in range(2, 6)]
    supervised_finetune(model, tok, traces, steps=150, batch_size=16, lr=1e-2, seed=0)
    model.eval()
    prompts = encode(tok, [p.prompt for p in traces[:8]])
    with torch.no_grad():
        rollout, stats = respond(model, tok, prompts, _params(cfg, 48), cfg,
                                 torch.Generator().manual_seed(1), 0, Tools.of(cfg.rollout))
        trainer, _, _ = response_logprobs(model, rollout, cfg.rollout.temperature)
    assert stats[:, 1].sum() >= 4  # calls made, so results sit between sampled turns
    acted = rollout.action_mask.bool()
    assert (rollout.injected.bool() & rollout.response_mask.bool()).any()
    assert (trainer[acted] - rollout.logprobs[acted]).abs().max() < 1e-4


def test_a_run_with_tools_logs_turns_and_calls(tmp_path, tiny):
    run = tmp_path / "run"
    train(load_config(None, [*tiny, "rollout.tools=[calculator]", "rollout.max_turns=3",
                             "train.steps=1", f"run_dir={run}"]))
    [row] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["turns"] >= 1 and {"tool_calls", "tool_errors", "tool_success", "tool_s"} <= set(row)
    assert any(e["name"] == "generation" for e in json.loads((run / "trace.json").read_text())
               ["traceEvents"])
