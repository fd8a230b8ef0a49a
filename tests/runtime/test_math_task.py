"""A math prompt file trains with the math-verify reward."""
import json

from rlloom.cli import main
from rlloom.data.synthetic import Problem
from rlloom.rewards.tasks import task_terms


def test_math_terms_by_task_name():
    p = Problem(prompt="What is 1/2 + 1/4?", answer="\\frac{3}{4}", solution="", meta={})
    terms = task_terms([p, p, p], ["We add: the answer is $\\boxed{0.75}$", "\\boxed{0.7}",
                                   "no idea"], "math")
    assert terms == {"correct": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0]}


def test_train_on_a_math_prompt_file(tmp_path, tiny, capsys):
    model = tmp_path / "model"
    main(["sft", *tiny, "--out", str(model)])
    rows = [{"prompt": f"Q:{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    prompts = tmp_path / "math.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    main(["train", *tiny, "data.task=math", f"data.prompt_file={prompts}",
          f"model.path={model}", f"run_dir={run}"])
    assert "held-out greedy accuracy: before RL" in capsys.readouterr().out
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
