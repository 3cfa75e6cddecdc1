"""dev.sh's torch set-up on a venv holding the other build (a venv shared by GPU and CPU machines).

dev.sh runs for real (``setup``) against a stub venv: its ``python`` is this
interpreter importing a fake torch of the build under test, and its pip
installs are recorded instead of run; a stub ``nvidia-smi`` stands for a GPU.
A CPU build on a GPU machine was kept without a word (tests/gpu deselected,
``--device auto`` on gloo), and NCCLKV_TORCH_SPEC was ignored silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_setup(tmp_path: Path, build: str, gpu: bool, **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    version = "2.13.0+cpu" if build == "cpu" else "2.13.0+cu128"
    cuda = None if build == "cpu" else "12.8"
    (fake / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n\nclass version:\n    cuda = {cuda!r}\n")
    (fake / f"torch-{version}.dist-info").mkdir()
    (fake / f"torch-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "pip.log"
    log.touch()
    python = bin_dir / "python"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = pip ] && [ "$3" = install ]; then echo "pip $*" >> ' f"'{log}'" "; exit 0; fi\n"
        f"PYTHONPATH='{fake}' exec '{sys.executable}' \"$@\"\n")
    python.chmod(0o755)
    stub_bin = tmp_path / "gpu-bin"  # a GPU or none, whatever this machine has
    stub_bin.mkdir()
    (stub_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stub'\n" if gpu else "#!/bin/sh\nexit 9\n")
    (stub_bin / "nvidia-smi").chmod(0o755)
    path = f"{stub_bin}:{os.environ['PATH']}"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCLKV_TORCH", "PYTHON"))}
    child_env.update(NCCLKV_VENV=str(tmp_path / "venv"), PATH=path, **env)
    done = subprocess.run(["bash", str(ROOT / "dev.sh"), "setup"], env=child_env, capture_output=True, text=True,
                          timeout=120, check=False)
    return done, log.read_text()


def test_a_cpu_build_on_a_gpu_machine_stops_set_up_naming_both(tmp_path: Path) -> None:
    done, pip = run_setup(tmp_path, "cpu", gpu=True)
    assert done.returncode == 1, done.stderr
    assert "holds torch 2.13.0+cpu, a CPU build, and this machine has a GPU" in done.stderr
    assert "NCCLKV_VENV" in done.stderr and "install" not in pip  # nothing swapped


def test_a_cuda_build_on_a_machine_without_a_gpu_stops_set_up(tmp_path: Path) -> None:
    done, pip = run_setup(tmp_path, "cuda", gpu=False)
    assert done.returncode == 1, done.stderr
    assert "holds torch 2.13.0+cu128, a CUDA build, and this machine has no GPU" in done.stderr
    assert "torch" not in pip


def test_a_cuda_build_on_a_gpu_machine_is_kept(tmp_path: Path) -> None:
    done, pip = run_setup(tmp_path, "cuda", gpu=True)
    assert done.returncode == 0, done.stderr
    assert "install -q torch" not in pip and "holds torch" not in done.stderr


def test_a_torch_spec_given_to_a_venv_with_torch_says_it_is_not_applied(tmp_path: Path) -> None:
    done, pip = run_setup(tmp_path, "cpu", gpu=False, NCCLKV_TORCH_SPEC="torch==2.12.0")
    assert done.returncode == 0, done.stderr
    assert "torch 2.13.0+cpu is installed; NCCLKV_TORCH_SPEC / NCCLKV_TORCH_INDEX apply to a venv without torch" \
        in done.stderr
    assert "torch==2.12.0" not in pip
