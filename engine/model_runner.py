"""All device work of a step: flatten the scheduled chunks, run the model, sample."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np
import torch

from backends.base import AttentionBackend, AttentionMetadata
from engine.kv_cache import KVBlock
from engine.models.llama import LlamaModel
from engine.outputs import TokenLogprobs
from engine.sampler import Sampler, isolated, position_logprobs
from engine.scheduler import ScheduledChunk, SchedulerOutput


@attrs.frozen
class RunnerOutput:
    """Per request id: the sampled token (only for chunks that reach the last known token),
    its logprobs if asked, prompt logprobs computed in this chunk if asked, and the error of
    each request whose own part of the step failed (its other entries are to be ignored)."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, list[TokenLogprobs]]
    failed: dict[str, Exception] = attrs.field(factory=dict)
    grammar_finished: set[str] = attrs.field(factory=set)  # structured output complete (stop token in)


@attrs.frozen
class _Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # row of each sampling chunk's last token
    sample_chunks: list[ScheduledChunk]


class BlockTables:
    """The block tables of the requests being run, kept in one persistent int32 array.

    A request gets a row the first time it is scheduled and keeps it until it finishes or is
    preempted. Each step copies into the rows only the block ids added since the previous
    step (a request's block list only grows while it holds it), so preparing the tables
    costs O(batch + new blocks) instead of O(every block of the batch): at 256 requests x
    2000 tokens that is 32k ids a step not rebuilt from Python lists.
    """

    def __init__(self) -> None:
        self._ids = np.zeros((8, 8), dtype=np.int32)
        self._row_of: dict[str, int] = {}
        self._source: list[list[KVBlock] | None] = [None] * 8  # the block list each row mirrors
        self._filled = [0] * 8  # how many of its ids are copied
        self._free_rows = list(range(7, -1, -1))

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._source[row] = None
                self._free_rows.append(row)

    def gather(self, request_ids: Sequence[str], blocks: Sequence[list[KVBlock]]) -> np.ndarray:
        """``[len(request_ids), longest table]`` block ids (0 past each table's end), a new array."""
        rows = []
        for request_id, owned in zip(request_ids, blocks):
            row = self._row_of.get(request_id)
            if row is None:
                row = self._row_of[request_id] = self._take_row()
            done, n = self._filled[row], len(owned)
            if self._source[row] is not owned or n < done:  # a new or re-allocated block list
                self._source[row] = owned
                self._ids[row] = 0
                done = 0
            if n > done:
                if n > self._ids.shape[1]:
                    self._ids = np.pad(self._ids, ((0, 0), (0, max(n, 2 * self._ids.shape[1]) - self._ids.shape[1])))
                self._ids[row, done:n] = [b.block_id for b in owned[done:]]
                self._filled[row] = n
            rows.append(row)
        width = max(len(owned) for owned in blocks)
        return self._ids[rows, :width]

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self._ids.shape[0]
            self._ids = np.pad(self._ids, ((0, old), (0, 0)))
            self._source += [None] * old
            self._filled += [0] * old
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._filled[row] = 0
        return row


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler.

    Resource handling: the KV cache (one tensor per layer) is allocated in the constructor
    and lives as long as the runner.
    """

    def __init__(self, model: LlamaModel, backend: AttentionBackend, num_blocks: int, block_size: int,
                 device: str, seed: int, max_num_seqs: int = 128) -> None:
        cfg = model.config
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        shape = backend.kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(cfg.num_layers)]
        self.sampler = Sampler(seed, device, max_num_seqs)
        self.block_tables = BlockTables()

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
        cfg = model.config
        element = torch.empty((), dtype=model.dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, block_tables: Mapping[str, list[KVBlock]]) -> RunnerOutput:
        """Run one step. ``block_tables`` maps (at least) each scheduled request id to its
        blocks: the block manager's live lists (``BlockManager.tables``)."""
        self.sampler.forget(output.finished_ids)
        self.block_tables.release(output.finished_ids)
        self.block_tables.release(output.preempted_ids)
        if output.is_empty:
            return RunnerOutput({}, {}, {})
        batch = self._prepare(output.chunks, block_tables)
        hidden = self.model.forward(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.backend)
        failed: dict[str, Exception] = {}
        prompt_logprobs = self._prompt_logprobs(output.chunks, hidden, failed)
        if not batch.sample_rows:
            return RunnerOutput({}, {}, prompt_logprobs, failed)
        logits = self.model.compute_logits(hidden[batch.sample_rows])  # [num_sampled, vocab]
        requests = [c.request for c in batch.sample_chunks]
        result = self.sampler(logits, requests)
        ids = [r.request_id for r in requests]
        failed.update((ids[row], error) for row, error in result.errors.items())
        logprobs = {i: lp for i, lp in zip(ids, result.logprobs) if lp is not None}
        return RunnerOutput(dict(zip(ids, result.token_ids)), logprobs, prompt_logprobs, failed,
                            {ids[row] for row in result.grammar_finished})

    def _prepare(self, chunks: list[ScheduledChunk], block_tables: Mapping[str, list[KVBlock]]) -> _Batch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        request_ids: list[str] = []
        tables: list[list[KVBlock]] = []
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        for chunk in chunks:
            request_id = chunk.request.request_id
            table = block_tables[request_id]
            input_ids += chunk.request.token_ids[chunk.start:chunk.end]
            positions += range(chunk.start, chunk.end)
            slots += [table[p // bs].block_id * bs + p % bs for p in range(chunk.start, chunk.end)]
            starts.append(len(input_ids))
            seq_lens.append(chunk.end)
            request_ids.append(request_id)
            tables.append(table)
            if chunk.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_chunks.append(chunk)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(self.block_tables.gather(request_ids, tables)).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(c.num_new_tokens for c in chunks),
            max_seq_len=max(seq_lens),
        )
        return _Batch(torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev), meta,
                      sample_rows, sample_chunks)

    def _prompt_logprobs(self, chunks: list[ScheduledChunk], hidden: torch.Tensor,
                         failed: dict[str, Exception]) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of prompt tokens 1.. predicted by this chunk's positions (only for requests
        asking, and only for positions not reported before: a preempted request recomputes its
        prompt, but its prompt logprobs were already sent)."""
        result: dict[str, list[TokenLogprobs]] = {}
        row = 0
        for chunk in chunks:
            request = chunk.request
            k = request.params.prompt_logprobs
            first = max(chunk.start, request.num_prompt_logprobs)
            last = min(chunk.end, request.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
            if k is not None and first < last:
                with isolated(failed, request.request_id):
                    rows = hidden[row + first - chunk.start:row + last - chunk.start]
                    logprobs = self.model.compute_logits(rows).log_softmax(dim=-1)
                    targets = request.prompt_token_ids[first + 1:last + 1]
                    result[request.request_id] = [position_logprobs(lp, t, k) for lp, t in zip(logprobs, targets)]
            row += chunk.num_new_tokens
        return result
