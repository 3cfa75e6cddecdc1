"""The tiny random Llama the real-vLLM tests run, and token-id prompts for it."""

from __future__ import annotations

import random
from collections.abc import Sequence

from ncclkv._vllm_model import TinyLlamaSpec, build_tiny_llama

__all__ = ["TINY_SPEC", "TinyLlamaSpec", "build_tiny_llama", "make_prompts"]

# The shape ncclkv's vLLM tests use: 2 layers, 4 kv-heads of 64 (8 query heads).
TINY_SPEC = TinyLlamaSpec()


def make_prompts(lengths: Sequence[int], *, vocab_size: int = TINY_SPEC.vocab_size,
                 seed: int = 0) -> list[list[int]]:
    """Random token-id prompts of the given lengths, the same for a given seed.

    Ids 0 and 1 (bos/eos of the tiny model) are left out.
    """
    if vocab_size <= 2:
        raise ValueError(f"vocab_size={vocab_size} leaves no ids besides bos/eos")
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(n)] for n in lengths]
