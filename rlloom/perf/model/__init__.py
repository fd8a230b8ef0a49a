"""The cost model: what is priced (model shapes, workloads, hardware) and how one plan's step is
priced from its stages' work, depth, memory and communication (docs/performance-model.md)."""
