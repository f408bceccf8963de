"""All device work of a step: flatten the step plan's rows, run the model, sample."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np
import torch

from backends.base import AttentionBackend, AttentionMetadata
from backends.kv_cache import KVCacheDtype, same_as
from engine.kv_groups import KVCacheGroups
from engine.models.llama import LlamaModel
from engine.outputs import TokenLogprobs
from engine.plan import RunnerOutput, StepPlan
from engine.runner.drafter import Drafter, DraftRow
from engine.runner.requests import RunnerRequest
from engine.runner.sampler import Sampler, argmax_rows, isolated, position_logprobs


def _plain_greedy(request: RunnerRequest) -> bool:
    """Whether the sampler's token for ``request`` is the argmax of its raw logits (and it
    wants no logprobs), at any position of this step."""
    params = request.params
    return (params.greedy and params.logprobs is None and not params.processes_logits
            and request.num_output_tokens >= params.min_tokens)


def kv_groups(model: LlamaModel, hybrid: bool = True) -> KVCacheGroups:
    """How ``model``'s layers share the KV cache (engine/kv_groups.py)."""
    cfg = model.config
    return KVCacheGroups.of([cfg.window(i) for i in range(cfg.num_layers)], hybrid)


def keeps_draft(sampled: int, draft: int) -> bool:
    """The acceptance rule of a proposed token (engine/speculative.py): kept where the token
    sampled at its position is that token. For a proposal of one token (an n-gram's), that is
    Leviathan et al.'s rule: kept with probability p(draft), else the sampled token, drawn from
    p without the draft."""
    return sampled == draft


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``hidden[rows]`` for increasing ``rows``; a view where they are consecutive (a decode
    step's are: every row samples), which skips the copy of an index lookup."""
    if rows[-1] - rows[0] == len(rows) - 1:
        return hidden[rows[0]:rows[-1] + 1]
    return hidden[rows]


@attrs.frozen
class _Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # token row of each sampling plan row's last token
    layer_metas: list[AttentionMetadata] | None = None  # per layer, with layer groups (else meta for all)


class BlockTables:
    """The block tables of the requests being run, kept in one persistent int32 array.

    A request gets a row when its first block ids arrive and keeps it until it finishes or is
    preempted. Each plan carries only the block ids appended since the previous one (a table
    only grows while its request runs), so preparing the tables costs O(batch + new blocks)
    instead of O(every block of the batch): at 256 requests x 2000 tokens that is 32k ids a
    step not rebuilt from Python lists.
    """

    def __init__(self) -> None:
        self._ids = np.zeros((8, 8), dtype=np.int32)
        self._row_of: dict[str, int] = {}
        self._filled = [0] * 8  # how many ids each row holds
        self._free_rows = list(range(7, -1, -1))

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)

    def extend(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Append ``block_ids`` to the table of ``request_id`` (a new table if it has none)."""
        row = self._row_of.get(request_id)
        if row is None:
            row = self._row_of[request_id] = self._take_row()
        done = self._filled[row]
        n = done + len(block_ids)
        if n > self._ids.shape[1]:
            self._ids = np.pad(self._ids, ((0, 0), (0, max(n, 2 * self._ids.shape[1]) - self._ids.shape[1])))
        self._ids[row, done:n] = block_ids
        self._filled[row] = n

    def gather(self, request_ids: Sequence[str]) -> np.ndarray:
        """``[len(request_ids), longest table]`` block ids (0 past each table's end), a new array."""
        row_of, filled = self._row_of, self._filled
        rows = [row_of[r] for r in request_ids]
        return self._ids[rows, :max(filled[r] for r in rows)]

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self._ids.shape[0]
            self._ids = np.pad(self._ids, ((0, old), (0, 0)))
            self._filled += [0] * old
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._ids[row] = 0
        self._filled[row] = 0
        return row


class ModelRunner:
    """Owns the model, the KV cache tensors, the sampler and its own state per request.

    It is driven by ``StepPlan`` values only (plan.py): what it knows of a request is what the
    plans said (``RunnerRequest``), dropped when a plan names the request finished or preempted.

    Resource handling: the KV cache (a tensor per layer, of ``kv_dtype``: the model's dtype by
    default; with layer groups, ``kv_groups``, a tensor per place in a group, shared by the
    groups' layers) is allocated in the constructor and lives as long as the runner; so do an
    fp8 cache's per-layer K and V scales (1.0, or from the first forward pass with
    ``calculate_kv_scales``).
    """

    def __init__(self, model: LlamaModel, backend: AttentionBackend, num_blocks: int, block_size: int,
                 device: str, seed: int, kv_dtype: KVCacheDtype | None = None,
                 calculate_kv_scales: bool = False, drafter: Drafter | None = None, hybrid_kv: bool = True) -> None:
        cfg = model.config
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.kv_dtype = kv_dtype or same_as(model.dtype)
        self.kv_groups = kv_groups(model, hybrid_kv)
        shape = backend.kv_cache_shape(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)
        tensors = [torch.zeros(shape, dtype=self.kv_dtype.storage, device=device) for _ in range(self.kv_groups.size)]
        self.kv_caches = [tensors[t] for t in self.kv_groups.layer_tensor]
        self.kv_scales = ([torch.ones(2, dtype=torch.float32, device=device) for _ in range(cfg.num_layers)]
                          if self.kv_dtype.is_fp8 else None)
        self._calibrate = calculate_kv_scales and self.kv_dtype.is_fp8
        self.sampler = Sampler(seed, device)
        self.block_tables = [BlockTables() for _ in self.kv_groups.windows]  # per layer group
        self.requests: dict[str, RunnerRequest] = {}
        self._block_ids: dict[str, list[list[int]]] = {}  # per request, per layer group
        self.drafter = drafter  # a draft model's proposals (speculative method draft_model)

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int, kv_dtype: KVCacheDtype, hybrid_kv: bool = True) -> int:
        """A block id's bytes: a block of every cache tensor (one per layer, or per place in a
        layer group)."""
        cfg = model.config
        return block_size * kv_dtype.bytes_per_token(kv_groups(model, hybrid_kv).size, cfg.num_kv_heads, cfg.head_dim)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run one step of ``plan`` (and take in what it says about requests' state)."""
        self._take_in(plan)
        if plan.is_empty:
            return RunnerOutput({}, {}, {})
        batch = self._prepare(plan)
        hidden = self.model.forward(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.backend,
                                    self.kv_scales, calibrate=self._calibrate, layer_metas=batch.layer_metas)
        self._calibrate = False
        failed: dict[str, Exception] = {}
        prompt_logprobs = self._prompt_logprobs(plan, hidden, failed)
        if not batch.sample_rows:
            output = RunnerOutput({}, {}, prompt_logprobs, failed)
        elif plan.num_draft_tokens:
            output = self._sample_drafted(plan, batch, hidden, prompt_logprobs, failed)
        else:
            logits = self.model.compute_logits(_rows(hidden, batch.sample_rows))  # [num_sampled, vocab]
            _, sampled, logprobs = self._sample(plan, logits, failed)
            output = RunnerOutput(sampled, logprobs, prompt_logprobs, failed)
        if self.drafter is not None:
            output = attrs.evolve(output, proposals=self.drafter.run(self._draft_rows(plan, output),
                                                                     plan.num_proposals))
        return output

    def _draft_rows(self, plan: StepPlan, output: RunnerOutput) -> list[DraftRow]:
        """What the draft model computes after this step: each row's tokens the target kept (a
        drafted row's first and its kept drafts), then, where proposals are wanted, the token
        sampled after them."""
        drafts, rows, offset = plan.num_draft_tokens, [], 0
        for row, (request_id, start, n) in enumerate(zip(plan.request_ids, plan.starts, plan.num_new_tokens)):
            tokens = plan.token_ids[offset:offset + n]
            offset += n
            if drafts and drafts[row]:
                tokens = tokens[:n - drafts[row] + len(output.accepted.get(request_id, ()))]
            token = output.sampled.get(request_id)
            propose = plan.num_proposals > 0 and token is not None and request_id not in output.failed
            rows.append(DraftRow(request_id, start, (*tokens, token) if propose else tokens,
                                 self._block_ids[request_id][0], propose))
        return rows

    def _sample(self, plan: StepPlan, logits: torch.Tensor, failed: dict[str, Exception],
                ) -> tuple[list[RunnerRequest], dict[str, int], dict[str, TokenLogprobs]]:
        """One token per sampling row from its ``logits`` row (the grammar masks applied): the
        rows' requests, the tokens and their logprobs (where asked) by request id."""
        ids = [plan.request_ids[row] for row in plan.sample_rows]
        rows = [self.requests[i] for i in ids]
        result = self.sampler(logits, rows, self._grammar(plan))
        failed.update((ids[row], error) for row, error in result.errors.items())
        logprobs = {i: lp for i, lp in zip(ids, result.logprobs) if lp is not None}
        return rows, dict(zip(ids, result.token_ids)), logprobs

    def _sample_drafted(self, plan: StepPlan, batch: _Batch, hidden: torch.Tensor,
                        prompt_logprobs: dict[str, list[TokenLogprobs]], failed: dict[str, Exception]) -> RunnerOutput:
        """A step with proposed tokens: every sampling row's first position (its last known
        token) and the later positions of drafted rows go through the LM head at once; the first
        are sampled together, then the later ones are verified (``_verify``)."""
        drafts = plan.num_draft_tokens
        first = [at - drafts[row] for at, row in zip(batch.sample_rows, plan.sample_rows)]
        later, index = self._later_positions(plan, batch)
        logits = self.model.compute_logits(hidden[first + later])
        rows, sampled, logprobs = self._sample(plan, logits[:len(first)], failed)
        accepted, accepted_logprobs = self._verify(plan, batch, logits[len(first):], index, rows, sampled,
                                                   logprobs, failed)
        return RunnerOutput(sampled, logprobs, prompt_logprobs, failed, accepted, accepted_logprobs)

    @staticmethod
    def _later_positions(plan: StepPlan, batch: _Batch) -> tuple[list[int], dict[tuple[int, int], int]]:
        """The token rows of every drafted row's positions after its first, and where position
        ``j`` of sampling row ``i`` is among them."""
        drafts = plan.num_draft_tokens
        later, index = [], {}
        for i, row in enumerate(plan.sample_rows):
            last = batch.sample_rows[i]
            for j in range(1, drafts[row] + 1):
                index[i, j] = len(later)
                later.append(last - drafts[row] + j)
        return later, index

    def _verify(self, plan: StepPlan, batch: _Batch, logits: torch.Tensor, index: dict[tuple[int, int], int],
                rows: list[RunnerRequest], sampled: dict[str, int], logprobs: dict[str, TokenLogprobs],
                failed: dict[str, Exception]) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[TokenLogprobs, ...]]]:
        """Sample the positions after each drafted row's first, in turn, while the drafts equal
        what is sampled (engine/speculative.py); ``logits`` are those positions' (``index``).
        ``sampled`` and ``logprobs`` (of the first positions) become each row's last sampled
        token; returns the drafts kept before it and their logprobs. A request that reads its
        output (penalties, bad words) keeps in its history only the tokens kept."""
        drafts = plan.num_draft_tokens
        spec = [(i, row) for i, row in enumerate(plan.sample_rows)
                if drafts[row] and plan.request_ids[row] not in failed]
        proposed = {i: plan.token_ids[batch.sample_rows[i] - drafts[row] + 1:batch.sample_rows[i] + 1]
                    for i, row in spec}
        kept: dict[str, list[int]] = {}
        kept_logprobs: dict[str, list[TokenLogprobs]] = {}
        alive = []
        for i, _ in spec:
            request_id = rows[i].request_id
            if keeps_draft(sampled[request_id], proposed[i][0]):
                alive.append(i)
                kept[request_id] = [proposed[i][0]]  # (the token whose KV the step computed)
                kept_logprobs[request_id] = [logprobs.pop(request_id)] if request_id in logprobs else []
        if alive:
            alive = self._verify_plain_greedy(alive, rows, logits, index, proposed, sampled, kept)
        j = 1
        while alive:
            for i in alive:
                rows[i].num_tokens += 1  # (position j knows the j drafts before it)
            result = self.sampler(logits[[index[i, j] for i in alive]], [rows[i] for i in alive])
            still = []
            for n, (i, token) in enumerate(zip(alive, result.token_ids)):
                request_id = rows[i].request_id
                if n in result.errors:
                    failed[request_id] = result.errors[n]
                elif j < len(proposed[i]) and keeps_draft(token, proposed[i][j]):
                    kept[request_id].append(proposed[i][j])
                    if result.logprobs[n] is not None:
                        kept_logprobs[request_id].append(result.logprobs[n])
                    still.append(i)
                else:
                    sampled[request_id] = token
                    if result.logprobs[n] is not None:
                        logprobs[request_id] = result.logprobs[n]
            alive, j = still, j + 1
        self._truncate_histories(plan, spec, rows, kept)
        return ({r: tuple(t) for r, t in kept.items()},
                {r: tuple(lps) for r, lps in kept_logprobs.items() if lps})

    @staticmethod
    def _verify_plain_greedy(alive: list[int], rows: list[RunnerRequest], logits: torch.Tensor, index: dict,
                             proposed: dict, sampled: dict[str, int], kept: dict[str, list[int]]) -> list[int]:
        """The drafted rows whose sampling is a plain argmax (greedy, nothing changes their
        logits, no logprobs) take every later position's token from one argmax over their
        logits, which is what the sampler would pick there. Returns the other rows."""
        plain = [i for i in alive if _plain_greedy(rows[i])]
        if not plain:
            return alive
        at = [index[i, j] for i in plain for j in range(1, len(proposed[i]) + 1)]
        best = dict(zip(at, argmax_rows(logits[at])))
        for i in plain:
            request_id, drafts = rows[i].request_id, proposed[i]
            for j in range(1, len(drafts) + 1):
                token = best[index[i, j]]
                if j < len(drafts) and keeps_draft(token, drafts[j]):
                    kept[request_id].append(drafts[j])
                else:
                    sampled[request_id] = token
                    break
        return [i for i in alive if not _plain_greedy(rows[i])]

    @staticmethod
    def _truncate_histories(plan: StepPlan, spec: list[tuple[int, int]], rows: list[RunnerRequest],
                            kept: dict[str, list[int]]) -> None:
        for i, row in spec:
            history = rows[i].token_ids
            if history is not None:  # (the drafts that were not kept leave the history)
                del history[plan.starts[row] + 1 + len(kept.get(rows[i].request_id, ())):]

    def _take_in(self, plan: StepPlan) -> None:
        """Drop the state of requests that ended or were preempted; add new ones; grow tables."""
        self.sampler.forget(plan.finished_ids)  # (a seeded request's draws go on across a preemption)
        for gone in (plan.finished_ids, plan.preempted_ids):
            for tables in self.block_tables:
                tables.release(gone)
            for request_id in gone:
                self.requests.pop(request_id, None)
                self._block_ids.pop(request_id, None)
            if self.drafter is not None:
                self.drafter.forget(gone)
        for new in plan.new_requests:
            for tables in self.block_tables:  # (a plan names a new request's old state gone first)
                tables.release((new.request_id,))
            history = list(new.token_ids) if new.params.reads_output else None
            self.requests[new.request_id] = RunnerRequest(
                new.request_id, list(new.token_ids[:new.num_prompt_tokens]), new.params, new.eos_token_id,
                new.num_prompt_logprobs, history)
            self._block_ids[new.request_id] = [[] for _ in self.block_tables]
            if self.drafter is not None:
                self.drafter.admit(new.request_id, new.token_ids)
        num_groups = len(self.block_tables)
        for request_id, block_ids in plan.new_block_ids:
            n = len(block_ids) // num_groups  # (each group's new ids, group after group)
            for g, (ids, tables) in enumerate(zip(self._block_ids[request_id], self.block_tables)):
                part = block_ids[g * n:(g + 1) * n] if num_groups > 1 else block_ids
                ids += part
                tables.extend(request_id, part)

    def _prepare(self, plan: StepPlan) -> _Batch:
        bs = self.block_size
        requests, tables = self.requests, self._block_ids
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        offset = 0
        for request_id, start, n in zip(plan.request_ids, plan.starts, plan.num_new_tokens):
            table = tables[request_id][0]
            end = start + n
            if n == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            history = requests[request_id].token_ids
            if history is not None and end > len(history):  # a request that reads its output: keep its tokens
                history += plan.token_ids[offset + len(history) - start:offset + n]
            offset += n
            starts.append(offset)
            seq_lens.append(end)
        drafts = plan.num_draft_tokens
        for row in plan.sample_rows:  # (a drafted row samples first where its known tokens end)
            requests[plan.request_ids[row]].num_tokens = seq_lens[row] - (drafts[row] if drafts else 0)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(self.block_tables[0].gather(plan.request_ids)).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(plan.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        layer_metas = None
        if len(self.block_tables) > 1:  # the other layer groups' tables and slots
            metas = [meta] + [self._group_meta(plan, meta, g) for g in range(1, len(self.block_tables))]
            layer_metas = [metas[g] for g in self.kv_groups.layer_group]
        return _Batch(torch.tensor(plan.token_ids, device=dev), torch.tensor(positions, device=dev), meta,
                      [starts[row + 1] - 1 for row in plan.sample_rows], layer_metas)

    def _group_meta(self, plan: StepPlan, meta: AttentionMetadata, group: int) -> AttentionMetadata:
        """``meta`` (group 0's) for the layers of layer group ``group``: its block tables and slots."""
        bs, tables = self.block_size, self._block_ids
        slots: list[int] = []
        for request_id, start, n in zip(plan.request_ids, plan.starts, plan.num_new_tokens):
            table = tables[request_id][group]
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        dev = self.device
        return AttentionMetadata(
            meta.query_start_loc, meta.seq_lens,
            torch.from_numpy(self.block_tables[group].gather(plan.request_ids)).to(dev),
            torch.tensor(slots, dtype=torch.int64, device=dev), meta.max_query_len, meta.max_seq_len)

    def _grammar(self, plan: StepPlan) -> tuple[torch.Tensor, list[int]] | None:
        """The plan's grammar bitmask and, for each of its rows, the sampled row it masks."""
        if not plan.grammar_rows:
            return None
        index = {row: i for i, row in enumerate(plan.sample_rows)}
        words_per_row = -(-self.model.config.vocab_size // 32)
        if len(plan.grammar_bitmask) != 4 * words_per_row * len(plan.grammar_rows):
            raise ValueError(f"the plan's grammar bitmask holds {len(plan.grammar_bitmask)} bytes, not "
                             f"{len(plan.grammar_rows)} rows of {words_per_row} int32 words")
        words = np.frombuffer(plan.grammar_bitmask, dtype=np.int32).reshape(len(plan.grammar_rows), -1)
        return torch.from_numpy(words.copy()), [index[row] for row in plan.grammar_rows]

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor,
                         failed: dict[str, Exception]) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of prompt tokens 1.. predicted by this step's positions (only for requests
        asking, and only for positions not reported before: a preempted request recomputes its
        prompt, but its prompt logprobs were already sent)."""
        result: dict[str, list[TokenLogprobs]] = {}
        row = 0
        for request_id, start, n in zip(plan.request_ids, plan.starts, plan.num_new_tokens):
            request = self.requests[request_id]
            k = request.params.prompt_logprobs
            if k is not None:
                first = max(start, request.num_prompt_logprobs)
                last = min(start + n, request.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
                if first < last:
                    with isolated(failed, request_id):
                        rows = hidden[row + first - start:row + last - start]
                        logprobs = self.model.compute_logits(rows).log_softmax(dim=-1)
                        targets = request.prompt_token_ids[first + 1:last + 1]
                        result[request_id] = [position_logprobs(lp, t, k) for lp, t in zip(logprobs, targets)]
                        request.num_prompt_logprobs = last
            row += n
        return result
