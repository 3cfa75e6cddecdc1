"""``ncclkv demo``: argument parsing, the batch it sends, its checks and its summary table (no engines here).

The real run (vLLM engines) is tests/vllm/test_demo.py.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys

import pytest

from ncclkv.cli import _build_parser, main
from ncclkv.commands.demo import demo_settings, transport_args
from ncclkv.demo import DemoReport, DemoSettings, PhaseResult, Reporter, format_plain, prompt_lengths, summary_table
from ncclkv.demo import connector_config, make_prompts, rich_available


def parse(*argv: str) -> argparse.Namespace:
    return _build_parser().parse_args(["demo", *argv])


# ------------------------------------------------------------------ arguments

def test_defaults_full_and_quick() -> None:
    full, quick = demo_settings(parse()), demo_settings(parse("--quick"))
    assert (full.num_requests, full.shortest, full.longest, full.gen_tokens, full.rounds) == (8, 64, 600, 32, 3)
    assert (quick.num_requests, quick.shortest, quick.longest, quick.gen_tokens, quick.rounds) == (4, 45, 200, 8, 1)
    assert full.modes == quick.modes == ("pull", "push")


def test_explicit_values_win_over_quick() -> None:
    settings = demo_settings(parse("--quick", "--requests", "3", "--min-tokens", "33", "--max-tokens", "99",
                                   "--gen-tokens", "5", "--rounds", "2", "--mode", "push"))
    assert (settings.num_requests, settings.shortest, settings.longest, settings.gen_tokens, settings.rounds,
            settings.modes) == (3, 33, 99, 5, 2, ("push",))
    assert settings.lengths == (33, 66, 99)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--requests", "0"], "num_requests must be an int >= 1, got 0"),
    (["--min-tokens", "300", "--max-tokens", "200"], "shortest prompt (300 tokens) is longer than the longest (200)"),
    (["--max-tokens", "1000", "--gen-tokens", "32"], "longest prompt 1000 + 32 generated tokens exceed"),
    (["--rounds", "-1"], "rounds must be an int >= 1, got -1"),
    (["--timeout", "0"], "--timeout must be a finite number of seconds > 0 (at most 1e+09), got 0.0"),
    (["--timeout", "inf"], "--timeout must be a finite number of seconds > 0 (at most 1e+09), got inf"),
    (["--transport-only", "--gen-tokens", "4"], "--gen-tokens apply to the vLLM demo, not to --transport-only"),
    (["--transport-only", "--requests", "0"], "--requests and --max-tokens must be >= 1, got 0 and 512"),
])
def test_bad_arguments_exit_2_naming_the_value(capsys: pytest.CaptureFixture[str], argv: list[str],
                                               needle: str) -> None:
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncclkv demo: error: ") and needle in err, err


def test_transport_only_arguments() -> None:
    assert transport_args(parse("--transport-only")) == ["--requests", "32", "--max-tokens", "512"]
    assert transport_args(parse("--transport-only", "--quick")) == ["--requests", "8", "--max-tokens", "128"]
    assert transport_args(parse("--transport-only", "--requests", "5")) == ["--requests", "5", "--max-tokens", "512"]


def test_unknown_mode_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse("--mode", "teleport")
    assert exc.value.code == 2 and "invalid choice: 'teleport'" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_transport_only_runs_the_engine_level_demo() -> None:
    """The pre-vLLM demo, unchanged: local engine ranks, heterogeneous layouts, bytes checked (exit 0)."""
    done = subprocess.run([sys.executable, "-m", "ncclkv.cli", "demo", "--transport-only", "--requests", "2",
                           "--max-tokens", "64", "--timeout", "90"], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[1/2] pull: prefill TP=2 -> decode PP=2" in done.stdout and "[2/2] done in" in done.stdout


# ------------------------------------------------------------------ the batch

def test_prompt_lengths_spread_with_partial_last_blocks() -> None:
    lengths = prompt_lengths(8, 64, 600, 32)
    assert lengths == (64, 141, 217, 294, 370, 447, 523, 600)
    assert lengths[0] % 32 == 0 and all(n % 32 for n in lengths[1:])
    assert prompt_lengths(3, 32, 96, 32) == (32, 65, 95)  # 64 -> 65; 96 is the longest: 95
    assert prompt_lengths(1, 40, 90, 32) == (40,)
    assert prompt_lengths(2, 64, 64, 32) == (64, 64)  # no room either way: kept
    with pytest.raises(ValueError, match="shortest=10, longest=5"):
        prompt_lengths(2, 10, 5, 32)


def test_prompts_are_seeded_and_avoid_bos_eos() -> None:
    settings = DemoSettings(num_requests=3, shortest=40, longest=90)
    prompts = settings.prompts(512)
    assert [len(p) for p in prompts] == list(settings.lengths)
    assert prompts == settings.prompts(512) and prompts != DemoSettings(num_requests=3, shortest=40, longest=90,
                                                                        seed=1).prompts(512)
    assert min(min(p) for p in prompts) >= 2 and max(max(p) for p in prompts) < 512
    warmup = settings.warmup_prompts(512)
    assert [len(p) for p in warmup] == list(settings.lengths) and not set(map(tuple, warmup)) & set(map(tuple, prompts))
    with pytest.raises(ValueError, match="vocab_size=2"):
        make_prompts((3,), 2, 0)


def test_settings_reject_repeated_or_unknown_modes() -> None:
    with pytest.raises(ValueError, match="modes must be distinct values of"):
        DemoSettings(modes=("pull", "pull"))
    with pytest.raises(ValueError, match="got \\['carrier-pigeon'\\]"):
        DemoSettings(modes=("carrier-pigeon",))


# ------------------------------------------------------------------ checks and summary

LENGTHS = (45, 97)
OUT_A, OUT_B = (5, 6, 7), (8, 9, 10)
BPT = 4096


def single(ttft: tuple[float, ...] = (0.1, 0.3), wall: float = 1.0) -> PhaseResult:
    return PhaseResult("single engine", (OUT_A, OUT_B), ttft, wall)


def pd(mode: str = "pull", outputs: tuple[tuple[int, ...], ...] = (OUT_A, OUT_B), kv_bytes: int = 142 * BPT,
       **fields: object) -> PhaseResult:
    values: dict[str, object] = dict(prefill_ttft_s=(0.05, 0.07), decode_ttft_s=(0.02, 0.04),
                                     kv_wait_s=(0.01, 0.02), transfers_failed=0, prefill_left=0)
    values.update(fields)
    ttft = tuple(a + b for a, b in zip(values["prefill_ttft_s"], values["decode_ttft_s"]))  # type: ignore[call-overload]
    return PhaseResult(f"P/D {mode}", outputs, ttft, 0.5, mode=mode, kv_bytes=kv_bytes, **values)  # type: ignore[arg-type]


def report(*phases: PhaseResult) -> DemoReport:
    return DemoReport(LENGTHS, 3, BPT, (single(), *phases))


def test_a_clean_run_has_no_problems() -> None:
    assert report(pd("pull"), pd("push")).problems() == []
    assert report(pd()).expected_kv_bytes == 142 * BPT


@pytest.mark.parametrize(("phase", "needle"), [
    (pd(outputs=(OUT_A, OUT_A)), "outputs of requests [1] differ from the single engine's"),
    (pd(kv_bytes=100), "received 100 KV bytes, expected 581632 (142 tokens x 4096)"),
    (pd(transfers_failed=2), "2 KV loads failed (vLLM recomputed them)"),
    (pd(prefill_left=1), "the prefill engine still holds 1 requests"),
    (pd(outputs=(OUT_A,)), "expected 2 outputs of 3 tokens, got [3]"),
])
def test_each_failure_is_named(phase: PhaseResult, needle: str) -> None:
    problems = report(pd("push"), phase).problems()
    assert len(problems) == 1 and problems[0].startswith("batch 3 (P/D pull): ") and needle in problems[0], problems


def test_a_single_engine_disagreeing_with_itself_is_a_problem() -> None:
    flaky = DemoReport(LENGTHS, 3, BPT, (single(), PhaseResult("single engine", (OUT_B, OUT_B), (0.1, 0.1), 1.0)))
    assert flaky.problems() == ["batch 2 (single engine): outputs of requests [0] differ from the single engine's"]
    with pytest.raises(ValueError, match="single-engine batch"):
        DemoReport(LENGTHS, 3, BPT, (pd(),))


def test_summary_table_medians_and_cells() -> None:
    rounds = (single(), pd("pull"), pd("push", kv_wait_s=(0.001, 0.001)),
              single(ttft=(0.5, 0.5), wall=3.0), pd("pull", kv_wait_s=(0.03, 0.04)), pd("push"),
              single(ttft=(0.2, 0.2), wall=2.0), pd("pull", outputs=(OUT_A, OUT_A), kv_wait_s=(0.02, 0.02)),
              pd("push"))
    table = summary_table(DemoReport(LENGTHS, 3, BPT, rounds))
    assert table.header == ("", "single engine", "P/D pull", "P/D push")
    rows = {row[0]: row[1:] for row in table.rows}
    assert rows["requests / batch"] == ("2", "2", "2")
    assert rows["prompt tokens / batch"] == ("142", "142", "142")
    assert rows["generated tokens / batch"] == ("6", "6", "6")
    assert rows["outputs equal to single engine"] == ("4/4", "5/6", "6/6")  # the reference is no comparison
    assert rows["KV bytes moved / batch"] == ("-", "0.58 MB", "0.58 MB")
    # pull throughput: bytes over the longest wait of each batch, median of 581632/0.02, /0.04, /0.02
    assert rows["KV throughput"] == ("-", "0.029 GB/s", "overlapped")
    assert rows["exposed KV wait / request"] == ("-", "20.0 ms", "15.0 ms")  # medians of per-batch means
    assert rows["TTFT / request (client)"] == ("200.0 ms", "90.0 ms", "90.0 ms")
    assert rows["  prefill engine"] == ("-", "60.0 ms", "60.0 ms")
    assert rows["  decode engine, after prefill"] == ("-", "30.0 ms", "30.0 ms")
    assert rows["batch wall time"] == ("2.00 s", "0.50 s", "0.50 s")


def test_the_reference_batch_is_not_counted_as_equal_to_itself() -> None:
    """The single engine's first batch is the reference: the single-engine column counts only its later rounds
    against it. It counted the reference against itself too, so with one round (--quick) it printed 2/2, a cell
    that could not fail, and with three rounds 6/6 for 4 comparisons."""
    rows = {row[0]: row[1:] for row in summary_table(report(pd("pull"))).rows}
    assert rows["outputs equal to single engine"] == ("reference", "2/2")
    flaky = DemoReport(LENGTHS, 3, BPT, (single(), pd(), PhaseResult("single engine", (OUT_B, OUT_B), (0.1,), 1.0)))
    rows = {row[0]: row[1:] for row in summary_table(flaky).rows}
    assert rows["outputs equal to single engine"] == ("1/2", "2/2")


def test_format_plain_aligns_columns() -> None:
    text = format_plain(summary_table(report(pd("pull"))))
    lines = text.splitlines()
    assert lines[0].split() == ["single", "engine", "P/D", "pull"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    ends = {line.rindex(line.split()[-1]) + len(line.split()[-1]) for line in lines if line.strip("- ")}
    assert len(ends) == 1, text  # every row's last value ends in the same column


def test_reporter_plain_steps_and_table() -> None:
    out = io.StringIO()
    reporter = Reporter(rich_ok=False, file=out)
    assert not reporter.uses_rich
    with reporter.step("starting engines") as update:
        update("3 s")  # plain output shows no intermediate detail
    reporter.table(summary_table(report(pd())), "title")
    lines = out.getvalue().splitlines()
    assert lines[0] == "starting engines ..." and lines[1].startswith("done starting engines (")
    assert "title" in lines and any(line.startswith("KV bytes moved / batch") for line in lines)


@pytest.mark.skipif(not rich_available(), reason="rich is not installed (the bench extra)")
def test_reporter_rich_renders_the_same_cells() -> None:
    out = io.StringIO()
    reporter = Reporter(file=out)
    assert reporter.uses_rich
    with reporter.step("building [model]"):
        pass
    table = summary_table(report(pd()))
    reporter.table(table, "title")
    text = out.getvalue()
    assert "done building [model]" in text  # markup in a step's text is escaped, not interpreted
    for row in table.rows:
        assert all(cell.strip() in text for cell in row), row


def test_the_demo_checks_its_connector_config_before_any_engine_starts() -> None:
    """A misspelled kv_connector_extra_config key fails in the demo's own process, naming it (it failed an engine
    child's start-up, after the model was built and the first engine had started)."""
    config = connector_config("kv_consumer", ref_path="decode_ref.json")
    assert config["kv_connector_extra_config"] == {"ref_path": "decode_ref.json"}
    assert config["kv_role"] == "kv_consumer" and config["kv_load_failure_policy"] == "recompute"
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys for NcclKVConnector: \['ref_pth'\]"):
        connector_config("kv_consumer", ref_pth="decode_ref.json")


# ------------------------------------------------------------------ devices

def test_engine_devices_by_gpu_count() -> None:
    from ncclkv.demo import DeviceCountError, EngineDevice, demo_devices

    cpu = demo_devices(())
    assert cpu.prefill == cpu.decode == cpu.single == EngineDevice() and not cpu.single_after_prefill
    assert EngineDevice().env() == {} and EngineDevice().llm_overrides() == {}
    with pytest.raises(DeviceCountError, match=r"needs 2 of them .* sees 1 .*--transport-only"):
        demo_devices(("GPU-abc",))
    two = demo_devices(("3", "5"))
    assert two.prefill == two.single == EngineDevice("3", 0.4) and two.decode == EngineDevice("5")
    assert two.single_after_prefill
    assert two.prefill.env() == {"CUDA_VISIBLE_DEVICES": "3"}
    assert two.prefill.llm_overrides() == {"gpu_memory_utilization": 0.4} and two.decode.llm_overrides() == {}
    three = demo_devices(("0", "1", "2", "3"))
    assert (three.prefill, three.decode, three.single) == (EngineDevice("0"), EngineDevice("1"), EngineDevice("2"))
    assert not three.single_after_prefill


def test_visible_gpus_name_what_each_child_takes() -> None:
    from ncclkv.demo._devices import visible_gpus

    assert visible_gpus(2, None) == ("0", "1")
    assert visible_gpus(2, "6, 2,7") == ("6", "2")  # torch counts the first valid ones
    assert visible_gpus(0, "") == () and visible_gpus(1, "GPU-9f2e") == ("GPU-9f2e",)
