"""The run every test trains when it needs a whole run."""

# a model and run small enough that a full RL step takes well under a second on 2 cores.
TINY = ["model.hidden_size=32", "model.layers=2", "model.heads=2", "model.kv_heads=1",
        "data.difficulty=1", "data.train_size=200", "data.eval_size=16", "sft.steps=20",
        "sft.batch_size=16", "train.steps=3", "train.prompts_per_step=4",
        "rollout.n_samples=4", "rollout.max_new_tokens=16", "eval.max_new_tokens=16",
        "eval.every=2", "checkpoint.every=1", "train.threads=1"]
