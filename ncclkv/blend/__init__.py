"""CacheBlend: reuse the KV of text chunks cached at other positions, recompute a few tokens.

In RAG a prompt is mostly retrieved documents whose KV was computed before,
each on its own. That KV is not a prefix of the prompt, so prefix caching
cannot use it; and it lacks the cross-attention between the chunks. CacheBlend
reuses it anyway and recomputes only the tokens whose KV deviates most.

Flow, one batch (packed along tokens, ``query_start_loc`` marks requests):

1. Offline, each chunk is prefilled alone and stored per layer with
   :meth:`ChunkStore.store_chunk`, keyed by its own tokens' stable hash.
2. ``task = BlendRetriever(store).new_request(prompts, chunk_starts)``: a
   background thread finds the chunks and assembles each layer's K/V for the
   whole batch a few layers ahead (chunks not found are marked invalid).
3. Per layer the model computes fresh Q/K/V of its current tokens and calls
   :meth:`BlendExecutor.blend` with ``task.result(layer)``; it attends with
   the returned short Q and long K/V and keeps ``local_indices`` of its
   hidden states. Before ``check_layer`` every token is computed; at it the
   tokens to recompute are chosen; after it only those are computed.

:mod:`ncclkv.blend.reference_model` holds a tiny pure-torch Llama used by the
tests and the benchmark to check all of this end to end.
"""

from ._executor import BlendExecutor
from ._retriever import BlendRetriever, BlendRetrieverTask
from ._rope import RopeSpec, apply_rope, rerotate
from ._store import ChunkStore, StoredChunk
from ._types import BlendConfig, BlendOutput, BlendRetrieverResult

__all__ = [
    "BlendConfig",
    "BlendExecutor",
    "BlendOutput",
    "BlendRetriever",
    "BlendRetrieverResult",
    "BlendRetrieverTask",
    "ChunkStore",
    "RopeSpec",
    "StoredChunk",
    "apply_rope",
    "rerotate",
]
