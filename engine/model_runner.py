"""All device work of a step: flatten the scheduled chunks, run the model, sample."""

from __future__ import annotations

import attrs
import torch

from backends.base import AttentionBackend, AttentionMetadata
from engine.models.llama import LlamaModel
from engine.outputs import TokenLogprobs
from engine.sampler import Sampler, position_logprobs
from engine.scheduler import ScheduledChunk, SchedulerOutput


@attrs.frozen
class RunnerOutput:
    """Per request id: the sampled token (only for chunks that reach the last known token),
    its logprobs if asked, and prompt logprobs computed in this chunk if asked."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, list[TokenLogprobs]]


@attrs.frozen
class _Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # row of each sampling chunk's last token
    sample_chunks: list[ScheduledChunk]


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler.

    Resource handling: the KV cache (one tensor per layer) is allocated in the constructor
    and lives as long as the runner.
    """

    def __init__(self, model: LlamaModel, backend: AttentionBackend, num_blocks: int, block_size: int,
                 device: str, seed: int) -> None:
        cfg = model.config
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        shape = backend.kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(cfg.num_layers)]
        self.sampler = Sampler(seed, device)

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
        cfg = model.config
        element = torch.empty((), dtype=model.dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, block_tables: dict[str, list[int]]) -> RunnerOutput:
        """Run one step. ``block_tables`` maps each scheduled request id to its KV block ids."""
        self.sampler.forget(output.finished_ids)
        if output.is_empty:
            return RunnerOutput({}, {}, {})
        batch = self._prepare(output.chunks, block_tables)
        hidden = self.model.forward(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.backend)
        prompt_logprobs = self._prompt_logprobs(output.chunks, hidden)
        if not batch.sample_rows:
            return RunnerOutput({}, {}, prompt_logprobs)
        logits = self.model.compute_logits(hidden[batch.sample_rows])  # [num_sampled, vocab]
        requests = [c.request for c in batch.sample_chunks]
        result = self.sampler(logits, requests)
        ids = [r.request_id for r in requests]
        logprobs = {i: lp for i, lp in zip(ids, result.logprobs) if lp is not None}
        return RunnerOutput(dict(zip(ids, result.token_ids)), logprobs, prompt_logprobs)

    def _prepare(self, chunks: list[ScheduledChunk], block_tables: dict[str, list[int]]) -> _Batch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        for chunk in chunks:
            table = block_tables[chunk.request.request_id]
            input_ids += chunk.request.token_ids[chunk.start:chunk.end]
            positions += range(chunk.start, chunk.end)
            slots += [table[p // bs] * bs + p % bs for p in range(chunk.start, chunk.end)]
            starts.append(len(input_ids))
            seq_lens.append(chunk.end)
            tables.append(table)
            if chunk.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_chunks.append(chunk)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(c.num_new_tokens for c in chunks),
            max_seq_len=max(seq_lens),
        )
        return _Batch(torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev), meta,
                      sample_rows, sample_chunks)

    def _prompt_logprobs(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of prompt tokens 1.. predicted by this chunk's positions (only for requests asking)."""
        result: dict[str, list[TokenLogprobs]] = {}
        row = 0
        for chunk in chunks:
            request = chunk.request
            k = request.params.prompt_logprobs
            last = min(chunk.end, request.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
            if k is not None and chunk.start < last:
                logprobs = self.model.compute_logits(hidden[row:row + last - chunk.start]).log_softmax(dim=-1)
                targets = request.prompt_token_ids[chunk.start + 1:last + 1]
                result[request.request_id] = [position_logprobs(lp, t, k) for lp, t in zip(logprobs, targets)]
            row += chunk.num_new_tokens
        return result
