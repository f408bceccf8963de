"""Tensor parallelism in Megatron's layout, over torch.distributed (gloo on CPU, NCCL on GPUs).

Each of ``size`` ranks holds a shard of every matrix and runs the same forward pass on the same
rows: the q/k/v and gate/up products split by output rows (each rank its own heads and its own
part of the MLP), the o and down products by input columns with an all-reduce after each, the
embedding and the LM head by vocabulary rows (an all-reduce of the looked-up rows, an
all-gather of the logits). Each rank keeps the KV heads its query heads read: its share of
them, or, with more ranks than KV heads, a copy of one. Packed (GGUF) matrices split on their
32-value blocks, so a split must fall on a block boundary.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import attrs
import torch
import torch.distributed as dist

from engine.models.linear import DenseLinear, PackedLinear, PackedWeight, packed_kernels

BLOCK = 32


@attrs.define
class CollectiveTime:
    """Time this process spent in the forward pass's collectives, and their payload bytes (for
    bench/tensor_parallel.py: a step's time split into compute and communication)."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def add(self, start: float, tensor: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.bytes += tensor.numel() * tensor.element_size()


COLLECTIVES = CollectiveTime()


@attrs.frozen
class TensorParallel:
    """This process's place: rank ``rank`` of ``size`` (the default process group)."""

    rank: int
    size: int

    def kv_heads(self, num_kv_heads: int) -> range:
        """The KV heads this rank keeps: its share, or with more ranks than heads the one its
        query heads read (a copy on ``size / num_kv_heads`` ranks)."""
        if num_kv_heads >= self.size:
            share = num_kv_heads // self.size
            return range(self.rank * share, (self.rank + 1) * share)
        first = self.rank * num_kv_heads // self.size
        return range(first, first + 1)

    def part(self, total: int) -> range:
        share = total // self.size
        return range(self.rank * share, (self.rank + 1) * share)


def check_sizes(config, size: int) -> None:
    """Refuse a ``size`` that does not divide the model's heads and MLP (or, with more ranks than
    KV heads, is not a multiple of them).

    Raises:
        ValueError: naming the size that does not divide.
    """
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} neither divides the model's {kv_heads} KV heads nor is a "
                         "multiple of them")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the MLP's {config.intermediate_size} rows")


def shard(config, weights: Mapping[str, object], tp: TensorParallel, fused_checkpoint: bool):
    """This rank's config (its heads, its MLP rows) and weights (the same names, sliced)."""
    check_sizes(config, tp.size)
    d = config.head_dim
    q_heads = tp.part(config.num_heads)
    kv_heads = tp.kv_heads(config.num_kv_heads)
    mlp = tp.part(config.intermediate_size)
    q = range(q_heads.start * d, q_heads.stop * d)
    kv = range(kv_heads.start * d, kv_heads.stop * d)
    q_size, kv_size, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    out = {}
    for name, value in weights.items():
        # By module, whole ("self_attn.qkv_proj.weight" ends with "v_proj.weight" too).
        parts = name.split(".")
        module, kind = ".".join(parts[-3:-1]), parts[-1]
        product = kind in ("weight", "bias")
        if product and module == "self_attn.q_proj":
            out[name] = _rows(value, q)
        elif product and module in ("self_attn.k_proj", "self_attn.v_proj"):
            out[name] = _rows(value, kv)
        elif product and module == "self_attn.qkv_proj":  # Phi-3's fused q, k, v
            out[name] = _cat([_rows(value, q), _rows(value, _shift(kv, q_size)), _rows(value, _shift(kv, q_size + kv_size))])
        elif product and module in ("mlp.gate_proj", "mlp.up_proj"):
            out[name] = _rows(value, mlp)
        elif kind == "bias" and module in ("self_attn.o_proj", "mlp.down_proj"):
            # The ranks' partial products are summed: the bias is added once, by rank 0.
            out[name] = value if tp.rank == 0 else torch.zeros_like(value)
        elif kind == "weight" and module == "mlp.gate_up_proj":  # Phi-3's fused gate, up
            out[name] = _cat([_rows(value, mlp), _rows(value, _shift(mlp, inter))])
        elif kind == "weight" and module == "self_attn.o_proj":
            out[name] = _columns(value, q)
        elif kind == "weight" and module == "mlp.down_proj":
            out[name] = _columns(value, mlp)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _rows(value, vocab_part(config.vocab_size, tp))
        else:
            out[name] = value  # norms: every rank the whole
    local = attrs.evolve(config, num_heads=len(q_heads), num_kv_heads=len(kv_heads),
                         intermediate_size=len(mlp))
    return local, out


def vocab_part(vocab_size: int, tp: TensorParallel) -> range:
    """This rank's vocabulary rows: equal parts of ``ceil(vocab / size)`` (the last may be shorter)."""
    share = -(-vocab_size // tp.size)
    return range(min(vocab_size, tp.rank * share), min(vocab_size, (tp.rank + 1) * share))


def _shift(r: range, by: int) -> range:
    return range(r.start + by, r.stop + by)


def _rows(value, rows: range):
    if isinstance(value, PackedWeight):
        return PackedWeight(value.data[rows.start:rows.stop].contiguous(), value.kind, (len(rows), value.shape[1]))
    return value[rows.start:rows.stop].contiguous()


def _columns(value, columns: range):
    if isinstance(value, PackedWeight):
        if columns.start % BLOCK or columns.stop % BLOCK:
            raise ValueError(f"a tensor-parallel split at input columns {columns.start}..{columns.stop} does not "
                             f"fall on the {value.kind} blocks of {BLOCK} values")
        block = packed_kernels.TYPES[value.kind][1]
        data = value.data[:, columns.start // BLOCK * block:columns.stop // BLOCK * block].contiguous()
        return PackedWeight(data, value.kind, (value.shape[0], len(columns)))
    return value[:, columns.start:columns.stop].contiguous()


def _cat(parts: list):
    if isinstance(parts[0], PackedWeight):
        data = torch.cat([p.data for p in parts])
        return PackedWeight(data, parts[0].kind, (data.shape[0], parts[0].shape[1]))
    return torch.cat(parts)


class _Shard:
    """A rank's product (``inner``), as the model sees the whole one."""

    inner: DenseLinear | PackedLinear

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    @property
    def kind(self) -> str:
        return self.inner.kind


class RowParallel(_Shard):
    """A product split by input columns: each rank's partial sums, all-reduced."""

    def __init__(self, inner: DenseLinear | PackedLinear) -> None:
        self.inner = inner
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        start = time.perf_counter()
        dist.all_reduce(y)
        COLLECTIVES.add(start, y)
        return y


class VocabParallel(_Shard):
    """The embedding (and LM head) split by vocabulary rows: a lookup takes this rank's rows (zeros
    for the others' ids) and all-reduces; a product all-gathers every rank's logits."""

    def __init__(self, inner: DenseLinear | PackedLinear, vocab_size: int, tp: TensorParallel) -> None:
        self.inner, self.vocab_size, self.tp = inner, vocab_size, tp
        self.rows_here = vocab_part(vocab_size, tp)
        self.share = -(-vocab_size // tp.size)
        self.in_features, self.out_features = inner.in_features, vocab_size

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        start, stop = self.rows_here.start, self.rows_here.stop
        here = (ids >= start) & (ids < stop)
        local = torch.where(here, ids - start, torch.zeros_like(ids))
        out = self.inner.rows(local) if stop > start else torch.zeros(*ids.shape, self.in_features)
        out = out * here.unsqueeze(-1).to(out.dtype)
        start = time.perf_counter()
        dist.all_reduce(out)
        COLLECTIVES.add(start, out)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        local = self.inner(x) if len(self.rows_here) else x.new_zeros(*x.shape[:-1], 0)
        if local.shape[-1] < self.share:  # (the last part may be shorter: padded for the gather)
            local = torch.nn.functional.pad(local, (0, self.share - local.shape[-1]))
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        start = time.perf_counter()
        dist.all_gather(parts, local.contiguous())
        COLLECTIVES.add(start, local)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def parallelize(model, tp: TensorParallel, vocab_size: int) -> None:
    """Wrap a model built from ``shard``'s weights: all-reduces after the row-split products, the
    vocabulary-split embedding and LM head."""
    for layer in model.layers:
        layer.o_proj = RowParallel(layer.o_proj)
        layer.down_proj = RowParallel(layer.down_proj)
    tied = model.lm_head is model.embed
    model.embed = VocabParallel(model.embed, vocab_size, tp)
    model.lm_head = model.embed if tied else VocabParallel(model.lm_head, vocab_size, tp)
