"""``ncclkv bench``: a bad ``--out`` or ``--results`` is a usage error before any benchmark runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import _runner
from ncclkv import cli


@pytest.fixture
def no_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fails any benchmark run; the names that were attempted."""
    ran: list[str] = []

    def run_one(name: str, ctx: object) -> None:
        ran.append(name)
        raise AssertionError(f"benchmark {name} ran despite a bad path")

    monkeypatch.setattr(_runner, "run_one", run_one)
    return ran


def _bad_paths(tmp_path: Path) -> list[tuple[str, str, str]]:
    """(flag, path, what the error says) for each bad path."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    (tmp_path / "folder").mkdir()
    return [
        ("--out", str(a_file / "x"), "cannot create"),  # below a file: NotADirectoryError
        ("--out", str(a_file), "cannot create"),  # a file, not a folder: FileExistsError
        ("--results", str(a_file / "R.md"), "cannot create"),  # its folder is a file
        ("--results", str(tmp_path / "folder"), "not a writable file"),  # a folder, not a file
    ]


def test_bad_out_or_results_fails_before_any_benchmark(tmp_path: Path, no_runs: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    good = {"--out": str(tmp_path / "out"), "--results": str(tmp_path / "RESULTS.md")}
    for flag, path, says in _bad_paths(tmp_path):
        argv = ["bench", "paged", "--quick", *[a for f, p in {**good, flag: path}.items() for a in (f, p)]]
        assert cli.main(argv) == 2, argv
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ncclkv bench: error: {flag} {path}: "), lines
        assert says in lines[0], lines
        assert captured.out == ""  # no table
    assert no_runs == []
    assert not (tmp_path / "RESULTS.md").exists()
