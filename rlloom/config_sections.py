"""The model, data and rollout sections of the run configuration (`rlloom.config` holds the
rest, and the loading): what is trained, on which prompts, and how responses are sampled."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from rlloom.data.synthetic import TASKS as BUILT_IN_TASKS
from rlloom.data.synthetic import check_difficulty
from rlloom.plan import Strict
from rlloom.rollout.tools import BUILT_IN as BUILT_IN_TOOLS
from rlloom.rollout.tools import load_tools
from rlloom.user_code import load, resolve_spec


def _absolute(path: str | None) -> str | None:
    """A relative path made absolute against the directory the config is read in, so a run
    resumed (or a Ray worker started) elsewhere finds the same file."""
    if path is None or Path(path).expanduser().is_absolute():
        return path
    return str((Path.cwd() / path).resolve())


FilePath = Annotated[str | None, AfterValidator(_absolute)]


class LoRASection(Strict):
    """LoRA adapters (Hu et al. 2021): only they train; the base weights stay frozen."""
    rank: int = Field(8, ge=1, description="adapter rank r")
    alpha: float = Field(16.0, gt=0, description="scale numerator: updates are (alpha / r) B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                "up_proj", "down_proj"],
                               description="projections that get adapters (PEFT's "
                                           "target_modules)")


class ModelSection(Strict):
    path: FilePath = Field(None, description="Hugging Face checkpoint dir; null = built-in "
                                               "tiny model, warm-started by SFT and cached")
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32", description="parameter dtype (float64: for checking a layout against one "
        "process to 1e-10)")
    hidden_size: int = Field(128, description="built-in model: hidden size")
    layers: int = Field(2, ge=1, description="built-in model: decoder layers")
    heads: int = Field(4, description="built-in model: attention heads")
    kv_heads: int = Field(2, description="built-in model: key/value heads (GQA)")
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = Field(
        "qwen3", description="built-in model: architecture family (qwen3_moe: every layer's "
        "MLP is routed experts)")
    experts: int = Field(4, ge=2, description="built-in qwen3_moe model: routed experts per "
                                              "layer")
    experts_per_token: int = Field(2, ge=1, description="built-in qwen3_moe model: experts "
                                                        "each token is routed to")
    lora: LoRASection | None = Field(None, description="train LoRA adapters instead of every "
                                     "weight, e.g. {rank: 16, alpha: 32}; null = full training")
    critic_path: FilePath = Field(None, description="a separate critic's starting checkpoint: "
                                  "a causal LM (its backbone, a zero value head) or a one-label "
                                  "*ForSequenceClassification reward model (OpenRLHF's "
                                  "critic_pretrain), of any size, with the policy's tokenizer; "
                                  "null = the policy's backbone")


class DataSection(Strict):
    task: Literal["arith", "countdown", "code", "math", "multiply", "none"] = Field(
        "arith", description="task, which selects the verifier: arith, countdown, code and "
        "multiply (with the calculator tool) are built in; math needs data.prompt_file "
        "(prompt, answer rows); none: no verifier, rows need only a prompt and "
        "reward.functions score alone")
    difficulty: int | dict[int, float] = Field(5, description="task difficulty (arith: "
                                               "operations, countdown: numbers), or a mixture "
                                               "{level: weight}, e.g. {1: 0.95, 16: 0.05} for "
                                               "long-tailed response lengths")
    prompt_file: FilePath = Field(None, description="prompts: a .jsonl or .parquet file or a "
                                    "datasets save_to_disk directory; null = the built-in task")
    columns: dict[str, str] = Field(default_factory=dict, description="field -> column name in "
                                    "the prompt file, e.g. {prompt: question, answer: gt}")
    train_size: int = Field(20000, ge=1, description="generated training problems")
    eval_size: int = Field(200, ge=1, description="held-out problems for greedy evaluation")
    preference_file: FilePath = Field(None, description="prompt/chosen/rejected pairs for "
                                        "offline algorithms (dpo): jsonl, parquet or a "
                                        "save_to_disk directory; plain or conversational")
    eval_file: FilePath = Field(None, description="held-out prompts, in the prompt file's "
                                  "format; null = a share of the prompt file (or the built-in "
                                  "task's held-out problems)")
    eval_fraction: float = Field(0.05, gt=0, lt=1, description="share of a prompt file held "
                                                               "out for evaluation")
    max_prompt_tokens: int = Field(512, ge=1, description="longest allowed prompt, in tokens "
                                   "once the chat template is applied")
    chat_template: str = Field("auto", description="auto: the tokenizer's chat template when "
                               "it has one (a text prompt becomes a user turn), else plain "
                               "text; none: plain text; or a jinja template file")
    system_prompt: str | None = Field(None, description="system turn opening every prompt "
                                      "that has none (needs a chat template)")
    transform: str | None = Field(None, description="module.path:function or file.py:function "
                                  "applied to each data row (a dict) before it is read")

    @field_validator("chat_template")
    @classmethod
    def _template_file(cls, v: str) -> str:
        if v in ("auto", "none"):
            return v
        path = Path(_absolute(v))
        if not path.is_file():
            raise ValueError(f"chat template file {str(path)!r} does not exist; give auto, "
                             "none or a jinja template file")
        return str(path)

    @field_validator("transform")
    @classmethod
    def _transform_loads(cls, v: str | None) -> str | None:
        if v is None:
            return v
        v = resolve_spec(v, Path.cwd(), "data.transform", ValueError)
        load(v, "data.transform", ValueError)  # fails early, naming the function
        return v

    @model_validator(mode="after")
    def _difficulty_fits_task(self) -> "DataSection":
        if self.task in BUILT_IN_TASKS:
            check_difficulty(self.task, self.difficulty)
        return self


class RolloutSection(Strict):
    n_samples: int = Field(8, ge=1, description="samples per prompt (K, the group size)")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    max_new_tokens: int = Field(64, ge=1, description="response length limit")
    min_p: float = Field(0.0, ge=0, lt=1, description="drop tokens below min_p x the most "
                         "likely token's probability; 0 = off")
    repetition_penalty: float = Field(1.0, gt=0, description="above 1, tokens already in the "
                                      "sequence are sampled less often (transformers' and "
                                      "vLLM's rule); like top_p it shapes what is sampled, "
                                      "not the log-probs trained on; 1 = off")
    stop: list[str] = Field([], description="strings that end a response like EOS (they stay "
                            "in it, and the response counts as finished)")
    max_batch: int = Field(0, ge=0, description="rollouts decoding at once per generation "
                           "replica (the engine's KV slots; continuous batching refills a "
                           "finished one; a tensor-parallel replica runs waves of this many); "
                           "0 = as many as the device memory left after the model state holds "
                           "with their KV cache and the forwards' buffers (on a CPU: every "
                           "rollout)")
    partial_tokens: int = Field(0, ge=0, description="partial rollouts: tokens a response "
                                "may generate per step; one still going is carried to the "
                                "next step and continued under its weights (its tokens keep "
                                "their own log-probs and versions); must divide "
                                "max_new_tokens; 0 = off")
    engine: Literal["rlloom", "plain", "vllm"] = Field(
        "rlloom", description="sampler: rlloom's engine (prefix sharing, continuous batching; "
        "unsharded models), plain (one batched decode loop, what a tensor-parallel "
        "generation layout runs; the one-process twin of such a layout) or vllm (a vLLM "
        "server in its own environment, fed the policy's weights after every step; "
        "docs/vllm.md)")
    vllm_python: str = Field("", description="rollout.engine=vllm: the Python of the "
                             "environment vLLM is installed in (empty: RLLOOM_VLLM_PYTHON, "
                             "else what `rlloom setup vllm` installed, else this one)")
    tools: list[str] = Field([], description="tools the policy may call in a multi-turn "
                             "rollout: calculator, python (run in the sandbox), or "
                             "module.path:function / file.py:function taking the call's "
                             "argument string and returning text (async allowed)")
    max_turns: int = Field(1, ge=1, description="model turns per rollout; a turn ending in a "
                           "tool call gets the tool's <result>...</result> and the model goes "
                           "on (1 = single-turn, no tools)")
    tool_format: Literal["tag", "json"] = Field(
        "tag", description='how a turn calls a tool: <call NAME>ARGS</call> (tag) or '
        '<call>{"name": NAME, "arguments": ARGS}</call> (json)')
    tool_timeout_s: float = Field(10.0, gt=0, description="seconds a tool call may take; "
                                  "then the model reads an error")
    tool_output_chars: int = Field(512, ge=1, description="longest tool result the model "
                                   "reads (longer ones are cut, saying how much)")

    @model_validator(mode="after")
    def _whole_chunks(self) -> "RolloutSection":
        if self.partial_tokens >= self.max_new_tokens:
            raise ValueError(f"rollout.partial_tokens ({self.partial_tokens}) must be below "
                             f"rollout.max_new_tokens ({self.max_new_tokens}) to carry "
                             "anything; set 0 for whole responses every step")
        if self.partial_tokens and self.max_new_tokens % self.partial_tokens:
            raise ValueError(f"rollout.partial_tokens ({self.partial_tokens}) must divide "
                             f"rollout.max_new_tokens ({self.max_new_tokens}): a carried "
                             "response resumes with whole chunks; e.g. partial_tokens="
                             f"{_divisor_below(self.max_new_tokens, self.partial_tokens)}")
        if (self.max_turns > 1) != bool(self.tools):
            raise ValueError("multi-turn rollouts call tools: set rollout.tools (e.g. "
                             "[calculator]) with rollout.max_turns > 1, or neither")
        if self.max_turns > 1 and self.partial_tokens:
            raise ValueError("rollout.partial_tokens carries single-turn responses across "
                             "steps; multi-turn rollouts (rollout.max_turns > 1) finish in "
                             "their step: set one of them to its default")
        return self

    @field_validator("tools")
    @classmethod
    def _tools_load(cls, specs: list[str]) -> list[str]:
        resolved = [s if s in BUILT_IN_TOOLS else resolve_spec(s, Path.cwd(), "tool", ValueError)
                    for s in specs]
        load_tools(resolved)  # fails early, naming the tool
        return resolved


def _divisor_below(n: int, k: int) -> int:
    return max(d for d in range(1, k + 1) if n % d == 0)


class EvalSection(Strict):
    every: int = Field(10, ge=1, description="evaluate every N steps (and before step 1)")
    max_new_tokens: int = Field(64, ge=1, description="greedy response length limit "
                                "(default: rollout.max_new_tokens)")
    n_samples: int = Field(1, ge=1, description="responses per held-out problem; above 1 the "
                           "run logs eval/pass@k (unbiased, k = 1, 2, 4, ..., n) and eval/mean@n")
    temperature: float = Field(0.0, ge=0, description="0: greedy; sampled evaluation (with "
                               "eval.n_samples > 1) needs a temperature above 0")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of the evaluation")
    score: str | None = Field(None, description="the reward term whose held-out value is the "
                              "run's score (eval before/after, the progress line; pass@k counts "
                              "a response with the term's full marks, >= 1): null = the "
                              "verifier's accuracy, or with data.task=none the first of "
                              "reward.functions")

    @model_validator(mode="after")
    def _samples_need_sampling(self) -> "EvalSection":
        if self.n_samples > 1 and self.temperature == 0:
            raise ValueError(f"eval.n_samples={self.n_samples} greedy responses would all be the "
                             "same; set eval.temperature (e.g. 0.6) for sampled evaluation")
        return self
