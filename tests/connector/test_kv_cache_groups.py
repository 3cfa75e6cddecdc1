"""Which KV caches the connector takes: full attention (MLA included), not caches whose blocks vLLM frees early."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MLAAttentionSpec, SlidingWindowSpec)

from ncclkv.connector import NcclKVConnector

from .harness import BLOCK_SIZE, make_vllm_config

NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SHAPE = {"block_size": BLOCK_SIZE, "num_kv_heads": 4, "head_size": 64, "dtype": torch.float32}


def _config(spec: object) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER], ids=["scheduler", "worker"])
@pytest.mark.parametrize(("spec", "name"), [
    (SlidingWindowSpec(**SHAPE, sliding_window=64), "SlidingWindowSpec"),
    (ChunkedLocalAttentionSpec(**SHAPE, attention_chunk_size=64), "ChunkedLocalAttentionSpec"),
], ids=["sliding-window", "chunked-local"])
def test_a_model_of_local_attention_only_is_refused_naming_its_spec(model_dir: Path, role: KVConnectorRole,
                                                                   spec: object, name: str) -> None:
    config = make_vllm_config("local", model_dir, "kv_producer")
    with pytest.raises(ValueError, match=rf"KV cache group 0 \(layers .*layers\.0.*\) is {name}: ncclkv moves "
                                         r"full-attention KV caches only"):
        NcclKVConnector(config, role, _config(spec))


@pytest.mark.parametrize("spec", [FullAttentionSpec(**SHAPE), MLAAttentionSpec(**{**SHAPE, "num_kv_heads": 1})],
                         ids=["full", "mla"])
def test_full_attention_and_mla_are_taken(model_dir: Path, spec: object) -> None:
    connector = NcclKVConnector(make_vllm_config("full", model_dir, "kv_producer"), KVConnectorRole.SCHEDULER,
                                _config(spec))
    connector.shutdown()
