"""``python -m ncclkv.scenario``: bad options, launcher variables and NCCLKV_* values are usage errors (exit 2,
argparse's usage line and the values, no traceback) before anything connects; the sizes the options give."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ncclkv.launch import LaunchInfo
from ncclkv.scenario import _ring, _transfer
from ncclkv.scenario.__main__ import build_parser, main
from ncclkv.scenario._transfer import config_from_args

# Variables discover() would take before plain RANK/WORLD_SIZE (and NCCLKV_* values other tests may leave).
_OTHER_LAUNCHERS = ("TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                    "SLURM_PROCID", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_STEP_NUM_NODES", "SLURM_NNODES")


def launcher_env(world_size: int, **extra: str | None) -> dict[str, str]:
    """Rank 0 of a plain RANK/WORLD_SIZE job, with ``extra`` set (None: unset)."""
    env = {key: value for key, value in os.environ.items()
           if key not in _OTHER_LAUNCHERS and not key.startswith("NCCLKV_")}
    env.update({"RANK": "0", "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    env.update(extra)  # type: ignore[arg-type]  # the Nones go below
    return {key: value for key, value in env.items() if value is not None}


def use_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(("world_size", "argv", "env", "message"), [
    (4, ["--kind", "transfer", "--prefill", "1", "--prefill-tp", "3", "--decode", "1"], {},
     "--prefill-tp 3 --prefill-pp 1: num_kv_heads=4 is neither divisible by nor a divisor of tp_size=3"),
    (3, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--decode-pp", "2", "--layers", "1"], {},
     "--decode-tp 1 --decode-pp 2: pp_size=2 is more pipeline stages than num_layers=1"),
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--requests", "0"], {},
     "--requests and --max-tokens must be >= 1, got 0, 512"),
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--mla", "--kv-heads", "4"], {},
     "num_kv_heads must be 1, got 4"),
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--mode", "pull", "--kill-rank", "0"], {},
     "--kill-rank 0 needs --mode push"),
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--device", "gpu"], {},
     "argument --device: invalid choice: 'gpu'"),
    (2, ["--kind", "ring", "--nbytes", "10"], {}, "nbytes must be a multiple of 8 and >= 24, got 10"),
    (2, ["--kind", "ring", "--kill-rank", "5"], {}, "kill_rank=5 is outside world_size=2"),
    # --kill-at without --kill-rank was ignored: nothing injected, and the run passed as if it had been.
    (2, ["--kind", "ring", "--kill-at", "2"], {}, "--kill-at 2 needs --kill-rank"),
    (2, ["--kind", "ring"], {"NCCLKV_COPY_THREADS": "99"}, "NCCLKV_COPY_THREADS='99' must be <= 16"),
    # With --deadline and --bind-host given (the launch scripts pass --bind-host auto) nothing read NCCLKV_* before
    # the run: rank 0 hosted the store, then its data plane raised (a traceback, exit 1), the others exit 3.
    (2, ["--kind", "ring", "--deadline", "5", "--bind-host", "auto"],
     {"NCCLKV_COPY_THREADS": "99", "GLOO_SOCKET_IFNAME": None}, "NCCLKV_COPY_THREADS='99' must be <= 16"),
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--deadline", "5", "--bind-host", "127.0.0.1"],
     {"NCCLKV_PAGED_KERNEL": "fast"}, "NCCLKV_PAGED_KERNEL='fast' must be one of native, torch"),
    # The engines' channel authentication was first read by EngineConfig, once rank 0 hosted the store: a traceback
    # and exit 1 on every rank, naming ChannelAuth.shared_secret, no variable.
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1"], {"NCCLKV_SHARED_SECRET": "tooshort"},
     "NCCLKV_SHARED_SECRET* / NCCLKV_CURVE_*: ChannelAuth.shared_secret has 8 bytes; use at least 32"),
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1"], {"NCCLKV_CURVE_SECRET_FILE": "/nonexistent/k"},
     "NCCLKV_SHARED_SECRET* / NCCLKV_CURVE_*: "),
    # Rank 0 wrote the summary once every rank had finished: a folder that is not there cost the whole run, then a
    # traceback and exit 1 on rank 0 alone.
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--json-out", "/nonexistent-ncclkv/summary.json"],
     {}, "--json-out '/nonexistent-ncclkv/summary.json': no folder /nonexistent-ncclkv to write it into"),
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--json-out", "/"], {},
     "--json-out '/': not a file rank 0 can write"),
    # A path ending in a slash names a folder: one not there, or a file followed by a slash, passed the check (the
    # folder above it is there), then rank 0 alone ended with IsADirectoryError and exit 1 after the whole run.
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--json-out", "/nonexistent-ncclkv/"], {},
     "--json-out '/nonexistent-ncclkv/': not a file rank 0 can write"),
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--json-out", "/etc/passwd/"], {},
     "--json-out '/etc/passwd/': not a file rank 0 can write"),
    # An empty path: the folder above the working directory was checked (refused or not by where the run
    # started), and then nothing written.
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1", "--json-out", ""], {},
     "--json-out '': names no file"),
    (2, ["--kind", "ring"], {"MASTER_PORT": None}, "env job of world_size=2 needs MASTER_PORT"),
    # 192.0.2.0/24 is TEST-NET-1: no host's own address. It ended as OSError [Errno 99] in the data plane.
    (2, ["--kind", "ring", "--bind-host", "192.0.2.7"], {}, "--bind-host '192.0.2.7' is not an address of this host"),
    # A name IDNA cannot encode raised UnicodeError (a ValueError: exit 2) naming neither --bind-host nor the name.
    (2, ["--kind", "ring", "--bind-host", "node01..ib"], {}, "--bind-host 'node01..ib' is not an address of this host"),
    (2, ["--kind", "transfer", "--prefill", "1", "--decode", "1"], {"NCCLKV_BIND_HOST": "192.0.2.7"},
     "NCCLKV_BIND_HOST '192.0.2.7' is not an address of this host"),
    # One rank without MASTER_PORT takes a free port on MASTER_ADDR: one not of this host (a shell's stale export)
    # or a name that does not resolve ended as OSError [Errno 99] / socket.gaierror from discover(), exit 1.
    (1, ["--kind", "ring"], {"MASTER_PORT": None, "MASTER_ADDR": "192.0.2.7"},
     "MASTER_ADDR='192.0.2.7' is not an address of this host"),
    (1, ["--kind", "ring"], {"MASTER_PORT": None, "MASTER_ADDR": "no-such-host.invalid"},
     "MASTER_ADDR='no-such-host.invalid' is not an address of this host"),
    # --bind-host auto (the launch scripts' default) routes to MASTER_ADDR: a name that does not resolve (a Slurm
    # node name without an address, derived as MASTER_ADDR) ended as socket.gaierror on every rank, exit 1.
    (2, ["--kind", "ring", "--bind-host", "auto"], {"MASTER_ADDR": "no-such-host.invalid", "GLOO_SOCKET_IFNAME": None},
     "rank 0: --bind-host auto: no route from this host to MASTER_ADDR='no-such-host.invalid'"),
    # A name with an empty label (a typo) or one past 63 chars: getaddrinfo's idna encoding raises UnicodeError,
    # not OSError, and the usage error named neither the rank nor MASTER_ADDR.
    (2, ["--kind", "ring", "--bind-host", "auto"], {"MASTER_ADDR": "node01..ib", "GLOO_SOCKET_IFNAME": None},
     "rank 0: --bind-host auto: no route from this host to MASTER_ADDR='node01..ib'"),
])
def test_bad_input_is_a_usage_error_before_anything_connects(
    world_size: int, argv: list[str], env: dict[str, str | None], message: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Each was a traceback and exit 1 (on every rank of the job); nothing may start the run."""
    use_env(monkeypatch, launcher_env(world_size, **env))
    ran: list[object] = []
    for module in (_ring, _transfer):
        monkeypatch.setattr(module, "run", lambda info, checked: ran.append(checked))
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "usage: python -m ncclkv.scenario" in err and message in err and "Traceback" not in err, err
    assert not ran


def test_help_reads_no_ncclkv_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An unrelated bad NCCLKV_* value broke even --help (the --deadline default was read while building the parser)."""
    monkeypatch.setenv("NCCLKV_COPY_THREADS", "99")
    monkeypatch.setenv("NCCLKV_DEADLINE_S", "soon")
    with pytest.raises(SystemExit) as exited:
        main(["--kind", "ring", "--help"])
    assert exited.value.code == 0 and "--deadline DEADLINE" in capsys.readouterr().out


def test_the_deadline_comes_from_the_environment_after_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float] = []
    use_env(monkeypatch, launcher_env(2, NCCLKV_DEADLINE_S="7"))
    monkeypatch.setattr(_ring, "run", lambda info, checked: seen.append(checked.config.deadline_s))
    assert main(["--kind", "ring", "--small"]) == 0
    assert main(["--kind", "ring", "--small", "--deadline", "3"]) == 0  # the option wins
    assert seen == [7.0, 3.0]


def test_the_entry_point_prints_one_usage_error_not_a_traceback() -> None:
    """The whole entry point, as a launcher starts it."""
    done = subprocess.run(
        [sys.executable, "-m", "ncclkv.scenario", "--kind", "transfer", "--prefill", "1", "--prefill-tp", "3",
         "--decode", "1"], env=launcher_env(4), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.strip().splitlines()[-1] == (
        "python -m ncclkv.scenario: error: --prefill-tp 3 --prefill-pp 1: num_kv_heads=4 is neither divisible by nor "
        "a divisor of tp_size=3"), done.stderr


# -- sizes: an option given wins over --small ------------------------------------------


@pytest.mark.parametrize(("options", "requests", "max_tokens"), [
    ([], 16, 512),
    (["--small"], 4, 80),
    (["--small", "--requests", "1", "--max-tokens", "2000"], 1, 2000),  # was 4 requests of up to 80 tokens
    (["--small", "--requests", "7"], 7, 80),
    (["--max-tokens", "40"], 16, 40),
])
def test_transfer_sizes_given_win_over_small(options: list[str], requests: int, max_tokens: int) -> None:
    args = build_parser("transfer").parse_args(["--kind", "transfer", "--deadline", "10", *options])
    tokens = config_from_args(args).tokens
    assert len(tokens) == requests and max_tokens // 4 <= min(tokens) and max(tokens) <= max_tokens, tokens


@pytest.mark.parametrize(("options", "count", "nbytes"), [
    ([], 8, 1 << 20),
    (["--small"], 4, 64 * 1024),
    (["--small", "--count", "16", "--nbytes", "262144"], 16, 262144),  # was capped at 4 and 64 KiB
])
def test_ring_sizes_given_win_over_small(options: list[str], count: int, nbytes: int) -> None:
    args = build_parser("ring").parse_args(["--kind", "ring", "--deadline", "10", *options])
    config = _ring.check(args, LaunchInfo("env", 0, 2, 0, 2, "127.0.0.1", 29500)).config
    assert (config.count, config.nbytes) == (count, nbytes)


def test_mla_takes_one_kv_head_unless_told() -> None:
    def heads(*options: str) -> int:
        args = build_parser("transfer").parse_args(["--kind", "transfer", "--deadline", "10", *options])
        return config_from_args(args).geometry.num_kv_heads

    assert (heads(), heads("--mla"), heads("--kv-heads", "2")) == (4, 1, 2)


@pytest.mark.parametrize("given", ["auto", "AUTO", " Auto "])
def test_bind_host_auto_is_taken_in_any_case_as_the_variable_is(given: str) -> None:
    """NCCLKV_BIND_HOST=AUTO was taken as auto when read from the environment, but the launch scripts pass the
    variable on as --bind-host, where only 'auto' was: every rank failed ("'AUTO' is not an address of this
    host")."""
    args = build_parser("ring").parse_args(["--kind", "ring", "--deadline", "10", "--bind-host", given])
    assert args.bind_host == "auto"
    host = build_parser("ring").parse_args(["--kind", "ring", "--deadline", "10", "--bind-host", "10.0.0.7"])
    assert host.bind_host == "10.0.0.7"
