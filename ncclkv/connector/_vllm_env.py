"""Read this worker's place in its engine and the model's KV geometry from vLLM."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from ..layout import KVGeometry, ParallelLayout
from ._worker import RankInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["MOVABLE_DRAFTERS", "check_context_parallel", "check_kv_cache_groups", "check_speculative", "drafter_layers",
           "parallel_ranks", "rank_info"]


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


def rank_info(vllm_config: VllmConfig, cache_dtype: torch.dtype, layer_indices: Collection[int] = ()) -> RankInfo:
    """Layout (with vLLM's pipeline layer split), geometry and ranks of this worker.

    ``layer_indices``: the layers whose caches this worker registers. Those
    past the model's are a speculative drafter's (EAGLE, MTP: vLLM numbers
    them on), counted into the geometry as layers like the others once
    :func:`check_speculative` allows the drafter.
    """
    from vllm.distributed.utils import get_pp_indices

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    tp_rank, pp_rank = parallel_ranks(tp_size, pp_size)
    num_layers = model.get_total_num_hidden_layers()
    drafter = drafter_layers(vllm_config, num_layers, layer_indices)
    num_layers += len(drafter)
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
                    vllm_config.cache_config.block_size, str(vllm_config.cache_config.cache_dtype), tuple(drafter),
                    str(model.dtype).removeprefix("torch."))


def drafter_layers(vllm_config: VllmConfig, num_model_layers: int, layer_indices: Collection[int]) -> list[int]:
    """The layers in ``layer_indices`` past the model's ``num_model_layers``: a speculative drafter's, which
    must follow the model's without a gap; ValueError naming them when no drafter with a KV cache explains them."""
    extra = sorted(i for i in layer_indices if i >= num_model_layers)
    if not extra:
        return []
    speculative = vllm_config.speculative_config
    if speculative is None or not speculative.uses_draft_kv_cache():
        raise ValueError(f"ncclkv: KV cache layers {extra} lie past the model's {num_model_layers} layers, and no "
                         "speculative drafter with a KV cache is configured")
    if extra != list(range(num_model_layers, num_model_layers + len(extra))):
        raise ValueError(f"ncclkv: the drafter's KV cache layers {extra} do not follow the model's "
                         f"{num_model_layers} layers")
    return extra


def check_context_parallel(vllm_config: VllmConfig) -> None:
    """Refuse vLLM's context parallelism (decode DCP, prefill PCP), naming the sizes.

    ncclkv's layout shards layers (PP) and kv heads (TP) and gives every rank
    all of a request's tokens. Under DCP vLLM deals tokens round-robin (in
    runs of ``cp_kv_cache_interleave_size``) over the ranks of a TP group and
    its scheduler's blocks hold ``block_size * dcp`` tokens; under PCP there
    are ``tp * pp * pcp`` workers where the layout counts ``tp * pp``. A load
    would write every token into each rank's blocks: wrong KV, no error.
    """
    parallel = vllm_config.parallel_config
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if dcp > 1 or pcp > 1:
        raise ValueError(
            f"ncclkv: context parallelism is not supported (decode_context_parallel_size={dcp}, "
            f"prefill_context_parallel_size={pcp}): its ranks hold every {max(dcp, pcp)}-th run of a request's "
            "tokens, and ncclkv's layout gives each rank all of them; run without DCP/PCP")


# Drafters whose KV layers follow the model's and whose forward writes a step's positions in its first pass and
# later ones past them (vLLM 0.32: EagleProposer); others (DFlash, which stores context KV outside the layer hooks,
# DSpark, ...) are refused by name until they are shown to work.
MOVABLE_DRAFTERS = ("eagle", "eagle3", "mtp")


def check_speculative(vllm_config: VllmConfig) -> None:
    """Refuse a speculative drafter whose KV cache ncclkv cannot move as layers of the model's own geometry.

    A drafter of :data:`MOVABLE_DRAFTERS` (single-module MTP) is moved as
    extra layers after the model's: its layers follow the model's in vLLM's
    numbering, share its block table (same kv heads, head size and dtype, so
    the same KV cache group) and go through the same connector hooks (vLLM
    defers ``wait_for_save`` past the drafter's forward). Refused, naming
    why: any other method with a drafter KV cache (a separate draft model,
    whose layers restart at 0; ``extract_hidden_states``, which caches hidden
    states; DFlash; ...), multi-module MTP (the prefill side's MTP layers
    hold unverified drafts at prompt positions), a drafter under pipeline
    parallelism, and a drafter whose kv heads or head size differ from the
    model's. Methods without a KV cache (``ngram``, ``suffix``) need nothing,
    except on a KV producer under pipeline parallelism, refused for any
    method: vLLM's V1 model runner defers ``wait_for_save`` past the drafter
    whenever a ``speculative_config`` is set, and its non-last pipeline ranks
    return before that point, so they would never hold a prompt nor finish a
    push, and never free its blocks.
    """
    speculative = vllm_config.speculative_config
    if speculative is None:
        return
    method = speculative.method
    kv, pp_size = vllm_config.kv_transfer_config, vllm_config.parallel_config.pipeline_parallel_size
    if pp_size > 1 and (kv is None or kv.is_kv_producer):
        raise ValueError(
            f"ncclkv: speculative_config method {method!r} with pipeline_parallel_size={pp_size} on a KV producer "
            f"(kv_role {kv.kv_role if kv is not None else None!r}) is not supported: with any speculative method "
            "vLLM's V1 model runner defers wait_for_save until after the drafter, which the runner's non-last "
            "pipeline ranks never reach, so those ranks would never hold a prompt for its pull nor finish its push, "
            "and vLLM would never free its blocks. Run the prefill engine without speculative decoding or without "
            "pipeline parallelism")
    if not speculative.uses_draft_kv_cache():
        return
    why = None
    if speculative.uses_draft_model():
        why = "a separate draft model's KV cache layers are numbered from 0, not after the model's"
    elif speculative.uses_extract_hidden_states():
        why = "it caches hidden states, not KV"
    elif method not in MOVABLE_DRAFTERS:
        why = f"ncclkv moves the drafters of {', '.join(MOVABLE_DRAFTERS)} only"
    elif method == "mtp" and getattr(speculative.draft_model_config.hf_config, "num_nextn_predict_layers", 1) > 1:
        # With more modules than draft tokens the unused ones would still be sent, never written.
        why = "multi-module MTP: the prefill side's MTP layers hold unverified drafts at prompt positions"
    elif vllm_config.parallel_config.pipeline_parallel_size > 1:
        why = "a drafter under pipeline parallelism is not supported"
    else:
        model, draft = vllm_config.model_config, speculative.draft_model_config
        ours = (model.get_total_num_kv_heads(), model.get_head_size(), bool(model.use_mla))
        theirs = (draft.get_total_num_kv_heads(), draft.get_head_size(), bool(draft.use_mla))
        if ours != theirs:
            why = (f"its (kv heads, head size, MLA) {theirs} differ from the model's {ours}: ncclkv moves a "
                   "drafter's layers as layers of the model's geometry")
    if why is not None:
        raise ValueError(f"ncclkv: speculative_config method {method!r} keeps a drafter KV cache that ncclkv "
                         f"cannot move ({why}). Use EAGLE, EAGLE-3 or single-module MTP with the model's kv heads "
                         "and head size, a method without a drafter KV cache ('ngram', 'suffix'), or no "
                         "speculative decoding with ncclkv")


def check_kv_cache_groups(kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse KV caches whose blocks vLLM may free while a transfer still reads or writes them.

    ncclkv moves every prompt token of every layer through the blocks of the
    request's one KV cache group; vLLM (hybrid manager off, as for any
    connector without ``SupportsHMA``) gives full-attention models exactly
    that, and turns sliding windows into full attention when a model mixes
    them. A model of sliding-window or chunked-local layers only keeps its
    own manager, which frees the blocks behind the window (its block table
    then names the null block there), and state caches (Mamba) hold no
    tokens: refused, naming the group and its spec.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    if kv_cache_config is None:
        return
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        refused = sorted({type(s).__name__ for s in specs if not isinstance(s, FullAttentionSpec)})
        if refused:
            raise ValueError(f"ncclkv: KV cache group {index} (layers {group.layer_names[:3]}"
                             f"{'...' if len(group.layer_names) > 3 else ''}) is {', '.join(refused)}: ncclkv moves "
                             "full-attention KV caches only (vLLM frees a sliding window's or chunked-local "
                             "layer's blocks behind the window while a transfer may still use them; a state "
                             "cache holds no tokens)")
