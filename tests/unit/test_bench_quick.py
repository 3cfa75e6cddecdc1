"""``ncclkv bench``: a quick run of every benchmark writes its JSON, PNG, table and RESULTS.md.

Nothing here asserts a timing: the machine is shared, and the numbers are the
benchmarks' business. The quick run is still a real check: the transfer
benchmark compares what every path wrote with what was sent (after the warm-up
round and after the last timed round, each time over random bytes), bench
overlap does the same for every mode of each row's last timed round, the scale
and memory runs check every landed byte, and the control benchmark checks
every request's Announce count and each link's data.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from benchmarks import _common, _runner
from ncclkv import cli

NAMES = ("paged", "transfer", "overlap", "control", "scale", "memory", "blend")
ALL_NAMES = (*NAMES, "vllm")  # vllm starts real engines: its quick run is tests/vllm/test_bench_vllm.py
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench")
    buffer = io.StringIO()  # capsys is function-scoped; one run serves the module's tests
    with contextlib.redirect_stdout(buffer):
        assert cli.main(["bench", *NAMES, "--quick", "--out", str(out)]) == 0
    return out, buffer.getvalue()


def test_every_benchmark_writes_json_and_png(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    for name in NAMES:
        data = json.loads((out / f"{name}.json").read_text())
        result = _common.BenchResult.from_json(data)
        assert result.name == name and result.rows and result.meta["quick"] is True
        assert result.meta["command"] == f"ncclkv bench {name} --quick"
        assert {"cpu", "cores", "torch"} <= set(result.meta["machine"])
        for row in result.rows:  # every column of the table has a value in every row
            assert {c.key for c in result.columns} <= set(row), f"{name}: row lacks {set(c.key for c in result.columns) - set(row)}"
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC


def test_tables_have_the_expected_columns(quick_run: tuple[Path, str]) -> None:
    out, printed = quick_run
    expected = {
        "transfer": ["slice", "tensors sent raw / ncclkv / engine / engine pull", "raw GB/s", "link GB/s",
                     "ncclkv GB/s", "engine GB/s", "engine pull GB/s", "memcpy GB/s", "ncclkv/raw", "engine/raw",
                     "engine pull/raw", "ncclkv/memcpy"],
        "overlap": ["c ms", "x ms", "layer-wise exposed (x)", "after-compute exposed (x)", "compute slowdown"],
        "control": ["what", "p50 us", "p99 us"],
        "paged": ["layout", "op", "GB/s best", "ratio best"],
        "scale": ["set", "mode", "GB/s best", "requests/s median", "vs 1P1D (median)"],
        "memory": ["what", "first MiB", "at 20% MiB", "last MiB", "peak MiB", "growth last 80% (%)",
                   "slope last 80% (B/request)"],
        "blend": ["recompute ratio", "fraction", "speed-up median", "query error"],
    }
    for name, headers in expected.items():
        result = _common.BenchResult.from_json(json.loads((out / f"{name}.json").read_text()))
        header_line = result.table().splitlines()[0]
        cells = [cell.strip() for cell in header_line.strip("|").split("|")]
        assert all(h in cells for h in headers), f"{name}: {cells}"
        assert header_line in printed  # each table was printed


def test_transfer_rows_cover_the_sizes_with_finite_ratios(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    rows = json.loads((out / "transfer.json").read_text())["results"]
    assert [r["slice_bytes"] for r in rows] == [64 << 10, 1 << 20, 4 << 20]
    for row in rows:
        for key in ("ncclkv_raw_median", "ncclkv_memcpy_median", "link_raw_median", "engine_raw_median",
                    "engine_pull_raw_median", "cpu_ceiling"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
        # Whole slices: every path sends one tensor per slice (the engine's count is its own stats')
        assert row["messages"] == row["ncclkv_messages"] == row["engine_messages"] == row["layers"] * row["requests"]
        # A pull sends a request's layers in runs of at most 4 MiB (pull_batch_bytes), as few as fit
        most = max(1, (4 << 20) // row["slice_bytes"])
        assert row["engine_pull_messages"] == row["requests"] * -(-row["layers"] // most), row["msgs"]


def test_overlap_times_the_link_and_the_real_engine(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    result = _common.BenchResult.from_json(json.loads((out / "overlap.json").read_text()))
    # Each path whole and in pieces (quick slices are about 4 MiB, pieces 1 MiB), every mode's bytes checked.
    assert [r["path"] for r in result.rows] == ["link", "link", "engine push", "engine push"]
    link, link_pieces, engine, engine_pieces = result.rows
    assert link["slice_bytes"] == engine["slice_bytes"] > 0  # the same slices through both paths
    assert link["chunks"].startswith("1 x ") and engine["chunks"].startswith("1 x ")
    assert int(link_pieces["chunks"].split(" x ")[0]) > 1 and int(engine_pieces["chunks"].split(" x ")[0]) > 1
    assert link["single_layer_x"] > 0 and engine["single_layer_x"] is None  # the engine path has no single-layer mode
    for row in result.rows:
        for key in ("x_ms", "c_ms", "layerwise_exposed_median", "after_exposed_median", "speedup"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["path"], key, row[key])
    assert any(line.startswith("engine push, sent as 1 x ") for line in result.headline)
    assert "last timed round" in result.meta["checked"]


def test_scale_runs_every_set_and_mode_on_the_same_bytes(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    result = _common.BenchResult.from_json(json.loads((out / "scale.json").read_text()))
    rows = result.rows
    assert [(r["set"], r["mode"], r["ranks"]) for r in rows] == [
        ("1P1D", "pull", 2), ("2P2D", "pull", 4), ("1P1D", "push", 2), ("2P1D", "push", 3), ("1P2D", "push", 3)]
    # The same requests, whatever the set: nothing lost or doubled, the warm-up requests left out.
    assert len({r["mib"] for r in rows}) == 1 and rows[0]["mib"] > 0
    assert rows[0]["vs_1p1d"] == rows[2]["vs_1p1d"] == 1.0
    for row in rows:
        assert math.isfinite(row["gbps_median"]) and row["gbps_median"] > 0 and row["rps_median"] > 0
    assert "untimed request per (prefill, decode) pair" in result.meta["warmup"]


def test_memory_samples_rss_staging_and_wire_buffers_every_wave(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    result = _common.BenchResult.from_json(json.loads((out / "memory.json").read_text()))
    rss, peak, after, wire, bound = result.rows
    assert rss["samples"] == len(rss["series"]) == math.ceil(result.meta["requests"] / result.meta["wave_size"])
    assert rss["series"][-1][0] == result.meta["requests"]  # [requests done, seconds, MiB], in order
    assert rss["first_mib"] > 0 and math.isfinite(rss["growth_pct"]) and math.isfinite(rss["slope_b"])
    # Staging's high-water mark, not a sample: pushes waited there; none was left over at a wave's end.
    assert peak["peak_mib"] > 0 and 0 < result.meta["staging_peak_rank_bytes"] <= result.meta["staging_capacity_bytes"]
    assert after["peak_mib"] == 0 and [p[2] for p in after["series"]] == [0.0] * rss["samples"]
    assert len(wire["series"]) == len(bound["series"]) == rss["samples"] and wire["last_mib"] > 0
    assert result.meta["wire_within_bound"] is True and result.meta["moved_bytes"] > 0
    assert result.headline[0].startswith("RSS left behind per request over the last 40%")
    assert "over the last 80% " in result.headline[0] and "(goal < 1024 B/request: " in result.headline[0]


def test_blend_recomputes_all_at_ratio_one_and_few_at_zero(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    rows = {r["ratio"]: r for r in json.loads((out / "blend.json").read_text())["results"]}
    assert rows[1.0]["computed"] == rows[1.0]["tokens"] and rows[1.0]["query_rel_error"] < 1e-3
    assert rows[0.0]["computed"] < rows[0.15]["computed"] < rows[1.0]["computed"]
    assert rows[0.0]["query_rel_error"] > rows[1.0]["query_rel_error"]


def test_blend_still_runs_alone(tmp_path: Path) -> None:
    from benchmarks import bench_blend

    argv = ["--chunks", "2", "--chunk-tokens", "16", "--query-tokens", "8", "--hidden", "64", "--layers", "2",
            "--repeats", "1", "--warmup", "0", "--ratios", "0", "1", "--out", str(tmp_path)]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert bench_blend.main(argv) == 0
    result = _common.BenchResult.from_json(json.loads((tmp_path / "blend.json").read_text()))
    assert [r["ratio"] for r in result.rows] == [0.0, 1.0]
    # The command that reproduces the numbers; where the files went is the runner's own (no machine path).
    assert result.meta["command"] == "python -m benchmarks.bench_blend " + " ".join(argv[:-2])
    assert (tmp_path / "blend.png").read_bytes()[:8] == PNG_MAGIC and "speed-up" in printed.getvalue()


def test_results_md_presents_every_benchmark(quick_run: tuple[Path, str]) -> None:
    out, printed = quick_run
    text = (out / "RESULTS.md").read_text()
    assert f"wrote {out / 'RESULTS.md'}" in printed
    for name in NAMES:
        assert f"## {name}:" in text and f"![{name}](figures/{name}.png)" in text
        assert (out / "figures" / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
        assert f"`ncclkv bench {name} --quick`" in text
    assert text.count("- Machine: ") == len(NAMES) and "torch " in text
    assert text.count("; code ") >= len(NAMES)  # the code version the numbers came from, in every machine line
    assert str(out) not in text  # no machine-specific paths in the document


def test_quick_runs_never_touch_the_committed_results(tmp_path: Path) -> None:
    assert _runner.results_path(_common.DEFAULT_OUT, quick=False) == _common.BENCH_DIR / "RESULTS.md"
    assert _runner.results_path(_common.QUICK_OUT, quick=True) == _common.QUICK_OUT / "RESULTS.md"
    assert _runner.results_path(_common.DEFAULT_OUT, quick=True) == _common.DEFAULT_OUT / "RESULTS.md"
    assert _runner.results_path(tmp_path, quick=False) == tmp_path / "RESULTS.md"
    assert _common.default_out(True) == _common.QUICK_OUT != _common.default_out(False)


def test_unknown_names_and_bad_repeats_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "transfer", "nope", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark(s) nope" in err and "transfer" in err
    assert cli.main(["bench", "control", "--repeats", "0", "--out", str(tmp_path)]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran


def test_list_names_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(ALL_NAMES)


def test_format_table_aligns_and_formats() -> None:
    columns = (_common.Column("name", "name", align="<"), _common.Column("gbps", "GB/s"), _common.Column("n", "n", "{:d}"))
    table = _common.format_table(columns, [{"name": "a", "gbps": 1.234, "n": 3}, {"name": "long name", "n": 10}])
    assert table.splitlines() == [
        "| name      | GB/s |  n |",
        "|:----------|-----:|---:|",
        "| a         | 1.23 |  3 |",
        "| long name |    - | 10 |",
    ]
    with pytest.raises(ValueError, match="align"):
        _common.Column("x", "x", align="^")


def test_statistics_helpers() -> None:
    assert _common.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert _common.percentile([5.0], 99) == 5.0
    assert _common.percentile(list(range(101)), 99) == 99.0
    stats = _common.summary([4.0, 1.0, 3.0])
    assert (stats["min"], stats["median"], stats["max"], stats["count"]) == (1.0, 3.0, 4.0, 3.0)
    with pytest.raises(ValueError):
        _common.summary([])
    with pytest.raises(ValueError, match="q must be"):
        _common.percentile([1.0], 101)
    assert _common.format_size(64 << 10) == "64 KiB" and _common.format_size(3 << 19) == "1.5 MiB"


def test_result_json_round_trip_and_options() -> None:
    result = _common.BenchResult("x", "X", (_common.Column("a", "A", "{:.1f}"),), [{"a": 1.0}], {"k": 1}, ["h"], "why")
    again = _common.BenchResult.from_json(json.loads(json.dumps(result.to_json())))
    assert again == result
    with pytest.raises(ValueError, match="not a benchmark result"):
        _common.BenchResult.from_json({"meta": {}, "results": []})
    with pytest.raises(ValueError, match="repeats"):
        _common.BenchOptions(repeats=0)
    assert _common.BenchOptions(quick=True).rounds(full=10, quick=3) == 3
    assert _common.BenchOptions(repeats=7).rounds(full=10, quick=3) == 7


def test_report_only_redraws_and_flags_unreadable_results(quick_run: tuple[Path, str], tmp_path: Path) -> None:
    out, _ = quick_run
    (tmp_path / "transfer.json").write_text((out / "transfer.json").read_text())
    (tmp_path / "paged.json").write_text(json.dumps({"meta": {}, "results": []}))  # an older format
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["bench", "--report-only", "--quick", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "`paged.json` could not be read" in text and "rerun `ncclkv bench paged`" in text
    assert "## transfer:" in text and "## overlap" not in text
    assert (tmp_path / "transfer.png").read_bytes()[:8] == PNG_MAGIC  # drawn from the JSON alone
    assert (tmp_path / "figures" / "transfer.png").is_file()


def test_lent_machines_follow_this_machines_sections_with_their_notes(quick_run: tuple[Path, str],
                                                                      tmp_path: Path) -> None:
    """A lent machine's kept JSON is presented after this machine's, under its own heading and NOTES.md."""
    out, _ = quick_run
    machine = tmp_path / "lent" / "big-box"
    machine.mkdir(parents=True)
    for suffix in (".json", ".png"):
        (machine / f"paged{suffix}").write_bytes((out / f"paged{suffix}").read_bytes())
    (machine / "NOTES.md").write_text("What the big box shows.\n")
    (tmp_path / "lent" / "empty-box").mkdir()  # no results: no heading
    path = _runner.write_results_md(tmp_path / "RESULTS.md", out, names=["paged", "transfer"], lent=tmp_path / "lent")
    text = path.read_text()
    ours, lent = text.split("# Lent machine: big-box\n")
    assert "## paged:" in ours and "## transfer:" in ours and "empty-box" not in text
    assert "`lent/big-box/`" in lent and lent.index("What the big box shows.") < lent.index("## paged:")
    assert "![paged](figures/lent-big-box-paged.png)" in lent and (tmp_path / "figures" / "lent-big-box-paged.png").is_file()
    assert "(shared machine)" in ours and "(shared machine)" not in lent
    assert "**Why**" not in lent  # the module's analysis describes this machine, not the lent one
    assert "- **big-box paged**: " in ours.split("## paged:")[0]  # in the summary


def test_report_only_without_results_leaves_results_md_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fresh clone has no JSON in out/: presenting nothing would empty RESULTS.md."""
    results = tmp_path / "RESULTS.md"
    results.write_text("kept\n")
    assert cli.main(["bench", "--report-only", "--out", str(tmp_path / "empty"), "--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert "no results to present" in err and "paged.json" in err and "left as it is" in err
    assert results.read_text() == "kept\n"


def test_transfer_checks_every_path_s_bytes_so_a_fast_but_wrong_path_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link path that sends zeros instead of the slices is caught by the check after its round."""
    import torch

    from benchmarks import _transfer_paths

    def wrong(self: _transfer_paths.Sender) -> None:
        zeros = torch.zeros_like(self.wires[0])
        for fut in [self.link.send(zeros) for _ in self.wires]:
            fut.result(_transfer_paths.WAIT_S)

    monkeypatch.setattr(_transfer_paths.Sender, "link_only", wrong)
    _transfer_of_64_kib_fails_its_check(tmp_path, r"^64 KiB, link path, round 0: the receiver's wire buffers differ")


def _transfer_of_64_kib_fails_its_check(out: Path, message: str) -> None:
    """A bench transfer run of 64 KiB slices raises BytesDiffer matching ``message``."""
    from benchmarks import _transfer_paths, bench_transfer

    params = bench_transfer.TransferParams(sizes=(64 << 10,), round_bytes=256 << 10, trip_sizes=(64 << 10,), trips=1)
    with _common.BenchContext(_common.BenchOptions(quick=True, repeats=1, out=out)) as ctx:
        with pytest.raises(_transfer_paths.BytesDiffer, match=message):
            bench_transfer.run(ctx, params)


def test_a_failed_memory_soak_raises_with_the_end_of_its_output() -> None:
    from benchmarks import bench_memory

    shown: list[str] = []
    with pytest.raises(RuntimeError, match=r"exited with 2; the last \d+ lines of its output:\n(.|\n)*wave-size"):
        bench_memory._soak_in_child(["--wave-size", "0"], shown.append)
    assert any("wave-size" in line for line in shown)  # and as progress, as it came


def test_memory_repeats_soak_anew_and_judge_the_median_slope(quick_run: tuple[Path, str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import bench_memory

    template = json.loads((quick_run[0] / "memory.json").read_text())
    slopes = iter([3000.0, 500.0, 900.0])
    argvs: list[list[str]] = []

    def soak(argv: list[str], progress: object) -> _common.BenchResult:
        argvs.append(argv)
        result = _common.BenchResult.from_json(json.loads(json.dumps(template)))
        result.rows[0]["slope_late_b"] = next(slopes)
        return result

    monkeypatch.setattr(bench_memory, "_soak_in_child", soak)
    result = bench_memory._repeated(["--quick"], 3, lambda _: None)
    assert argvs == [["--quick"]] * 3  # each soak a process of its own
    assert result.rows[0]["slope_late_b"] == 900.0 and result.meta["repeats"] == 3
    assert result.meta["rss_slope_late_b_all"] == [3000.0, 500.0, 900.0]
    assert result.headline[0].startswith("RSS left behind per request over the last 40% of 80 requests")
    assert "+900 B/request (median of 3 soaks, each in a new process; min +500) (goal < 1024 B/request: met)" in \
        result.headline[0]


def _send_without_gathering(self: object) -> None:
    """The ncclkv path with its gathers left out: it sends whatever its wire buffers hold."""
    from benchmarks import _transfer_paths

    for fut in [self.link.send(buf) for _, _, buf in self.pieces]:  # type: ignore[attr-defined]
        fut.result(_transfer_paths.WAIT_S)


def test_transfer_checks_that_the_ncclkv_path_gathered_what_it_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's wire buffers start out holding the gathered slices (the raw and link paths send them), so an
    ncclkv path that sent them without gathering delivered the right bytes: its check must not rest on them."""
    from benchmarks import _transfer_paths

    monkeypatch.setattr(_transfer_paths.Sender, "ncclkv", _send_without_gathering)
    _transfer_of_64_kib_fails_its_check(tmp_path, r"^64 KiB, ncclkv path, round 0: the receiver's cache differ")


def test_overlap_checks_that_the_link_path_gathered_what_it_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above for bench overlap's link rows: whole layers sent from wire buffers filled before the round."""
    from benchmarks import _transfer_paths, bench_overlap

    monkeypatch.setattr(_transfer_paths.Sender, "ncclkv", _send_without_gathering)
    params = bench_overlap.OverlapParams(num_layers=2, compute_ms=(1.0,), transfer_ms=1.0, chunk_bytes=(0,),
                                         engine_pieces=())
    with _common.BenchContext(_common.BenchOptions(quick=True, repeats=1, out=tmp_path)) as ctx:
        with pytest.raises(_transfer_paths.BytesDiffer, match=r"^link, sent as 1 x .*, c=1 ms, transfer round: "
                                                              r"layers \[0, 1\] "):
            bench_overlap.run(ctx, params)
