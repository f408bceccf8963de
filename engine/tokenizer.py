"""Tokenizer and chat template, through transformers.

Building a tokenizer from a GGUF vocabulary takes seconds to tens of seconds, so the
converted tokenizer is saved under the cache directory, keyed by the file's identity, and
later starts load it from there.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from engine.models.loader import ModelSource, cache_dir

log = logging.getLogger(__name__)


def _gguf_cache_key(path: Path) -> str:
    stat = path.stat()
    ident = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def tokenizer_for(config) -> Any:
    """The tokenizer an ``EngineConfig`` names: its ``tokenizer``, else its model's."""
    from engine.models.loader import resolve_model

    return load_tokenizer(resolve_model(config.model), config.tokenizer)


def load_tokenizer(source: ModelSource, tokenizer: str | None = None):
    """A transformers tokenizer for ``source`` (or for the explicit ``tokenizer`` path)."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        if tokenizer.endswith(".gguf"):  # a GGUF file's vocabulary, built and cached as the model's is
            return load_tokenizer(ModelSource(Path(tokenizer), Path(tokenizer).stem))
        return AutoTokenizer.from_pretrained(tokenizer)
    if not source.is_gguf:
        return AutoTokenizer.from_pretrained(source.path)
    cached = cache_dir() / "tokenizers" / _gguf_cache_key(source.path)
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    log.info("building the tokenizer from %s (once; cached in %s)", source.path.name, cached)
    tok = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    try:
        tok.save_pretrained(cached)
    except OSError as exc:  # a read-only cache only costs the next start some time
        log.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return tok


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
