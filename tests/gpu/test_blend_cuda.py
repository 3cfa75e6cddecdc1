"""The blend retriever on CUDA: chunks kept on the host are assembled on the GPU on a side stream, each layer handed
over once its copies are done (a bounded wait on an event), byte for byte what the store holds."""

from __future__ import annotations

import pytest
import torch

from ncclkv.blend import BlendRetriever, ChunkStore
from ncclkv.buffer import KVStoreBuffer

pytestmark = pytest.mark.gpu

LAYERS, HEADS, HEAD_SIZE = 3, 2, 8


def _kv(tokens: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(tokens, HEADS, HEAD_SIZE, generator=gen) for _ in range(LAYERS)]
    v = [torch.randn(tokens, HEADS, HEAD_SIZE, generator=gen) for _ in range(LAYERS)]
    return k, v


def test_the_retriever_assembles_each_layer_on_the_gpu() -> None:
    store = ChunkStore(KVStoreBuffer(1 << 22), LAYERS)
    first, second = torch.arange(100, 105), torch.arange(200, 208)
    first_kv, second_kv = _kv(5, seed=1), _kv(8, seed=2)
    store.store_chunk(first, *first_kv, torch.arange(5))
    store.store_chunk(second, *second_kv, torch.arange(40, 48))
    unknown = torch.arange(300, 303)  # not stored: computed by the model, its rows left for it
    prompt = torch.cat([unknown, second, first])
    with BlendRetriever(store, device="cuda", lookahead=2, deadline_s=30.0).new_request([prompt], [[3, 11]]) as task:
        for layer in range(LAYERS):
            got = task.result(layer, timeout_s=30.0)
            assert got.k.device.type == "cuda" and got.v.device.type == "cuda"
            assert got.valid_mask.tolist() == [False] * 3 + [True] * 13
            assert got.original_positions.tolist() == [0, 0, 0] + list(range(40, 48)) + list(range(5))
            for part, tensor in ((0, got.k), (1, got.v)):
                assert torch.equal(tensor[3:11].cpu(), second_kv[part][layer])
                assert torch.equal(tensor[11:].cpu(), first_kv[part][layer])
        assert not task.prefetching
