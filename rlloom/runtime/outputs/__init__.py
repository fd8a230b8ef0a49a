"""What a run writes as it goes: metrics, the trace, plots and progress."""
