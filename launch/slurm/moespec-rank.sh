#!/usr/bin/env bash
# One moespec rank under `srun`: the sbatch templates in this folder run this script once per
# task (one task per GPU, or per CPU rank for the gloo test), never directly by hand.
#
#   srun ... launch/slurm/moespec-rank.sh serve --config C [--set k=v ...] [--host H --port P]
#
# What it does, in order:
#   1. finds the rendezvous: MASTER_ADDR = first host of the job (`scontrol show hostnames`,
#      or moespec's own nodelist parser where scontrol is missing), MASTER_PORT = the value
#      given, else one derived from SLURM_JOB_ID so two jobs on one head node don't collide;
#   2. leaves rank, world size and local rank to slurm's own variables (SLURM_PROCID,
#      SLURM_NTASKS, SLURM_LOCALID), which moespec.parallel.groups.read_launch_env reads
#      natively; torchrun's RANK/WORLD_SIZE/LOCAL_RANK are unset so a stale value inherited
#      from the submitting shell cannot win over slurm's;
#   3. on the leader (SLURM_PROCID 0) prints where the OpenAI API will be served;
#   4. with MOESPEC_DEVICE_PER_RANK=cuda, puts this rank's model on cuda:SLURM_LOCALID;
#   5. execs `moespec "$@"`, so the rank's exit status is moespec's.
#
# MOESPEC_DRY_RUN=1 prints the resolved variables (KEY=VALUE lines) and the command instead of
# running it: this is how tests check the mapping without a cluster.
set -euo pipefail

# --- slurm must have started us --------------------------------------------------------------
: "${SLURM_PROCID:?run this under srun (SLURM_PROCID is unset)}"
: "${SLURM_NTASKS:?run this under srun (SLURM_NTASKS is unset)}"
: "${SLURM_LOCALID:=0}"
NODELIST="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"

# --- where the moespec checkout and its interpreter are ---------------------------------------
# MOESPEC_HOME: the repository (configs/ and checkpoints/ paths in configs are relative to it).
MOESPEC_HOME="${MOESPEC_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}"
# MOESPEC_BIN: the moespec entry point; default: the repository's .venv, else `moespec` on PATH.
if [[ -z "${MOESPEC_BIN:-}" ]]; then
    if [[ -x "$MOESPEC_HOME/.venv/bin/moespec" ]]; then
        MOESPEC_BIN="$MOESPEC_HOME/.venv/bin/moespec"
    else
        MOESPEC_BIN="moespec"
    fi
fi
MOESPEC_PYTHON="$(dirname "$(command -v "$MOESPEC_BIN" || echo "$MOESPEC_BIN")")/python"

# --- rendezvous: head node = first host of the allocation -------------------------------------
if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -z "$NODELIST" ]]; then
        echo "moespec-rank: neither SLURM_JOB_NODELIST nor MASTER_ADDR is set" >&2
        exit 2
    fi
    if command -v scontrol >/dev/null 2>&1 && MASTER_ADDR="$(scontrol show hostnames "$NODELIST" 2>/dev/null | head -n 1)" \
            && [[ -n "$MASTER_ADDR" ]]; then
        :
    else  # no scontrol here (or it failed): the same expansion in moespec itself
        MASTER_ADDR="$("$MOESPEC_PYTHON" -c 'import sys; from moespec.parallel.groups import parse_nodelist; print(parse_nodelist(sys.argv[1])[0])' "$NODELIST")"
    fi
fi
# MASTER_PORT: the torch.distributed store on the head node; 20000-29999 from the job id unless set.
if [[ -z "${MASTER_PORT:-}" ]]; then
    MASTER_PORT=$(( 20000 + ${SLURM_JOB_ID:-0} % 10000 ))
fi
export MASTER_ADDR MASTER_PORT MOESPEC_HOME
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK

# --- CPU threads per rank: one rank per core unless told otherwise ------------------------------
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"

cd "$MOESPEC_HOME"

# --- one GPU per rank ---------------------------------------------------------------------------
# MOESPEC_DEVICE_PER_RANK=cuda: this rank's model goes on cuda:SLURM_LOCALID (every task sees all
# of its node's GPUs; without this every rank's weights would land on the current device, cuda:0).
# Unset (CPU, or a single-rank job) leaves model.device as the config says.
args_extra=()
if [[ -n "${MOESPEC_DEVICE_PER_RANK:-}" ]]; then
    args_extra=(--set "model.device=${MOESPEC_DEVICE_PER_RANK}:${SLURM_LOCALID}")
fi

# --- the leader says where it serves -----------------------------------------------------------
if [[ "$SLURM_PROCID" == "0" ]]; then
    # --port/--host given on the command line win; else what the batch script exported.
    port="${MOESPEC_PORT:-8000}" host="${MOESPEC_HOST:-0.0.0.0}"
    args=("$@")
    for ((i = 0; i < ${#args[@]}; i++)); do
        case "${args[$i]}" in
            --port) port="${args[$((i + 1))]:-$port}" ;;
            --host) host="${args[$((i + 1))]:-$host}" ;;
        esac
    done
    shown="$host"
    [[ "$host" == "0.0.0.0" || "$host" == "::" ]] && shown="$(hostname)"
    echo "moespec-rank: leader (rank 0 of $SLURM_NTASKS) on $(hostname), rendezvous $MASTER_ADDR:$MASTER_PORT"
    echo "moespec-rank: serving the OpenAI API on http://$shown:$port/v1 (health: http://$shown:$port/health)"
fi

if [[ "${MOESPEC_DRY_RUN:-0}" == "1" ]]; then
    echo "SLURM_PROCID=$SLURM_PROCID"
    echo "SLURM_NTASKS=$SLURM_NTASKS"
    echo "SLURM_LOCALID=$SLURM_LOCALID"
    echo "SLURM_JOB_NODELIST=$NODELIST"
    echo "MASTER_ADDR=$MASTER_ADDR"
    echo "MASTER_PORT=$MASTER_PORT"
    echo "OMP_NUM_THREADS=$OMP_NUM_THREADS"
    echo "COMMAND=$MOESPEC_BIN $*${args_extra[*]:+ ${args_extra[*]}}"
    exit 0
fi

exec "$MOESPEC_BIN" "$@" "${args_extra[@]}"
