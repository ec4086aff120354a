"""Scheduling: requests, the continuous-batching scheduler, its per-step plans, results and undo."""
