"""Real launchers for tests/launchers: child environments, bounded subprocesses, a one-node Slurm.

The ``slurm`` session fixture installs Slurm from Debian packages where it is
missing, writes a minimal slurm.conf in a temp folder (no munge, 8 CPUs and 8
placeholder GPUs on this node), starts slurmctld and slurmd, waits for the
node to be idle, and stops both daemons by PID afterwards. When Slurm cannot
be installed or started the Slurm tests are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _launch import SlurmCluster, child_env, run, unused_port
SLURM_PACKAGES = ("slurmd", "slurmctld", "slurm-client", "libpmix-dev")  # libpmix.so, dlopened by mpi/pmix
SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "sinfo")
APT_TIMEOUT_S = 300.0
DAEMON_START_S = 30.0


# -- Slurm -------------------------------------------------------------------


def _missing_packages() -> list[str]:
    missing = []
    for package in SLURM_PACKAGES:
        probe = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, timeout=30, check=False
        )
        if "install ok installed" not in probe.stdout:
            missing.append(package)
    return missing


def _install_slurm() -> str:
    """Install what is missing; return a note for the log. Skips the test session's Slurm tests on failure."""
    if shutil.which("dpkg-query") is None or shutil.which("apt-get") is None:
        pytest.skip("Slurm tests need Debian's apt-get to install slurmd/slurmctld/slurm-client")
    missing = _missing_packages()
    if not missing:
        return "Slurm already installed"
    if os.geteuid() != 0:
        pytest.skip(f"Slurm packages {missing} are missing and installing them needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    started = time.monotonic()
    done = run(install, env=env, timeout_s=APT_TIMEOUT_S, cwd=Path("/"))
    if done.returncode != 0:  # the package lists may be missing or stale
        update = run(["apt-get", "update"], env=env, timeout_s=APT_TIMEOUT_S, cwd=Path("/"))
        done = run(install, env=env, timeout_s=APT_TIMEOUT_S, cwd=Path("/")) if update.returncode == 0 else update
    if done.returncode != 0:
        pytest.skip(f"cannot install Slurm:\n{done.describe()}")
    return f"installed {' '.join(missing)} in {time.monotonic() - started:.1f} s"


def _write_conf(workdir: Path) -> Path:
    node = socket.gethostname().split(".")[0]
    for sub in ("state", "spool", "log", "gpus"):
        (workdir / sub).mkdir()
    for index in range(8):  # placeholder GPU device files: the templates' --gpus-per-task runs as written
        (workdir / "gpus" / f"gpu{index}").touch()
    (workdir / "gres.conf").write_text(f"NodeName={node} Name=gpu File={workdir}/gpus/gpu[0-7]\n")
    conf = workdir / "slurm.conf"
    conf.write_text(
        "\n".join([
            "ClusterName=ncclkv-test",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={unused_port()}",
            f"SlurmdPort={unused_port()}",
            "AuthType=auth/none",
            "CredType=cred/none",
            "SlurmUser=root",
            "SlurmdUser=root",
            "SlurmdParameters=config_overrides",  # CPUs=8 on a smaller machine
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "GresTypes=gpu",
            # sbatch --wait polls every 2 s only while 2 < MinJobAge/2 fails; the default
            # (300) makes it sleep 2, 8, then 32 s between polls.
            "MinJobAge=4",
            f"StateSaveLocation={workdir}/state",
            f"SlurmdSpoolDir={workdir}/spool",
            f"SlurmctldPidFile={workdir}/slurmctld.pid",
            f"SlurmdPidFile={workdir}/slurmd.pid",
            f"SlurmctldLogFile={workdir}/log/slurmctld.log",
            f"SlurmdLogFile={workdir}/log/slurmd.log",
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs=8 Gres=gpu:8 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "",
        ])
    )
    return conf


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def _wait_idle(env: dict[str, str], daemons: list[subprocess.Popen[bytes]], workdir: Path) -> None:
    deadline = time.monotonic() + DAEMON_START_S
    state = ""
    while time.monotonic() < deadline:
        dead = [proc.args for proc in daemons if proc.poll() is not None]
        if dead:
            logs = "\n".join(p.read_text()[-2000:] for p in sorted((workdir / "log").glob("*")))
            pytest.fail(f"Slurm daemon ended early: {dead}\n{logs}")
        probe = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10, check=False)
        state = probe.stdout.strip()
        if state == "idle":
            return
        time.sleep(0.1)  # polling a daemon's state: there is no event to wait on
    pytest.fail(f"the Slurm node is not idle after {DAEMON_START_S:g} s (state {state!r})")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    note = _install_slurm()
    tools = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if tools:
        pytest.skip(f"Slurm installed but {tools} not on PATH")
    workdir = tmp_path_factory.mktemp("slurm")
    conf = _write_conf(workdir)
    env = child_env(SLURM_CONF=str(conf))
    started = time.monotonic()
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        for daemon in ("slurmctld", "slurmd"):
            log = open(workdir / "log" / f"{daemon}.out", "wb")  # noqa: SIM115 - closed with the daemon below
            daemons.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()  # the child holds its own copy
        _wait_idle(env, daemons, workdir)
        print(f"\n[slurm] {note}; daemons idle after {time.monotonic() - started:.2f} s ({conf})")
        yield SlurmCluster(conf, workdir, env)
    finally:
        for proc in reversed(daemons):
            _stop(proc)
