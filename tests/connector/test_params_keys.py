"""What the decode side checks a remote prefill against, besides the tokens: real vLLM Requests.

The params' token_hash covered the tokens, the LoRA adapter and the cache
salt, not the multimodal inputs or prompt embeddings: two prompts with one
image each behind the same placeholder tokens passed the check, and the
decode took the other image's KV.
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

from ncclkv.connector._params import RemotePrefill, token_hash
from ncclkv.connector._scheduler import _prefilled_for, extra_keys
from ncclkv.engine import EngineRef
from ncclkv.layout import ParallelLayout

PROMPT = list(range(100, 132))  # 32 tokens; an image's placeholders at 4..11
BLOCK = 16


def request(images: list[tuple[str, int, int]] = (), embeds: torch.Tensor | None = None,
            salt: str | None = None) -> Request:
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                      mm_position=PlaceholderRange(offset=offset, length=length))
                for identifier, offset, length in images]
    return Request("r", prompt_token_ids=list(PROMPT), sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, mm_features=features, cache_salt=salt, prompt_embeds=embeds)


def remote_for(prefill: Request, num_tokens: int = len(PROMPT)) -> RemotePrefill:
    digest = token_hash(PROMPT[:num_tokens], BLOCK, extra_keys(prefill, num_tokens))
    ref = EngineRef("prefill", ParallelLayout(1, 1), ("tcp://127.0.0.1:1",))
    return RemotePrefill("t", ref, (0, 1), num_tokens, digest, BLOCK, False)


def test_the_same_tokens_with_another_image_are_not_the_prefilled_request() -> None:
    prefill = request([("image-a", 4, 8)])
    remote = remote_for(prefill)
    assert _prefilled_for(request([("image-a", 4, 8)]), remote)  # the same image: its KV is taken
    assert not _prefilled_for(request([("image-b", 4, 8)]), remote)  # passed before: image-a's KV for image-b
    assert not _prefilled_for(request([("image-a", 6, 8)]), remote)  # placed elsewhere
    assert not _prefilled_for(request(), remote)


def test_only_inputs_among_the_prefilled_tokens_count() -> None:
    """An image after the prefilled tokens does not change their KV: a longer decode prompt still matches."""
    prefill = request([("image-a", 4, 8)])
    remote = remote_for(prefill, num_tokens=16)
    assert _prefilled_for(request([("image-a", 4, 8), ("image-c", 20, 8)]), remote)
    assert not _prefilled_for(request([("image-a", 4, 8), ("image-c", 15, 8)]), remote)  # starts inside them


def test_prompt_embeddings_count() -> None:
    embeds = torch.randn(len(PROMPT), 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    remote = remote_for(request(embeds=embeds), num_tokens=16)
    assert _prefilled_for(request(embeds=embeds.clone()), remote)
    other = embeds.clone()
    other[3, 0] += 1
    assert not _prefilled_for(request(embeds=other), remote)
    later = embeds.clone()
    later[20, 0] += 1  # past the prefilled tokens
    assert _prefilled_for(request(embeds=later), remote)


@pytest.mark.parametrize("salt", [None, "tenant-1"])
def test_the_lora_name_stays_the_first_key_for_the_kv_events(salt: str | None) -> None:
    keys = extra_keys(request([("image-a", 4, 8)], salt=salt), len(PROMPT))
    assert keys == (None, salt, "image-a", 4, 8)


def _produced(prefill: Request) -> RemotePrefill:
    """The params the prefill scheduler returns for ``prefill`` (its request_finished path)."""
    from ncclkv.connector import NcclKVConfig
    from ncclkv.connector._scheduler import SchedulerSide, _Produce

    side = SchedulerSide("prefill", NcclKVConfig(), True, False, BLOCK)
    side._ref = EngineRef("prefill", ParallelLayout(1, 1), ("tcp://127.0.0.1:1",))  # noqa: SLF001
    out = side._remote_prefill(prefill, _Produce(prefill, None, "t", 1), [0, 1], prefill.num_prompt_tokens)  # noqa: SLF001
    assert out is not None
    return out


def test_a_prompt_of_embeddings_only_is_the_prefilled_request() -> None:
    """vLLM gives such a request no prompt_token_ids (its all_token_ids are placeholders, 0): the prefill hashed
    those, the decode side hashed an empty list and took every such request for another prompt."""
    embeds = torch.randn(len(PROMPT), 8, generator=torch.Generator().manual_seed(1))

    def only(e: torch.Tensor) -> Request:
        return Request("r", prompt_token_ids=None, sampling_params=SamplingParams(max_tokens=1),
                       pooling_params=None, prompt_embeds=e)
    remote = _produced(only(embeds))
    assert _prefilled_for(only(embeds.clone()), remote)
    other = embeds.clone()
    other[3, 0] += 1
    assert not _prefilled_for(only(other), remote)


def test_a_prompt_of_tokens_and_embeddings_is_the_prefilled_request() -> None:
    """Mixed mode: positions given as embeddings hold a sentinel id in prompt_token_ids, 0 in all_token_ids."""
    embeds = torch.randn(len(PROMPT), 8, generator=torch.Generator().manual_seed(2))
    is_token = [not 4 <= i < 12 for i in range(len(PROMPT))]

    def mixed(e: torch.Tensor) -> Request:
        return Request("r", prompt_token_ids=[t if ok else 99999 for t, ok in zip(PROMPT, is_token)],
                       sampling_params=SamplingParams(max_tokens=1), pooling_params=None, prompt_embeds=e,
                       prompt_is_token_ids=is_token)
    remote = _produced(mixed(embeds))
    assert _prefilled_for(mixed(embeds.clone()), remote)
