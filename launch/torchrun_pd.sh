#!/usr/bin/env bash
# Start a prefill/decode set with torchrun; see launch/_pd_args.sh for the options.
#
#   launch/torchrun_pd.sh --prefill 1 --prefill-tp 2 --decode 1 --decode-tp 1 --decode-pp 2
#
# One node (default): torchrun --standalone picks a free rendezvous port.
# Several nodes: run the same command on every node with
#   NNODES=2 RDZV_ENDPOINT=host0:29400 [RDZV_ID=job42]
# PYTHON selects the interpreter (default: python on PATH).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_pd_args.sh"
pd_parse_args "$@"

nnodes=${NNODES:-1}
[[ $nnodes =~ ^[1-9][0-9]*$ ]] || pd_die "NNODES must be a positive integer, got '$nnodes'"
((WORLD_SIZE % nnodes == 0)) || pd_die "$WORLD_SIZE ranks do not split evenly over NNODES=$nnodes"
if ((nnodes == 1)); then
    rendezvous=(--standalone)
else
    rendezvous=(--nnodes "$nnodes" --rdzv-backend c10d
        --rdzv-endpoint "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port for a multi-node run}"
        --rdzv-id "${RDZV_ID:-ncclkv-pd}")
fi
exec "${PYTHON:-python}" -m torch.distributed.run "${rendezvous[@]}" --max-restarts 0 \
    --nproc-per-node "$((WORLD_SIZE / nnodes))" -m ncclkv.scenario "${SCENARIO_ARGS[@]}"
