"""Tokenizer and chat template, through transformers.

Building a tokenizer from a GGUF vocabulary takes seconds to tens of seconds, so the
converted tokenizer is saved under the cache directory, keyed by the file's identity, and
later starts load it from there.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import ConfigError, InvalidParameterError
from engine.models.loader import ModelSource, cache_dir

log = logging.getLogger(__name__)


def _gguf_cache_key(path: Path) -> str:
    stat = path.stat()
    ident = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


# The files a Hugging Face model directory usually keeps its tokenizer in (for the message when
# transformers reads none).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _from_directory(path: Path, param: str):
    """The tokenizer of a model directory, as transformers reads it (local files only).

    Raises:
        ConfigError: naming ``param``, with transformers' reason (its first line), when it reads none.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # (OSError, ValueError, and the tokenizers library's own for a corrupt file)
        if path.is_dir() and not any((path / name).exists() for name in _TOKENIZER_FILES):
            reason = f"no tokenizer files there: {', '.join(_TOKENIZER_FILES)}"
        else:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(param, f"{param} {str(path)!r}: no tokenizer read there ({reason})") from None


def tokenizer_for(config) -> Any:
    """The tokenizer an ``EngineConfig`` names: its ``tokenizer``, else its model's."""
    from engine.models.loader import resolve_model

    return load_tokenizer(resolve_model(config.model), config.tokenizer)


def token_bytes(tokenizer) -> tuple[bytes, ...]:
    """Each token id's own bytes, which may be part of a character (byte-level BPE, SentencePiece
    byte fallback or plain pieces, as xgrammar reads the vocabulary): what a logprobs entry's
    ``bytes`` holds, so that a character split over tokens is whole again when they are joined.
    ~0.5 s for a 49k vocabulary. Empty where xgrammar cannot read the tokenizer (logprobs then
    carry the UTF-8 of each token's text, as vLLM's sampled tokens do)."""
    import xgrammar

    try:
        return tuple(xgrammar.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab)
    except Exception as exc:  # (any failure of a third-party reader: the text's bytes still serve)
        log.warning("logprobs' bytes will be the UTF-8 of each token's text: xgrammar cannot read this "
                    "tokenizer's vocabulary (%s)", exc)
        return ()


def load_tokenizer(source: ModelSource, tokenizer: str | None = None):
    """A transformers tokenizer for ``source`` (or for the explicit ``tokenizer`` path), read
    from local files only.

    Raises:
        ConfigError: naming ``tokenizer``, for a path that does not exist or holds no tokenizer.
    """
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not path.exists():
            raise ConfigError("tokenizer", f"tokenizer {tokenizer!r} not found: give a model directory or a .gguf "
                                           "file (this server does not download from a hub)")
        given = ModelSource(path, path.stem)
        if given.is_gguf:  # a GGUF file's vocabulary, built and cached as the model's is
            return _from_gguf(given, "tokenizer")
        return _from_directory(path, "tokenizer")
    if not source.is_gguf:
        return _from_directory(source.path, "model")
    return _from_gguf(source, "model")


def _from_gguf(source: ModelSource, param: str):
    """The tokenizer of a GGUF file's vocabulary, as transformers builds it (cached).

    Raises:
        ConfigError: naming ``param``, when transformers builds none from the file's metadata.
    """
    from transformers import AutoTokenizer

    cached = cache_dir() / "tokenizers" / _gguf_cache_key(source.path)
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    log.info("building the tokenizer from %s (once; cached in %s)", source.path.name, cached)
    try:
        tok = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    except Exception as exc:  # (KeyError, ValueError, IndexError...: whatever the metadata lacks)
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(param, f"{param} {source.path.name}: no tokenizer built from its vocabulary "
                                 f"({type(exc).__name__}: {reason})") from None
    try:
        tok.save_pretrained(cached)
    except OSError as exc:  # a read-only cache only costs the next start some time
        log.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return tok


# transformers' apply_chat_template arguments (and render_chat_template's) that the engine sets,
# which chat_template_kwargs may not: those kwargs are the template's own variables
# (add_generation_prompt and continue_final_message among them override the caller's, as in vLLM).
# With every other named argument of the installed transformers' apply_chat_template (engine_arguments).
ENGINE_TEMPLATE_ARGUMENTS = frozenset({
    "messages", "tokenizer", "conversation", "tools", "documents", "chat_template", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs", "sanitize_control_tokens"})


@functools.cache
def engine_arguments() -> frozenset[str]:
    """The arguments chat_template_kwargs may not name: ``ENGINE_TEMPLATE_ARGUMENTS`` and the
    other named ones of this transformers' ``apply_chat_template`` (a newer one adds some)."""
    from transformers import PreTrainedTokenizerBase

    named = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return ENGINE_TEMPLATE_ARGUMENTS | (set(named) - {"self", "kwargs", "add_generation_prompt",
                                                      "continue_final_message"})


def template_switches(kwargs: Mapping[str, Any] | None, add_generation_prompt: bool, continue_final_message: bool,
                      ) -> tuple[bool, bool, dict[str, Any]]:
    """The two template switches, overridden by ``chat_template_kwargs`` where they name them
    (vLLM applies the kwargs last), and the kwargs without them.

    Raises:
        InvalidParameterError: naming ``chat_template_kwargs``, for a switch that is not a
            boolean or an argument the engine sets itself.
    """
    kwargs = dict(kwargs or {})
    add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
    if not isinstance(add_generation_prompt, bool) or not isinstance(continue_final_message, bool):
        raise InvalidParameterError("chat_template_kwargs", "chat_template_kwargs: add_generation_prompt and "
                                                            "continue_final_message must be booleans")
    taken = sorted(set(kwargs) & engine_arguments())
    if taken:
        raise InvalidParameterError("chat_template_kwargs", f"chat_template_kwargs: {', '.join(taken)} is the "
                                                            "server's to set (tools and documents are request "
                                                            "fields); these kwargs are the chat template's own "
                                                            "variables")
    return add_generation_prompt, continue_final_message, kwargs


def content_text(content: Any, index: int) -> str:
    """Message ``index``'s content as text: a string as it is, None as "", a list of OpenAI's
    text parts (dicts, or objects with ``type`` and ``text``) one per line, as vLLM joins them
    for a template that takes strings; an assistant's ``refusal`` part reads as its ``refusal`` text.

    Raises:
        InvalidParameterError: naming ``messages``, for a part that is not text.
    """
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        fields = part if isinstance(part, Mapping) else {"type": getattr(part, "type", type(part).__name__),
                                                          "text": getattr(part, "text", None),
                                                          "refusal": getattr(part, "refusal", None)}
        kind = fields.get("type")
        text = fields.get("refusal" if kind == "refusal" else "text")
        if kind not in ("text", "refusal"):
            raise InvalidParameterError("messages", f"messages[{index}]: content of type {kind!r} is not supported "
                                                    "by this server (text only)")
        texts.append(text or "")
    return "\n".join(texts)


def text_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI-style messages with each content as text (``content_text``).

    Raises:
        InvalidParameterError: naming ``messages``, for a message without a role or a part
            that is not text.
    """
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidParameterError("messages", f"messages[{i}] must be an object with a role (a string)")
        result.append(template_message(message, i))
    return result


def template_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Chat message ``index`` as chat templates take it, as vLLM gives it them: its content as
    text (``content_text``: None is "", as for an assistant's turn of only tool calls), OpenAI's
    developer role as system, an earlier turn's ``reasoning`` (what responses carry) as the
    ``reasoning_content`` templates read; its other fields as they are."""
    converted = {**message, "content": content_text(message.get("content"), index)}
    if converted["role"] == "developer":
        converted["role"] = "system"
    if converted.get("reasoning_content") is None and message.get("reasoning") is not None:
        converted["reasoning_content"] = message["reasoning"]
    return converted


def render_chat_template(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                         continue_final_message: bool = False, chat_template: str | None = None,
                         **template_kwargs: Any) -> str:
    """A conversation as the model's (or the given) chat template writes it."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, chat_template=chat_template, **template_kwargs)


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    """Token ids of a conversation rendered with the model's (or the given) chat template
    (``options`` as for ``render_chat_template``)."""
    return tokenizer.encode(render_chat_template(tokenizer, messages, **options), add_special_tokens=False)
