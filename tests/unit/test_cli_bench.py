"""``ncclkv bench --help``: its benchmark list comes from the registry, read only when help is shown.

The runs themselves are covered in test_bench_quick.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import _runner
from ncclkv import cli
from ncclkv.commands import bench


def help_text(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_benchmark_of_the_registry_as_list_does(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(capsys)
    listed = text.split("\nBenchmarks:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in listed] == list(_runner.BENCHMARKS)
    assert all(_runner.load(name).TITLE in text for name in _runner.BENCHMARKS)
    assert cli.main(["bench", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == [line.strip() for line in listed]


def test_building_the_parser_reads_no_registry() -> None:
    """Every command builds the bench parser: ``ncclkv plan`` must not pay for torch through it."""
    code = ("import sys\nfrom ncclkv import cli\ncli._build_parser()\n"
            "assert 'benchmarks._runner' not in sys.modules and 'torch' not in sys.modules, 'registry imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_the_checkout_help_says_why_and_list_fails(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    def missing() -> None:
        raise ValueError("ncclkv bench needs the source checkout's benchmarks/ folder; none next to site-packages/ncclkv")

    monkeypatch.setattr(bench, "_runner", missing)
    assert "Benchmarks:\n\n  (none: ncclkv bench needs the source checkout's benchmarks/ folder" in help_text(capsys)
    assert cli.main(["bench", "--list"]) == 2
    assert "ncclkv bench: error: ncclkv bench needs the source checkout's" in capsys.readouterr().err
