"""Trace-driven simulation of the real scheduler and KV cache manager with a measured step-cost model."""
