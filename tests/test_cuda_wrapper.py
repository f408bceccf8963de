"""The CUDA library without a GPU: it is built (when nvcc exists), exports the C ABI, and its
Python wrapper rejects bad arguments before any pointer reaches the library."""

from __future__ import annotations

import shutil

import pytest
import torch

from backends import native
from backends.base import AttentionMetadata
from backends.cuda import CudaAttentionBackend

ABI = ("pa_cuda_write_kv", "pa_cuda_attention", "pa_cuda_workspace_bytes", "pa_cuda_last_error")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed here")
def test_cuda_library_is_built_and_exports_the_abi():
    lib = native.load_library("pa_cuda", "cuda")
    for symbol in ABI:
        assert getattr(lib, symbol) is not None
    # 4 tokens x 3 KV heads over 1024 keys: partitions shrink from 512 to 128 keys (8 of them)
    # to give the GPU more CTAs; each (token, head, partition) keeps max, sum and 64 floats.
    shape = native._shape(4, 1, 9, 3, 64, 16, 10, 1, 4, 1024, 0)
    assert lib.pa_cuda_workspace_bytes(shape) == 4 * 9 * 8 * (64 + 2) * 4
    # 512 tokens x 3 KV heads already fill the GPU: 512-key partitions, two of them.
    shape = native._shape(512, 1, 9, 3, 64, 16, 10, 1, 4, 1024, 0)
    assert lib.pa_cuda_workspace_bytes(shape) == 512 * 9 * 2 * (64 + 2) * 4
    # A single partition needs no workspace: the kernel writes the output itself.
    shape = native._shape(512, 1, 9, 3, 64, 16, 10, 1, 4, 300, 0)
    assert lib.pa_cuda_workspace_bytes(shape) == 0


class FakeLib:
    """Stands in for libpa_cuda.so: records calls, which the checks must prevent."""

    def __init__(self) -> None:
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            return 0
        return call


def good_args(dtype=torch.bfloat16):
    query = torch.zeros(3, 8, 64, dtype=dtype)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=dtype)
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
                             seq_lens=torch.tensor([5, 2], dtype=torch.int32),
                             block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
                             slot_mapping=torch.tensor([4, 16, 17]), max_query_len=2, max_seq_len=5)
    return query, cache, meta, torch.empty_like(query)


@pytest.mark.parametrize("break_it, words", [
    (lambda q, c, m, o: (q.float(), c, m, o), "float32"),
    (lambda q, c, m, o: (q.transpose(0, 1), c, m, o), "out shape"),
    (lambda q, c, m, o: (q, c[:, :, :, :1], m, o), "contiguous"),
    (lambda q, c, m, o: (q, c[..., :32].contiguous(), m, o), "head_size"),
    (lambda q, c, m, o: (q, c, m, o[:2]), "out shape"),
    (lambda q, c, m, o: (q, c.view(2, 4, 16, 128), m, o), "dimensions"),
    (lambda q, c, m, o: (q, c, AttentionMetadata(m.query_start_loc.long(), m.seq_lens, m.block_tables,
                                                 m.slot_mapping, 2, 5), o), "int32"),
    (lambda q, c, m, o: (q, c, AttentionMetadata(m.query_start_loc[:2], m.seq_lens, m.block_tables,
                                                 m.slot_mapping, 2, 5), o), r"num_seqs \+ 1"),
    (lambda q, c, m, o: (q, c, AttentionMetadata(m.query_start_loc, m.seq_lens, m.block_tables,
                                                 m.slot_mapping, 2, 100), o), "max_seq_len"),
    (lambda q, c, m, o: (q.view(3, 4, 128), c, m, o.view(3, 4, 128)), "head_size"),
    (lambda q, c, m, o: (torch.zeros(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape), c, m, o), "16-byte aligned"),
])
def test_attention_arguments_are_checked_before_the_call(break_it, words):
    lib = FakeLib()
    backend = CudaAttentionBackend(lib)
    query, cache, meta, out = break_it(*good_args())
    with pytest.raises(ValueError, match=words):
        backend.attend(query, cache, meta, 0.125, out)
    assert lib.calls == []


def test_cpu_tensors_are_refused_by_the_cuda_wrapper():
    lib = FakeLib()
    with pytest.raises(ValueError, match="CUDA tensors"):
        CudaAttentionBackend(lib).attend(*good_args()[:3], 0.125, good_args()[3])
    assert lib.calls == []


def test_write_kv_arguments_are_checked():
    lib = FakeLib()
    backend = CudaAttentionBackend(lib)
    key = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    for args, words in [((key, key, cache, torch.tensor([1, 2, 3], dtype=torch.int32)), "int64"),
                        ((key, key, cache, torch.tensor([1, 2])), "one slot per token"),
                        ((key, key[:, :1], cache, torch.tensor([1, 2, 3])), "value shape .* differs from key"),
                        ((key, key, cache.float(), torch.tensor([1, 2, 3])), "a float32 KV cache is not supported here")]:
        with pytest.raises(ValueError, match=words):
            backend.write_kv(*args)
    assert lib.calls == []


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed here")
def test_packed_cuda_library_is_built_and_exports_the_abi():
    from backends import packed

    lib = native.load_library("qm_cuda", "cuda", packed.HEADER, "packed-weight kernels")
    for symbol in ("qm_cuda_linear", "qm_cuda_dequantize", "qm_cuda_last_error"):
        assert getattr(lib, symbol) is not None
