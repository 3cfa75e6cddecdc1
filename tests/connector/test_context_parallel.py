"""vLLM's context parallelism (DCP on decode, PCP on prefill) is refused at start, naming the sizes.

Under DCP vLLM deals a request's tokens round-robin over the ranks of a TP
group; ncclkv's layout gives every rank all of them, so a load would write
wrong KV without an error. Both roles refuse, before any worker starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ncclkv.connector import NcclKVConnector
from ncclkv.connector._vllm_env import check_context_parallel

from .harness import make_vllm_config


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER], ids=["scheduler", "worker"])
@pytest.mark.parametrize(("kv_role", "field", "size", "dcp", "pcp"), [
    ("kv_consumer", "decode_context_parallel_size", 2, 2, 1),
    ("kv_producer", "prefill_context_parallel_size", 4, 1, 4),
    ("kv_both", "decode_context_parallel_size", 8, 8, 1),
])
def test_context_parallelism_is_refused_naming_the_sizes(model_dir: Path, role: KVConnectorRole, kv_role: str,
                                                         field: str, size: int, dcp: int, pcp: int) -> None:
    config = make_vllm_config("cp", model_dir, kv_role)
    check_context_parallel(config)  # vLLM's default (1, 1): taken
    object.__setattr__(config.parallel_config, field, size)  # vLLM's own check wants TP >= DCP: not built here
    with pytest.raises(ValueError, match=rf"^ncclkv: context parallelism is not supported "
                                         rf"\(decode_context_parallel_size={dcp}, prefill_context_parallel_size={pcp}\)"
                                         rf": its ranks hold every {size}-th run"):
        NcclKVConnector(config, role)
