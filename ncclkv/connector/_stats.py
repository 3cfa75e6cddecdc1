"""Transfer statistics of the connector: vLLM's ``KVConnectorStats`` and Prometheus metrics.

Workers send one :class:`NcclKVStats` per step (the change since their last
report); vLLM aggregates them across workers and logging intervals, logs
:meth:`NcclKVStats.reduce`, and feeds the data to :class:`NcclKVPromMetrics`.
``data`` holds only JSON-like values (it crosses processes):

- counters ``bytes_sent``, ``bytes_received``, ``tensors_sent``, ``tensors_received``,
  ``transfers_sent``, ``transfers_received``, ``transfers_failed``;
- ``layer_wait_s`` / ``layer_waits``: per layer (str key), seconds from the start
  of a load until that layer had landed, summed, and how many loads that is;
- ``transfer_s``: each finished load's duration (start to last layer landed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from ..engine import StatsSnapshot

__all__ = ["COUNTERS", "NcclKVPromMetrics", "NcclKVStats", "stats_delta"]

COUNTERS = ("bytes_sent", "bytes_received", "tensors_sent", "tensors_received",
            "transfers_sent", "transfers_received", "transfers_failed")
_SNAPSHOT_FIELDS = {"bytes_sent": "bytes_sent", "bytes_received": "bytes_received", "tensors_sent": "tensors_sent",
                    "tensors_received": "tensors_received", "transfers_sent": "requests_sent",
                    "transfers_received": "requests_received", "transfers_failed": "requests_failed"}


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {name: 0 for name in COUNTERS}
    data.update(layer_wait_s={}, layer_waits={}, transfer_s=[])
    return data


@dataclass
class NcclKVStats(KVConnectorStats):
    def __post_init__(self) -> None:
        base = _empty()
        base.update(self.data or {})
        self.data = base

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> NcclKVStats:
        if not isinstance(other, NcclKVStats):
            raise TypeError(f"cannot aggregate NcclKVStats with {type(other).__name__}")
        for name in COUNTERS:
            self.data[name] += other.data[name]
        for key in ("layer_wait_s", "layer_waits"):
            mine = self.data[key]
            for layer, value in other.data[key].items():
                mine[layer] = mine.get(layer, 0) + value
        self.data["transfer_s"] = list(self.data["transfer_s"]) + list(other.data["transfer_s"])
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in COUNTERS}
        durations = sorted(self.data["transfer_s"])
        if durations:
            out["avg_transfer_ms"] = round(1000 * sum(durations) / len(durations), 3)
            out["p50_transfer_ms"] = round(1000 * durations[len(durations) // 2], 3)
        for layer in sorted(self.data["layer_waits"], key=int):
            count = self.data["layer_waits"][layer]
            if count:
                out[f"avg_layer{layer}_wait_ms"] = round(1000 * self.data["layer_wait_s"][layer] / count, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS) and not self.data["transfer_s"]


def stats_delta(before: StatsSnapshot, after: StatsSnapshot, transfer_s: list[float]) -> NcclKVStats:
    """What one engine did between two snapshots, plus the loads that finished meanwhile."""
    data = _empty()
    for name, field_name in _SNAPSHOT_FIELDS.items():
        data[name] = getattr(after, field_name) - getattr(before, field_name)
    for layer, seconds in after.layer_wait_seconds.items():
        count = after.layer_wait_count.get(layer, 0) - before.layer_wait_count.get(layer, 0)
        if count:
            data["layer_wait_s"][str(layer)] = seconds - before.layer_wait_seconds.get(layer, 0.0)
            data["layer_waits"][str(layer)] = count
    data["transfer_s"] = list(transfer_s)
    return NcclKVStats(data=data)


_TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class NcclKVPromMetrics(KVConnectorPromMetrics):
    """Counters (bytes, tensors, transfers, failures, per-layer wait) and a histogram of load durations."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:ncclkv_{name}", documentation=f"ncclkv: {name.replace('_', ' ')}",
                                    labelnames=labelnames)
            for name in COUNTERS
        }
        layer_labels = [*labelnames, "layer"]
        self._layer_wait = self._counter_cls(
            name="vllm:ncclkv_layer_wait_seconds", labelnames=layer_labels,
            documentation="ncclkv: seconds from the start of a load until each layer landed, summed over loads")
        self._layer_waits = self._counter_cls(
            name="vllm:ncclkv_layer_waits", labelnames=layer_labels,
            documentation="ncclkv: loads counted in ncclkv_layer_wait_seconds, per layer")
        self._transfer = self._histogram_cls(
            name="vllm:ncclkv_transfer_seconds", labelnames=labelnames, buckets=list(_TRANSFER_BUCKETS),
            documentation="ncclkv: duration of each KV load, start to last layer landed")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        data = NcclKVStats(data=dict(transfer_stats_data)).data
        # max(0, ...): a counter refuses a negative step by raising, inside vLLM's stat logger
        for name, counter in self._counters.items():
            if data[name] > 0:
                counter.labels(*labels).inc(data[name])
        for layer, seconds in data["layer_wait_s"].items():
            self._layer_wait.labels(*labels, layer).inc(max(0.0, seconds))
            self._layer_waits.labels(*labels, layer).inc(data["layer_waits"].get(layer, 0))
        histogram = self._transfer.labels(*labels)
        for seconds in data["transfer_s"]:
            histogram.observe(seconds)
