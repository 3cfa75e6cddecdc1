"""What ``ncclkv demo`` sends: a batch of token-id prompts of varied lengths, and how many tokens to generate."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["MODES", "DemoSettings", "make_prompts", "prompt_lengths"]

MODES = ("pull", "push")


def prompt_lengths(num_requests: int, shortest: int, longest: int, block_size: int) -> tuple[int, ...]:
    """``num_requests`` lengths spread evenly from ``shortest`` to ``longest``.

    Every length but ``shortest`` ends in a partial block (one token is added
    to a whole-block length where there is room), so the transfer of partial
    last blocks is exercised; ``shortest`` is kept as given.
    """
    if num_requests < 1 or shortest < 1 or longest < shortest or block_size < 1:
        raise ValueError(f"need num_requests >= 1 and 1 <= shortest <= longest, got num_requests={num_requests}, "
                         f"shortest={shortest}, longest={longest}, block_size={block_size}")
    if num_requests == 1:
        return (shortest,)
    lengths = []
    for i in range(num_requests):
        n = shortest + round(i * (longest - shortest) / (num_requests - 1))
        if i and n % block_size == 0:
            n += 1 if n < longest else -1 if n - 1 >= shortest else 0
        lengths.append(n)
    return tuple(lengths)


def make_prompts(lengths: tuple[int, ...], vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts, the same for a given seed; ids 0 and 1 (bos/eos) are left out."""
    if vocab_size <= 2:
        raise ValueError(f"vocab_size={vocab_size} leaves no ids besides bos/eos")
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab_size) for _ in range(n)] for n in lengths]


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """One demo run: the batch, how many rounds of it, the transfer modes, the engines' model length."""

    num_requests: int = 8
    shortest: int = 64
    longest: int = 600
    gen_tokens: int = 32
    modes: tuple[str, ...] = MODES
    block_size: int = 32
    max_model_len: int = 1024
    rounds: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "shortest", "longest", "gen_tokens", "block_size", "max_model_len", "rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.shortest > self.longest:
            raise ValueError(f"the shortest prompt ({self.shortest} tokens) is longer than the longest "
                             f"({self.longest})")
        if self.longest + self.gen_tokens > self.max_model_len:
            raise ValueError(f"longest prompt {self.longest} + {self.gen_tokens} generated tokens exceed the "
                             f"model length {self.max_model_len}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must be distinct values of {list(MODES)}, got {list(self.modes)}")

    @property
    def lengths(self) -> tuple[int, ...]:
        return prompt_lengths(self.num_requests, self.shortest, self.longest, self.block_size)

    def prompts(self, vocab_size: int) -> list[list[int]]:
        return make_prompts(self.lengths, vocab_size, self.seed)

    def warmup_prompts(self, vocab_size: int) -> list[list[int]]:
        """A batch of the same lengths but other tokens: every path and shape runs once before anything is timed."""
        return make_prompts(self.lengths, vocab_size, self.seed + 1)
