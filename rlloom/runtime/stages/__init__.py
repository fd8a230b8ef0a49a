"""The stages of one RL step (generation, assessment, training) and the offline and SFT
steps, for one process or any group of ranks."""
