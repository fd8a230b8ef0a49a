"""What runs a plan: groups of ranks, the one-process loop, torchrun, and the Ray executor
(driver, workers, cluster and faults, checks before start, weight sync)."""
