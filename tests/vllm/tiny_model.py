"""The tiny random Llama the real-vLLM tests run, and token-id prompts for it."""

from __future__ import annotations

from collections.abc import Sequence

from ncclkv._vllm_model import TinyLlamaSpec, build_tiny_llama
from ncclkv.demo._workload import make_prompts as demo_prompts

__all__ = ["TINY_SPEC", "TinyLlamaSpec", "build_tiny_llama", "make_prompts"]

# The shape ncclkv's vLLM tests use: 2 layers, 4 kv-heads of 64 (8 query heads).
TINY_SPEC = TinyLlamaSpec()


def make_prompts(lengths: Sequence[int], *, vocab_size: int = TINY_SPEC.vocab_size,
                 seed: int = 0) -> list[list[int]]:
    """Random token-id prompts of the given lengths, the same for a given seed (bos/eos ids left out)."""
    return demo_prompts(tuple(lengths), vocab_size, seed)
