"""The server's front end alone, in process: CPU seconds per streamed token.

The real FastAPI app (`pagedcore.serve.app.build_app`) over an `AsyncEngine` whose engine
process is faked: every "step" hands one raw delta per running stream to the front end
(`AsyncEngine._on_message`, what the engine process's frames feed), and each stream is one
`POST /v1/completions` with `stream: true` driven through ASGI with a `send` that counts the
bytes and drops them. So it measures what the event loop spends per token between the
engine's pipe and uvicorn: delta dispatch, `AsyncEngine.generate`, the SSE chunk, Starlette.
Not uvicorn's HTTP writer, the pipe or the client (`serve_cpu/compare.sh` runs the whole
server).

    python docs/benchmarks/serve_cpu/frontend_inprocess.py [STREAMS] [TOKENS] [prof|--json OUT]
"""
import asyncio
import cProfile
import json
import pstats
import subprocess
import sys
import time

from pagedcore.serve.app import build_app
from pagedcore.serve.async_engine import AsyncEngine
from pagedcore.serve.core_loop import EngineInfo
from pagedcore.serve.metrics import ServeMetrics

STREAMS = int(sys.argv[1]) if len(sys.argv) > 1 else 256
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 200
PROFILE = len(sys.argv) > 3 and sys.argv[3] == "prof"
JSON = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--json" else None


class _Fit:
    def check(self, num_prompt_tokens, max_tokens):
        pass


class FakeProcess:
    """What `AsyncEngine` uses of an `EngineProcess`; records the requests added."""

    def __init__(self):
        self.info = EngineInfo(model_name="m", tokenizer=None, max_model_len=4096,
                               max_num_seqs=STREAMS, vocab_size=1000, fit=_Fit(),
                               backend_names=("x",), device="cpu")
        self.attached = False
        self.alive = True
        self.added = []  # [request id, tokens so far, prompt length]

    def attach(self, loop, on_message):
        self.on_message = on_message
        self.attached = True

    def send(self, command):
        if command[0] == "add":
            self.added.append([command[1], 0, len(command[2])])

    def detach(self):
        pass

    def close(self):
        pass


async def main():
    proc = FakeProcess()
    engine = AsyncEngine(None, process=proc, metrics=ServeMetrics("m", dict), max_waiting=0)
    app = build_app(engine, model_names=["m"], metrics=engine.metrics)
    engine.start()
    body = json.dumps({"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": TOKENS,
                       "stream": True, "ignore_eos": True}).encode()
    sent = [0]

    async def one():
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
                 "scheme": "http", "server": ("x", 1), "client": ("y", 2), "root_path": "",
                 "app": app, "asgi": {"version": "3.0"}}
        first = [True]
        done = asyncio.Event()

        async def receive():
            if first[0]:
                first[0] = False
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body":
                sent[0] += len(message.get("body", b""))
                if not message.get("more_body", False):
                    done.set()

        await app(scope, receive, send)

    tasks = [asyncio.ensure_future(one()) for _ in range(STREAMS)]
    while len(proc.added) < STREAMS:
        await asyncio.sleep(0)
    t0, w0 = time.process_time(), time.perf_counter()
    prof = cProfile.Profile() if PROFILE else None
    if prof:
        prof.enable()
    tokens = 0
    live = proc.added
    while live:  # one engine step: a raw delta per running stream, then let the loop run
        items, running = [], []
        for entry in live:
            entry[1] += 1
            finish = "length" if entry[1] >= TOKENS else None
            items.append((entry[0], (entry[0], " tok", [7], None, finish, None, entry[2], 0,
                                     entry[1], None)))
            if finish is None:
                running.append(entry)
        tokens += len(items)
        proc.on_message(("step", items, None))
        live = running
        for _ in range(3):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    cpu = time.process_time() - t0
    return {"streams": STREAMS, "tokens": tokens, "cpu_s": round(cpu, 3),
            "us_per_token": round(cpu / tokens * 1e6, 2), "bytes": sent[0],
            "wall_s": round(time.perf_counter() - w0, 3)}


if __name__ == "__main__":
    runs = [asyncio.run(main()) for _ in range(1 if PROFILE else 5)]
    for run in runs:
        print(json.dumps(run))
    if JSON:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        json.dump({"command": "python docs/benchmarks/serve_cpu/frontend_inprocess.py "
                              + " ".join(sys.argv[1:]), "commit": commit,
                   "best_us_per_token": min(r["us_per_token"] for r in runs), "runs": runs},
                  open(JSON, "w"), indent=1)
