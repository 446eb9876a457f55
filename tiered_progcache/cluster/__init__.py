"""Compile once per cluster: the per-thread, per-node and cross-node single-flight."""
