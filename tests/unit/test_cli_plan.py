"""``ncclkv plan``: through cli.main and once through the console entry in a subprocess."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ncclkv._env import PP_PARTITION_VAR
from ncclkv.cli import main
from ncclkv._messages import MAX_MODEL_DIM
from ncclkv.commands.plan import MAX_TOKENS, parse_layout, parse_tokens
from ncclkv.layout import KVGeometry, ParallelLayout, SpanSet, plan

REPO = Path(__file__).resolve().parents[2]
SRC, DST = "tp=4,pp=1", "tp=2,pp=2"


@pytest.fixture(autouse=True)
def no_vllm_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's VLLM_PP_LAYER_PARTITION, if any, would change every pp > 1 layout below."""
    monkeypatch.delenv(PP_PARTITION_VAR, raising=False)


def argv(src: str = SRC, dst: str = DST, layers: str = "32", kv_heads: str = "8", *extra: str) -> list[str]:
    return ["plan", "--src", src, "--dst", dst, "--layers", layers, "--kv-heads", kv_heads, *extra]


def run_cli(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def stringify(data: dict[str, object]) -> dict[str, object]:
    return json.loads(json.dumps(data))


def test_text_output_has_grid_routes_and_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, argv())
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("plan tp=4,pp=1 -> tp=2,pp=2: 32 layers x 8 kv-heads")
    assert lines[2].split() == ["d0(tp0,pp0)", "L0:16", "H0:2", "L0:16", "H2:4", ".", "."]
    route_lines = [line for line in lines if line.lstrip().startswith("src") and "->" in line]
    assert len(route_lines) == 8
    assert route_lines[0].split()[:10] == ["src", "0", "->", "dst", "0", "layers", "[0,16)", "heads", "[0,2)", "tokens"]
    per_rank = 16 * 2 * 4096 * 2 * 128 * 2 * 2  # 2 routes per src: 16 layers x 2 heads x 4096 tokens, K+V, bf16
    assert f"src  0 sends    {per_rank:>14,d} B" in out
    assert f"dst  3 receives {per_rank:>14,d} B" in out


def test_json_output_is_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, argv(SRC, DST, "32", "8", "--json", "--tokens", "0:100,200:300", "--dtype", "float16", "--head-size", "64"))
    assert code == 0
    expected = plan(ParallelLayout(4, 1), ParallelLayout(2, 2), KVGeometry(32, 8, 64, "float16"), SpanSet([(0, 100), (200, 300)]))
    data = json.loads(out)  # exactly one JSON object, nothing else on stdout
    assert data == stringify(expected.to_json())
    assert len(data["routes"]) == 16 and data["routes"][1]["tokens"] == [200, 300]


def test_mla_defaults_to_one_latent(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, ["plan", "--src", SRC, "--dst", DST, "--layers", "32", "--mla", "--json", "--tokens", "10"])
    assert code == 0
    data = json.loads(out)
    assert all(r["heads"] == [0, 1] for r in data["routes"])
    assert sorted((r["src"], r["dst"]) for r in data["routes"]) == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_partition_spec(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv("tp=1,pp=2,partition=10:22", "tp=1", "32", "2", "--json")) == 0
    assert [r["layers"] for r in json.loads(capsys.readouterr().out)["routes"]] == [[0, 10], [10, 32]]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (argv("tp=four"), "tp=four"),
        (argv("tp=2,dp=2"), "dp=2"),
        (argv("tp=2", "tp=2,pp=2,partition=1:x"), "partition=1:x"),
        (argv("tp=2", "tp=2,pp=2,partition=10:10"), "sums to 20, num_layers is 32"),
        (argv("tp=2", "tp=2,pp=2,partition=3:-1"), "layer partition (3, -1) has a negative entry, -1 (stage 1)"),
        (argv("tp=2", "tp=2,pp=2,partition=33:-1"), "has a negative entry, -1 (stage 1)"),  # sums right: still named
        (argv("tp=2", "tp=2,pp=2,partition=32:0"), "gives a stage no layer (stage 1 has 0)"),
        (argv("tp=0"), "tp_size must be a positive int, got 0"),
        (argv(SRC, DST, "32", "8", "--tokens", "0:x"), "'0:x'"),
        (argv(SRC, DST, "32", "8", "--tokens", "5:3"), "'5:3'"),
        (argv(SRC, DST, "32", "8", "--tokens", "-4"), "'-4'"),
        (argv(kv_heads="6"), "num_kv_heads=6 is neither divisible by nor a divisor of tp_size=4"),
        (argv(layers="1"), "pp_size=2 is more pipeline stages than num_layers=1"),
        (argv(SRC, DST, "32", "8", "--mla"), "--kv-heads must be 1 or omitted, got 8"),
        (argv(SRC, DST, "32", "8", "--dtype", "int4"), "'int4'"),
    ],
)
def test_bad_input_exits_2_naming_the_text(capsys: pytest.CaptureFixture[str], args: list[str], needle: str) -> None:
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("ncclkv plan: error:") and needle in err


def test_vllm_pp_layer_partition_is_read_like_vllm(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PP_PARTITION_VAR, "10, 22")  # vLLM: int() of each comma-separated item
    assert main(argv("tp=1,pp=2", "tp=1", "32", "2", "--json")) == 0
    assert [r["layers"] for r in json.loads(capsys.readouterr().out)["routes"]] == [[0, 10], [10, 32]]
    # an explicit partition= wins; a pp=1 layout has one split and ignores the variable
    assert main(argv("tp=1,pp=2,partition=16:16", "tp=1", "32", "2", "--json")) == 0
    assert [r["layers"] for r in json.loads(capsys.readouterr().out)["routes"]] == [[0, 16], [16, 32]]
    code, out, _ = run_cli(capsys, argv("tp=1,pp=2", "tp=2,pp=2", "32", "2"))
    assert code == 0 and out.startswith("plan tp=1,pp=2,partition=10:22 -> tp=2,pp=2,partition=10:22:")
    assert parse_layout("tp=2,pp=2", {PP_PARTITION_VAR: "10,22"}) == ParallelLayout(2, 2, (10, 22))
    assert parse_layout("tp=2,pp=2", {}) == parse_layout("tp=2,pp=2") == ParallelLayout(2, 2)


@pytest.mark.parametrize(
    ("value", "layout", "needle"),
    [
        ("10,22", "tp=1,pp=4", "VLLM_PP_LAYER_PARTITION='10,22' has 2 stages but layout 'tp=1,pp=4' has pp=4"),
        ("10:22", "tp=1,pp=2", "VLLM_PP_LAYER_PARTITION='10:22' is not comma-separated integers"),
        ("", "tp=1,pp=2", "VLLM_PP_LAYER_PARTITION='' is not comma-separated integers"),  # vLLM refuses it too
        ("10,20", "tp=1,pp=2", "VLLM_PP_LAYER_PARTITION='10,20' (for layout 'tp=1,pp=2'): layer partition (10, 20) "
                               "sums to 30, num_layers is 32"),
        ("33,-1", "tp=1,pp=2", "has a negative entry, -1 (stage 1)"),
    ],
)
def test_bad_vllm_pp_layer_partition_names_the_variable(value: str, layout: str, needle: str, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PP_PARTITION_VAR, value)
    assert main(argv(layout, "tp=1", "32", "2")) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("ncclkv plan: error:") and needle in err


def test_help_names_the_partition_sources(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "VLLM_PP_LAYER_PARTITION if set, else vLLM's default split" in text


def test_kv_heads_required_without_mla(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--src", SRC, "--dst", DST, "--layers", "32"]) == 2
    assert "--kv-heads is required unless --mla" in capsys.readouterr().err


def test_parsers() -> None:
    assert parse_layout("tp=4") == ParallelLayout(4, 1)
    assert parse_layout("pp=2, tp=2") == ParallelLayout(2, 2)
    assert parse_layout("tp=2,pp=3,partition=1:2:3") == ParallelLayout(2, 3, (1, 2, 3))
    assert parse_layout(ParallelLayout(2, 3, (1, 2, 3)).spec()) == ParallelLayout(2, 3, (1, 2, 3))
    with pytest.raises(ValueError, match="'tp=2,tp=4'"):
        parse_layout("tp=2,tp=4")
    assert parse_tokens("4096") == SpanSet.range(0, 4096)
    assert parse_tokens("0") == SpanSet()
    assert parse_tokens("200:300,0:100") == SpanSet([(0, 100), (200, 300)])


def test_console_entry_in_a_subprocess() -> None:
    command = [sys.executable, "-m", "ncclkv.cli", *argv(SRC, DST, "32", "8", "--tokens", "128", "--json")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    expected = plan(ParallelLayout(4, 1), ParallelLayout(2, 2), KVGeometry(32, 8, 128), 128)
    assert json.loads(done.stdout) == stringify(expected.to_json())


def test_a_reader_that_leaves_early_ends_it_as_sigpipe_would_without_a_traceback() -> None:
    """`ncclkv plan ... | head`: the plan is larger than the pipe holds, and the reader reads a few bytes and
    leaves. The write failed with a BrokenPipeError traceback and exit 1; now exit 128 + SIGPIPE, stderr empty."""
    command = [sys.executable, "-m", "ncclkv.cli", *argv("tp=64,pp=8", "tp=32,pp=16", "512", "64")]
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.read(10) == b"plan tp=64"
        proc.stdout.close()  # the reader leaves: the rest of the plan has nowhere to go
        err = proc.stderr.read()
        code = proc.wait(60)
    assert (code, err) == (128 + signal.SIGPIPE, b"")


@pytest.mark.parametrize(("tokens", "end"), [
    ("100000000000000000000", "100000000000000000000"),  # an OverflowError traceback (past sys.maxsize)
    ("0:10,20:1099511627776", "1099511627776"),  # 2**40: a MemoryError traceback
    (str(MAX_TOKENS + 1), str(MAX_TOKENS + 1)),
])
def test_huge_token_counts_are_a_usage_error(tokens: str, end: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, argv(SRC, DST, "32", "8", "--tokens", tokens))
    assert (code, out) == (2, "")
    assert err == (f"ncclkv plan: error: bad --tokens {tokens!r}: tokens must end at {MAX_TOKENS} (2**30) at most, "
                   f"got {end}\n")
    assert parse_tokens(str(MAX_TOKENS)) == SpanSet([(0, MAX_TOKENS)])


def test_a_layout_error_with_a_fitting_vllm_pp_layer_partition_does_not_blame_the_variable(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The variable fits the model (16 + 16 layers): the layout's tp does not fit its kv-heads. The message is the
    one without the variable, not that error under the variable's name."""
    monkeypatch.setenv(PP_PARTITION_VAR, "16,16")
    assert main(argv("tp=3,pp=2", "tp=1", "32", "8")) == 2
    err = capsys.readouterr().err
    assert err == "ncclkv plan: error: num_kv_heads=8 is neither divisible by nor a divisor of tp_size=3\n"


@pytest.mark.parametrize("option", ["--layers", "--kv-heads", "--head-size"])
@pytest.mark.parametrize("value", [2**63, 10**310, MAX_MODEL_DIM + 1])
def test_huge_model_dims_are_a_usage_error(option: str, value: int, capsys: pytest.CaptureFixture[str]) -> None:
    """Old code: 10**310 layers or kv-heads, an OverflowError traceback (len() of a span past sys.maxsize); a head
    size of 10**310, another (4096 tokens' bytes as a float); exit 1 both. 2**63, or just past the handshake's
    bound: a plan printed that no engine could run."""
    def dims(size: int) -> list[str]:
        given = {"--layers": "32", "--kv-heads": "8", "--head-size": "128", option: str(size)}
        return argv(SRC, DST, given["--layers"], given["--kv-heads"], "--head-size", given["--head-size"])

    code, out, err = run_cli(capsys, dims(value))
    assert (code, out) == (2, "")
    assert err == (f"ncclkv plan: error: {option} must be at most {MAX_MODEL_DIM} (what an engine's handshake "
                   f"accepts), got {value}\n")
    assert main([*dims(MAX_MODEL_DIM), "--tokens", "1"]) == 0
