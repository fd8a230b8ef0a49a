"""The work-depth-memory performance model (see PERF_MODEL.md). Pure Python: never imports torch,
so `rlloom plan` is instant on any machine."""
