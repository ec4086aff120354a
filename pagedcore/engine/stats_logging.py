"""The engine's periodic stats line, through `logging` (logger ``pagedcore.engine``).

With ``log_stats=True`` (the CLI's default; the library's is False) the engine logs, at most
every ``log_interval`` seconds, a line like vLLM's::

    Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 12 reqs, Waiting: 3 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 63.0%

Throughputs and the hit rate are over the interval since the previous line (prompt tokens are
counted when a request is admitted; the hit rate is cached / admitted prompt tokens).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LOGGER_NAME", "StatsLogger", "configure_cli_logging"]

#: The logger the engine writes to.
LOGGER_NAME = "pagedcore.engine"
logger = logging.getLogger(LOGGER_NAME)


class StatsLogger:
    """Logs the stats line when `interval` seconds have passed since the previous one."""

    def __init__(self, interval: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last = clock()
        self._prompt = 0
        self._hits = 0
        self._generated = 0

    def maybe_log(self, get_stats: Callable[[], dict[str, Any]],
                  generated_tokens: int) -> str | None:
        """Log (and return) the line if it is due. `get_stats` returns ``LLM.stats()``-shaped
        figures (running, waiting, kv_cache_usage, prompt_tokens, prefix_hit_tokens,
        prefix_hit_rate; called only when due); `generated_tokens` counts every token
        sampled so far."""
        now = self.clock()
        elapsed = now - self._last
        if elapsed < self.interval:
            return None
        stats = get_stats()
        prompt = int(stats["prompt_tokens"]) - self._prompt
        hits = int(stats["prefix_hit_tokens"]) - self._hits
        generated = generated_tokens - self._generated
        rate = hits / prompt if prompt else float(stats["prefix_hit_rate"])
        line = (
            f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
            f"Running: {stats['running']} reqs, Waiting: {stats['waiting']} reqs, "
            f"KV cache usage: {100 * float(stats['kv_cache_usage']):.1f}%, "
            f"Prefix cache hit rate: {100 * rate:.1f}%"
        )
        logger.info(line)
        self._last = now
        self._prompt += prompt
        self._hits += hits
        self._generated += generated
        return line


def configure_cli_logging(args: Any) -> None:
    """For a command: when ``args.log_stats``, show logger ``pagedcore.engine``'s INFO lines
    on stderr (a handler is added only if the logger has none)."""
    if not getattr(args, "log_stats", False):
        return
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] "
                                               "%(message)s", datefmt="%m-%d %H:%M:%S"))
        logger.addHandler(handler)
