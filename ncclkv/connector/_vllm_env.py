"""Read this worker's place in its engine and the model's KV geometry from vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..layout import KVGeometry, ParallelLayout
from ._worker import RankInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["check_speculative", "parallel_ranks", "rank_info"]


def parallel_ranks(tp_size: int, pp_size: int) -> tuple[int, int]:
    """(tp_rank, pp_rank) of this process from vLLM's parallel state.

    Without an initialised parallel state (a connector driven outside a
    vLLM worker, as the lifecycle tests do) only a single-rank engine is valid.
    """
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group, model_parallel_is_initialized

    if model_parallel_is_initialized():
        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    if tp_size * pp_size != 1:
        raise RuntimeError(f"vLLM's parallel state is not initialised, but the engine has tp_size={tp_size}, "
                           f"pp_size={pp_size}: cannot tell this worker's rank")
    return 0, 0


def rank_info(vllm_config: VllmConfig, cache_dtype: torch.dtype) -> RankInfo:
    """Layout (with vLLM's pipeline layer split), geometry and ranks of this worker."""
    from vllm.distributed.utils import get_pp_indices

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    tp_rank, pp_rank = parallel_ranks(tp_size, pp_size)
    num_layers = model.get_total_num_hidden_layers()
    partition = None
    if pp_size > 1:  # vLLM's own split (it honours VLLM_PP_LAYER_PARTITION), carried to the peer explicitly
        bounds = [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]
        partition = tuple(stop - start for start, stop in bounds)
    use_mla = bool(model.use_mla)
    geometry = KVGeometry(
        num_layers=num_layers,
        num_kv_heads=1 if use_mla else model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        dtype=str(cache_dtype).removeprefix("torch."),
        use_mla=use_mla,
    )
    engine_id = vllm_config.kv_transfer_config.engine_id if vllm_config.kv_transfer_config else None
    if not engine_id:
        raise ValueError("kv_transfer_config.engine_id is not set")
    return RankInfo(str(engine_id), tp_rank, pp_rank, ParallelLayout(tp_size, pp_size, partition), geometry,
                    vllm_config.cache_config.block_size, str(vllm_config.cache_config.cache_dtype))


def check_speculative(vllm_config: VllmConfig) -> None:
    """Refuse speculative decoding whose drafter keeps a KV cache of its own (EAGLE, MTP, a draft model).

    ncclkv moves the model's layers only: a drafter's layers would fail
    registration (their indices run past the model's, or repeat them), and a
    decode engine's drafter would attend over prompt positions of its own
    layers that it never computed. Methods without a drafter KV cache
    (``ngram``, ``suffix``) need nothing moved beyond the model's layers.
    """
    speculative = vllm_config.speculative_config
    if speculative is not None and speculative.uses_draft_kv_cache():
        raise ValueError(
            f"ncclkv: speculative_config method {speculative.method!r} keeps a drafter KV cache, which ncclkv does "
            "not move (only the model's layers): the decode engine's drafter would attend over prompt positions it "
            "never computed. Use a method without one ('ngram', 'suffix') or no speculative decoding with ncclkv")
