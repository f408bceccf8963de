"""The synchronous engine core: validate and add requests, step the model, report deltas.

No trio here: the core actor (``actor()``; and the offline ``LLM``) drive it. A step is three parts so
that the actor can run only the middle one on the device thread (device_thread.py):
``schedule()`` -> ``execute(plan)`` (device work) -> ``update(plan, result)``.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from backends import get_backend
from backends.kv_cache import KVCacheDtype, resolve_kv_cache_dtype
from engine.config import (
    DEFAULT_CPU_KV_CACHE_TOKENS,
    EngineConfig,
    default_gpu_kv_cache_memory,
    resolve_device,
    resolve_dtype,
)
from engine.core.core_actor import CoreActor
from engine.core.device_thread import DeviceThread
from engine.core.tensor_parallel import TensorParallelDriver, ranks_per_node, shared_settings
from engine.errors import ConfigError, InvalidParameterError
from engine.messages import Decodes, EngineStats, KVCacheInfo, TokenDelta
from engine.models.llama import LlamaModel, fix_summation_order
from engine.models.loader import load_model, read_config, resolve_model
from engine.models.parallel import TensorParallel, check_sizes
from engine.plan import RunnerOutput, StepPlan
from engine.runner.drafter import Drafter
from engine.runner.model_runner import ModelRunner, kv_groups
from engine.sampling_params import MIN_SEED, SamplingParams, is_int64
from engine.sched.kv_cache import BlockManager
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler, SchedulerOutput
from engine.structured_outputs import CompiledGrammar, GrammarBitmask

if TYPE_CHECKING:
    import trio

log = logging.getLogger(__name__)


class GrammarRefusedError(Exception):
    """A sampled token that the request's grammar does not allow (the mask should make this
    impossible; if it happens, that request fails and the rest go on)."""


class EngineCore:
    """Owns the model runner, the block manager and the scheduler.

    Args:
        config: the engine configuration.
        model: an already-built model to use instead of loading ``config.model`` (tests).
    """

    def __init__(self, config: EngineConfig, model: LlamaModel | None = None) -> None:
        self.config = config
        self.device = resolve_device(config)
        self.backend = get_backend(config.backend, self.device)  # before loading: a wrong choice fails fast
        dtype = model.dtype if model is not None else resolve_dtype(config, self.device)
        if dtype not in self.backend.model_dtypes:  # (before loading, not at the first request)
            raise ConfigError("dtype", f"the {self.backend.name} backend cannot run a model in {dtype} (it runs "
                                       f"{', '.join(str(d) for d in self.backend.model_dtypes)})")
        self.kv_dtype = self._kv_cache_dtype(dtype)
        source = resolve_model(config.model, allow_missing_default=config.load_format == "dummy")
        # Weights, KV cache and forward passes all on one thread (device_thread.py says why).
        self.device_thread = DeviceThread.shared()
        if model is not None and config.tensor_parallel_size > 1:
            raise ConfigError("tensor_parallel_size", "a model handed in runs on one rank only")
        self.tensor_parallel: TensorParallelDriver | None = None  # (the other ranks: they load beside this one)
        tp = TensorParallel(0, config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        if tp is not None:  # (sizes that do not divide the model are refused before any rank starts)
            try:
                check_sizes(read_config(source), tp.size)
            except ValueError as exc:
                raise ConfigError("tensor_parallel_size", str(exc)) from None
            self.tensor_parallel = TensorParallelDriver(config, self.device,
                                                        shared_settings(config, dtype, self.kv_dtype.name))
        try:
            self._set_up(model, source, dtype, tp)
        except BaseException:
            self.close()  # (the other ranks, started beside this one's loading)
            raise

    def _set_up(self, model: LlamaModel | None, source, dtype, tp: TensorParallel | None) -> None:
        """The model (this rank's shard), the KV cache, the scheduler and the runner."""
        config = self.config
        self.model = model or self.device_thread.run_sync(
            load_model, source, config.load_format, dtype, self.device, config.seed,
            config.quantization, config.activations, tp)
        if config.batch_invariant:
            self._fix_summation_order()
        else:  # (a model handed in may have been fixed by an earlier engine)
            self.model.fix_summation_order(False)
        self.vocab_size = self.model.config.vocab_size
        self.draft_model = self._load_draft_model(dtype)
        if config.generation_config == "auto" and self.model.config.sampling_defaults:
            log.info("default sampling values from the model's generation_config.json: %s "
                     "(--generation-config vllm ignores them)", dict(self.model.config.sampling_defaults))
        self.eos_token_id = self.model.config.eos_token_id
        # max_num_batched_tokens, where not given: with chunked prefill off, it takes the longest prompt,
        # of the models' context until the cache has capped max_model_len, then of that
        given = config
        self.config = config = attrs.evolve(config, max_num_batched_tokens=given.batch_tokens(self._longest()))
        self.kv_groups = kv_groups(self.model, not config.disable_hybrid_kv_cache_manager)
        num_blocks = self._num_kv_blocks()
        if num_blocks < self.kv_groups.num_groups:
            raise ConfigError("num_kv_blocks", f"{num_blocks} KV blocks cannot hold a token: this model's layers are "
                                               f"in {self.kv_groups.num_groups} groups, a block each per place "
                                               "(raise num_kv_blocks or kv_cache_memory)")
        held = self.kv_groups.most_held(config.max_num_batched_tokens, config.block_size)
        self.max_model_len = self._max_model_len(self.kv_groups.longest(num_blocks, config.block_size, held))
        self.config = config = attrs.evolve(config, max_num_batched_tokens=given.batch_tokens(self.max_model_len))
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.kv_groups.windows)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.runner = self._start_runner(num_blocks)
        self._bitmask = GrammarBitmask(config.max_num_seqs)
        self._arrivals = itertools.count()
        self._children: dict[str, list[str]] = {}  # caller's request id -> its sequences' ids
        self._num_prompt_tokens = 0
        self._num_request_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._generation_debt = 0  # tokens counted past stop strings, taken off as later steps count theirs
        self._num_steps = 0
        self.fault: Exception | None = None  # set when a step failed: the core's state is then unknown
        self.kv_cache_info = self._describe_kv_cache(num_blocks)
        self._log_ready()

    # ---- set-up ----

    def _describe_kv_cache(self, num_blocks: int) -> KVCacheInfo:
        """What the KV cache is (``/metrics``' cache_config_info, the start-up line)."""
        cfg, windows = self.model.config, self.kv_groups.windows
        return KVCacheInfo(self.config.block_size, num_blocks, self.kv_dtype.name,
                           self.kv_dtype.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim),
                           self.config.enable_prefix_caching, max((w for w in windows if w is not None), default=None))

    def _log_ready(self) -> None:
        """The start-up lines: backend, device, dtype, context, and the KV cache's type and size."""
        config, groups, cache = self.config, self.kv_groups, self.kv_cache_info
        tokens = cache.num_blocks // groups.num_groups * cache.block_size  # (of short sequences: every layer)
        log.info("engine ready: backend %s on %s, %s, max_model_len %d; KV cache %s%s: %d blocks of %d tokens "
                 "(%d tokens), %.1f MB (%d bytes per token)",
                 self.backend.name, self.device, self.model.dtype, self.max_model_len, cache.cache_dtype,
                 " (auto on this backend)" if config.kv_cache_dtype == "auto" else "", cache.num_blocks,
                 cache.block_size, tokens, cache.num_blocks * ModelRunner.kv_bytes_per_block(
                     self.model, cache.block_size, self.kv_dtype, groups.hybrid) / 1e6, cache.bytes_per_token)
        if groups.hybrid:
            log.info("KV layer groups: %d global and %d sliding (window %d) of %d layers each, a block table each; "
                     "a sequence past its window holds only the window's blocks in the sliding groups "
                     "(--disable-hybrid-kv-cache-manager: one table)", sum(w is None for w in groups.windows),
                     sum(w is not None for w in groups.windows), max(w or 0 for w in groups.windows), groups.size)

    def _start_runner(self, num_blocks: int) -> ModelRunner:
        """The model runner on the device thread, with a draft model's drafter where there is one,
        after the other tensor-parallel ranks (if any) have joined with their shards."""
        config = self.config
        drafter, window = None, self.kv_groups.windows[0]
        if self.draft_model is not None:
            draft = self.draft_model.config
            if window is not None and any((draft.window(i) or math.inf) > window for i in range(draft.num_layers)):
                log.info("the draft model attends within the model's sliding window (%d tokens): the model's "
                         "blocks past it are given back", window)
            drafter = self.device_thread.run_sync(Drafter, self.draft_model, self.backend, num_blocks,
                                                  config.block_size, self.device, self.kv_dtype,
                                                  config.speculative.num_speculative_tokens, config.max_num_seqs,
                                                  config.max_num_batched_tokens,  # (max_catch_up)
                                                  window)  # (of the table it lies over)
        if self.tensor_parallel is not None:
            self.device_thread.run_sync(self.tensor_parallel.join, num_blocks)
        return self.device_thread.run_sync(ModelRunner, self.model, self.backend, num_blocks, config.block_size,
                                           self.device, config.sampling_seed, self.kv_dtype, config.calculate_kv_scales,
                                           drafter, not config.disable_hybrid_kv_cache_manager)

    def _load_draft_model(self, dtype) -> LlamaModel | None:
        """The draft model of speculative method ``draft_model`` (None for other methods): loaded
        as the target is, and refused unless it shares the target's vocabulary."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return None
        try:
            source = resolve_model(spec.model)
        except ConfigError as exc:
            raise ConfigError("speculative_config", f"speculative_config: the draft model: {exc}") from None
        draft = self.device_thread.run_sync(load_model, source, "auto", dtype, self.device, self.config.seed,
                                            self.config.quantization)
        if draft.config.vocab_size != self.model.config.vocab_size:
            raise ConfigError("speculative_config",
                              f"speculative_config: the draft model {source.name} has a vocabulary of "
                              f"{draft.config.vocab_size} tokens, the model {self.model.config.vocab_size}: a draft "
                              "model must use the model's tokenizer")
        log.info("speculative decoding: %d tokens proposed by the draft model %s (%d layers, hidden size %d)",
                 spec.num_speculative_tokens, source.name, draft.config.num_layers, draft.config.hidden_size)
        return draft

    def _fix_summation_order(self) -> None:
        """``--batch-invariant``: the model's products and the backend's attention in an order set
        by each row alone, where the backend has one; where it has not, the start-up log says so."""
        if not fix_summation_order(self.model, self.backend, self.device):
            log.warning("batch invariance is not available on the %s backend on %s (the cpu and torch backends "
                        "have it, on CPU): a request's results may differ in their last bits with what else runs",
                        self.backend.name, self.device)
            return
        log.info("batch invariant: each request's tokens and logprobs are the same bits whatever else runs "
                 "(products in row tiles, attention unsplit)")

    def _kv_cache_dtype(self, model_dtype) -> KVCacheDtype:
        try:
            return resolve_kv_cache_dtype(self.config.kv_cache_dtype, self.backend, model_dtype)
        except ValueError as exc:
            raise ConfigError("kv_cache_dtype", str(exc)) from None

    def _num_kv_blocks(self) -> int:
        config = self.config
        per_block = ModelRunner.kv_bytes_per_block(self.model, config.block_size, self.kv_dtype,
                                                   not config.disable_hybrid_kv_cache_manager)
        if self.draft_model is not None:  # (its cache has as many blocks, a tensor per layer)
            per_block += ModelRunner.kv_bytes_per_block(self.draft_model, config.block_size, self.kv_dtype, False)
        if (blocks := config.num_kv_blocks) is not None:
            self._within_the_device("num_kv_blocks", f"num_kv_blocks {blocks} ({blocks * per_block} bytes)",
                                    blocks * per_block)
            return blocks
        memory = config.kv_cache_memory
        if memory is None and self.device == "cpu":
            # What max_num_seqs full-length sequences can use, at most the default context, and
            # at least one sequence of an explicit max_model_len.
            longest = config.max_model_len or self.model.config.exact_context_length
            tokens = max(min(DEFAULT_CPU_KV_CACHE_TOKENS, longest * config.max_num_seqs), config.max_model_len or 0)
            return -(-tokens // config.block_size) * self.kv_groups.num_groups  # (a block per group and place)
        if memory is not None:
            field, why = "kv_cache_memory", f"kv_cache_memory {memory} bytes holds no KV block"
        else:
            memory = default_gpu_kv_cache_memory(config.gpu_memory_utilization)
            field, why = "gpu_memory_utilization", (f"gpu_memory_utilization {config.gpu_memory_utilization} leaves "
                                                    f"{memory} bytes, which hold no KV block (raise it, or free GPU "
                                                    "memory)")
        num_blocks = memory // per_block
        if num_blocks < 1:
            raise ConfigError(field, why)
        self._within_the_device(field, f"{field} {memory} bytes", memory)
        return num_blocks

    def _within_the_device(self, field: str, asked: str, num_bytes: int) -> None:
        """Refuse a cache of more bytes than the device has free (a petabyte's block lists were
        built until the machine ran out; a cache of all its memory would be zeroed into swap or
        the OOM killer)."""
        ranks = ranks_per_node(self.config) if self.device == "cpu" else 1  # (this machine's ranks share its memory)
        if num_bytes * ranks > (free := device_free_memory(self.device)):
            each = f" for each of this machine's {ranks} tensor-parallel ranks" if ranks > 1 else ""
            raise ConfigError(field, f"{asked}{each} is more than this {self.device} has free ({free} bytes)")

    def _max_model_len(self, kv_capacity: int | None) -> int:
        """The longest sequence: asked for, or the model's, within what the cache holds of a
        sequence (``kv_capacity`` tokens; None: any length, with a model-wide sliding window)."""
        model_config = self.model.config
        model_max = model_config.exact_context_length
        wanted = self.config.max_model_len
        if wanted is not None and wanted > model_max:
            why = ("" if model_max == model_config.max_position_embeddings else
                   " as this engine runs it (its length-dependent rotary scaling is not followed past that)")
            raise ConfigError("max_model_len", f"max_model_len {wanted} exceeds the model's context length "
                                               f"{model_max}{why}")
        if model_max < model_config.max_position_embeddings:
            log.warning("max_model_len at most %d, not the model's %d: past that length transformers changes "
                        "what it computes (dynamic or longrope scaling) and this engine does not follow",
                        model_max, model_config.max_position_embeddings)
        draft_max = None if self.draft_model is None else self.draft_model.config.exact_context_length
        if draft_max is not None and draft_max < model_max:  # (the draft computes every position too)
            if wanted is not None and wanted > draft_max:
                raise ConfigError("max_model_len", f"max_model_len {wanted} exceeds the draft model's context length "
                                                   f"{draft_max} (speculative_config)")
            log.warning("max_model_len at most %d: the draft model's context length", draft_max)
            model_max = draft_max
        if kv_capacity is None:
            kv_capacity = model_max  # (a window's worth fits: any length does)
        if wanted is not None and wanted > kv_capacity:
            raise ConfigError("max_model_len", f"max_model_len {wanted} does not fit in the KV cache "
                                               f"({kv_capacity} tokens); raise num_kv_blocks or kv_cache_memory")
        if wanted is None and model_max > kv_capacity:
            log.warning("max_model_len capped at the KV cache capacity, %d tokens", kv_capacity)
        resolved = wanted or min(model_max, kv_capacity)
        if not self.config.enable_chunked_prefill:
            self.config.check_unchunked_batch(self.config.max_num_batched_tokens, resolved)
        return resolved

    def _longest(self) -> int:
        """The longest sequence asked for, or that the models allow."""
        longest = [self.config.max_model_len or self.model.config.exact_context_length]
        if self.draft_model is not None:
            longest.append(self.draft_model.config.exact_context_length)
        return min(longest)

    # ---- requests ----

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    priority: int = 0, grammar: CompiledGrammar | None = None) -> None:
        """Queue a request (``params.n`` sequences).

        ``grammar`` is ``params.structured_outputs`` compiled (``StructuredOutputManager``);
        each sequence gets its own matcher of it.

        Raises:
            InvalidParameterError: an empty prompt, token ids outside the vocabulary, a prompt
                plus ``max_tokens`` longer than ``max_model_len``, a request id in use, or
                structured outputs without their compiled grammar.
        """
        if request_id in self._children:
            raise InvalidParameterError("request_id", f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        extra_eos = [t for t in self.model.config.extra_eos_token_ids if t not in params.stop_token_ids]
        if extra_eos and not params.ignore_eos:
            # The model's other end tokens stop the request as vLLM does: as stop tokens
            # (the response's stop_reason names the one that ended it).
            params = attrs.evolve(params, stop_token_ids=[*params.stop_token_ids, *extra_eos])
        max_tokens = self.validate(prompt, params, priority)
        if (params.structured_outputs is None) != (grammar is None):
            raise InvalidParameterError("structured_outputs", "structured outputs need their compiled grammar "
                                                              "(and a grammar needs structured outputs)")
        stops = self.eos_token_ids if grammar is not None else ()
        arrival = next(self._arrivals)
        children = [Request(child_id(request_id, index), prompt, _child_params(params, index), max_tokens,
                            self.eos_token_id, arrival, priority=priority, parent_id=request_id, index=index,
                            matcher=None if grammar is None else grammar.matcher(stops))
                    for index in range(params.n)]
        for child in children:
            self.scheduler.add_request(child)
        self._children[request_id] = [c.request_id for c in children]

    def validate(self, prompt: list[int], params: SamplingParams, priority: int = 0) -> int:
        """Check a prompt and its parameters against the model; return the resolved max_tokens."""
        return validate_request(prompt, params, priority, max_model_len=self.max_model_len,
                                vocab_size=self.vocab_size, scheduling_policy=self.config.scheduling_policy,
                                eos_token_ids=self.eos_token_ids)

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's end tokens: its EOS, then generation_config's others."""
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        return eos + tuple(t for t in self.model.config.extra_eos_token_ids if t != self.eos_token_id)

    @property
    def sampling_defaults(self) -> dict[str, int | float]:
        """The sampling values a request gets where it sets none (``--generation-config auto``:
        the model's generation_config.json; ``vllm``: none)."""
        return dict(self.model.config.sampling_defaults) if self.config.generation_config == "auto" else {}

    def abort_requests(self, request_ids: Sequence[str]) -> list[TokenDelta]:
        """Abort requests (by the caller's ids); unknown or finished ids are ignored."""
        child_ids = [c for r in request_ids for c in self._children.get(r, ())]
        return [self._delta(r, ()) for r in self.scheduler.abort_requests(child_ids)]

    @property
    def live_request_ids(self) -> tuple[str, ...]:
        """The caller's ids of every request not yet finished."""
        return tuple(self._children)

    def abort_all(self) -> list[TokenDelta]:
        """Abort every live request (after a fault, or at shutdown)."""
        return self.abort_requests(list(self._children))

    def finish_request(self, request_id: str, index: int, stop_reason: int | str | None,
                       num_tokens: int | None = None) -> TokenDelta | None:
        """End one sequence as stopped (e.g. on a stop string found after detokenization) after
        its first ``num_tokens`` output tokens: those made past them (kept drafts of the step
        that made the stop string, steps run before this call) leave the generation-token
        count, as they leave the output (usage, vllm:request_generation_tokens): out of the
        next steps' counts, as a counter never falls (Prometheus reads a fall as a reset). (A
        sequence the core ended itself, by an end token or its length, before it heard of the
        stop string keeps its count, as vLLM's, which counts each step's tokens before its stop
        check.)"""
        children = self._children.get(request_id, [])
        request = self.scheduler.requests.get(children[index]) if index < len(children) else None
        if request is None:
            return None
        if num_tokens is not None:
            self._generation_debt += max(0, request.num_output_tokens - num_tokens)
        self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED, stop_reason)
        return self._delta(request, ())

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_running_requests(self) -> int:
        """Callers' requests with a sequence in the running batch (n > 1 counts once)."""
        return len({r.parent_id for r in self.scheduler.running})

    # ---- the step ----

    def step(self) -> list[TokenDelta]:
        """One whole step; its deltas, each a ``TokenDelta``."""
        plan = self.schedule()
        deltas, decodes = self.update(plan, self.execute(plan))
        return deltas + decodes.as_deltas()

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def _mask_grammar_rows(self, output: SchedulerOutput) -> StepPlan:
        """The plan with the bitmasks of its constrained rows (rows whose grammar allows every
        token are left out; a row whose matcher raised fails its request after the step, in
        ``update``). On the device thread, where the step runs: filling masks takes time that
        the event loop must not lose, and the runner never sees a grammar, only its mask."""
        plan, errors = output.plan, output.grammar_errors
        matchers = [output.chunks[row].request.matcher for row in output.constrained_rows]
        bitmask = self._bitmask.get(matchers[0].backend, len(matchers))
        rows = []
        for row, matcher in zip(output.constrained_rows, matchers):
            try:
                if matcher.fill_bitmask(bitmask, len(rows)):  # False: everything is allowed
                    rows.append(row)
            except Exception as exc:  # this request's own fault: it fails, the step goes on
                errors[plan.request_ids[row]] = exc
        return attrs.evolve(plan, grammar_rows=tuple(rows), grammar_bitmask=bitmask[:len(rows)].numpy().tobytes())

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """The device work of a step, on the device thread; touches no scheduler state (the
        core actor awaits it with ``device_thread.run`` while its event loop goes on), only
        the constrained rows' matchers, to fill their masks."""
        return self.device_thread.run_sync(self._execute, output)

    def _execute(self, output: SchedulerOutput) -> RunnerOutput:
        plan = self._mask_grammar_rows(output) if output.constrained_rows else output.plan
        if self.tensor_parallel is not None:
            self.tensor_parallel.send(plan)
        return self.runner.execute(plan)

    def check_health(self) -> None:
        """Raise what the next step would (between steps, cheap: no collective).

        Raises:
            EngineDeadError: a tensor-parallel rank is gone.
        """
        if self.tensor_parallel is not None:
            self.tensor_parallel.check()

    def close(self) -> None:
        """End what the core started beside it (tensor-parallel ranks); idempotent."""
        if getattr(self, "tensor_parallel", None) is not None:
            self.tensor_parallel.abandon()  # (a start still waiting for ranks holds the device thread)
            self.device_thread.run_sync(self.tensor_parallel.stop)

    def update(self, plan: SchedulerOutput, result: RunnerOutput) -> tuple[list[TokenDelta], Decodes]:
        """Account for a finished step. Returns what it added to each completion: the common case
        (a next token, no logprobs, not finished) as columns, the rest as ``TokenDelta``s."""
        failed, grammar_finished = result.failed, ()
        if plan.constrained_rows:
            failed = {**failed, **plan.grammar_errors}
            grammar_finished = self._advance_grammars(plan, result.sampled, failed)
        deltas, failed_parents = self._fail_requests(failed)
        accepted = result.accepted
        running = RequestStatus.RUNNING
        counted = self._num_generation_tokens
        # (and a drafted row's kept tokens, below; a failed row's token is dropped: not output)
        self._num_generation_tokens += len(result.sampled) - (sum(
            request.request_id in result.sampled for request, _, _, _ in plan.chunks if request.status is not running)
            if failed else 0)
        self.scheduler.update(plan, result.sampled, grammar_finished, accepted, result.proposals)
        self._num_steps += 1
        sampled, logprobs, prompt_logprobs = result.sampled, result.logprobs, result.prompt_logprobs
        ids, indices, tokens = [], [], []
        plain = not prompt_logprobs and not logprobs  # no row of this step has logprobs to send
        for request, start, num_new, _ in plan.chunks:
            num_prompt = len(request.prompt_token_ids)
            if start < num_prompt:
                self._num_prompt_tokens += min(start + num_new, num_prompt) - start
            if failed_parents and request.parent_id in failed_parents:
                continue
            token = sampled.get(request.request_id)
            drafted = bool(accepted) and request.request_id in accepted  # (it appended token_ids[start + 1:])
            if token is not None and start < num_prompt:  # (a decoding row skips this at the first test)
                known_before = start + 1 if drafted else len(request.token_ids) - 1
                if known_before == num_prompt < len(request.token_ids):
                    self._num_request_prompt_tokens += num_prompt  # (its first token: once a sequence, as vLLM)
            if drafted:
                deltas.append(self._drafted_delta(request, start, logprobs.get(request.request_id),
                                                  result.accepted_logprobs.get(request.request_id, ())))
                continue
            if (token is not None and request.status is running
                    and (plain or (not prompt_logprobs and request.request_id not in logprobs))
                    and len(request.token_ids) > num_prompt + 1):  # not its first token
                ids.append(request.parent_id)
                indices.append(request.index)
                tokens.append(token)
                continue
            prompt_lps = prompt_logprobs.get(request.request_id, ()) if prompt_logprobs else ()
            request.num_prompt_logprobs += len(prompt_lps)
            if token is None and not prompt_lps and not request.finished:
                continue
            new_lp = logprobs.get(request.request_id) if logprobs else None
            deltas.append(self._delta(request, () if token is None else (token,),
                                      () if new_lp is None else (new_lp,), tuple(prompt_lps)))
        if self._generation_debt:  # (tokens past stop strings: out of this step's count, never below the last)
            paid = min(self._generation_debt, self._num_generation_tokens - counted)
            self._num_generation_tokens -= paid
            self._generation_debt -= paid
        return deltas, Decodes(tuple(ids), tuple(indices), tuple(tokens))

    def _drafted_delta(self, request: Request, start: int, last_logprobs, kept_logprobs) -> TokenDelta:
        """The tokens a drafted step appended (the kept drafts and the sampled token, up to
        one that stopped the request) and, where asked, their logprobs."""
        new_tokens = tuple(request.token_ids[start + 1:])  # (none: it ended while the step ran)
        self._num_generation_tokens += max(len(new_tokens) - 1, 0)
        new_logprobs = (*kept_logprobs, last_logprobs) if last_logprobs is not None else ()
        return self._delta(request, new_tokens, new_logprobs[:len(new_tokens)])

    @staticmethod
    def _advance_grammars(output: SchedulerOutput, sampled: dict[str, int], failed: dict[str, Exception]) -> set[str]:
        """Move each constrained sequence's grammar on by its sampled token; the ids of those
        whose grammar is now complete (their stop token is in). A token the grammar refuses
        (the mask should make that impossible) fails its request alone (added to ``failed``),
        as does a matcher that raises."""
        finished = set()
        for row in output.constrained_rows:
            request = output.chunks[row].request
            request_id = request.request_id
            token = sampled.get(request_id)
            if token is None or request_id in failed or request.finished:
                continue
            try:
                if not request.matcher.accept(token):
                    raise GrammarRefusedError(f"token {token} is not allowed by the request's grammar")
                if request.matcher.terminated:
                    finished.add(request_id)
            except Exception as exc:
                failed[request_id] = exc
        return finished

    def _fail_requests(self, errors: dict[str, Exception]) -> tuple[list[TokenDelta], set[str]]:
        """Finish the sequences whose own part of the step raised, as 'error', and abort their
        siblings (the caller sees one request). Returns their deltas and the callers' ids."""
        deltas, parents = [], set()
        for request_id, error in errors.items():
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue
            callers = isinstance(error, InvalidParameterError) and not isinstance(error, ConfigError)
            if callers:  # (the caller's parameters, found wrong only now: a 400, no traceback)
                log.warning("request %s refused in the engine: %s", request.parent_id, error)
            else:
                log.error("request %s failed in the engine (the engine goes on)", request.parent_id, exc_info=error)
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            if callers:
                deltas.append(self._delta(request, (), error=str(error), error_param=error.param))
            else:
                deltas.append(self._delta(request, (), error=f"{type(error).__name__}: {error}"))
            parents.add(request.parent_id)
        for parent_id in parents:
            deltas += self.abort_requests([parent_id])
        return deltas, parents

    def _forget_if_done(self, parent_id: str) -> None:
        if not any(c in self.scheduler.requests for c in self._children.get(parent_id, ())):
            self._children.pop(parent_id, None)

    def _delta(self, request: Request, new_tokens: tuple[int, ...], new_logprobs=(), prompt_logprobs=(),
               error: str | None = None, error_param: str | None = None) -> TokenDelta:
        if request.finished:
            self._forget_if_done(request.parent_id)
        return TokenDelta(request.parent_id, request.index, new_tokens, new_logprobs, prompt_logprobs,
                          request.finish_reason, request.stop_reason, max(request.num_cached_tokens, 0),
                          request.first_scheduled_at, error, error_param)

    def engine_kv_caches(self) -> list[KVCacheInfo]:
        return [self.kv_cache_info]

    def engine_stats(self) -> list[EngineStats]:
        return [self.stats()]

    def actor(self, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel) -> CoreActor:
        """The actor that steps this core in a trio nursery (core_actor.py)."""
        return CoreActor(self, inbox, outbox)

    def stats(self) -> EngineStats:
        kv, spec = self.block_manager, self.scheduler.spec_stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_total=kv.num_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_request_prompt_tokens=self._num_request_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_steps=self._num_steps,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(spec.accepted_per_pos),
        )


def device_free_memory(device: str) -> int:
    """The bytes of memory ``device`` has free now (a CPU: the machine's available memory, as
    Linux reckons it; all of it where /proc/meminfo cannot be read)."""
    if device == "cpu":
        try:
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    return torch.cuda.mem_get_info(device)[0]


def child_id(request_id: str, index: int) -> str:
    """The engine's id of completion ``index`` of the caller's request ``request_id``.

    Always prefixed, also for n == 1: the prefix is digits up to the first '_', so no two
    (request id, index) pairs share a child id, whatever ids callers choose.
    """
    return f"{index}_{request_id}"


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index`` draws from seed + index (wrapping around the seed range), so the n
    completions differ."""
    if params.seed is None or index == 0:
        return params
    return attrs.evolve(params, seed=(params.seed + index - MIN_SEED) % 2**64 + MIN_SEED)


def validate_request(prompt: list[int], params: SamplingParams, priority: int, *, max_model_len: int,
                     vocab_size: int, scheduling_policy: str, eos_token_ids: tuple[int, ...] = ()) -> int:
    """Check a prompt and its parameters against a model's limits; return the resolved max_tokens
    (an engine core and the front of an engine in another process both check with this)."""
    if not prompt:
        raise InvalidParameterError("prompt", "the prompt is empty")
    if not is_int64(priority):
        raise InvalidParameterError("priority", f"priority must be a 64-bit integer; got {priority!r}")
    if priority != 0 and scheduling_policy != "priority":
        raise InvalidParameterError("priority", f"priority {priority!r} needs the 'priority' scheduling policy; "
                                                f"this engine schedules {scheduling_policy}")
    if len(prompt) >= max_model_len:
        raise InvalidParameterError("prompt", f"the prompt has {len(prompt)} tokens, but this model's maximum "
                                              f"context length is {max_model_len} tokens")
    _check_token_ids("prompt", prompt, vocab_size)
    _check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    _check_token_ids("logit_bias", params.logit_bias, vocab_size)
    _check_token_ids("allowed_token_ids", params.allowed_token_ids or (), vocab_size)
    for ids in params.bad_words_token_ids or ():
        _check_token_ids("bad_words", ids, vocab_size)
    if params.allowed_token_ids is not None and params.min_tokens and not params.ignore_eos:
        ends = set(eos_token_ids) | set(params.stop_token_ids) | {ids[0] for ids in params.bad_words_token_ids or ()
                                                                  if len(ids) == 1}
        if set(params.allowed_token_ids) <= ends:
            raise InvalidParameterError("allowed_token_ids", "allowed_token_ids leaves no token to sample before "
                                                             "min_tokens: the end and stop tokens are all it allows")
    room = max_model_len - len(prompt)
    if params.max_tokens is not None and params.max_tokens > room:
        raise InvalidParameterError(
            "max_tokens", f"this model's maximum context length is {max_model_len} tokens, but "
                          f"{len(prompt) + params.max_tokens} were requested ({len(prompt)} in the prompt, "
                          f"{params.max_tokens} for max_tokens)")
    if params.max_tokens is None and params.min_tokens > room:  # (with max_tokens, SamplingParams checks)
        raise InvalidParameterError(
            "min_tokens", f"min_tokens ({params.min_tokens}) is more than the {room} tokens left for output: "
                          f"this model's maximum context length is {max_model_len} tokens, {len(prompt)} in the prompt")
    return params.max_tokens or room


def _check_token_ids(param: str, token_ids, vocab_size: int) -> None:
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidParameterError(param, f"{param} holds {t!r}, which is not a token id (an integer)")
        if not 0 <= t < vocab_size:
            raise InvalidParameterError(param, f"{param} holds token id {t!r}, outside the vocabulary "
                                               f"[0, {vocab_size})")
