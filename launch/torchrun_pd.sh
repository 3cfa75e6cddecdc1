#!/usr/bin/env bash
# Start a prefill/decode set with torchrun; see launch/_pd_args.sh for the options.
#
#   launch/torchrun_pd.sh --prefill 1 --prefill-tp 2 --decode 1 --decode-tp 1 --decode-pp 2
#
# One node (default): torchrun --standalone picks a free rendezvous port and a fresh run id.
# Several nodes: run the same command on every node with
#   NNODES=2 RDZV_ENDPOINT=host0:29400 RDZV_ID=job42 LOCAL_ADDR=<this node's address>
# RDZV_ID names this run in the rendezvous (torchrun wants one per job): default $SLURM_JOB_ID inside a
# Slurm job, else it must be given; two runs meeting at one endpoint under one id would join each other.
# LOCAL_ADDR (optional, passed as --local-addr): the address torchrun publishes for this node. The workers'
# MASTER_ADDR is the rank-0 node's, by default its host name (getfqdn()), which resolves to loopback on many
# hosts (Debian: 127.0.1.1): then --bind-host auto refuses to bind there. Give it on every node.
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
    [[ -n ${RDZV_ENDPOINT:-} ]] || pd_die "NNODES=$nnodes: set RDZV_ENDPOINT=host:port (the same on every node)"
    rdzv_id=${RDZV_ID:-${SLURM_JOB_ID:-}}
    [[ -n $rdzv_id ]] || pd_die "NNODES=$nnodes: set RDZV_ID to an id of this run, the same on every node and" \
        "unique per job (torchrun's --rdzv-id; inside a Slurm job it defaults to SLURM_JOB_ID)"
    rendezvous=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$rdzv_id")
fi
local_addr=()  # expanded as ${local_addr[@]+...}: bash < 4.4 under set -u rejects an empty "${local_addr[@]}"
[[ -z ${LOCAL_ADDR:-} ]] || local_addr=(--local-addr "$LOCAL_ADDR")
exec "${PYTHON:-python}" -m torch.distributed.run "${rendezvous[@]}" ${local_addr[@]+"${local_addr[@]}"} \
    --max-restarts 0 --nproc-per-node "$((WORLD_SIZE / nnodes))" -m ncclkv.scenario "${SCENARIO_ARGS[@]}"
