"""A draft model beside the target (speculative method ``draft_model``, engine/speculative.py).

While proposals are wanted (``StepPlan.num_proposals``), the draft model computes every token
the target computes, each step, into a KV cache of its own laid out over the target's block
tables (same block ids, same slots: its cache tensors are the target's shape for the draft's
heads). So what the target's cache holds (a prompt's chunks, a prefix from the cache, what a
preempted request recomputes), the draft's holds too, for the same positions.

While they are not (a batch above ``disable_by_batch_size``), the draft model does not run:
its cost would be all loss there. It notes which positions it missed instead: per block id,
how many leading positions hold the draft's KV of what the target's block now holds
(``filled``), and per request its tokens. When proposals resume, a request whose draft KV
lags is caught up in the same pass (its missing tokens first, from its earliest missed one;
at most ``max_num_batched_tokens`` of them a pass, the rest in the next ones), and a prefix
from the cache is read as far as its blocks are filled. The blocks a pass writes count as filled
for the rows after it in the same pass: a request admitted in the step that computes its prefix
(an n > 1 request's other choices) reads that prefix, as the target does.

Over a model whose every layer slides (its one table slides: ``window``) the draft keeps running:
the target gives back the blocks its window passed while the runner's table still names them
(other requests' now, or block 0 in place of a cached prefix's passed blocks). So nothing the
draft computes may reach before the window: its layers attend within the target's window (a
draft model of a longer reach, or none, is cut to it), and a request's draft KV is looked for,
and caught up, only from the blocks its first query's window reaches (the first queries of such a
catch-up read keys before it that are not there: a rare case's proposals, never another request's
KV, suffer).

After the target's step, for each request that sampled a token and is to get proposals, the
draft model takes that token and proposes the greedy continuation, one position at a time:
``num_proposals`` more forward passes over one row per request. Those positions lie past the
request's last known token, where the target may own no block yet: they go to scratch blocks
the draft cache has beyond the target's (a few per request, reused every step), appended to
the request's table for these passes only. Their KV is never kept: the next step's first pass
writes what the target then computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from backends.base import AttentionBackend, AttentionMetadata
from backends.kv_cache import KVCacheDtype
from engine.models.llama import LlamaModel
from engine.runner.sampler import argmax_rows


@attrs.frozen
class DraftRow:
    """One request's part of a step, for the draft model: ``token_ids`` at positions ``start``..
    (the tokens the target computed and kept, then, with ``propose``, the token it sampled
    after them), over the target's block table ``block_ids``."""

    request_id: str
    start: int
    token_ids: Sequence[int]
    block_ids: Sequence[int]
    propose: bool


class Drafter:
    """Owns the draft model and its KV cache (``num_blocks`` blocks as the target's, and scratch
    blocks for ``max_rows`` requests' proposals past their tables).

    Resource handling: the cache tensors live as long as the drafter."""

    def __init__(self, model: LlamaModel, backend: AttentionBackend, num_blocks: int, block_size: int,
                 device: str, kv_dtype: KVCacheDtype, num_proposals: int, max_rows: int, max_catch_up: int,
                 window: int | None = None) -> None:
        cfg = model.config
        if window is not None:
            model = model.within_window(window)
        self.model, self.backend, self.block_size, self.device = model, backend, block_size, device
        # Proposals past a table's end: positions last + 1 .. last + num_proposals - 1, and the
        # sampled token's own (the target computes it only next step).
        self.scratch_per_row = -(-num_proposals // block_size) + 1
        self.scratch_base = num_blocks
        total = num_blocks + max_rows * self.scratch_per_row
        shape = backend.kv_cache_shape(total, block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype.storage, device=device) for _ in range(cfg.num_layers)]
        self.kv_scales = ([torch.ones(2, dtype=torch.float32, device=device) for _ in range(cfg.num_layers)]
                          if kv_dtype.is_fp8 else None)
        self.filled = [0] * num_blocks  # per block id: its leading positions whose draft KV is the target's
        self._tokens: dict[str, list[int]] = {}  # per request: its tokens so far (what a catch-up reads)
        # Per request: positions 0.. with the draft's KV. What `filled` over its table says, kept so
        # that a running request's table is not walked every step (a row starts where the last
        # one's kept tokens end, so a paused row never starts below it).
        self._valid: dict[str, int] = {}
        self.max_catch_up = max_catch_up  # missed tokens one pass computes at most (the rest the next)
        # The sliding window of the target's table (None: it holds every block of a request). Over
        # one the draft does not sit out steps without proposals: a catch-up would reach back past
        # blocks the target gave back.
        self.window = window

    def admit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """A request the runner takes in (new, or back after a preemption): its tokens so far."""
        self._tokens[request_id] = list(token_ids)
        self._valid.pop(request_id, None)

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._tokens.pop(request_id, None)
            self._valid.pop(request_id, None)

    def _record(self, row: DraftRow) -> None:
        """The request's tokens from ``row``'s start on are ``row``'s."""
        tokens = self._tokens[row.request_id]
        del tokens[row.start:]
        tokens.extend(row.token_ids)

    def _mark(self, row: DraftRow, computed: bool) -> None:
        """The target computed ``row``'s tokens (its first ``len(token_ids)``, less the sampled one
        where it proposes) into its blocks; the draft did too where ``computed``."""
        bs, start, filled = self.block_size, row.start, self.filled
        end = start + len(row.token_ids) - row.propose
        for b in range(start // bs, -(-end // bs)):
            block, first, last = row.block_ids[b], max(start - b * bs, 0), min(end - b * bs, bs)
            if not computed:
                filled[block] = min(filled[block], first)
            elif filled[block] >= first:  # (else a hole before: that block's tail stays unread)
                filled[block] = last
        if computed:
            self._valid[row.request_id] = end

    def _valid_length(self, row: DraftRow) -> int:
        """Positions 0.. of ``row``'s request whose draft KV is there (a new request's: as far as
        its blocks are filled), or need not be: over a sliding table, the blocks before the first
        one the window of its first query reaches, which the target may have given back."""
        bs, valid = self.block_size, self._valid.get(row.request_id)
        first = 0 if self.window is None else max(row.start - self.window + 1, 0) // bs
        if valid is None:
            valid = first * bs
            for block in row.block_ids[first:-(-row.start // bs)]:
                valid += self.filled[block]
                if self.filled[block] < bs:
                    break
        return max(valid, first * bs)  # (a catch-up lagging past the window starts within it)

    def _caught_up(self, rows: list[DraftRow]) -> list[DraftRow]:
        """``rows``, each from the first position whose draft KV is missing (the request's tokens
        from there, then the row's), at most ``max_catch_up`` missed tokens in all: a row past
        that computes what fits of its missed tokens, proposes nothing, and goes on next pass.
        Each row is marked as it is taken: the rows after it see its blocks filled."""
        budget, out = self.max_catch_up, []
        for row in rows:
            valid = self._valid_length(row)
            if valid < row.start:
                missed = self._tokens[row.request_id][valid:row.start]
                if len(missed) <= budget:
                    budget -= len(missed)
                    row = attrs.evolve(row, start=valid, token_ids=(*missed, *row.token_ids))
                else:
                    self._mark(row, computed=False)
                    if not budget:
                        continue
                    row = DraftRow(row.request_id, valid, tuple(missed[:budget]), row.block_ids, False)
                    budget = 0
            self._mark(row, computed=True)
            out.append(row)
        return out

    def run(self, rows: list[DraftRow], num_proposals: int) -> dict[str, tuple[int, ...]]:
        """Compute ``rows`` into the draft cache; for each row that proposes, its greedy
        continuation of ``num_proposals`` tokens (fewer where the draft model's context ends).
        With no proposals asked for, the draft model runs nothing (where it may pause)."""
        rows = [row for row in rows if row.token_ids]
        for row in rows:
            self._record(row)
        if num_proposals <= 0 and self.window is None:
            for row in rows:
                self._mark(row, computed=False)
            return {}
        rows = self._caught_up(rows)
        if not rows:
            return {}
        limit = self.model.config.max_position_embeddings
        # A row whose sampled token reaches the end of the draft's context proposes nothing, and
        # that token (the target computes it next step) stays out too: it may sit past the
        # target's blocks, where only a proposing row's scratch blocks would hold it.
        # (a proposing row holds at least one computed token before the sampled one)
        rows = [row if not row.propose or (num_proposals > 0 and row.start + len(row.token_ids) < limit)
                else attrs.evolve(row, token_ids=row.token_ids[:-1], propose=False) for row in rows]
        proposing = [i for i, row in enumerate(rows) if row.propose]
        scratch = {i: n for n, i in enumerate(proposing)}
        tables = [self._table(row, scratch.get(i)) for i, row in enumerate(rows)]
        positions = [range(row.start, row.start + len(row.token_ids)) for row in rows]
        last = self._forward(rows, [list(row.token_ids) for row in rows], positions, tables,
                             [i for i in proposing])
        proposals = {i: [token] for i, token in zip(proposing, last)}
        for j in range(1, num_proposals):
            alive = [i for i in proposing if rows[i].start + len(rows[i].token_ids) + j < limit]
            if not alive:
                break
            ends = {i: rows[i].start + len(rows[i].token_ids) + j for i in alive}
            picked = [rows[i] for i in alive]
            last = self._forward(picked, [[proposals[i][-1]] for i in alive],
                                 [range(ends[i] - 1, ends[i]) for i in alive], [tables[i] for i in alive],
                                 list(range(len(alive))))
            for i, token in zip(alive, last):
                proposals[i].append(token)
        return {rows[i].request_id: tuple(tokens) for i, tokens in proposals.items()}

    def _table(self, row: DraftRow, scratch_index: int | None) -> list[int]:
        """The row's block ids, with its scratch blocks after them when it proposes."""
        if scratch_index is None:
            return list(row.block_ids)
        first = self.scratch_base + scratch_index * self.scratch_per_row
        return [*row.block_ids, *range(first, first + self.scratch_per_row)]

    def _forward(self, rows: Sequence[DraftRow], tokens: list[list[int]], positions: list[range],
                 tables: list[list[int]], sample: list[int]) -> list[int]:
        """One pass of the draft model over ``tokens`` at ``positions`` (per row, the row's newest
        tokens: it attends to its earlier ones in the cache); the argmax after the last token of
        each row in ``sample``."""
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for table, span in zip(tables, positions) for p in span]
        starts = [0]
        for span in positions:
            starts.append(starts[-1] + len(span))
        width = max(len(table) for table in tables)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([span.stop for span in positions], dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(len(span) for span in positions),
            max_seq_len=max(span.stop for span in positions))
        input_ids = torch.tensor([t for row in tokens for t in row], device=dev)
        flat_positions = torch.tensor([p for span in positions for p in span], device=dev)
        hidden = self.model.forward(input_ids, flat_positions, self.kv_caches, meta, self.backend, self.kv_scales)
        if not sample:
            return []
        logits = self.model.compute_logits(hidden[[starts[i + 1] - 1 for i in sample]])
        return argmax_rows(logits)
