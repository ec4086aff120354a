"""Sampling: per-request sampling parameters and the batched sampler."""
