"""NCCL links: real 2-rank NCCL groups, both ends in this process (one thread each), as the engine opens them.

One GPU: NCCL refuses a communicator with two ranks on one GPU, so the link's
handshake must refuse it first, with an error that names the GPU. Two GPUs:
tensors of every dtype cross in both directions, and engine pulls and pushes
land byte for byte, through the same code as gloo links but the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
import torch

from ncclkv.errors import HandshakeError
from ncclkv.layout import KVGeometry, ParallelLayout, Span
from ncclkv.paged import CacheLayout
from ncclkv.transport import DataPlane, Link

from engine.kvsim import RankSide, close_sides, engine_ref

WAIT_S = 60.0  # NCCL's first communicator in a process takes seconds
T = TypeVar("T")


def both_ends(first: Callable[[], T], second: Callable[[], T]) -> tuple[T, T]:
    """Run the two ends' blocking calls at once (each waits for the other); the first error is raised."""
    with ThreadPoolExecutor(2) as pool:
        futures = pool.submit(first), pool.submit(second)
        return futures[0].result(WAIT_S), futures[1].result(WAIT_S)


def sample(seq: int, device: str) -> torch.Tensor:
    dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8)
    gen = torch.Generator().manual_seed(seq)
    raw = torch.randint(0, 256, ((seq % 7 + 1) * 4096 * 8,), dtype=torch.uint8, generator=gen)
    return raw.view(dtypes[seq % len(dtypes)]).reshape(seq % 7 + 1, -1).to(device)


@pytest.mark.gpu
def test_two_ends_on_one_gpu_are_refused_naming_the_gpu() -> None:
    with DataPlane("127.0.0.1") as a, DataPlane("127.0.0.1") as b:
        store = a.address
        with pytest.raises(HandshakeError, match="same GPU") as caught:
            both_ends(lambda: a.open_link("one-gpu", 0, store, "cuda:0", WAIT_S),
                      lambda: b.open_link("one-gpu", 1, store, "cuda:0", WAIT_S))
        assert "GPU-" in str(caught.value) and "one-gpu" in str(caught.value)
        assert a.links() == [] and b.links() == []


@pytest.mark.gpu(2)
def test_tensors_cross_both_ways_in_order_byte_exact() -> None:
    with DataPlane("127.0.0.1") as a, DataPlane("127.0.0.1") as b:
        store = a.address
        ends: tuple[Link, Link] = both_ends(lambda: a.open_link("two-gpus", 0, store, "cuda:0", WAIT_S),
                                            lambda: b.open_link("two-gpus", 1, store, "cuda:1", WAIT_S))
        for direction, (sender, receiver) in enumerate((ends, ends[::-1])):
            tensors = [sample(seq + 100 * direction, str(sender.device)) for seq in range(24)]
            received = [receiver.recv(t.shape, t.dtype) for t in tensors]
            sent = [sender.send(t) for t in tensors]
            for seq, (tensor, future) in enumerate(zip(tensors, received)):
                got = future.result(WAIT_S)
                assert got.device == receiver.device
                assert torch.equal(got.cpu().view(torch.uint8), tensor.cpu().view(torch.uint8)), (direction, seq)
            for future in sent:
                future.result(WAIT_S)
        assert ends[0].stats().tensors_sent == ends[1].stats().tensors_received == 24
        for link in ends:
            link.close()


@pytest.mark.gpu(2)
@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_engine_moves_a_request_between_two_gpus(push: bool) -> None:
    geometry = KVGeometry(num_layers=4, num_kv_heads=8, head_size=128, dtype="bfloat16")
    layout = ParallelLayout(1, 1)
    prefill = [RankSide.build("prefill", 0, layout, geometry, CacheLayout.FLASH_NHD, 16, 32, "producer",
                              device="cuda:0")]
    decode = [RankSide.build("decode", 0, layout, geometry, CacheLayout.FLASH_HND, 16, 32, "consumer",
                             device="cuda:1")]
    try:
        num_tokens, src_blocks, dst_blocks = 300, list(range(31, 12, -1)), list(range(19))
        prefill[0].fill(seed=9, block_ids=src_blocks, num_tokens=num_tokens)
        producer, consumer = prefill[0].engine, decode[0].engine
        if push:
            producer.start_push("r", engine_ref("decode", layout, decode), src_blocks, num_tokens)
            consumer.expect("r", engine_ref("prefill", layout, prefill), dst_blocks, num_tokens, push=True)
            for layer in range(geometry.num_layers):
                producer.save_layer("r", layer)
            producer.finish("r")
        else:
            producer.finish("r", src_blocks, num_tokens)
            consumer.expect("r", engine_ref("prefill", layout, prefill), dst_blocks, num_tokens)
        consumer.wait("r", timeout_s=WAIT_S)
        assert decode[0].mismatches(9, dst_blocks, num_tokens, Span(0, num_tokens)) == []
        assert consumer.take_finished_receiving() == {"r": None}
        assert consumer.stats().bytes_received == 2 * num_tokens * 8 * 128 * 2 * geometry.num_layers
    finally:
        close_sides(prefill, decode)
