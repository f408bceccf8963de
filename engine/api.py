"""The engine's public surface, named as in vLLM: ``LLM``, ``SamplingParams``, ``RequestOutput``,
plus ``open_engine``/``EngineClient`` for trio programs.

``LLM`` is the offline API: give it prompts, get completions back in order. It runs the
same actor graph as ``open_engine``, inside ``trio.run``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import attrs
import trio

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import ConfigError, EngineDeadError, InvalidParameterError, ungrouped
from engine.frontend.async_engine import Engine, EngineClient, encoded, open_engine
from engine.frontend.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.messages import EngineStats, StepOutput
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    sampling_params_or_none,
)
from engine.structured_outputs import StructuredOutputManager
from engine.tokenizer import apply_chat_template, template_switches, text_messages, tokenizer_for
from engine.tools import plan_tools, render_inputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "EngineConfig", "Engine", "EngineClient",
           "EngineDeadError", "EngineStats", "StepOutput", "open_engine"]

log = logging.getLogger(__name__)

# A prompt: text, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [int]}.
PromptType = Union[str, Sequence[int], dict[str, Any]]
Message = dict[str, Any]


class LLM:
    """Offline generation: the same actor graph as the server, run with ``trio.run`` per call.

    Args:
        model: a ``.gguf`` file or Hugging Face directory; None serves the default model.
        **fields: any ``EngineConfig`` field, e.g. ``backend="torch"``, ``num_kv_blocks=64``.

    Raises:
        ConfigError: an unknown or invalid configuration field (naming it); a process layout
            (``engine_process``, ``data_parallel_size``): ``LLM`` runs the engine in this
            process, ``open_engine`` and the server run the others.
    """

    def __init__(self, model: str | None = None, **fields: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **fields)
        for name, value in (("engine_process", self.config.engine_process),
                            ("data_parallel_size", self.config.data_parallel_size > 1),
                            ("data_parallel_size_local", self.config.data_parallel_size_local is not None)):
            if value:
                raise ConfigError(name, f"LLM runs the engine in this process: {name} is for open_engine and the "
                                        "server (python -m engine.api)")
        self.engine = EngineCore(self.config)
        self.tokenizer = tokenizer_for(self.config)
        self.structured_outputs = StructuredOutputManager.for_engine(self.tokenizer, self.engine.vocab_size, self.config)
        self._request_counter = itertools.count()
        # One call at a time drives the engine (vLLM's LLM is not for threads either): a second
        # thread's call waits for the first's.
        self._lock = threading.Lock()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling values a request gets where it sets none (as vLLM's: the model's
        generation_config.json under ``generation_config="auto"``)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block (as vLLM's ``LLM.reset_prefix_cache``): later
        requests compute their prompts from scratch."""
        with self._lock:  # (not while another thread's call steps the engine)
            self.engine.block_manager.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of ``prompts`` (vLLM's
        signature). Without ``sampling_params``, the model's defaults
        (``get_default_sampling_params``). ``use_tqdm`` shows a progress bar: requests done,
        output tokens per second. ``priority``: one per prompt, under the priority policy.

        Raises:
            InvalidParameterError: a bad prompt or parameter (checked before anything is queued).
            EngineDeadError: the forward pass failed.
        """
        _no_lora(lora_request)
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise InvalidParameterError("priority", f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        engine = Engine(self.engine, self.tokenizer, self.structured_outputs)
        inputs = [engine.client.prepare(p, engine.client.truncates(params.truncate_prompt_tokens))
                  for p, params in zip(prompt_list, params_list)]
        inputs = [(text, engine.client.truncate(ids, params, encoded(p)))  # (a text's BOS stays in front)
                  for p, (text, ids), params in zip(prompt_list, inputs, params_list)]
        for (_, ids), params, rank in zip(inputs, params_list, priorities):
            self.engine.validate(ids, params, rank)
            if params.structured_outputs is not None:  # a bad constraint fails before anything runs
                self.structured_outputs.compile(params.structured_outputs)
        own = {id(p): engine.client.tokenize_bad_words(attrs.evolve(p, output_kind=RequestOutputKind.FINAL_ONLY))
               for p in params_list}  # (each distinct parameters once: bad words are tokenized here)
        final = [own[id(p)] for p in params_list]
        ids = [str(next(self._request_counter)) for _ in inputs]  # (one count per LLM, as vLLM's)
        with self._lock:
            return trio.run(self._generate_all, engine, inputs, final, ids, priorities, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, *,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of each prompt, best first
        (engine/frontend/beam_search.py): vLLM's ``LLM.beam_search``. The prompts' searches run
        side by side, their steps batched together.

        Raises:
            InvalidParameterError: a bad prompt or parameter (checked before anything is queued).
        """
        prompt_list = _as_prompt_list(prompts)
        engine = Engine(self.engine, self.tokenizer, self.structured_outputs)
        inputs = [engine.client.prepare(p) for p in prompt_list]
        for _, ids in inputs:
            self.engine.validate(ids, SamplingParams(max_tokens=params.max_tokens, stop_token_ids=params.stop_token_ids))
        results: list[BeamSearchOutput | None] = [None] * len(inputs)
        progress = _Progress(len(inputs)) if use_tqdm else None

        async def search(client: EngineClient, i: int) -> None:
            output = await client.beam_search({"prompt_token_ids": inputs[i][1]}, params, request_id=f"beam-{i}",
                                              admitted=True)  # (all at once, as generate's requests)
            results[i] = BeamSearchOutput([  # (vLLM's: tokens and text hold the prompt's too)
                BeamSearchSequence(tokens, c.logprobs, c.cumulative_logprob, self.tokenizer.decode(tokens),
                                   c.finish_reason, c.stop_reason)
                for c in output.outputs for tokens in [output.prompt_token_ids + c.token_ids]])
            if progress is not None:
                progress.done(output)

        async def run_all() -> None:
            with ungrouped():
                async with engine.serve() as client, trio.open_nursery() as nursery:
                    for i in range(len(inputs)):
                        nursery.start_soon(search, client, i)
        try:
            with self._lock:
                trio.run(run_all)
        finally:
            if progress is not None:
                progress.close()
        return results

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: None = None, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
             parallel_tool_calls: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the chat template.

        With ``tools`` (OpenAI's function tools), the prompt lists them and calls come out in
        the Hermes format, shaped by a grammar as ``tool_choice`` and ``parallel_tool_calls``
        ask (as in the HTTP API); ``engine.tools.parse_tool_calls`` reads them from a text.
        """
        _no_lora(lora_request)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        plan = plan_tools(tools, tool_choice, parallel_tool_calls)
        add_generation_prompt, continue_final_message, template_kwargs = template_switches(
            chat_template_kwargs, add_generation_prompt, continue_final_message)
        prompts = []
        for conv in conversations:
            conv, tool_kwargs = render_inputs(self.tokenizer, text_messages(conv), plan, chat_template)
            prompts.append({"prompt_token_ids": apply_chat_template(
                self.tokenizer, conv, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                **{**template_kwargs, **tool_kwargs})})
        if plan is not None:
            params = self._params_per_prompt(sampling_params, len(prompts))
            sampling_params = [plan.constrain(p) for p in params]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    async def _generate_all(engine: Engine, inputs: list[tuple[str | None, list[int]]],
                            params_list: list[SamplingParams], request_ids: list[str], priorities: list[int],
                            use_tqdm: bool = False) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(inputs)
        progress = _Progress(len(inputs)) if use_tqdm else None

        async def collect(i: int, channel) -> None:
            async for output in channel:
                results[i] = output
            if progress is not None:
                progress.done(results[i])

        try:
            with ungrouped():
                async with engine.serve() as client:
                    # Queue everything before the first step, so batches do not depend on task timing.
                    # Requests left unfinished by an error die with the engine when serve() exits.
                    channels = [client.submit({"prompt": text, "prompt_token_ids": ids}, params, request_id, rank)
                                for (text, ids), params, request_id, rank in zip(inputs, params_list, request_ids,
                                                                                 priorities)]
                    async with trio.open_nursery() as nursery:
                        for i, channel in enumerate(channels):
                            nursery.start_soon(collect, i, channel)
        finally:
            if progress is not None:
                progress.close()
        return results

    def _params_per_prompt(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if isinstance(sampling_params, (str, Mapping)) or not isinstance(sampling_params, Iterable):
            raise InvalidParameterError("sampling_params", "sampling_params must be a SamplingParams or a list of "
                                                           f"them; got {type(sampling_params).__name__}")
        params = [sampling_params_or_none(p) or self.get_default_sampling_params() for p in sampling_params]
        if len(params) != num_prompts:
            raise InvalidParameterError("sampling_params", f"got {len(params)} sampling_params for {num_prompts} prompts")
        return params


class _Progress:
    """``LLM.generate``'s progress bar (tqdm, as vLLM's): requests done and output tokens/s."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
        self._output_tokens = 0

    def done(self, output: RequestOutput | None) -> None:
        if output is not None:
            self._output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = self._bar.format_dict["elapsed"]
        self._bar.set_postfix_str(f"output {self._output_tokens / elapsed:.1f} tok/s" if elapsed else "",
                                  refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise InvalidParameterError("lora_request", "LoRA adapters are not supported by this engine")


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidParameterError("prompts", "prompts are a string, a list of token ids, a dict or a list of "
                                               f"those; got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise InvalidParameterError("prompts", "no prompts given")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def main(argv: list[str] | None = None) -> None:
    """``python -m engine.api``: serve the OpenAI-compatible HTTP API (see ``api.server``)."""
    from api.server import main as serve_main

    serve_main(argv)


if __name__ == "__main__":
    main()
