"""Rehearsal: the runtime's own code at a plan's real shapes and world size on fake tensors."""
