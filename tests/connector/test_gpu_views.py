"""The caches vLLM 0.32's GPU model runner hands the connector, made on the CPU by vLLM's own code.

vLLM 0.32 views every attention layer's cache as ``[blocks, kv heads, tokens,
2*head_size]`` whose last dim its GPU backends split per token into K and V,
laid out in memory by a ``KVCacheLayout`` (heads before tokens, tokens before
heads, or blocks outermost with every layer's page of a block together), and
cut into kernel blocks smaller than the blocks it schedules where a backend
needs them. The harness builds such caches with vLLM's ``allocate_kv_cache``
and writes and reads them as vLLM's FlashAttention backend does; ncclkv
moves them from and to the CPU backend's caches and between themselves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ncclkv.connector import NcclKVConfig
from ncclkv.connector._worker import RankInfo, WorkerSide
from ncclkv.layout import KVGeometry, ParallelLayout

from .harness import BLOCK_SIZE, EngineSim
from .test_lifecycle import CELL_BYTES, FAST, LENGTHS, NUM_LAYERS, PROMPTS, _bytes, _decode, _prefill, _reference, _settle


@pytest.mark.parametrize(("prefill_layout", "decode_layout", "kernel_block_size", "push"), [
    ("BLNHC", None, BLOCK_SIZE, False),  # blocks outermost, tokens before heads -> the CPU backend's cache
    ("LBNHC", "LBHNC", 16, False),  # kernel blocks of 16 under vLLM's blocks of 32, on both sides
    (None, "BLHNC", BLOCK_SIZE, True),  # the CPU backend's cache -> blocks outermost, heads before tokens
    ("LBHNC", "LBNHC", 16, True),
], ids=["blnhc-to-cpu-pull", "lbnhc-to-lbhnc-kernel16-pull", "cpu-to-blhnc-push", "lbhnc-to-lbnhc-kernel16-push"])
def test_vllm_gpu_caches_move_k_and_v_per_token(engines: list[EngineSim], model_dir: Path, prefill_layout: str | None,
                                                decode_layout: str | None, kernel_block_size: int, push: bool) -> None:
    expected = _reference(engines, model_dir, PROMPTS)
    prefill = EngineSim.build("prefill", model_dir, "kv_producer", FAST, gpu_layout=prefill_layout,
                              kernel_block_size=kernel_block_size)
    engines.append(prefill)
    decode = EngineSim.build("decode", model_dir, "kv_consumer", FAST, gpu_layout=decode_layout,
                             kernel_block_size=kernel_block_size)
    engines.append(decode)
    extra = {"remote_decode": decode.ref} if push else None
    params = _prefill(prefill, PROMPTS, extra)
    ids = _decode(decode, PROMPTS, params, also=(prefill,))
    assert decode.outputs(ids) == expected
    # The decode side's "attention" read every loaded token back through the backend's own K and V views.
    assert decode.mismatches == [] and decode.load_errors == set()
    assert _bytes(decode, "bytes_received") == sum(LENGTHS) * CELL_BYTES * NUM_LAYERS
    _settle(prefill, decode)


def _worker(block_size: int = BLOCK_SIZE) -> WorkerSide:
    info = RankInfo("e", 0, 0, ParallelLayout(1, 1), KVGeometry(2, 4, 64, "float32"), block_size)
    return WorkerSide(info, NcclKVConfig(cache_layout="packed"), "consumer")


def test_caches_laid_out_differently_are_refused_naming_the_layers() -> None:
    heads_first = torch.zeros(8, 4, 32, 128)
    tokens_first = torch.zeros(8, 32, 4, 128).transpose(1, 2)  # same shape, read alike: one layout, one block size
    _worker()._cache_layout({0: heads_first, 1: tokens_first})  # noqa: SLF001
    with pytest.raises(ValueError, match=r"not all laid out alike \(PACKED in blocks of 32 for layers \[0\]; "
                                         r"PACKED in blocks of 16 for layers \[1\]\).*drafter"):
        _worker()._cache_layout({0: heads_first, 1: torch.zeros(16, 4, 16, 128)})  # noqa: SLF001
    with pytest.raises(ValueError, match=r"layer 1's KV cache: a PACKED cache must be .*got shape \[8, 4, 32, 127\]"):
        _worker()._cache_layout({0: heads_first, 1: torch.zeros(8, 4, 32, 127)})  # noqa: SLF001


def test_kernel_blocks_must_divide_vllms_blocks() -> None:
    with pytest.raises(ValueError, match=r"blocks of 32 tokens, which do not divide vLLM's block size 48"):
        _worker(48)._cache_layout({0: torch.zeros(8, 4, 32, 128)})  # noqa: SLF001
    worker = _worker(64)
    assert worker._cache_layout({0: torch.zeros(8, 4, 16, 128)})[1] == 16  # noqa: SLF001
    worker._blocks_per_id = 4  # noqa: SLF001 - as register_kv_caches sets it
    assert list(worker._cache_blocks([3, 0])) == [12, 13, 14, 15, 0, 1, 2, 3]  # noqa: SLF001
