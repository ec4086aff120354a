"""`pagedcore serve MODEL`: the OpenAI-compatible server (flags named as `vllm serve`'s)."""

from __future__ import annotations

import click

from pagedcore.cli_types import ChatTemplate, FiniteFloat
from pagedcore.engine.engine_args import EngineArgs
from pagedcore.engine.engine_args_cli import engine_options
from pagedcore.engine.stats_logging import configure_cli_logging

__all__ = ["serve"]


@click.command()
@engine_options(model="argument")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to bind.")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="Name(s) clients use in 'model' (default: MODEL). Repeatable.")
@click.option("--api-key", default=None, envvar="PAGEDCORE_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and "
                   "/tokenizer_info (env PAGEDCORE_API_KEY).")
@click.option("--max-waiting", default=1024, show_default=True, type=click.IntRange(min=0),
              help="Requests admitted beyond --max-num-seqs; past it: 503 with Retry-After.")
@click.option("--max-request-bytes", default=4 * 2**20, show_default=True,
              type=click.IntRange(min=1024), help="Larger request bodies get 413.")
@click.option("--shutdown-timeout", default=30.0, show_default=True,
              type=FiniteFloat(min=0.0),
              help="Seconds in-flight requests get to finish on SIGTERM before being aborted.")
@click.option("--threads", default=None, type=click.IntRange(min=1),
              help="torch CPU threads (CPU serving).")
@click.option("--engine-process/--no-engine-process", default=True, show_default=True,
              help="Run the engine in a process of its own (else on a thread of the server's; "
                   "that shares the GIL with the HTTP event loop and is slower under load).")
@click.option("--stream-interval", default=1, show_default=True, type=click.IntRange(min=1),
              help="Engine steps between two chunks of a running stream (each then carries up "
                   "to that many tokens); above 1 the engine builds its outputs less often, "
                   "which raises throughput with hundreds of streams.")
@click.option("--chat-template", default=None, type=ChatTemplate(),
              help="A Jinja chat template (a file, or the template itself) for "
                   "/v1/chat/completions instead of the tokenizer's.")
@click.option("--enable-tokenizer-info-endpoint", is_flag=True, default=False,
              help="Serve GET /tokenizer_info: the tokenizer's configuration (its "
                   "tokenizer_config.json fields, class and chat template).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              help="uvicorn's log level.")
def serve(host: str, port: int, served_model_names: tuple[str, ...], api_key: str | None,
          max_waiting: int, max_request_bytes: int, shutdown_timeout: float,
          threads: int | None, engine_process: bool, stream_interval: int,
          chat_template: str | None, enable_tokenizer_info_endpoint: bool, log_level: str,
          engine_args: EngineArgs) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (a checkpoint directory, a Hugging Face
    model id, 'demo' or 'random:<type>'): /v1/completions, /v1/chat/completions, /v1/models,
    /tokenize, /detokenize, /tokenizer_info (with --enable-tokenizer-info-endpoint), /health,
    /metrics."""
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
    from pagedcore.serve.gc_control import freeze_startup_heap, watch_gc
    from pagedcore.serve.metrics import ServeMetrics
    from pagedcore.serve.server import run_server, server_stack
    from pagedcore.serve.step_trace import StepTrace

    configure_cli_logging(engine_args)
    model = str(engine_args.model)
    names = list(served_model_names) or [model]
    engine_ref: list[AsyncEngine] = []
    metrics = ServeMetrics(names[0], lambda: engine_ref[0].stats())
    try:
        StepTrace.check_env()
        if engine_process:
            engine = AsyncEngine.spawn(engine_args, threads=threads, max_waiting=max_waiting,
                                       metrics=metrics, stream_interval=stream_interval)
        else:
            if threads is not None:
                torch.set_num_threads(threads)
            engine = AsyncEngine(LLM.from_engine_args(engine_args), max_waiting=max_waiting,
                                 metrics=metrics, stream_interval=stream_interval)
    except ValueError as exc:  # a user mistake (model, lengths, KV budget): exit status 2
        raise click.UsageError(str(exc)) from exc
    except RuntimeError as exc:  # the engine process failed to start (its log says why)
        raise click.ClickException(str(exc)) from exc
    engine_ref.append(engine)
    # The server's own startup heap (and the model's, with the engine on a thread) out of
    # the collector's walks; with a step trace, the server process's collections beside it.
    freeze_startup_heap()
    front_trace = StepTrace.from_env(proc="front", suffix=".front", line_buffered=True) \
        if engine_process else None
    if front_trace is not None:
        watch_gc(front_trace.row, "front")
    app = build_app(engine, model_names=names, api_key=api_key, metrics=metrics,
                    max_body_bytes=max_request_bytes, shutdown_timeout=shutdown_timeout,
                    chat_template=chat_template,
                    enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint,
                    on_shutdown=lambda line: click.echo(f"pagedcore serve: {line}", err=True))
    where = "its own process" if engine_process else "a thread"
    loop, http = server_stack()
    click.echo(f"pagedcore serve: {names[0]} ({engine.model_name}, backend "
               f"{', '.join(engine.backend_names)}, device {engine.device}, "
               f"max_model_len {engine.max_model_len}, engine in {where}, {loop} + {http}) on "
               f"http://{host}:{port}", err=True)
    run_server(app, host=host, port=port, log_level=log_level,
               shutdown_timeout=shutdown_timeout)
