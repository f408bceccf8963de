"""How a model's layers share the KV cache's blocks: one block table, or one per layer group.

A model whose layers all attend alike (all to the whole context, or all through a sliding
window) has one block table per request, and a block id names that block in every layer's
cache tensor. A model that mixes global and sliding layers (Gemma 2, Gemma 3) would then keep
every block of a long request for its sliding layers too, which read only their window. As
vLLM's hybrid KV cache manager does, such a model's layers are split into groups of ``size``
layers of one kind (the smaller kind's count; the larger kind's last group may be short):

- each group has its own block table per request (``windows[g]``: None for global layers);
  a sliding group gives back the blocks its window has passed (``BlockManager``), a global
  group keeps them;
- there are ``size`` cache tensors; layer ``i`` keeps its K/V in tensor ``layer_tensor[i]``,
  so one block id is ``size`` layers' memory, which the group that took it uses.

So a request of L tokens holds L tokens' blocks in each global group and about its window's
in each sliding one: Gemma 2 (13 global and 13 sliding layers, window 4096) holds at 32k
tokens 56% of what one table holds. Groups are listed global first (the draft model of
speculative decoding, which reads every position, takes group 0's table).

Plain Python (no torch): the scheduler's block manager and the model runner both build it
from the model's per-layer windows, and so agree without sending it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class KVCacheGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window, or None (global)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_tensor: tuple[int, ...]  # per layer: the cache tensor that holds its K/V
    size: int  # layers per group, and cache tensors

    @classmethod
    def of(cls, layer_windows: Sequence[int | None], hybrid: bool = True) -> KVCacheGroups:
        """The groups of a model whose layer ``i`` attends within ``layer_windows[i]`` (None:
        the whole context). One group unless the model mixes global and sliding layers and
        ``hybrid`` (vLLM's ``--disable-hybrid-kv-cache-manager`` turns it off): with windows on
        every layer the group's window is the widest."""
        num_layers = len(layer_windows)
        windowed = [i for i, w in enumerate(layer_windows) if w is not None]
        if not windowed or len(windowed) == num_layers or not hybrid:
            window = max(layer_windows[i] for i in windowed) if len(windowed) == num_layers else None
            return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
        full = [i for i, w in enumerate(layer_windows) if w is None]
        window = max(layer_windows[i] for i in windowed)
        size = min(len(full), len(windowed))
        windows: list[int | None] = []
        group, tensor = [0] * num_layers, [0] * num_layers
        for kind, layers in ((None, full), (window, windowed)):
            for first in range(0, len(layers), size):
                for j, layer in enumerate(layers[first:first + size]):
                    group[layer], tensor[layer] = len(windows), j
                windows.append(kind)
        return cls(tuple(windows), tuple(group), tuple(tensor), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Whether the layers are split in groups (some global, some sliding)."""
        return len(self.windows) > 1

    def most_held(self, max_num_batched_tokens: int, block_size: int) -> int | None:
        """The most tokens a sliding group holds of a sequence: its window, the block being
        filled and a step's prefill chunk (BlockManager.free_out_of_window); None: no group slides."""
        windows = [w for w in self.windows if w is not None]
        return max(windows) + max_num_batched_tokens + 2 * block_size if windows else None

    def longest(self, num_blocks: int, block_size: int, most_held: int | None) -> int | None:
        """The most tokens one sequence can have in ``num_blocks`` blocks, where a sliding group
        holds at most ``most_held`` tokens' blocks; None: any number (every group is sliding,
        and that fits)."""
        num_global = sum(w is None for w in self.windows)
        num_sliding = self.num_groups - num_global
        held = None if most_held is None or num_sliding == 0 else -(-most_held // block_size)
        if held is None or num_blocks < self.num_groups * held:  # every group holds the whole length
            return num_blocks // self.num_groups * block_size
        if num_global == 0:
            return None
        return (num_blocks - num_sliding * held) // num_global * block_size
