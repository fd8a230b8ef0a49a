"""Multi-turn rollouts with a slow tool: the engine (each conversation keeps its KV slot
across turns, parked while its call runs, the result extended onto its cached keys) next to
the reference driver (every turn re-decodes each conversation from its prompt, and waits
for all of the turn's calls before any conversation goes on):
``python bench/tool_rollouts.py [--rollouts 64] [--latency-ms 20] [--turns 4]``.

One process. The model has random weights; its token 5 reads as a complete call
`<call sleep>x</call>` and the `sleep` tool answers "ok" after `--latency-ms`, so a
conversation calls the tool whenever it samples a 5 and runs until EOS, `--max-new` tokens
or `--turns` turns. Both drivers sample at temperature 1 from the same model and tools
(their samples differ: the reference draws a seed per turn), so the script prints each
one's seconds, tokens decoded, calls, and the tokens each pushed through prefill and extend
forwards, and the ratios, measured side by side in this one run.
"""
from __future__ import annotations

import argparse
import time

import torch

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.rollout.engine import Engine
from rlloom.rollout.multi_turn import Dialogue, Tools
from rlloom.rollout.sampling import SamplingParams
from rlloom.rollout.tools import CALL_END, ToolRunner

CALL, EOS, PAD = 5, 7, 0


def decode(ids: list[int]) -> str:
    return "".join("<call sleep>x</call>" if t == CALL else "y" for t in ids)


def encode(text: str) -> list[int]:
    return [9] * max(1, len(text) // 4)  # "<result>ok</result>": 4 tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=160)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(family="qwen3", vocab_size=48, hidden_size=256, intermediate_size=768,
                      num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, qk_norm=True)
    model = CausalLM(cfg)
    model.init_weights(seed=1, std=0.05)
    model.eval()

    def sleep(_: str) -> str:
        time.sleep(args.latency_ms / 1000)
        return "ok"

    prompts = [[11 + i % 8, 12, 13, 14] * 8 for i in range(args.rollouts)]
    params = SamplingParams(args.max_new, temperature=1.0, stop=(CALL_END,))
    rows = []
    for name in ("engine", "reference"):
        dialogue = Dialogue(Tools(ToolRunner({"sleep": sleep}, 10.0, 100), args.turns, "tag"),
                            len(prompts), args.max_new, decode, encode)
        engine = Engine(model)
        prefill = extend = 0

        def turn(batch: list[list[int]], room: int):
            nonlocal prefill
            r = engine.generate(batch, SamplingParams(room, temperature=1.0,
                                                      stop=(CALL_END,)), EOS, PAD,
                                torch.Generator().manual_seed(2), decode)
            prefill += engine.forwarded.prefill
            return r
        start = time.perf_counter()
        with torch.inference_mode():
            if name == "engine":
                out = engine.generate(prompts, params, EOS, PAD,
                                      torch.Generator().manual_seed(2), decode, dialogue)
                prefill, extend = engine.forwarded.prefill, engine.forwarded.extend
            else:
                out = dialogue.converse(turn, prompts, PAD)
        seconds = time.perf_counter() - start
        decoded = int(out.action_mask.sum())
        calls = int(dialogue.stats()[:, 1].sum())
        rows.append((name, seconds, decoded, calls, prefill, extend))
    print(f"{args.rollouts} rollouts, up to {args.turns} turns, tool latency "
          f"{args.latency_ms:g} ms, {args.max_new} response tokens at most")
    print(f"{'driver':<10} {'seconds':>8} {'decoded':>8} {'calls':>6} {'prefilled':>10} "
          f"{'extended':>9} {'tokens/s':>9}")
    for name, seconds, decoded, calls, prefill, extend in rows:
        print(f"{name:<10} {seconds:8.2f} {decoded:8d} {calls:6d} {prefill:10d} {extend:9d} "
              f"{decoded / seconds:9.0f}")
    (_, s_e, d_e, _, p_e, x_e), (_, s_r, d_r, _, p_r, _) = rows
    print(f"engine / reference: seconds {s_e / s_r:.2f}, decoded tokens per second "
          f"{(d_e / s_e) / (d_r / s_r):.2f}x, tokens through prefill+extend "
          f"{(p_e + x_e) / p_r:.3f}")


if __name__ == "__main__":
    main()
