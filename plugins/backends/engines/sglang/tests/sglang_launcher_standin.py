"""A stand-in server for the launcher's process-management tests. It is NOT SGLang.

The launcher runs ``python -m <server_module> --model-path ... --port ...``; the tests point
``server_module`` here, so this program is started through exactly the launcher code path that
starts ``sglang.launch_server`` on a GPU machine. It answers ``/health``, ``/health_generate``,
``/generate`` (SGLang's response shape, made-up tokens) and ``/server_info`` (its argv and
device environment), and misbehaves on request. The "model path" selects the behaviour:

- ``standin:ok``: serve.
- ``standin:die``: print an error and exit with code 3 during startup.
- ``standin:hang``: never listen.
- ``standin:ignore-term``: serve, ignoring SIGTERM (only SIGKILL stops it).
- ``standin:no-generate``: ``/health`` answers 200, ``/health_generate`` 503 forever.

With ``--api-key KEY`` it answers 401 to a request without ``Authorization: Bearer KEY``, but
for the paths under ``/health`` (SGLang's rule).

With ``STANDIN_PID_FILE`` set it first starts a child process that ignores SIGTERM (as a stuck
worker would) and writes ``<own pid> <child pid>`` to that file.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--api-key", default=None)
    args, _ = parser.parse_known_args()
    mode = args.model_path.removeprefix("standin:")
    print(f"stand-in starting: mode={mode} argv={sys.argv[1:]}", flush=True)

    pid_file = os.environ.get("STANDIN_PID_FILE")
    if pid_file:
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "time.sleep(600)",
            ]
        )
        with open(pid_file, "w") as f:
            f.write(f"{os.getpid()} {child.pid}")

    if mode == "die":
        time.sleep(0.3)
        print("RuntimeError: stand-in could not load the model (simulated failure)", flush=True)
        sys.exit(3)
    if mode == "hang":
        while True:
            time.sleep(1)

    # imported only now: the lines above must reach the log at once, even on a loaded machine
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def health_generate(_: web.Request) -> web.Response:
        if mode == "no-generate":
            return web.Response(status=503, text="not ready")
        return web.Response(text="")

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        ids = list(body["input_ids"])
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 1))
        out = [(ids[-1] + k + 1) % 1000 for k in range(n)]
        meta = {
            "id": body.get("rid") or "r0",
            "finish_reason": {"type": "length", "length": n},
            "output_token_logprobs": [[-0.5, t, None] for t in out],
            "weight_version": args.weight_version,
            "prompt_tokens": len(ids),
            "completion_tokens": n,
        }
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "argv": sys.argv[1:],
                "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "marker": os.environ.get("STANDIN_MARKER"),
            }
        )

    @web.middleware
    async def require_key(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if args.api_key is None or request.path.startswith("/health"):
            return await handler(request)
        if request.headers.get("Authorization") != f"Bearer {args.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    app = web.Application(middlewares=[require_key])
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_post("/generate", generate)
    app.router.add_get("/server_info", server_info)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=False)
    else:
        web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
