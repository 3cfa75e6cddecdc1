"""Real vLLM engines on the CPU: the harness the ncclkv connector tests build on.

(a) one engine's greedy outputs are deterministic and not degenerate;
(b) prefill and decode in two engine processes through vLLM's own
    ExampleConnector (KV on disk) give exactly the single engine's outputs,
    the decode engine really loaded the prefill's KV, and corrupting that KV
    changes its outputs. The ncclkv P/D test follows the same shape.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from engine_proc import EngineOptions, EngineProcess, RequestResult
from tiny_model import TINY_SPEC, build_tiny_llama, make_prompts

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
# Varied lengths over 1, 2 and 4 blocks. None is 1 more than a multiple of 32:
# ExampleConnector stores under a key of the prompt cut to whole blocks of
# len-1 tokens and looks up with len-2, so those lengths would never match.
PROMPT_LENGTHS = (45, 77, 130)
MAX_TOKENS = 12
PROMPTS = make_prompts(PROMPT_LENGTHS)


@dataclass(frozen=True, slots=True)
class Reference:
    first: list[RequestResult]
    second: list[RequestResult]
    start_s: float


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, cpu_cores: list[int],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    """One plain engine (no connector) run twice over PROMPTS, then closed."""
    log = tmp_path_factory.mktemp("reference") / "single.log"
    with EngineProcess(EngineOptions(model_dir=tiny_model_dir, cpu_core=cpu_cores[0]), log,
                       name="single") as engine:
        start_s = engine.start()
        first = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
        second = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
    print(f"\nsingle engine start: {start_s:.1f} s")
    yield Reference(first, second, start_s)


def _ids(results: list[RequestResult]) -> list[tuple[int, ...]]:
    return [r.token_ids for r in results]


@pytest.mark.timeout(400)
def test_single_engine_greedy_is_deterministic(reference: Reference) -> None:
    first = _ids(reference.first)
    assert [len(t) for t in first] == [MAX_TOKENS] * len(PROMPTS)
    assert all(r.finish_reason == "length" for r in reference.first)
    # The second pass reads the first pass's KV from the prefix cache and must
    # still give the same tokens.
    assert _ids(reference.second) == first
    assert [r.num_cached_tokens for r in reference.second] == [
        n // BLOCK_SIZE * BLOCK_SIZE for n in PROMPT_LENGTHS
    ]
    # Not degenerate: prompts give different continuations, each of several tokens.
    assert len(set(first)) == len(PROMPTS)
    assert all(len(set(t)) >= MAX_TOKENS // 2 for t in first), first
    assert all(0 <= tok < TINY_SPEC.vocab_size for t in first for tok in t)


def test_tiny_model_build_is_idempotent(tiny_model_dir: Path, tmp_path: Path) -> None:
    weights = tiny_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_tiny_llama(tiny_model_dir, **asdict(TINY_SPEC)) == tiny_model_dir
    assert weights.stat().st_mtime_ns == before  # same spec: nothing rewritten
    other = build_tiny_llama(tmp_path / "other", **{**asdict(TINY_SPEC), "seed": 1})
    assert (other / "model.safetensors").read_bytes() != weights.read_bytes()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not a model")
    with pytest.raises(ValueError, match="refusing to overwrite"):
        build_tiny_llama(foreign)
    assert (foreign / "keep.txt").read_text() == "not a model"


def _example_connector(role: str, storage: Path) -> dict[str, object]:
    return dict(
        kv_connector="ExampleConnector",
        kv_role=role,
        kv_connector_extra_config={"shared_storage_path": str(storage)},
    )


def _loaded_tokens(prompt_len: int) -> int:
    # ExampleConnector loads whole blocks of the first len-2 tokens; the decode
    # engine recomputes the rest.
    return (prompt_len - 2) // BLOCK_SIZE * BLOCK_SIZE


def _corrupt_saved_kv(storage: Path) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(storage.glob("*/*.safetensors"))
    gen = torch.Generator().manual_seed(1234)
    for path in files:
        kv = load_file(path)["kv_cache"]
        save_file({"kv_cache": torch.randn(kv.shape, generator=gen).to(kv.dtype) * 4}, path)
    return len(files)


@pytest.mark.timeout(400)
def test_pd_through_example_connector_matches_single_engine(
    reference: Reference, launch_engine, cpu_cores: list[int], tmp_path: Path
) -> None:
    storage = tmp_path / "kv_store"
    storage.mkdir()
    t0 = time.monotonic()
    # Both build at once, each pinned to its own core when there are two.
    prefill = launch_engine("prefill", cpu_core=cpu_cores[0],
                            kv_transfer_config=_example_connector("kv_producer", storage))
    # No local prefix cache on the decode side: every generate must load.
    decode = launch_engine("decode", cpu_core=cpu_cores[-1], enable_prefix_caching=False,
                           kv_transfer_config=_example_connector("kv_consumer", storage))
    prefill.wait_ready()
    decode.wait_ready()
    print(f"\nprefill start: {prefill.start_s:.1f} s, decode start: {decode.start_s:.1f} s "
          f"(launched together)")

    expected = _ids(reference.first)
    prefilled = prefill.generate(PROMPTS, max_tokens=1)
    assert [r.token_ids for r in prefilled] == [t[:1] for t in expected]
    saved = sorted(storage.glob("*/*.safetensors"))
    assert len(saved) == len(PROMPTS) * TINY_SPEC.num_layers, saved

    decoded = decode.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert _ids(decoded) == expected
    # The decode engine has an empty prefix cache: every cached token was loaded.
    assert [r.num_cached_tokens for r in decoded] == [_loaded_tokens(n) for n in PROMPT_LENGTHS]

    # The loaded KV is what made the outputs right: garbage in, other tokens out.
    assert _corrupt_saved_kv(storage) == len(saved)
    corrupted = decode.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r.num_cached_tokens for r in corrupted] == [_loaded_tokens(n) for n in PROMPT_LENGTHS]
    assert all(c != e for c, e in zip(_ids(corrupted), expected)), _ids(corrupted)
    print(f"P/D test body: {time.monotonic() - t0:.1f} s")
