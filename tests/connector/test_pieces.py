"""The connector's vLLM-facing pieces on their own: stats, Prometheus metrics, handshakes, layer names, and
the CPU cache order (checked against vLLM's own cache-write op)."""

from __future__ import annotations

import pickle
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm import _custom_ops as ops
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from ncclkv.connector import NcclKVConnector
from ncclkv.connector._cpu_cache import cpu_cache_layout, vllm_cpu_layout
from ncclkv.connector._metadata import NcclKVHandshake, NcclKVMetadata, engine_ref_from_handshakes
from ncclkv.connector._stats import NcclKVPromMetrics, NcclKVStats, stats_delta
from ncclkv.connector._worker import layer_index
from ncclkv.engine import StatsSnapshot
from ncclkv.layout import ParallelLayout, Span
from ncclkv.paged import CacheLayout, PagedCacheSpec, SlotMap, gather, scatter

from .harness import make_vllm_config


def _snapshot(sent: int, received: int, waits: dict[int, tuple[float, int]]) -> StatsSnapshot:
    return StatsSnapshot(sent, 2, 1, 0.1, received, 3, 1, 0, {k: v[0] for k, v in waits.items()},
                         {k: v[1] for k, v in waits.items()})


def test_stats_delta_aggregate_reduce() -> None:
    before = _snapshot(100, 50, {0: (0.5, 1)})
    after = _snapshot(400, 50, {0: (0.8, 3), 1: (0.2, 2)})
    delta = stats_delta(before, after, [0.02, 0.04])
    assert delta.data["bytes_sent"] == 300 and delta.data["bytes_received"] == 0
    assert delta.data["layer_wait_s"] == {"0": pytest.approx(0.3), "1": pytest.approx(0.2)}
    assert delta.data["layer_waits"] == {"0": 2, "1": 2}
    other = NcclKVConnector.build_kv_connector_stats({"bytes_sent": 1, "transfer_s": [0.06],
                                                       "layer_wait_s": {"0": 0.1}, "layer_waits": {"0": 1}})
    assert isinstance(other, NcclKVStats)
    total = delta.aggregate(other)
    reduced = total.reduce()
    assert reduced["bytes_sent"] == 301 and reduced["avg_transfer_ms"] == pytest.approx(40.0)
    assert reduced["avg_layer0_wait_ms"] == pytest.approx(1000 * 0.4 / 3, abs=1e-3)
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and stats_delta(after, after, []).is_empty()
    assert pickle.loads(pickle.dumps(total)).data == total.data  # crosses processes


def test_prometheus_metrics_observe() -> None:
    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)  # all the metrics base class reads
    metrics = NcclKVConnector.build_prom_metrics(config, types, ["model_name", "engine"],  # type: ignore[arg-type]
                                                 {0: ["tiny", "0"]})
    assert isinstance(metrics, NcclKVPromMetrics)
    data = NcclKVStats(data={"bytes_received": 4096, "transfers_received": 2, "transfer_s": [0.003, 0.2],
                             "layer_wait_s": {"1": 0.5}, "layer_waits": {"1": 2}}).data
    metrics.observe(data, 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:ncclkv_bytes_received_total", labels) == 4096
    assert registry.get_sample_value("vllm:ncclkv_transfers_received_total", labels) == 2
    assert registry.get_sample_value("vllm:ncclkv_layer_wait_seconds_total", {**labels, "layer": "1"}) == 0.5
    assert registry.get_sample_value("vllm:ncclkv_transfer_seconds_count", labels) == 2
    assert registry.get_sample_value("vllm:ncclkv_transfer_seconds_bucket", {**labels, "le": "0.005"}) == 1


def _handshake(tp: int, pp: int, tp_size: int = 2, pp_size: int = 2) -> NcclKVHandshake:
    layout = ParallelLayout(tp_size, pp_size, (1, 1))
    return NcclKVHandshake("eng", layout.rank(tp, pp), tp, pp, tp_size, pp_size, (1, 1), f"tcp://h:1{tp}{pp}")


def test_handshakes_make_one_engine_ref() -> None:
    shakes = {(pp, tp): _handshake(tp, pp) for tp in range(2) for pp in range(2)}
    ref = engine_ref_from_handshakes(pickle.loads(pickle.dumps(shakes)))
    assert ref.layout == ParallelLayout(2, 2, (1, 1))
    assert ref.control_addrs == ("tcp://h:100", "tcp://h:110", "tcp://h:101", "tcp://h:111")  # rank = pp * tp_size + tp
    del shakes[(1, 0)]
    with pytest.raises(ValueError, match=r"no handshake from ranks \[2\]"):
        engine_ref_from_handshakes(shakes)
    with pytest.raises(ValueError, match="keyed"):
        engine_ref_from_handshakes({(0, 1): _handshake(0, 0)})


def test_a_handshake_of_another_connector_is_refused_naming_its_type() -> None:
    """vLLM's MultiConnector publishes its first sub-connector's handshake metadata and hands it to every
    sub-connector's scheduler: ncclkv's may get another connector's. engine_ref_from_handshakes read the first
    one's layout before checking its type, so it raised AttributeError ('... has no attribute layout') instead
    of the ValueError naming the type it meant to raise."""
    class _Other:  # e.g. NIXL's handshake payload
        engine_id = "eng"

    with pytest.raises(ValueError, match=r"handshake \(0, 0\) is _Other, not NcclKVHandshake"):
        engine_ref_from_handshakes({(0, 0): _Other()})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"handshake \(0, 1\) is _Other, not NcclKVHandshake"):
        engine_ref_from_handshakes({(0, 0): _handshake(0, 0), (0, 1): _Other()})  # type: ignore[dict-item]


def test_metadata_pickles_and_layer_names() -> None:
    meta = NcclKVMetadata(preempted=frozenset({"r"}))
    assert pickle.loads(pickle.dumps(meta)) == meta and not meta.empty and NcclKVMetadata().empty
    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(ValueError, match="one layer index"):
        layer_index("model.layers.1.experts.2.attn")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_layout_choice_reads_what_vllm_writes(dtype: torch.dtype) -> None:
    """Write with vLLM's own CPU cache op; the connector's layout gathers any token span back exactly."""
    nb, heads, bs, dim = 6, 4, 32, 64
    cache = torch.zeros(nb, heads, bs, 2 * dim, dtype=dtype)
    layout = cpu_cache_layout(CacheLayout.CPU, cache, bs, dim)  # what register_kv_caches does with a detected CPU
    assert layout is vllm_cpu_layout(dtype, bs, dim)
    isa = _get_attn_isa(dtype, bs, dim, "auto")
    if isa in ("vec", "vec16"):  # vLLM's portable kernels store K column-major ([head_size, block_size])
        assert layout is CacheLayout.CPU_KT
    if isa == "amx":  # bfloat16 on a CPU with AMX tiles: K and V packed in 16-row tiles
        assert layout is CacheLayout.CPU_AMX
    tokens = 100
    kv = torch.randn(2, tokens, heads, dim).to(dtype)
    block_ids = [4, 1, 5, 2]
    slots = torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(tokens)])
    keys, values = cache.view(nb, heads, 2 * bs, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(kv[0], kv[1], keys, values, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    spec = PagedCacheSpec.from_tensor(cache, layout)
    slot_map = SlotMap(block_ids, bs)
    for span, hs in ((Span(0, 100), Span(0, 4)), (Span(13, 77), Span(1, 3)), (Span(31, 33), Span(2, 3))):
        out = torch.empty(2, len(span), len(hs), dim, dtype=dtype)
        gather(cache, spec, slot_map, span, hs, out)
        assert torch.equal(out, kv[:, span.start:span.stop, hs.start:hs.stop])
    before = cache.clone()
    patch = torch.randn(2, 20, 2, dim).to(dtype)
    scatter(patch, cache, spec, slot_map, Span(40, 60), Span(1, 3))
    out = torch.empty(2, 20, 2, dim, dtype=dtype)
    gather(cache, spec, slot_map, Span(40, 60), Span(1, 3), out)
    assert torch.equal(out, patch)
    scatter(kv[:, 40:60, 1:3].contiguous(), cache, spec, slot_map, Span(40, 60), Span(1, 3))
    assert torch.equal(cache, before)  # nothing else was touched
    # A block scattered by ncclkv is what vLLM's op writes for the same tokens.
    again = torch.zeros_like(cache)
    scatter(kv[:, :64].contiguous(), again, spec, SlotMap([3, 0], bs), Span(0, 64), Span(0, 4))
    assert torch.equal(again[3], cache[4]) and torch.equal(again[0], cache[1])


def test_cpu_layout_choice_checks_a_configured_layout() -> None:
    cache = torch.zeros(2, 2, 32, 128)
    found = cpu_cache_layout(CacheLayout.CPU, cache, 32, 64)
    other = CacheLayout.CPU if found is CacheLayout.CPU_KT else CacheLayout.CPU_KT
    assert cpu_cache_layout(found, cache, 32, 64, configured=True) is found
    with pytest.raises(ValueError, match=rf"cache_layout'\]='{other.value}', but vLLM's CPU cache op .* "
                                         rf"use '{found.value}'"):
        cpu_cache_layout(other, cache, 32, 64, configured=True)
    flash = torch.zeros(2, 2, 32, 2, 64)
    assert cpu_cache_layout(CacheLayout.FLASH_NHD, flash, 32, 64, configured=True) is CacheLayout.FLASH_NHD


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_cpu_cache_is_read_as_vllms_attention_writes_it(model_dir: Path, kv_cache_dtype: str) -> None:
    """kv_cache_dtype fp8 on vLLM's CPU backend: the caches are uint8, and vLLM's attention hands its cache op keys
    and values in the model's dtype, the ISA picked for the model's dtype. The worker registers them and reads
    back, token by token, the fp8 codes vLLM's own op wrote."""
    model_dtype = torch.float32  # the harness's model
    try:
        isa = _get_attn_isa(model_dtype, 32, 64, kv_cache_dtype)
    except NotImplementedError:  # fp8 KV on the CPU needs AVX-512 or AMX: vLLM refuses it, and so does the probe
        with pytest.raises(NotImplementedError):
            vllm_cpu_layout(torch.uint8, 32, 64, kv_cache_dtype, model_dtype)
        return
    config = make_vllm_config("fp8", model_dir, "kv_consumer")
    config.cache_config.cache_dtype = kv_cache_dtype
    num_layers, nb, heads, bs, dim = config.model_config.get_total_num_hidden_layers(), 6, 4, 32, 64
    storage = torch.zeros(num_layers, nb, heads, bs, 2 * dim, dtype=torch.uint8)
    connector = NcclKVConnector(config, KVConnectorRole.WORKER)
    try:
        connector.register_kv_caches({f"model.layers.{i}.self_attn.attn": storage[i] for i in range(num_layers)})
        cache, spec = connector._work()._caches[0]  # noqa: SLF001
        fp8 = torch.float8_e5m2 if kv_cache_dtype.endswith("e5m2") else torch.float8_e4m3fn
        gen = torch.Generator().manual_seed(1)
        tokens = 100
        codes = torch.randint(0, 256, (2, tokens, heads, dim), generator=gen, dtype=torch.uint8)
        codes[~torch.isfinite(codes.view(fp8).float()) | (codes == 0x80)] = 0  # no nan, inf or -0: exact codes
        block_ids = [4, 1, 5, 2]
        slots = torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(tokens)])
        keys, values = cache.view(nb, heads, 2 * bs, dim).chunk(2, dim=2)
        kv = codes.view(fp8).to(model_dtype)
        ops.cpu_attn_reshape_and_cache(kv[0], kv[1], keys, values, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype=kv_cache_dtype)
        out = torch.empty(2, tokens, heads, dim, dtype=torch.uint8)
        gather(cache, spec, SlotMap(block_ids, bs), Span(0, tokens), Span(0, heads), out)
        assert torch.equal(out, codes)
    finally:
        connector.shutdown()
