"""launch/*.sh and slurm/*.sbatch: the srun command they build, and bash < 4.4's empty arrays."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*(REPO / "launch").glob("*.sh"), *(REPO / "slurm").glob("*.sbatch")])
TIMEOUT_S = 30


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_arrays_that_may_be_empty_expand_in_the_guarded_form(script: Path) -> None:
    """bash < 4.4 (RHEL 7's 4.2, say) under ``set -u`` fails on ``"${arr[@]}"`` of an empty array
    ("unbound variable"); ``${arr[@]+"${arr[@]}"}`` expands to nothing instead."""
    text = re.sub(r"(^|\s)#.*", "", script.read_text(), flags=re.M)  # comments may quote the unguarded form
    for name in re.findall(r"(?:^|\s)(?:local\s+)?(\w+)=\(\)", text, re.M):
        plain = text.count(f'"${{{name}[@]}}"')
        guarded = text.count(f'${{{name}[@]+"${{{name}[@]}}"}}')
        assert plain == guarded, f"{script.name}: {name}=() may stay empty, but \"${{{name}[@]}}\" is expanded unguarded"


def srun_argv(command: list[str], tmp_path: Path, **env: str) -> list[str]:
    """The arguments ``command`` hands to srun: a stand-in srun on PATH writes them one per line."""
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$SRUN_ARGV_OUT"\n')
    fake.chmod(0o755)
    out = tmp_path / "argv"
    base = {key: value for key, value in os.environ.items()
            if not key.startswith(("SLURM_", "NCCLKV_", "GPUS_PER_TASK", "SRUN_MPI", "PYTHON"))}
    full_env = {**base, "PATH": f"{fake.parent}{os.pathsep}{base.get('PATH', '')}", "SRUN_ARGV_OUT": str(out), **env}
    subprocess.run(command, cwd=REPO, env=full_env, check=True, timeout=TIMEOUT_S, capture_output=True)
    return out.read_text().splitlines()


SCENARIO = ["python", "-m", "ncclkv.scenario", "--kind", "ring", "--prefill", "1", "--prefill-tp", "1",
            "--prefill-pp", "1", "--decode", "1", "--decode-tp", "2", "--decode-pp", "1", "--bind-host", "auto"]


def test_srun_pd_without_gpus_or_extra_arguments(tmp_path: Path) -> None:
    argv = srun_argv(["bash", "launch/srun_pd.sh", "--kind", "ring", "--decode-tp", "2"], tmp_path, GPUS_PER_TASK="0")
    assert argv == ["--ntasks", "3", "--mpi", "pmix", *SCENARIO]


def test_srun_pd_passes_gpus_and_extra_arguments_intact(tmp_path: Path) -> None:
    command = ["bash", "launch/srun_pd.sh", "--kind", "ring", "--decode-tp", "2", "--", "--count", "3", "a b"]
    argv = srun_argv(command, tmp_path)
    assert argv == ["--ntasks", "3", "--gpus-per-task", "1", "--mpi", "pmix", *SCENARIO, "--count", "3", "a b"]


@pytest.mark.parametrize("small", [False, True])
def test_sbatch_template_with_and_without_small(small: bool, tmp_path: Path) -> None:
    env = {"SLURM_SUBMIT_DIR": str(REPO), "NCCLKV_KIND": "ring", **({"NCCLKV_SMALL": "1"} if small else {})}
    argv = srun_argv(["bash", "slurm/pd_1p1d.sbatch"], tmp_path, **env)
    assert argv[:6] == ["--ntasks", "2", "--gpus-per-task", "1", "--mpi", "pmix"]
    assert argv[-2:] == (["auto", "--small"] if small else ["--bind-host", "auto"])
