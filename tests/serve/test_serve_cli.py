"""`pagedcore serve` as a process: serves, and on SIGTERM finishes in-flight requests first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from pagedcore.serve.server import free_port
from pagedcore.serve.step_trace import read


def test_serve_command_graceful_sigterm(tmp_path: Path) -> None:
    port = free_port()
    trace = tmp_path / "trace.jsonl"  # the step trace on: the engine's and the server's files
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAGEDCORE_STEP_TRACE": str(trace)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedcore.cli", "serve", "demo", "--port", str(port),
         "--device", "cpu", "--backend", "reference", "--max-model-len", "128",
         "--kv-cache-memory", "8MiB",
         "--threads", "1", "--log-level", "warning", "--served-model-name", "demo-model",
         "--enable-tokenizer-info-endpoint"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout
            time.sleep(0.1)
        # The flag reaches the app (the demo's byte tokenizer: its class alone).
        assert httpx.get(url + "/tokenizer_info").json() == {"tokenizer_class": "ByteTokenizer"}
        first_chunk = threading.Event()
        got: dict[str, object] = {}

        def stream() -> None:
            body = {"model": "demo-model", "prompt": "hi", "max_tokens": 100,
                    "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first_chunk.set()
                        event = json.loads(line[6:])
                        if event["usage"]:
                            got["usage"] = event["usage"]
                    elif line == "data: [DONE]":
                        got["done"] = True

        t = threading.Thread(target=stream)
        t.start()
        assert first_chunk.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        # The in-flight stream ran to its end although the server was told to stop.
        assert got.get("done") and got["usage"]["completion_tokens"] == 100  # type: ignore[index]
        # uvicorn re-raises the SIGTERM it handled once shut down: exit status -15 (or 0).
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert proc.stdout is not None
        log = proc.stdout.read()
        assert "engine stopped (0 request(s) in flight" in log
        assert "uvloop + httptools" in log  # uvicorn[standard], the serve extra's
        rows = read(str(trace))
        assert sum(r["ev"] == "step" for r in rows) >= 100
        assert os.path.exists(str(trace) + ".front")  # the server process's collections
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
