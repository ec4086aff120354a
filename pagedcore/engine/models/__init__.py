"""Models: loading checkpoints, the transformers attention hook, fused ops, MLA attention."""
