"""The quart-trio application: routes, authentication, CORS and error mapping."""

from __future__ import annotations

import hmac
import logging
import math
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import aclosing, contextmanager
from typing import Any

import attrs
import jinja2
import orjson
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from api.connections import close_connections_as_asked
from api.errors import APIError, bad_request
from api.frontend import Throughput, engine_stats_json, load_static
from api.metrics import CONTENT_TYPE, Metrics
from api.openapi import DOCS_HTML, openapi_document
from api.responses import (
    ResponseBuilder,
    ResponseStore,
    StoredResponse,
    chat_body,
    chat_param,
    check_request,
    in_responses_terms,
    input_item_resources,
    item_page,
    output_messages,
    response_head,
    responses_usage,
    sse_event,
)
from api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
    beam_search_params,
    in_request_terms,
    scoring_only,
    parse,
    sampling_params,
    structured_outputs,
)
from api.serving import (
    SSE_DONE,
    ChunkWriter,
    OutputSplitter,
    ReasoningPlan,
    UsageTracker,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    sse,
)
from engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineShutdownError,
    InvalidParameterError,
    RequestFailedError,
    ungrouped,
)
from engine.frontend.async_engine import EngineClient
from engine.frontend.beam_search import BeamSearchParams
from engine.messages import EngineStats
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.reasoning import ReasoningParser, check_budget
from engine.tokenizer import render_chat_template, template_message, template_switches, token_bytes
from engine.tools import ToolPlan, plan_tools, render_inputs

log = logging.getLogger(__name__)

VERSION = "0.1.0"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@attrs.frozen
class Limits:
    """What one request may cost the server before it is refused or cut off.

    Attributes:
        max_body_bytes: larger bodies are a 413.
        body_timeout: seconds a client may take to send its body (then 408).
        max_json_depth: deeper JSON nesting is a 400 (nothing here needs more than a few levels).
        request_timeout: default deadline (seconds) of a generation request, from its arrival;
            a request's own ``X-Request-Timeout`` header may set another. None: no deadline.
        max_prompts_per_request: prompts one ``/v1/completions`` request may hold (a 400
            past it, before any is tokenized).
    """

    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout: float = 60.0
    max_json_depth: int = 32
    request_timeout: float | None = None
    max_prompts_per_request: int = 256


@attrs.define
class ServerState:
    """What the handlers share. ``client`` is None while the model loads; ``draining`` once
    shutdown has begun (new work and /health get 503, requests in flight finish)."""

    model_name: str  # the id answers carry (vLLM's first --served-model-name)
    client: EngineClient | None = None
    api_key: str | tuple[str, ...] | None = None  # one key, or several (any of them opens /v1/*)
    allowed_origins: tuple[str, ...] = ()
    chat_template: str | None = None
    trust_request_chat_template: bool = False  # a request's chat_template is used, not refused
    exclude_tools_when_tool_choice_none: bool = False  # (vLLM's flag: by default the template gets them)
    # --reasoning-parser; --default-chat-template-kwargs (a request's chat_template_kwargs override them)
    reasoning_parser: ReasoningParser | None = None
    default_chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    limits: Limits = Limits()
    responses: ResponseStore | None = None  # --enable-responses-store
    frontend: bool = True  # the chat page at / (off: --disable-frontend)
    created: int = attrs.field(factory=lambda: int(time.time()))
    metrics: Metrics | None = None  # set by create_app
    draining: bool = False
    other_model_names: tuple[str, ...] = ()  # more ids requests may name (--served-model-name a b)

    def attach(self, client: EngineClient) -> None:
        """The engine is ready: serve requests with it and feed ``/metrics`` from its timings."""
        self.client = client
        if self.metrics is not None:
            client.add_stat_logger(self.metrics.record)


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status=status, content_type="application/json")


def create_app(state: ServerState) -> QuartTrio:
    close_connections_as_asked()  # (served by hypercorn: see api/connections.py)
    app = QuartTrio(__name__, static_folder=None)  # the page's files are served from memory (api/frontend.py)
    app.config["MAX_CONTENT_LENGTH"] = state.limits.max_body_bytes
    app.config["BODY_TIMEOUT"] = state.limits.body_timeout
    metrics = state.metrics = Metrics(lambda: state.client.engine_stats() if state.client else [_EMPTY_STATS],
                                      state.model_name, lambda: state.client.engine_kv_caches() if state.client else [])
    api = _Handlers(state, metrics)

    @app.before_request
    async def authenticate() -> Response | None:
        if request.method == "OPTIONS" and state.allowed_origins:
            return _cors(Response("", status=204))
        if state.api_key and request.path.startswith(_AUTHENTICATED):
            given = request.headers.get("Authorization", "").encode()
            keys = (state.api_key,) if isinstance(state.api_key, str) else state.api_key
            if not any([hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys]):  # (all compared)
                raise APIError(401, "invalid or missing API key", code="invalid_api_key")
        return None

    @app.after_request
    async def finish(response: Response) -> Response:
        has_body = request.content_length or "Transfer-Encoding" in request.headers
        if has_body and (response.status_code >= 400 or request.method != "POST"):
            # A body nobody read (an error before it was read: a wrong method or route, a
            # missing API key; or a body on a GET or OPTIONS, answered without it) would be
            # parsed as the next request on this connection and hang the client. Only POST
            # handlers read bodies, and they read them first.
            response.headers["Connection"] = "close"
        return _cors(response) if state.allowed_origins else response

    def _cors(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if "*" in state.allowed_origins or origin in state.allowed_origins:
            response.headers["Access-Control-Allow-Origin"] = origin or "*"
            response.headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
        return response

    _register_error_handlers(app, state.limits)

    _add_routes(app, api, state.frontend)
    return app


def _add_routes(app: QuartTrio, api: _Handlers, frontend: bool) -> None:
    app.add_url_rule("/openapi.json", "openapi", api.openapi, methods=["GET"])
    app.add_url_rule("/docs", "docs", api.docs, methods=["GET"])
    app.add_url_rule("/health", "health", api.health, methods=["GET"])
    app.add_url_rule("/ping", "ping", api.ping, methods=["GET", "POST"])  # (SageMaker's health check, as vLLM)
    app.add_url_rule("/invocations", "invocations", api.invocations, methods=["POST"])
    app.add_url_rule("/version", "version", api.version, methods=["GET"])
    app.add_url_rule("/metrics", "metrics", api.metrics, methods=["GET"])
    app.add_url_rule("/v1/models", "models", api.models, methods=["GET"])
    app.add_url_rule("/v1/models/<path:model>", "model", api.model, methods=["GET"])  # (an id may hold a /)
    app.add_url_rule("/tokenize", "tokenize", api.tokenize, methods=["POST"])
    app.add_url_rule("/detokenize", "detokenize", api.detokenize, methods=["POST"])
    app.add_url_rule("/v1/chat/completions", "chat", api.chat_completions, methods=["POST"])
    app.add_url_rule("/v1/completions", "completions", api.completions, methods=["POST"])
    app.add_url_rule("/v1/responses", "responses", api.responses_create, methods=["POST"])
    app.add_url_rule("/v1/responses/<response_id>", "response", api.responses_get, methods=["GET"])
    app.add_url_rule("/v1/responses/<response_id>", "response_delete", api.responses_delete, methods=["DELETE"])
    app.add_url_rule("/v1/responses/<response_id>/cancel", "response_cancel", api.responses_cancel, methods=["POST"])
    app.add_url_rule("/v1/responses/<response_id>/input_items", "response_input_items", api.responses_input_items,
                     methods=["GET"])
    app.add_url_rule("/v1/engine/stats", "engine_stats", api.engine_stats, methods=["GET"])
    if frontend:
        app.add_url_rule("/", "page", api.page, methods=["GET"])
        app.add_url_rule("/static/<name>", "page_file", api.page_file, methods=["GET"])


def _register_error_handlers(app: QuartTrio, limits: Limits) -> None:
    """Every error leaves as OpenAI's error JSON; a 500 says nothing more than that (the log has the rest)."""

    @app.errorhandler(APIError)
    async def api_error(error: APIError) -> Response:
        response = json_response(error.body(), error.status)
        if error.retry_after is not None:
            response.headers["Retry-After"] = str(math.ceil(error.retry_after))
        return response

    @app.errorhandler(InvalidParameterError)
    async def invalid(error: InvalidParameterError) -> Response:
        return await api_error(APIError(400, str(error), error.param))

    @app.errorhandler(EngineDeadError)
    @app.errorhandler(EngineOverloadedError)
    @app.errorhandler(RequestFailedError)
    async def engine_error(error: Exception) -> Response:
        return await api_error(engine_api_error(error))

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        messages = {404: f"route {request.path} not found", 405: f"method {request.method} not allowed for {request.path}",
                    408: f"the request body did not arrive within {limits.body_timeout:g} s",
                    413: f"request body larger than {limits.max_body_bytes} bytes"}
        # 408/413 leave the body unread: the after_request hook closes the connection.
        return await api_error(APIError(error.code or 500, messages.get(error.code, error.description or "error")))

    @app.errorhandler(Exception)
    async def internal(error: Exception) -> Response:
        log.error("unhandled error in %s %s", request.method, request.path, exc_info=error)
        return await api_error(APIError(500, "internal server error", type="server_error"))


def engine_api_error(error: Exception) -> APIError:
    """The client's view of an engine-side failure (for a response, or a stream's error event)."""
    if isinstance(error, EngineOverloadedError):
        return APIError(503, str(error), type="service_unavailable_error", code="overloaded",
                        retry_after=error.retry_after)
    if isinstance(error, EngineShutdownError):
        return APIError(503, "the server is shutting down", code="shutting_down")
    if isinstance(error, EngineDeadError):
        log.error("a request ended with the engine: %s", error)
        return APIError(500, "the engine failed while serving this request", type="server_error", code="engine_dead")
    log.error("a request failed in the engine: %s", error)
    return REQUEST_FAILED


# Paths that need the API key (when one is set). /health, /metrics, /version and the API
# description stay open, as in vLLM: probes and scrapers carry no key.
_AUTHENTICATED = ("/v1/", "/tokenize", "/detokenize", "/invocations")  # (what generates or reads the model)
_EMPTY_STATS = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
# One request failed inside the engine (the engine goes on); the log has the details.
REQUEST_FAILED = APIError(500, "the request failed inside the engine", type="server_error", code="request_failed")


class _Handlers:
    def __init__(self, state: ServerState, metrics: Metrics) -> None:
        self.state = state
        self.metrics_registry = metrics
        self._openapi = openapi_document(VERSION)
        self._page = load_static() if state.frontend else {}
        self._throughput = Throughput()
        self._vocab_bytes: tuple[bytes, ...] | None = None  # each token's bytes, read at the first need
        self._vocab_bytes_lock = trio.Lock()

    # ---- helpers ----

    @property
    def client(self) -> EngineClient:
        client = self.state.client
        if client is None:
            raise APIError(503, "the model is still loading", code="model_loading")
        if client.errored:
            raise APIError(503, "the engine has failed; restart the server", code="engine_dead")
        if self.state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return client

    async def vocab_bytes(self) -> tuple[bytes, ...]:
        """Each token id's bytes (chat logprobs' ``bytes``), read from the vocabulary once, in a
        thread (~0.5 s), by the first request that asks."""
        async with self._vocab_bytes_lock:
            if self._vocab_bytes is None:
                self._vocab_bytes = await trio.to_thread.run_sync(token_bytes, self.client.tokenizer)
        return self._vocab_bytes

    async def body(self, cls: type) -> Any:
        raw = await request.get_data()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}") from None
        if _nested_deeper_than(data, self.state.limits.max_json_depth):
            raise bad_request(f"the body's JSON is nested deeper than {self.state.limits.max_json_depth} levels")
        return parse(data, cls)

    def deadline(self) -> float | None:
        """When this request must be done (trio time), from X-Request-Timeout or the server's default."""
        header = request.headers.get("X-Request-Timeout")
        timeout = self.state.limits.request_timeout
        if header is not None:
            try:
                timeout = float(header)
            except ValueError:
                timeout = math.nan
            if not 0 < timeout < math.inf:
                raise bad_request(f"X-Request-Timeout must be a positive number of seconds; got {header!r}",
                                  "X-Request-Timeout")
        return None if timeout is None else trio.current_time() + timeout

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.model_name and model not in self.state.other_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model", code="model_not_found")

    def check_prompts(self, num_prompts: int, n: int) -> None:
        """Refuse a request of too many prompts, or of more sequences than the waiting queue
        has room for, before any work is done on it (the engine checks again as it queues)."""
        limit = self.state.limits.max_prompts_per_request
        if num_prompts > limit:
            raise bad_request(f"the prompt holds {num_prompts} prompts; this server takes at most {limit} in one "
                              f"request (--max-prompts-per-request)", "prompt")
        self.client.check_room(num_prompts * n, "n" if n > 1 else "prompt")

    def validate(self, prompt_ids: list[int], params, priority: int = 0) -> None:
        self.client.validate(prompt_ids, params, priority)

    # ---- simple routes ----

    async def health(self) -> Response:
        if self.state.client is None or self.state.client.errored or self.state.draining:
            return Response("", status=503)
        return Response("", status=200)

    async def ping(self) -> Response:
        await request.get_data()  # (a POST's body, read as every POST's is)
        return await self.health()

    async def invocations(self) -> Response:
        """SageMaker's inference route, as vLLM's: a chat completion where the body holds
        ``messages``, a completion where it holds ``prompt``."""
        try:
            data = orjson.loads(await request.get_data())
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}") from None
        if isinstance(data, dict) and "messages" in data:
            return await self.chat_completions()
        if isinstance(data, dict) and "prompt" in data:
            return await self.completions()
        raise bad_request("an /invocations body holds messages (a chat completion) or a prompt (a completion)")

    async def openapi(self) -> Response:
        return json_response(self._openapi)

    async def docs(self) -> Response:
        return Response(DOCS_HTML, content_type="text/html; charset=utf-8")

    async def version(self) -> Response:
        return json_response({"version": VERSION})

    async def metrics(self) -> Response:
        return Response(self.metrics_registry.exposition(), content_type=CONTENT_TYPE)

    async def page(self) -> Response:
        return self._static_file("index.html")

    async def page_file(self, name: str) -> Response:
        return self._static_file(name)

    def _static_file(self, name: str) -> Response:
        file = self._page.get(name)
        if file is None:
            raise APIError(404, f"route {request.path} not found")
        return Response(file.body, content_type=file.content_type, headers={"Cache-Control": "no-cache"})

    async def engine_stats(self) -> Response:
        """The chat page's live panel: counts and rates only, never a request's text."""
        client = self.state.client
        stats = client.engine_stats() if client else [_EMPTY_STATS]
        max_len = client.max_model_len if client else None
        return json_response(engine_stats_json(self.state.model_name, stats, self._throughput, max_len))

    async def models(self) -> Response:
        names = (self.state.model_name, *self.state.other_model_names)
        return json_response({"object": "list", "data": [self._model_card(name) for name in names]})

    async def model(self, model: str) -> Response:
        """OpenAI's retrieve model (``client.models.retrieve``)."""
        self.check_model(model)
        return json_response(self._model_card(model))

    def _model_card(self, name: str) -> dict:
        max_len = self.state.client.max_model_len if self.state.client else None
        return {"id": name, "object": "model", "created": self.state.created, "owned_by": "trio-llm-engine",
                "root": self.state.model_name, "parent": None, "max_model_len": max_len}

    async def tokenize(self) -> Response:
        req = await self.body(TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            plan = plan_tools(req.tools)
            ids = (await self.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                          req.chat_template_kwargs, plan, req.chat_template,
                                          add_special_tokens=bool(req.add_special_tokens),
                                          documents=req.documents)).ids
        else:
            ids = await _off_loop(len(req.prompt), self.client.encode, req.prompt, req.add_special_tokens is not False)
        body = {"count": len(ids), "max_model_len": self.client.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = self.client.tokenizer.convert_ids_to_tokens(ids)
        return json_response(body)

    async def detokenize(self) -> Response:
        req = await self.body(DetokenizeRequest)
        self.check_model(req.model)
        tokenizer = self.client.tokenizer
        vocab = len(tokenizer)

        def decode(tokens: list[int]) -> str:
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
            return tokenizer.decode(tokens)

        # (~4 characters a token: a long list is checked and decoded off the event loop)
        return json_response({"prompt": await _off_loop(4 * len(req.tokens), decode, req.tokens)})

    # ---- chat ----

    async def render_chat(self, messages, add_generation_prompt: bool, continue_final_message: bool,
                          template_kwargs: dict | None, plan: ToolPlan | None, chat_template: str | None = None,
                          truncating: bool = False, *, add_special_tokens: bool = False,
                          documents: list[dict[str, str]] | None = None) -> RenderedChat:
        """The conversation through the chat template (with the server's default template
        arguments under the request's own): the server's, or the request's ``chat_template``
        where the server trusts requests' templates (vLLM's --trust-request-chat-template).
        ``add_special_tokens``: the tokenizer's own (a BOS) on top of what the template writes;
        ``documents``: the template's ``documents`` (as transformers passes them)."""
        if chat_template is not None and not self.state.trust_request_chat_template:
            raise bad_request("a request's chat_template is refused: this server renders chats with its own "
                              "(start it with --trust-request-chat-template to accept requests' templates)",
                              "chat_template")
        template = chat_template if chat_template is not None else self.state.chat_template
        template_kwargs = {**self.state.default_chat_template_kwargs, **(template_kwargs or {})}
        # (the kwargs, the server's defaults too, override the request's two switches)
        add_generation_prompt, continue_final_message, template_kwargs = template_switches(
            template_kwargs, add_generation_prompt, continue_final_message)
        converted = []
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}",
                                  "messages")
            converted.append(self._template_message(m, i))
        size = sum(map(_text_size, converted)) + sum(len(orjson.dumps(d)) for d in documents or ())
        if plan is not None:
            size += sum(len(orjson.dumps(t.parameters)) + len(t.description or "") for t in plan.tools)
        if not truncating:  # (truncate_prompt_tokens: any length may come, its last tokens are kept)
            self.client.check_text_length(size, "messages")
        return await _off_loop(size + len(chat_template or ""), self._apply_template, converted,
                               add_generation_prompt, continue_final_message, template_kwargs, plan, template,
                               "messages" if chat_template is None else "chat_template", add_special_tokens,
                               documents)

    def _apply_template(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                        template_kwargs: dict, plan: ToolPlan | None, template: str | None, param: str,
                        add_special_tokens: bool, documents: list[dict[str, str]] | None) -> RenderedChat:
        tokenizer = self.client.tokenizer
        try:
            messages, tool_kwargs = render_inputs(tokenizer, messages, plan, template)
            text = render_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, chat_template=template,
                                        documents=documents, **{**template_kwargs, **tool_kwargs})
        except InvalidParameterError:
            raise
        except (jinja2.TemplateError, ValueError, TypeError) as exc:  # the caller's messages, kwargs or template
            raise bad_request(f"could not apply the chat template: {exc}", param) from None
        except Exception as exc:  # (a request's own template may raise anything: {{ 1/0 }})
            if param != "chat_template":
                raise
            raise bad_request(f"could not apply the chat template: {type(exc).__name__}: {exc}", param) from None
        continued = messages[-1]["content"] if continue_final_message and messages else None
        return RenderedChat(tokenizer.encode(text, add_special_tokens=add_special_tokens), text, continued)

    def reasoning(self, rendered: RenderedChat, params: SamplingParams, budget: int | None,
                  ) -> tuple[ReasoningPlan | None, SamplingParams]:
        """The request's reasoning (None without a reasoning parser), and ``params`` with its
        constraint moved after the reasoning and its budget in the grammar."""
        parser = self.state.reasoning_parser
        try:
            budget = check_budget(budget)
        except InvalidParameterError as exc:
            raise APIError(400, str(exc), exc.param) from None
        if parser is None:
            if budget is not None:
                raise bad_request("thinking_token_budget needs a reasoning parser (start the server with "
                                  "--reasoning-parser)", "thinking_token_budget")
            return None, params
        opening = parser.opening(rendered.text, rendered.continued)
        tokenizer, skip = self.client.tokenizer, params.skip_special_tokens
        plan = ReasoningPlan(parser, opening, lambda ids: tokenizer.decode(ids, skip_special_tokens=skip))
        return plan, parser.constrain(params, opening, budget)

    async def compile_constraint(self, req, params: SamplingParams, plan: ToolPlan | None = None) -> None:
        """Compile the request's output constraint now (off the event loop, cached), so that a
        bad one is a 400 naming the field it came from, also for a stream not yet begun."""
        if params.structured_outputs is None:
            return
        try:
            await self.client.compile(params)
        except InvalidParameterError as exc:
            source = "tools" if plan is not None and plan.may_call else structured_outputs(req)[1]
            raise APIError(400, f"{source}: {exc}", source) from None

    @staticmethod
    def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
        fields = {key: value for key, value in attrs.asdict(message, recurse=False).items() if value is not None}
        try:
            return template_message(fields, index)
        except InvalidParameterError as exc:
            raise APIError(400, str(exc), "messages", code="unsupported_parameter") from None

    async def chat_completions(self) -> Response:
        deadline = self.deadline()  # from the request's arrival: reading, templating, compiling count
        with _within(deadline):
            return await self._chat_completions(deadline)

    async def _chat_completions(self, deadline: float | None) -> Response:
        req: ChatCompletionRequest = await self.body(ChatCompletionRequest)
        chat = await self.prepare_chat(req)
        ids, params, plan, reasoning = chat.ids, chat.params, chat.plan, chat.reasoning
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        tracker = UsageTracker(len(ids))
        echo = self._chat_echo(req)
        tools = plan is not None and plan.may_call
        vocab_bytes = await self.vocab_bytes() if req.logprobs else ()
        beam = beam_search_params(req, params.max_tokens or self.client.max_model_len - len(ids))
        if beam is not None:
            (final,) = await self._beam_search([ids], [beam], request_id, req.priority, tracker)
        else:
            # queued now: a refusal (503) comes before a stream's status line, not as its first event
            stream = _Before(deadline, await self.client.add_request({"prompt_token_ids": ids}, params,
                                                                     request_id=request_id, priority=req.priority))
            if req.stream:
                return self.sse_response(self._chat_chunks(req, request_id, stream, tracker, echo, plan, reasoning,
                                                           ids, vocab_bytes), stream)
            final = await self._final(stream, tracker)
        choices, splitters = [], []
        for c in final.outputs:
            splitter = OutputSplitter(reasoning, tools, chat.calls_only)
            splitters.append(splitter)
            split = splitter.feed(c.text, c.token_ids, final=True)
            message = {"role": "assistant", "content": echo + split.content, "refusal": None}
            finish_reason = c.finish_reason
            if tools:
                calls = splitter.tools.calls
                message["content"] = message["content"] or (None if calls else "")
                if calls:
                    message["tool_calls"] = calls
                finish_reason = plan.finish_reason(finish_reason, splitter.tools.num_complete)
            if reasoning is not None:
                text = split.reasoning if splitter.has_reasoning and req.include_reasoning else None
                message["reasoning_content"] = message["reasoning"] = text
            choice = {"index": c.index, "message": message, "finish_reason": finish_reason,
                      "logprobs": chat_logprobs(c.logprobs, c.token_ids, req.top_logprobs or 0,
                                                req.return_tokens_as_token_ids, vocab_bytes) if req.logprobs else None,
                      "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        tracker.count_reasoning(splitters)
        body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.state.model_name, "choices": choices, "usage": tracker.usage()}
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return json_response(body)

    async def prepare_chat(self, req: ChatCompletionRequest) -> PreparedChat:
        """A chat request checked, rendered and turned into the engine's parameters, its output
        constraint compiled: what is left is to generate."""
        req.check_supported()
        self.check_model(req.model)
        self.check_prompts(1, req.n)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        if plan is not None and plan.choice == "none" and self.state.exclude_tools_when_tool_choice_none:
            plan = None
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:  # (as vLLM: the template reads it; "none" turns thinking off)
            template_kwargs.setdefault("reasoning_effort", req.reasoning_effort)
            if req.reasoning_effort == "none":
                template_kwargs.setdefault("enable_thinking", False)
        params = sampling_params(req, chat=True, defaults=self.state.client.default_sampling)  # (checked first)
        rendered = await self.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                          template_kwargs, plan, req.chat_template,
                                          self.client.truncates(params.truncate_prompt_tokens),
                                          add_special_tokens=req.add_special_tokens, documents=req.documents)
        try:
            if plan is not None:
                params = plan.constrain(params)
            reasoning, params = self.reasoning(rendered, params, req.thinking_token_budget)
        except InvalidParameterError as exc:  # (the request's constraint, beside calls or after reasoning)
            source = structured_outputs(req)[1]
            if exc.param != "structured_outputs" or source is None:
                raise
            raise APIError(400, f"{source}: {exc}", source) from None
        try:
            ids = self.client.truncate(rendered.ids, params, req.add_special_tokens)
            self.validate(ids, params, req.priority)
        except InvalidParameterError as exc:
            raise in_request_terms(exc, req, chat=True) from None
        await self.compile_constraint(req, params, plan)
        return PreparedChat(ids, params, plan, reasoning)

    @classmethod
    def _chat_echo(cls, req: ChatCompletionRequest) -> str:
        last = req.messages[-1]
        if req.echo and last.role == "assistant":
            return cls._template_message(last, len(req.messages) - 1)["content"]
        return ""

    async def _chat_chunks(self, req, request_id: str, stream, tracker: UsageTracker, echo: str,
                           plan: ToolPlan | None, reasoning: ReasoningPlan | None, prompt_token_ids: list[int],
                           vocab_bytes: Sequence[bytes]):
        chunk = ChunkWriter(request_id, "chat.completion.chunk", self.state.model_name, req.stream_options, tracker)
        tools = plan is not None and plan.may_call
        splitters = [OutputSplitter(reasoning, tools, plan is not None and plan.calls_only) for _ in range(req.n)]
        first = {"prompt_token_ids": prompt_token_ids} if req.return_token_ids else {}
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": echo}, "logprobs": None,
                      "finish_reason": None} for i in range(req.n)], **first)
        async for output in stream:  # (closed with the response)
            tracker.observe(output)
            choices = []
            for c in output.outputs:
                splitter = splitters[c.index]
                split = splitter.feed(c.text, c.token_ids, final=c.finish_reason is not None)
                delta = {}
                if split.reasoning and req.include_reasoning:
                    delta["reasoning_content"] = delta["reasoning"] = split.reasoning
                if split.content:
                    delta["content"] = split.content
                if split.calls:
                    delta["tool_calls"] = [call.as_openai() for call in split.calls]
                finish_reason = c.finish_reason
                if tools:
                    finish_reason = plan.finish_reason(finish_reason, splitter.tools.num_complete)
                choice = {"index": c.index, "delta": delta,
                          "logprobs": chat_logprobs(c.logprobs, c.token_ids, req.top_logprobs or 0,
                                                    req.return_tokens_as_token_ids, vocab_bytes) if req.logprobs else None,
                          "finish_reason": finish_reason}
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                if c.finish_reason:
                    choice["stop_reason"] = c.stop_reason
                elif not delta and choice["logprobs"] is None and not choice.get("token_ids"):
                    continue  # (text held back: a call or a stop string may be starting; vLLM sends nothing)
                choices.append(choice)
            if choices:
                yield chunk(choices)
        if chunk.include_usage:
            tracker.count_reasoning(splitters)
            yield chunk([], tracker.usage())
        yield SSE_DONE

    # ---- responses ----

    async def responses_create(self) -> Response:
        deadline = self.deadline()
        with _within(deadline):
            req: ResponsesRequest = await self.body(ResponsesRequest)
            check_request(req, self.state.responses, self.state.reasoning_parser is not None)
            try:
                return await self._responses_create(req, deadline)
            except APIError as exc:  # a chat field's error, in the Responses API's words
                raise attrs.evolve(exc, message=in_responses_terms(exc.message, exc.param),
                                   param=chat_param(exc.param)) from None
            except InvalidParameterError as exc:
                raise APIError(400, in_responses_terms(str(exc), exc.param), chat_param(exc.param)) from None

    async def _responses_create(self, req: ResponsesRequest, deadline: float | None) -> Response:
        store = self.state.responses
        history = [] if req.previous_response_id is None else \
            store.previous(req.previous_response_id).conversation
        body, conversation = chat_body(req, history)
        chat_req: ChatCompletionRequest = parse(body, ChatCompletionRequest)
        chat = await self.prepare_chat(chat_req)
        response_id = _response_id()
        stored = store is not None and req.store is not False
        builder = ResponseBuilder(response_head(req, response_id, self.state.model_name, stored))
        tracker = UsageTracker(len(chat.ids))
        stream = _Before(deadline, await self.client.add_request({"prompt_token_ids": chat.ids}, chat.params,
                                                                 request_id=response_id, priority=req.priority))
        items = input_item_resources(req.input) if stored else []
        remember = (lambda response: store.put(StoredResponse(response, conversation + output_messages(
            response["output"]), items))) if stored else None
        if req.stream:
            def failed(error: Exception) -> bytes:
                return b"".join(sse_event(event) for event in builder.fail(_stream_error(error)))

            return self.sse_response(self._response_events(chat, stream, tracker, builder, remember), stream,
                                     failed)
        final = await self._final(stream, tracker)
        (c,) = final.outputs
        splitter = OutputSplitter(chat.reasoning, chat.may_call, chat.calls_only)
        builder.feed(splitter.feed(c.text, c.token_ids, final=True))
        tracker.count_reasoning([splitter])
        response, _ = builder.finish(responses_usage(tracker.usage()), c.finish_reason == "length")
        if remember is not None:
            remember(response)
        return json_response(response)

    async def _response_events(self, chat: PreparedChat, stream, tracker: UsageTracker, builder: ResponseBuilder,
                               remember):
        splitter = OutputSplitter(chat.reasoning, chat.may_call, chat.calls_only)
        for event in builder.start():
            yield sse_event(event)
        finish_reason = None
        async for output in stream:  # (closed with the response)
            tracker.observe(output)
            (c,) = output.outputs
            for event in builder.feed(splitter.feed(c.text, c.token_ids, final=c.finish_reason is not None)):
                yield sse_event(event)
            finish_reason = c.finish_reason or finish_reason
        tracker.count_reasoning([splitter])
        response, events = builder.finish(responses_usage(tracker.usage()), finish_reason == "length")
        if remember is not None:
            remember(response)
        for event in events:
            yield sse_event(event)

    def _store(self) -> ResponseStore:
        if self.state.responses is None:
            raise APIError(404, "this server stores no responses (start it with --enable-responses-store)",
                           code="response_not_found")
        return self.state.responses

    async def responses_get(self, response_id: str) -> Response:
        return json_response(self._store().get(response_id).response)

    async def responses_delete(self, response_id: str) -> Response:
        self._store().delete(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def responses_cancel(self, response_id: str) -> Response:
        self._store().get(response_id)  # (a 404 for one it does not know)
        raise bad_request("only background responses can be cancelled, and this server makes none: this one "
                          "has finished", "response_id")

    async def responses_input_items(self, response_id: str) -> Response:
        items = self._store().get(response_id).input_items
        args = request.args
        try:
            limit = int(args.get("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise bad_request(f"limit must be an integer from 1 to 100; got {args.get('limit')!r}", "limit")
        order = args.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc'; got {order!r}", "order")
        return json_response(item_page(items, limit, order, args.get("after")))

    # ---- completions ----

    async def completions(self) -> Response:
        deadline = self.deadline()
        with _within(deadline):
            return await self._completions(deadline)

    async def _completions(self, deadline: float | None) -> Response:
        req: CompletionRequest = await self.body(CompletionRequest)
        req.check_supported()
        self.check_model(req.model)
        prompts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
        self.check_prompts(len(prompts), req.n)  # before tokenizing any of them
        params = sampling_params(req, chat=False, defaults=self.state.client.default_sampling)
        truncating = self.client.truncates(params.truncate_prompt_tokens)
        inputs = [await _off_loop(len(p) if isinstance(p, str) else 0, self.client.prepare, p, truncating,
                                  req.add_special_tokens) for p in prompts]
        if params.truncate_prompt_tokens is not None:  # (an echo shows the prompt the model read)
            inputs = [(None, self.client.truncate(ids, params, req.add_special_tokens and text is not None))
                      for text, ids in inputs]
        # echo with logprobs: the prompt's tokens have logprobs too (OpenAI's legacy completions,
        # vLLM; lm-evaluation-harness scores continuations so); a stream sends them with the echo,
        # in each choice's first chunk
        echo_logprobs = req.echo and req.logprobs is not None
        if echo_logprobs and params.prompt_logprobs is None:  # (as vLLM: the caller's own prompt_logprobs stand)
            params = attrs.evolve(params, prompt_logprobs=req.logprobs)
        for _, ids in inputs:  # every prompt is checked before any is queued
            self.validate(ids, params, req.priority)
        await self.compile_constraint(req, params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        tracker = UsageTracker(sum(len(ids) for _, ids in inputs))
        prompt_texts = [text if text is not None else self.client.tokenizer.decode(ids) for text, ids in inputs]
        beam = beam_search_params(req, params.max_tokens)
        if beam is not None and scoring_only(req):
            raise bad_request("use_beam_search needs max_tokens of 1 or more (an echo of max_tokens 0 generates "
                              "nothing to search)", "max_tokens")
        if beam is not None:
            finals = await self._beam_search([ids for _, ids in inputs], [beam] * len(inputs), request_id,
                                             req.priority, tracker)
        else:
            outputs = _Before(deadline, await self.client.add_requests(
                [{"prompt": text, "prompt_token_ids": ids} for text, ids in inputs], params,
                [f"{request_id}-{i}" for i in range(len(inputs))], req.priority))
            if req.stream:
                return self.sse_response(self._completion_chunks(req, request_id, outputs, tracker, prompt_texts),
                                         outputs)
            finals: list[RequestOutput | None] = [None] * len(inputs)
            async with aclosing(outputs):  # (cancelled, as by a disconnect: its requests abort now)
                async for index, output in outputs:
                    output = _generated_dropped(output) if scoring_only(req) else output
                    tracker.observe(output, index)
                    finals[index] = output
        choices = [self._completion_choice(req, p, final, c, prompt_texts[p] if req.echo else "", echo_logprobs)
                   for p, final in enumerate(finals) for c in final.outputs]
        return json_response({"id": request_id, "object": "text_completion", "created": int(time.time()),
                              "model": self.state.model_name, "choices": choices, "usage": tracker.usage()})

    def _completion_choice(self, req, p: int, final: RequestOutput, c, prefix: str, echo_logprobs: bool) -> dict:
        """Choice ``c`` of prompt ``p`` in a whole (not streamed) completion; ``prefix``: the
        echoed prompt's text."""
        logprobs = None
        as_ids = req.return_tokens_as_token_ids
        if echo_logprobs:
            logprobs = completion_logprobs(final.prompt_logprobs + c.logprobs, final.prompt_token_ids + c.token_ids,
                                           req.logprobs, 0, self.client.tokenizer.decode, as_ids)
        elif req.logprobs is not None:
            logprobs = completion_logprobs(c.logprobs, c.token_ids, req.logprobs, len(prefix), as_ids=as_ids)
        choice = {"index": p * req.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if req.return_token_ids:
            choice |= {"prompt_token_ids": final.prompt_token_ids, "token_ids": c.token_ids}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return choice

    async def _completion_chunks(self, req, request_id: str, outputs, tracker: UsageTracker, prompt_texts):
        chunk = ChunkWriter(request_id, "text_completion", self.state.model_name, req.stream_options, tracker)
        # each choice's next text_offset, counted as the whole response counts it: from the end
        # of the echoed prompt, a token's decoded text at a time
        offsets = {p * req.n + i: len(text) if req.echo else 0 for p, text in enumerate(prompt_texts)
                   for i in range(req.n)}

        unsent = set(offsets) if req.return_token_ids else set()  # (choices whose prompt_token_ids are due)
        unechoed = set(offsets) if req.echo and req.logprobs is not None else set()  # (echoed with their logprobs)
        prompt_logprobs: dict[int, list] = {}  # per prompt: they come once, in its first output
        if req.echo and not unechoed:
            yield chunk([{"index": p * req.n + i, "text": text, "logprobs": None, "finish_reason": None}
                         for p, text in enumerate(prompt_texts) for i in range(req.n)])
        async for p, output in outputs:  # (closed with the response)
            output = _generated_dropped(output) if scoring_only(req) else output
            tracker.observe(output, p)
            if output.prompt_logprobs is not None:
                prompt_logprobs[p] = output.prompt_logprobs
            choices = []
            for c in output.outputs:
                index = p * req.n + c.index
                text, logprobs = c.text, None
                if index in unechoed:
                    unechoed.discard(index)
                    text = prompt_texts[p] + c.text
                    logprobs = completion_logprobs(prompt_logprobs[p] + c.logprobs, output.prompt_token_ids + c.token_ids,
                                                   req.logprobs, 0, self.client.tokenizer.decode,
                                                   req.return_tokens_as_token_ids)
                elif req.logprobs is not None:
                    logprobs = completion_logprobs(c.logprobs, c.token_ids, req.logprobs, offsets[index],
                                                   as_ids=req.return_tokens_as_token_ids)
                if logprobs is not None and c.token_ids:
                    last = c.logprobs[-1][c.token_ids[-1]]
                    offsets[index] = logprobs["text_offset"][-1] + len(last.decoded_token or "")
                choice = {"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.return_token_ids:
                    choice["token_ids"] = c.token_ids
                    if index in unsent:
                        unsent.discard(index)
                        choice["prompt_token_ids"] = output.prompt_token_ids
                choices.append(choice)
            yield chunk(choices)
        if chunk.include_usage:
            yield chunk([], tracker.usage())
        yield SSE_DONE

    # ---- shared ----

    async def _beam_search(self, prompts: list[list[int]], params: list[BeamSearchParams], request_id: str,
                           priority: int, tracker: UsageTracker) -> list[RequestOutput]:
        """Each prompt's beams (``use_beam_search``), the searches side by side in waiting room
        held for all their beams (all or none, as ``n`` without beam search); an exit (an error,
        a deadline, a disconnect) aborts what they have queued."""
        finals: list[RequestOutput | None] = [None] * len(prompts)

        async def search(i: int) -> None:
            finals[i] = await self.client.beam_search({"prompt_token_ids": prompts[i]}, params[i],
                                                      f"{request_id}-{i}", priority, admitted=True)
            tracker.observe(finals[i], i)

        with self.client.reserve(sum(p.beam_width for p in params), "n"), ungrouped():
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(search, i)
        return finals

    @staticmethod
    async def _final(stream, tracker: UsageTracker) -> RequestOutput:
        final = None
        async with aclosing(stream):  # (as above)
            async for output in stream:
                tracker.observe(output)
                final = output
        return final

    @staticmethod
    def sse_response(chunks, closes, error_event=None) -> Response:
        """An event stream of ``chunks``, made of the queued requests ``closes``, which are closed
        with it however it ends (their requests abort now, even before the chunks first read
        them, not when the garbage collector finds them); a failure once it has begun ends it
        with ``error_event(error)`` (a chat-shaped error and [DONE] by default)."""
        response = Response(_guard(chunks, closes, error_event), content_type="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.timeout = None  # a long generation is not a stalled response
        return response


@attrs.frozen
class PreparedChat:
    """A chat request ready to generate: prompt ids, engine parameters, tools and reasoning."""

    ids: list[int]
    params: SamplingParams
    plan: ToolPlan | None
    reasoning: ReasoningPlan | None

    @property
    def may_call(self) -> bool:
        return self.plan is not None and self.plan.may_call

    @property
    def calls_only(self) -> bool:
        return self.plan is not None and self.plan.calls_only


@attrs.frozen
class RenderedChat:
    """A conversation through the chat template: its token ids and the text they encode."""

    ids: list[int]
    text: str
    continued: str | None = None  # the assistant message the output continues (continue_final_message)


async def _guard(events, closes, error_event=None):
    """A response's SSE events; whatever fails once the status line has been sent (the engine,
    the request, its deadline, a rejection from the engine core, a bug), the stream ends with
    an error event (and [DONE]) rather than a cut connection."""
    try:  # (both closed now, not at garbage collection: their requests abort)
        async with aclosing(closes), aclosing(events):
            async for event in events:
                yield event
    except Exception as error:
        yield error_event(error) if error_event is not None else sse(_stream_error(error).body()) + SSE_DONE


def _stream_error(error: Exception) -> APIError:
    """The error event for a failure in the middle of a stream: what its response would have been."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidParameterError):
        return APIError(400, str(error), error.param)
    if isinstance(error, (EngineDeadError, EngineOverloadedError, RequestFailedError)):
        return engine_api_error(error)
    log.error("a stream failed after its headers were sent", exc_info=error)
    return APIError(500, "internal server error", type="server_error")


def _response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


# Text longer than this (characters) is tokenized or templated in a worker thread: 16k
# characters take ~7 ms to tokenize, and a whole 8 MB body several seconds.
_OFF_LOOP_CHARS = 16_384


def _generated_dropped(output: RequestOutput) -> RequestOutput:
    """``output`` without the tokens generated (``scoring_only``: the one the engine made),
    ended by its length (0 tokens) whatever ended the dropped one."""
    return attrs.evolve(output, outputs=[
        attrs.evolve(c, text="", token_ids=[], cumulative_logprob=None if c.logprobs is None else 0.0,
                     logprobs=None if c.logprobs is None else [],
                     finish_reason=None if c.finish_reason is None else "length", stop_reason=None)
        for c in output.outputs])


def _text_size(message: dict[str, Any]) -> int:
    """The characters of every string in a message: what its template may render of it (the
    content, and tool calls' arguments, reasoning, names), so none passes the size check unseen."""
    size, todo = 0, [message]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            size += len(value)
        elif isinstance(value, dict):
            todo.extend(value.values())
            todo.extend(value.keys())  # (tool-call arguments given as an object: its keys are text too)
        elif isinstance(value, (list, tuple)):
            todo.extend(value)
    return size


async def _off_loop(num_chars: int, fn, *args):
    """``fn(*args)``, in a worker thread when the text it works on could stall the event loop
    (abandoned if the request is cancelled: ``fn`` only computes)."""
    if num_chars < _OFF_LOOP_CHARS:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


def _deadline_passed() -> APIError:
    return APIError(504, "the request did not finish before its deadline (its X-Request-Timeout, or the "
                         "server's --request-timeout)", code="request_timeout")


@contextmanager
def _within(deadline: float | None) -> Iterator[None]:
    """Work on a request that must end by ``deadline`` (trio time): past it, a 504."""
    if deadline is None:
        yield
        return
    with trio.move_on_at(deadline) as scope:
        yield
    if scope.cancelled_caught:
        raise _deadline_passed()


class _Before:
    """The items of ``stream`` until ``deadline`` (trio time). Past it the stream is closed,
    which aborts its requests, and a 504 is raised. Closing this closes ``stream``, whether or
    not it was read (queued requests abort even if their response never began)."""

    def __init__(self, deadline: float | None, stream) -> None:
        self._deadline = deadline
        self._stream = stream

    def __aiter__(self) -> _Before:
        return self

    async def __anext__(self):
        if self._deadline is None:
            return await self._stream.__anext__()
        with trio.move_on_at(self._deadline):
            return await self._stream.__anext__()
        await self.aclose()
        raise _deadline_passed()

    async def aclose(self) -> None:
        await self._stream.aclose()


def _nested_deeper_than(data: Any, limit: int) -> bool:
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False
