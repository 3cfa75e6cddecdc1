# Shared by launch/torchrun_pd.sh and launch/srun_pd.sh (sourced, not run).
#
# pd_parse_args "$@" reads the prefill/decode set:
#   --kind KIND                         scenario kind (default: transfer)
#   --prefill N --prefill-tp T --prefill-pp P
#   --decode M  --decode-tp T  --decode-pp P
#   -- ARGS...                          passed on to `python -m ncclkv.scenario`
# and sets WORLD_SIZE (N*T*P + M*T*P) and SCENARIO_ARGS (an array).

pd_usage() {
    cat <<USAGE
usage: $(basename "$0") [--kind KIND] [--prefill N] [--prefill-tp T] [--prefill-pp P]
                         [--decode M] [--decode-tp T] [--decode-pp P] [-- SCENARIO_ARGS...]
Starts N prefill and M decode instances (T x P ranks each) running
\`python -m ncclkv.scenario --kind KIND\`. Defaults: --kind transfer, 1P1D, TP=PP=1.
USAGE
}

pd_die() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

pd_parse_args() {
    local kind=transfer prefill=1 prefill_tp=1 prefill_pp=1 decode=1 decode_tp=1 decode_pp=1
    local extra=()
    while (($#)); do
        case $1 in
            --kind) kind=${2-}; shift 2 || pd_die "--kind needs a value" ;;
            --prefill) prefill=${2-}; shift 2 || pd_die "--prefill needs a value" ;;
            --prefill-tp) prefill_tp=${2-}; shift 2 || pd_die "--prefill-tp needs a value" ;;
            --prefill-pp) prefill_pp=${2-}; shift 2 || pd_die "--prefill-pp needs a value" ;;
            --decode) decode=${2-}; shift 2 || pd_die "--decode needs a value" ;;
            --decode-tp) decode_tp=${2-}; shift 2 || pd_die "--decode-tp needs a value" ;;
            --decode-pp) decode_pp=${2-}; shift 2 || pd_die "--decode-pp needs a value" ;;
            -h | --help) pd_usage; exit 0 ;;
            --) shift; extra=("$@"); break ;;
            *) pd_usage >&2; pd_die "unknown option '$1'" ;;
        esac
    done
    local name value
    for name in prefill prefill_tp prefill_pp decode decode_tp decode_pp; do
        value=${!name}
        [[ $value =~ ^[1-9][0-9]*$ ]] || pd_die "--${name//_/-} must be a positive integer, got '$value'"
    done
    [[ -n $kind ]] || pd_die "--kind needs a value"
    WORLD_SIZE=$((prefill * prefill_tp * prefill_pp + decode * decode_tp * decode_pp))
    SCENARIO_ARGS=(
        --kind "$kind"
        --prefill "$prefill" --prefill-tp "$prefill_tp" --prefill-pp "$prefill_pp"
        --decode "$decode" --decode-tp "$decode_tp" --decode-pp "$decode_pp"
        --bind-host "${NCCLKV_BIND_HOST:-auto}"
        ${extra[@]+"${extra[@]}"}  # bash < 4.4: "${extra[@]}" of an empty array fails under set -u
    )
}
