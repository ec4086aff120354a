"""Sampling: per-request parameters, the sampler, penalties and logits processors."""
