#!/usr/bin/env bash
# Start a prefill/decode set as one Slurm job step; see launch/_pd_args.sh for the options.
#
#   launch/srun_pd.sh --prefill 2 --prefill-tp 2 --decode 2 --decode-tp 2
#
# Inside an allocation (sbatch, salloc) the step uses it; otherwise srun makes one.
# GPUS_PER_TASK (default 1; 0 requests none), SRUN_MPI (default pmix; "none" for
# sites without the PMIx plugin), PYTHON (default: python on PATH).
# MASTER_ADDR / MASTER_PORT default to the first node (of het group 0 in a heterogeneous step) and a port
# derived from the job and step ids; a rank meeting another job's store there is refused (export MASTER_PORT).
# GLOO_SOCKET_IFNAME, when set, is the interface whose address each rank binds (--bind-host auto).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_pd_args.sh"
pd_parse_args "$@"

gpus=${GPUS_PER_TASK:-1}
[[ $gpus =~ ^[0-9]+$ ]] || pd_die "GPUS_PER_TASK must be a non-negative integer, got '$gpus'"
gpu_args=()  # expanded as ${gpu_args[@]+...}: bash < 4.4 under set -u rejects an empty "${gpu_args[@]}"
((gpus == 0)) || gpu_args=(--gpus-per-task "$gpus")
exec srun --ntasks "$WORLD_SIZE" ${gpu_args[@]+"${gpu_args[@]}"} --mpi "${SRUN_MPI:-pmix}" \
    "${PYTHON:-python}" -m ncclkv.scenario "${SCENARIO_ARGS[@]}"
