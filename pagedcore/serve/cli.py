"""`pagedcore serve MODEL`: the OpenAI-compatible server (flags named as `vllm serve`'s)."""

from __future__ import annotations

import click

__all__ = ["serve"]


def _parse_memory(text: str | None) -> int | None:
    """``"4GiB"``, ``"512MiB"``, ``"1e9"`` -> bytes."""
    if text is None:
        return None
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 2**10, "m": 2**20, "g": 2**30}
    lowered = text.strip().lower()
    number, scale = lowered, 1
    for suffix in sorted(units, key=len, reverse=True):
        if lowered.endswith(suffix):
            number, scale = lowered.removesuffix(suffix).strip(), units[suffix]
            break
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size such as 4GiB, 512MiB or 1e9",
                                 param_hint="--kv-cache-memory") from None
    if value <= 0:
        raise click.BadParameter(f"{text!r} must be positive", param_hint="--kv-cache-memory")
    return value


@click.command()
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to bind.")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="Name(s) clients use in 'model' (default: MODEL). Repeatable.")
@click.option("--api-key", default=None, envvar="PAGEDCORE_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* (env PAGEDCORE_API_KEY).")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--dtype", default=None, help="Model dtype (default: bfloat16 on CUDA).")
@click.option("--backend", default=None, help="Force an attention backend by name.")
@click.option("--max-model-len", default=None, type=click.IntRange(min=1),
              help="Longest prompt + output (default: the model's).")
@click.option("--max-num-seqs", default=256, show_default=True, type=click.IntRange(min=1),
              help="Requests per engine step at most.")
@click.option("--max-num-batched-tokens", default=2048, show_default=True,
              type=click.IntRange(min=1), help="Tokens per engine step at most.")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1),
              help="Tokens per KV-cache block.")
@click.option("--gpu-memory-utilization", default=0.9, show_default=True,
              type=click.FloatRange(0.0, 1.0, min_open=True),
              help="Fraction of the GPU pagedcore may fill.")
@click.option("--kv-cache-memory", default=None,
              help="KV-cache budget (e.g. 4GiB; overrides --gpu-memory-utilization).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True,
              show_default=True, help="Reuse KV blocks of shared prompt prefixes.")
@click.option("--long-prefill-token-threshold", default=None, type=click.IntRange(min=1),
              help="Cap one request's prefill tokens per step.")
@click.option("--tensor-parallel-size", "-tp", default=1, show_default=True,
              type=click.IntRange(min=1), help="Shard the model over this many GPUs.")
@click.option("--enforce-eager", is_flag=True, help="Never use CUDA graphs.")
@click.option("--seed", default=0, show_default=True, help="Seed of random weights/sampling.")
@click.option("--max-waiting", default=1024, show_default=True, type=click.IntRange(min=0),
              help="Requests admitted beyond --max-num-seqs; past it: 503 with Retry-After.")
@click.option("--max-request-bytes", default=4 * 2**20, show_default=True,
              type=click.IntRange(min=1024), help="Larger request bodies get 413.")
@click.option("--shutdown-timeout", default=30.0, show_default=True,
              type=click.FloatRange(min=0.0),
              help="Seconds in-flight requests get to finish on SIGTERM before being aborted.")
@click.option("--threads", default=None, type=click.IntRange(min=1),
              help="torch CPU threads (CPU serving).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def serve(model: str, host: str, port: int, served_model_names: tuple[str, ...],
          api_key: str | None, device: str | None, dtype: str | None, backend: str | None,
          max_model_len: int | None, max_num_seqs: int, max_num_batched_tokens: int,
          block_size: int, gpu_memory_utilization: float, kv_cache_memory: str | None,
          enable_prefix_caching: bool, long_prefill_token_threshold: int | None,
          tensor_parallel_size: int, enforce_eager: bool, seed: int, max_waiting: int,
          max_request_bytes: int, shutdown_timeout: float, threads: int | None,
          log_level: str) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (a checkpoint directory, 'demo' or
    'random:<type>'): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(
            f"pagedcore serve needs the web stack ({exc.name} is missing): "
            "pip install 'pagedcore[serve]'") from exc
    import torch

    from pagedcore.engine.llm import LLM
    from pagedcore.serve.app import build_app
    from pagedcore.serve.async_engine import AsyncEngine
    from pagedcore.serve.metrics import ServeMetrics
    from pagedcore.serve.server import run_server

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        llm = LLM(model, device=device, dtype=dtype, backend=backend, seed=seed,
                  block_size=block_size, max_model_len=max_model_len,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                  enable_prefix_caching=enable_prefix_caching,
                  long_prefill_token_threshold=long_prefill_token_threshold,
                  kv_cache_memory_bytes=_parse_memory(kv_cache_memory),
                  gpu_memory_utilization=gpu_memory_utilization,
                  tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager)
    except ValueError as exc:  # a user mistake (model, lengths, KV budget): exit status 2
        raise click.UsageError(str(exc)) from exc
    names = list(served_model_names) or [model]
    engine_ref: list[AsyncEngine] = []
    metrics = ServeMetrics(names[0], lambda: engine_ref[0].stats())
    engine = AsyncEngine(llm, max_waiting=max_waiting, metrics=metrics)
    engine_ref.append(engine)
    app = build_app(engine, model_names=names, api_key=api_key, metrics=metrics,
                    max_body_bytes=max_request_bytes, shutdown_timeout=shutdown_timeout,
                    on_shutdown=lambda line: click.echo(f"pagedcore serve: {line}", err=True))
    click.echo(f"pagedcore serve: {names[0]} ({llm.model_name}, backend "
               f"{', '.join(sorted(set(llm.backend_names)))}, device {llm.device}, "
               f"max_model_len {llm.max_model_len}) on http://{host}:{port}", err=True)
    run_server(app, host=host, port=port, log_level=log_level,
               shutdown_timeout=shutdown_timeout)
