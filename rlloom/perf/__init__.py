"""The work-depth-memory performance model (docs/performance-model.md). Pure Python: never
imports torch, so `rlloom plan` is instant on any machine."""
