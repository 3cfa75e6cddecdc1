"""EngineConfig.cpus (NCCLKV_CPUS): every thread an engine starts runs there; the caller's thread keeps its mask.

Run in a child process: /proc/self/task then lists only the threads this run started (channel, ZMQ,
data-plane store, executors, links, gloo), whatever the test process ran before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ncclkv._affinity import core_siblings, parse_cpu_list, usable_cpus
from ncclkv.engine import EngineConfig
from ncclkv.layout import KVGeometry, ParallelLayout

_CHILD = r"""
import json, os, sys, threading
from pathlib import Path
from kvsim import build_sides, close_sides, engine_ref, wait_sent
from ncclkv.paged import set_copy_threads
from ncclkv.layout import KVGeometry, ParallelLayout, Span
from ncclkv.paged import CacheLayout

def masks():
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name = next(l.split(None, 1)[1] for l in status if l.startswith("Name:"))
        cpus = next(l.split(None, 1)[1] for l in status if l.startswith("Cpus_allowed_list:"))
        out[int(task.name)] = (name.strip(), cpus.strip())
    return out

import torch
torch.set_num_threads(1)  # the test's own torch ops start no OpenMP threads: only the engines' are counted
cpus = frozenset(int(c) for c in sys.argv[1].split(","))
before = masks()
main_before = sorted(os.sched_getaffinity(0))
# 1 MiB slices (128 tokens x 8 heads x 128 x 2 x float32): with NCCLKV_COPY_THREADS=2 a scatter takes the pool
geometry, layout = KVGeometry(2, 8, 128, "float32"), ParallelLayout(1, 1)
prefill = build_sides("cpus-prefill", layout, geometry, CacheLayout.CPU, 16, "producer", num_blocks=24, cpus=cpus)
decode = build_sides("cpus-decode", layout, geometry, CacheLayout.CPU, 16, "consumer", num_blocks=24, cpus=cpus)
src, dst, staged_src, staged_dst = list(range(8)), list(range(8)), list(range(8, 16)), list(range(8, 16))
try:
    # A push that lands in the consumer's staging before expect(): expect scatters it on the caller's thread,
    # the first threaded copy of this process, so the copy pool's workers start there.
    ref = engine_ref("cpus-decode", layout, decode)
    prefill[0].fill(seed=2, block_ids=staged_src, num_tokens=128)  # the test's own copies: one thread
    prefill[0].fill(seed=1, block_ids=src, num_tokens=128)
    prefill[0].engine.start_push("r2", ref, staged_src, 128)
    for layer in range(2):
        prefill[0].engine.save_layer("r2", layer)
    prefill[0].engine.finish("r2")
    assert wait_sent(prefill[0], "r2")["r2"] is None
    set_copy_threads(2)  # from here on copies take the pool, and the first is expect's, on this thread
    decode[0].engine.expect("r2", engine_ref("cpus-prefill", layout, prefill), staged_dst, 128, push=True)
    decode[0].engine.wait("r2", timeout_s=20)
    assert decode[0].mismatches(2, staged_dst, 128, Span(0, 128)) == []
    prefill[0].engine.finish("r1", src, 128)  # held for the pull
    decode[0].engine.expect("r1", engine_ref("cpus-prefill", layout, prefill), dst, 128)
    decode[0].engine.wait("r1", timeout_s=20)
    assert decode[0].mismatches(1, dst, 128, Span(0, 128)) == []
    during = masks()
finally:
    close_sides(prefill, decode)
started = {tid: value for tid, value in during.items() if tid not in before}
print(json.dumps({"main_before": main_before, "main_after": sorted(os.sched_getaffinity(0)),
                  "started": sorted(started.values())}))
"""


def test_every_thread_an_engine_starts_runs_on_its_cpus() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:  # the one CPU would be every thread's inherited mask too: "on its CPUs" shows nothing
        pytest.skip(f"needs 2 or more allowed CPUs to tell the engine's mask from an inherited one, has {allowed}")
    target = {allowed[-1]}  # not all of them: a thread that kept an inherited mask would show
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("NCCLKV_CPUS", None)
    env.pop("NCCLKV_COPY_THREADS", None)
    done = subprocess.run([sys.executable, "-c", _CHILD, ",".join(map(str, target))], capture_output=True, text=True,
                          timeout=180, env=env, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["main_after"] == result["main_before"] == allowed  # the caller's thread got its mask back
    names = [name for name, _ in result["started"]]
    # Python threads show as "python" here (CPython < 3.14 names no OS thread); the C++ ones by name:
    # ZMQ's (the channel's context), the data plane's store, gloo's (the links).
    for native in ("ZMQbg/IO/0", "pt_tcpstore_uv", "gloo_tcp_loop", "ncclkv-copy"):
        assert native in names, names
    assert names.count("python") >= 8, names  # channel I/O and dispatcher, executors, link posters and reapers
    elsewhere = [(name, cpus) for name, cpus in result["started"] if parse_cpu_list(cpus) != target]
    assert not elsewhere, f"threads not on CPUs {sorted(target)}: {elsewhere}"


def test_cpus_come_from_the_environment_and_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    geometry, layout = KVGeometry(2, 2, 16, "float32"), ParallelLayout(1, 1)
    monkeypatch.setenv("NCCLKV_CPUS", "0-1,3")
    assert EngineConfig("e", 0, layout, geometry).cpus == frozenset({0, 1, 3})
    assert EngineConfig("e", 0, layout, geometry, cpus={2}).cpus == frozenset({2})  # the config wins
    monkeypatch.setenv("NCCLKV_CPUS", "auto")
    monkeypatch.setenv("OMP_PLACES", "{0},{1}")
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    siblings = core_siblings([0, 1])
    free = usable_cpus() - siblings[0] - siblings[1]
    assert EngineConfig("e", 0, layout, geometry).cpus == (free or None)
    monkeypatch.delenv("NCCLKV_CPUS")
    assert EngineConfig("e", 0, layout, geometry).cpus is None  # unset: threads keep their starting mask
    for bad in (set(), {-1}, {1.5}, [0], "0"):
        with pytest.raises(ValueError, match=r"cpus must be a non-empty set of CPU numbers >= 0, got"):
            EngineConfig("e", 0, layout, geometry, cpus=bad)  # type: ignore[arg-type]
