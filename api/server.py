"""The server process: command line, engine + hypercorn in one trio nursery, graceful shutdown."""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import os
import signal
import sys
from pathlib import Path

import jinja2
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from api.app import Limits, ServerState, create_app
from api.cli import build_parser, engine_config
from api.responses import ResponseStore
from backends.kv_cache_names import kv_cache_dtype_refusal
from engine.config import EngineConfig
from engine.errors import (
    BackendUnavailableError,
    ConfigError,
    EngineDeadError,
    InvalidParameterError,
    ListenError,
    first_leaf,
    listening_at,
)
from engine.frontend.async_engine import open_engine
from engine.frontend.stats import activity_line
from engine.messages import EngineStats
from engine.models.loader import resolve_model
from engine.reasoning import reasoning_parser
from engine.signals import on_stop_signals

log = logging.getLogger("engine.server")

# Seconds between the activity lines (vLLM's default; --disable-log-stats turns them off).
LOG_STATS_INTERVAL_S = 10.0

# Seconds hypercorn gives open connections to finish once told to stop (the requests on
# them have been drained or ended by then; this is for writing their last bytes).
_RESPONSE_FLUSH_S = 5.0


async def run_server(args: argparse.Namespace, *, task_status=trio.TASK_STATUS_IGNORED) -> bool:
    """Serve until SIGINT/SIGTERM, or until the engine fails under ``--on-engine-failure exit``.

    Shutdown drains first: new work and /health get 503 at once while the requests in flight
    finish, for up to ``--shutdown-timeout`` seconds; the rest are then ended with a 503 (an
    error event on streams), and only then does the HTTP server close its connections.
    Returns True if it stopped because the engine failed.
    """
    config = engine_config(args)
    source = resolve_model(config.model)
    state = server_state(args, source.name)
    app = create_app(state)
    hc = _hypercorn_config(args)
    shutdown, stop_http = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signals, shutdown, args.shutdown_timeout)
        if args.launcher_fd is not None:
            nursery.start_soon(_stop_with_the_launcher, args.launcher_fd, shutdown)

        async def http(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with listening_at(f"--host {args.host} --port {args.port}"):
                await serve(app, hc, shutdown_trigger=stop_http.wait, task_status=task_status)
            nursery.cancel_scope.cancel()  # the engine goes down with the HTTP server

        # One server alone listens at once (/health says 503 while the model loads). A front of
        # --api-server-count accepts on the shared socket only once ready: until then the
        # fronts that are ready take every connection.
        shared_socket = args.listen_fd is not None
        if not shared_socket:
            urls = await nursery.start(http)  # (hypercorn's "http://host:port": the port bound, with --port 0 too)
        log.info("loading %s (backend %s)...", source.path, config.backend)
        starting, engine_ready = trio.CancelScope(), trio.Event()
        nursery.start_soon(_stop_the_start, shutdown, starting, engine_ready)
        with starting:
            async with open_engine(config, engine_fds=args.engine_fd) as client:
                engine_ready.set()
                state.attach(client)
                if not args.disable_log_stats:
                    nursery.start_soon(_log_stats, client)
                if shared_socket:
                    urls = await nursery.start(http)
                _log_ready(app, state, client, config, urls[0])
                task_status.started()
                failed = await _wait_for_shutdown(shutdown, client, args.on_engine_failure)
                await _drain(state, client, args.shutdown_timeout)
        # Leaving open_engine ended every open request with EngineShutdownError: their handlers
        # answer 503 or an error event while hypercorn still runs; then it closes.
        stop_http.set()
        if starting.cancelled_caught:
            log.info("stopped before the engine was ready")
            if shared_socket:  # (its HTTP server never started: nothing else ends the nursery)
                nursery.cancel_scope.cancel()
            return False
        return failed
    return False  # cancelled before the engine started


def _hypercorn_config(args: argparse.Namespace) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [f"fd://{args.listen_fd}" if args.listen_fd is not None else f"{args.host}:{args.port}"]
    hc.graceful_timeout = _RESPONSE_FLUSH_S  # requests are drained before hypercorn is told to stop
    hc.accesslog = None
    return hc


async def _stop_the_start(shutdown: trio.Event, starting: trio.CancelScope, engine_ready: trio.Event) -> None:
    """A signal before the engine is ready (its processes still load, or the front waits for
    headless engines to join) ends the start: there is nothing to drain yet."""
    await shutdown.wait()
    if not engine_ready.is_set():
        starting.cancel()


async def _drain(state: ServerState, client, timeout: float) -> None:
    """New work gets 503 while the requests in flight finish, for up to ``timeout`` seconds."""
    state.draining = True
    with trio.move_on_after(timeout):
        await client.wait_idle()
    if client.num_unfinished:
        log.warning("shutdown: ending %d unfinished requests", client.num_unfinished)


async def _wait_for_shutdown(shutdown: trio.Event, client, on_engine_failure: str) -> bool:
    """Wait for a signal (False), or for the engine to fail when the policy is to exit (True)."""
    async with trio.open_nursery() as nursery:
        failed = False

        async def engine_failure() -> None:
            nonlocal failed
            error = await client.wait_failed()
            log.error("the engine failed (%s); shutting down (--on-engine-failure exit)", error)
            failed = True
            nursery.cancel_scope.cancel()

        if on_engine_failure == "exit":
            nursery.start_soon(engine_failure)
        await shutdown.wait()
        nursery.cancel_scope.cancel()
    return failed


async def _log_stats(client, interval: float = LOG_STATS_INTERVAL_S) -> None:
    """Every ``interval`` seconds with activity, one line of what the engines did (as vLLM's)."""
    before = EngineStats.total(client.engine_stats())
    while True:
        await trio.sleep(interval)
        now = EngineStats.total(client.engine_stats())
        line = activity_line(before, now, interval)
        if line is not None:
            log.info("%s", line)
        before = now


def _log_ready(app, state: ServerState, client, config: EngineConfig, url: str) -> None:
    stats = client.stats()
    log.info("serving %s as %r on %s with backend %s; KV cache %d blocks x %d tokens = %d tokens",
             resolve_model(config.model).path.name, state.model_name, url, client.backend_name,
             stats.kv_blocks_total, config.block_size, stats.kv_blocks_total * config.block_size)
    log.info("routes: %s", ", ".join(sorted(str(r.rule) for r in app.url_map.iter_rules())))
    if state.frontend:
        log.info("chat page: %s/ (--disable-frontend turns it off)", url)


async def _stop_on_signals(shutdown: trio.Event, grace: float) -> None:
    """The first SIGINT or SIGTERM starts a graceful shutdown; a second SIGINT exits at once."""
    def handle(sig: signal.Signals) -> None:
        if not shutdown.is_set():
            log.info("received %s: shutting down (requests in flight get %g s; SIGINT again to exit now)",
                     sig.name, grace)
            shutdown.set()
        elif sig == signal.SIGINT:
            log.warning("received SIGINT again: exiting now")
            os._exit(130)

    await on_stop_signals(handle)


async def _stop_with_the_launcher(fd: int, shutdown: trio.Event) -> None:
    """A front of ``--api-server-count``: the launcher holds the write end of this pipe and never
    writes; when it is gone, however it died, the read ends, and this front shuts down as on
    SIGTERM (api/launcher.py)."""
    async with trio.lowlevel.FdStream(fd) as pipe:
        while await pipe.receive_some():
            pass
    if not shutdown.is_set():
        log.warning("the launcher of the API servers is gone: shutting down")
        shutdown.set()


def server_state(args: argparse.Namespace, model_name: str) -> ServerState:
    """What the handlers share, from the flags (``model_name``: the model's own, for the id)."""
    limits = Limits(body_timeout=args.request_body_timeout, request_timeout=args.request_timeout,
                    max_prompts_per_request=args.max_prompts_per_request)
    names = args.served_model_name or [args.model or model_name]  # (vLLM's: the --model given, as given)
    # (an empty --api-key is none, as vLLM reads it and as an empty $VLLM_API_KEY is)
    api_key = tuple(key for key in args.api_key or () if key) or None
    return ServerState(names[0], other_model_names=tuple(names[1:]), api_key=api_key,
                       allowed_origins=allowed_origins(args.allowed_origins),
                       chat_template=chat_template(args.chat_template),
                       trust_request_chat_template=args.trust_request_chat_template,
                       exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                       reasoning_parser=reasoning_parser(args.reasoning_parser),
                       default_chat_template_kwargs=args.default_chat_template_kwargs, limits=limits,
                       responses=ResponseStore(args.max_stored_responses) if args.enable_responses_store else None,
                       frontend=not args.disable_frontend)


def chat_template(value: str | None) -> str | None:
    """``--chat-template``: the file it names, else (vLLM's rule) the template itself where the
    value holds {, } or a newline (a typed \\n read as one); compiled here as each chat request
    compiles it, so that a broken one stops the server at start, not every chat with a 400.

    Raises:
        ConfigError: no such file (and no template either), a file that is no UTF-8 text, or a
            template Jinja cannot compile (its line said).
    """
    if value is None:
        return None
    if not value.strip():
        raise ConfigError("chat_template", "--chat-template is empty: give a file or a template")
    try:
        template = Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("chat_template", f"--chat-template {value}: not UTF-8 text ({exc.reason} at byte "
                                           f"{exc.start})") from None
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ConfigError("chat_template", f"--chat-template {value}: {exc.strerror or exc} (neither a readable "
                                               "file nor a template: a template holds {, } or a newline)") from None
        template = codecs.decode(value, "unicode_escape")
    try:  # (transformers' own compiler, cached by text: the one render_chat_template's requests use)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # (a transformers without it: the first chat request says what is wrong)
        return template
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateError as exc:
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise ConfigError("chat_template", f"--chat-template does not compile: {exc.message}{where}") from None
    return template


def allowed_origins(value: str) -> tuple[str, ...]:
    """``--allowed-origins``: comma-separated, or vLLM's JSON list (``'["*"]'``)."""
    if value.strip().startswith("["):
        try:
            origins = json.loads(value)
        except ValueError:
            origins = None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise InvalidParameterError("allowed_origins", f"--allowed-origins is not a JSON list of strings: {value}")
        return tuple(o.strip() for o in origins if o.strip())
    return tuple(o.strip() for o in value.split(",") if o.strip())


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if refusal := kv_cache_dtype_refusal(args.backend, args.kv_cache_dtype):
        parser.error(refusal)
    if args.max_stored_responses < 1:
        parser.error("--max-stored-responses must be at least 1")
    try:
        allowed_origins(args.allowed_origins)
    except InvalidParameterError as exc:
        parser.error(str(exc))
    if args.enable_responses_store and args.api_server_count > 1:
        parser.error("--enable-responses-store keeps responses in one server's memory: it needs --api-server-count 1")
    if any(not name.strip() for name in args.served_model_name or ()):
        parser.error("--served-model-name: a name must not be empty")
    if args.nnodes > 1 and args.node_rank > 0 and not args.headless:
        parser.error(f"--node-rank {args.node_rank} runs this machine's tensor-parallel ranks only: add --headless "
                     "(node 0 runs the engine and the HTTP server)")
    if args.data_parallel_start_rank is not None and not args.headless:
        parser.error("--data-parallel-start-rank numbers a --headless machine's engines (the server's own are "
                     "the first ranks)")
    if args.headless and args.api_server_count > 1:
        parser.error("--api-server-count does not combine with --headless (a headless node runs engines only: "
                     "the API servers run on the node without it)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        status = _run(args, argv)
    except BaseException as exc:  # configuration mistakes end the process with one clear line
        leaf = first_leaf(exc)
        if isinstance(leaf, ConfigError):  # a wrong flag or combination: a usage error, as argparse's
            print(f"error: {leaf}", file=sys.stderr)
            raise SystemExit(2) from None
        # (an engine gone before it was ready: its own process says why; a front whose link broke
        # before it read that says the link broke, in one line too)
        if isinstance(leaf, (InvalidParameterError, BackendUnavailableError, ListenError, OSError, EngineDeadError)):
            raise SystemExit(f"error: {leaf}") from None
        raise
    raise SystemExit(status)


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The process ``args`` ask for, to its exit status: a launcher of API servers, a headless
    node's engines, or the server."""
    if not args.headless:  # (at once, not in each front after the engines have loaded; a node has no use of it)
        chat_template(args.chat_template)
    if args.api_server_count > 1 and args.listen_fd is None:
        from api.launcher import run_launcher

        return trio.run(run_launcher, args, list(sys.argv[1:] if argv is None else argv))
    if args.headless:
        from engine.core.tensor_parallel import run_node
        from engine.transport.processes import run_headless

        config = engine_config(args)
        return run_node(config) if config.nnodes > 1 else trio.run(run_headless, config)
    return 1 if trio.run(run_server, args) else 0
