"""The benchmarks' judgements, without running them: slopes, the wire-pool bound, byte checks, summaries, warm-up.

No timing is asserted; every input is made up here.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import _runner, bench_memory, bench_overlap, bench_paged
from benchmarks._common import BenchResult, machine_info
from benchmarks._resources import fit, slope
from benchmarks._soak import SoakSample
from benchmarks._transfer_paths import BytesDiffer
from ncclkv.layout import KVGeometry
from ncclkv.scenario._transfer import TransferConfig, add_arguments, config_from_args

KIB = 1 << 10


def test_slope_is_bytes_per_request_over_the_last_80_percent() -> None:
    requests = list(range(8, 808, 8))
    warmup = [100e6 + 1e6 * i for i in range(20)]  # the first 20% may climb freely
    leak = warmup + [200e6 + 2 * KIB * r for r in requests[20:]]  # 2 KiB per request after it
    assert slope(requests, leak) == pytest.approx(2 * KIB)
    assert fit(requests, leak)[1] == pytest.approx(0, abs=1e-6)
    steps = warmup + [200e6 + (1 << 20) * (i % 2) for i in range(80)]  # one MiB up and down: no trend
    assert abs(slope(requests, steps)) < 100 and fit(requests, steps)[1] > 0
    with pytest.raises(ValueError, match="as many"):
        slope([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError, match="samples"):
        slope([1], [1.0])
    with pytest.raises(ValueError, match="distinct"):
        slope([5, 5, 5], [1.0, 2.0, 3.0], warmup=0)


def _sample(cached: int, bound: int) -> SoakSample:
    return SoakSample(0, 0.0, "end", 1, 0, 0, 0, cached, wire_bound=bound)


def test_wire_pools_are_judged_against_the_highest_bound_so_far() -> None:
    # The bound read at a wave's end can drop with its window before the next give trims the pool to it.
    assert bench_memory._within_running_bound([_sample(5, 10), _sample(9, 6), _sample(10, 8)])
    assert not bench_memory._within_running_bound([_sample(5, 10), _sample(11, 10)])


def test_overlap_check_names_the_layers_that_differ() -> None:
    sent: list[Any] = []

    class Endpoint:
        def send(self, tag: str, payload: object = None) -> None:
            sent.append(tag)

        def expect(self, tag: str, timeout_s: float = 0) -> object:
            return ["a", "x", "c"] if tag == "digests" else None

    check = bench_overlap._ByteCheck(SimpleNamespace(endpoint=Endpoint()), ["a", "b", "c"], "link, sent as 1 x 4 MiB")
    check.before()
    check.after("single", 4.0)  # the last layer alone: only it must match
    with pytest.raises(BytesDiffer, match=r"^link, sent as 1 x 4 MiB, c=4 ms, layerwise round: layers \[1\] "):
        check.after("layerwise", 4.0)
    assert sent == ["scramble", "digests", "digests"]


def _paged_row(layout: str, op: str, ratio: float) -> dict[str, Any]:
    return {"layout": layout, "op": op, "slice": "full", "kernel": "torch", "ratio_median": ratio, "size_mib": 64.0}


def test_gpu_paged_summary_counts_gpu_layouts_only() -> None:
    rows = [_paged_row(layout, op, ratio) for op in ("gather", "scatter")
            for layout, ratio in (("FLASH_NHD", 0.6), ("PACKED", 0.4), ("CPU_KT", 0.03), ("CPU", 0.5))]
    result = BenchResult("paged", "t", (), rows, {"device": "cuda"})
    lines = bench_paged.headline(result)
    assert lines[0] == "gather / memcpy (median, full slices, GPU layouts): 0.40 (PACKED, 64 MiB) to 0.60 " \
                       "(FLASH_NHD, 64 MiB)"
    assert "CPU-backend layouts" in lines[2] and "0.03 (CPU_KT, 64 MiB)" in lines[2]
    assert "0.03" not in lines[0] + lines[1]
    cpu = bench_paged.headline(BenchResult("paged", "t", (), rows, {"device": "cpu"}))
    assert cpu[0].startswith("gather / memcpy (median, full slices): 0.03 (CPU_KT")  # on the CPU every layout


def test_machine_line_names_the_code_version() -> None:
    info = machine_info()
    assert isinstance(info["code"], str) and info["code"]
    assert f"; code {info['code']}" in _runner._machine_line({"machine": info})
    assert "code" not in _runner._machine_line({"machine": {"cpu": "x"}})  # older results: no such part


def test_transfer_scenario_warm_up_uses_blocks_past_every_request() -> None:
    cfg = TransferConfig(KVGeometry(2, 2, 8, "float32"), (40, 20, 33), warmup=True)
    per = 3  # ceil(40 / 16)
    assert cfg.num_blocks(16, num_prefill=2) == (3 + 2) * per
    assert cfg.warmup_tokens == 20
    assert cfg.warmup_blocks(0, 16) == [9, 10] and cfg.warmup_blocks(1, 16) == [12, 13]
    assert TransferConfig(cfg.geometry, cfg.tokens).num_blocks(16, num_prefill=2) == 3 * per  # off: as before
    parser = argparse.ArgumentParser()
    parser.add_argument("--deadline", type=float, default=10.0)
    parser.add_argument("--small", action="store_true")
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--warmup"])).warmup
    assert not config_from_args(parser.parse_args([])).warmup


def test_rerunning_one_benchmark_keeps_the_figures_of_the_kept_results(tmp_path: Any) -> None:
    """In a clone the JSON of out/ is kept (committed) but not its PNGs (ignored): rewriting RESULTS.md after one
    benchmark ran (its PNG just written) must still show the others' figures, drawn from their kept JSON."""
    import json
    import shutil

    from benchmarks._common import DEFAULT_OUT

    out = tmp_path / "out"
    out.mkdir()
    for name in ("paged", "control"):
        shutil.copyfile(DEFAULT_OUT / f"{name}.json", out / f"{name}.json")
    control = BenchResult.from_json(json.loads((out / "control.json").read_text()))
    assert _runner.load("control").plot(control, out / "control.png")  # the benchmark that was just rerun
    text = _runner.write_results_md(tmp_path / "RESULTS.md", out, names=["paged", "control"]).read_text()
    assert "![control](figures/control.png)" in text
    assert "![paged](figures/paged.png)" in text, "the kept result's section lost its figure"
    assert (tmp_path / "figures" / "paged.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_lines_name_their_machine_when_the_kept_results_come_from_several(tmp_path: Any) -> None:
    """out/ keeps each benchmark's last full run: rerunning one on another day's machine leaves this machine's
    sections from two machines, and the summary must not present their lines as one machine's."""
    import json

    out = tmp_path / "out"
    out.mkdir()
    # Names outside the registry: no module draws a figure or recomputes the findings of these made-up rows.
    base = {"name": "paged", "title": "t", "columns": [["x", "x", "{:.2f}", ">"]], "results": [{"x": 1.0}],
            "headline": ["paged finding"], "analysis": ""}

    def kept(name: str, cpu: str, date: str) -> None:
        meta = {"machine": {"cpu": cpu, "cores": 2, "usable_cores": 2, "date": date}, "command": f"ncclkv bench {name}"}
        (out / f"{name}.json").write_text(json.dumps({**base, "name": name, "meta": meta,
                                                      "headline": [f"{name} finding"]}))

    kept("alpha", "Intel(R) Xeon(R) Processor", "2026-11-26 21:33 UTC")
    kept("beta", "AMD EPYC", "2026-11-27 09:08 UTC")
    text = _runner.write_results_md(tmp_path / "RESULTS.md", out, names=["alpha", "beta"]).read_text()
    summary = text.split("## Summary\n", 1)[1].split("\n## ", 1)[0]
    assert "- **alpha** (Intel(R) Xeon(R) Processor, 2 cores, 2026-11-26 21:33 UTC): alpha finding" in summary
    assert "- **beta** (AMD EPYC, 2 cores, 2026-11-27 09:08 UTC): beta finding" in summary
    kept("beta", "Intel(R) Xeon(R) Processor", "2026-11-27 09:08 UTC")  # one machine, two days: no labels
    text = _runner.write_results_md(tmp_path / "RESULTS.md", out, names=["alpha", "beta"]).read_text()
    assert "- **alpha**: alpha finding" in text and "- **beta**: beta finding" in text
