#!/usr/bin/env bash
# launch/torchrun.sh: run an astrai job with `torchrun` (torch.distributed.run), on one node or several.
#
# Usage: launch/torchrun.sh [LAUNCHER OPTIONS] JOB.yaml [--section.key VALUE ...]
#
# Launcher options (torchrun's names; they come before JOB.yaml):
#   --nproc_per_node N     processes on this node (default: TRAIN_GPU_COUNT, else the GPUs this node sees, else 1)
#   --nnodes N             nodes (default 1)
#   --rdzv_endpoint H:P    rendezvous host:port (c10d); required when --nnodes > 1 unless --master_addr is given
#   --rdzv_id ID           job id shared by all nodes (default: the job file's name)
#   --rdzv_backend NAME    default c10d when --rdzv_endpoint is given
#   --max_restarts N       restart the whole group up to N times when a rank fails (default TRAIN_MAX_RESTARTS, else
#                          0); the restarted job resumes its latest checkpoint itself. N > 0 uses the c10d
#                          rendezvous (on one node at --master_addr:--master_port, default localhost:29400) with
#                          TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the default rendezvous failed 5 restarts of 17
#   --node_rank R, --master_addr ADDR, --master_port PORT   passed through
# Everything after JOB.yaml goes to `python -m astrai.train` as config overrides.
#
# Runs: torchrun --nnodes N --nproc_per_node P [rendezvous] -m astrai.train --config JOB.yaml [overrides]
# after checking the job in one process (python -m astrai.train --check; TRAIN_CHECK=0 skips it).
# Signals: torchrun forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT and (set here, PET_SIGNALS_TO_HANDLE) SIGUSR1 to every
# rank, which then stops at the next step with a checkpoint (exit 75), and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# seconds (set here to 600 unless set) before it kills the ranks.
# Multi-node: run the same command on every node (launch/slurm.sbatch does that under Slurm).
set -euo pipefail
PROG=torchrun.sh
# shellcheck source=launch/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

args=() nproc="" nnodes=1 endpoint="" rdzv_id="" backend="" master="" master_port="" restarts=${TRAIN_MAX_RESTARTS:-0}
while (($#)); do
  case $1 in
    -h|--help) usage_from_header "$0"; exit 0 ;;
    --nproc_per_node) need_value "$1" $#; nproc=$2; shift 2 ;;
    --nnodes) need_value "$1" $#; nnodes=$2; shift 2 ;;
    --rdzv_endpoint) need_value "$1" $#; endpoint=$2; shift 2 ;;
    --rdzv_id) need_value "$1" $#; rdzv_id=$2; shift 2 ;;
    --rdzv_backend) need_value "$1" $#; backend=$2; shift 2 ;;
    --master_addr) need_value "$1" $#; master=$2; shift 2 ;;
    --master_port)
      need_value "$1" $#
      [[ $2 =~ ^[0-9]+$ ]] || die "$1: expected a non-negative integer, got '$2'"
      master_port=$2; shift 2 ;;
    --max_restarts) need_value "$1" $#; restarts=$2; shift 2 ;;
    --node_rank)
      need_value "$1" $#
      [[ $2 =~ ^[0-9]+$ ]] || die "$1: expected a non-negative integer, got '$2'"
      args+=("$1" "$2"); shift 2 ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
    -*) die "unknown launcher option $1 (launcher options come before JOB.yaml; see --help)" ;;
    *) break ;;
  esac
done
job=${1:-}
require_job_file "$job"
shift
is_count "$nnodes" || die "--nnodes: expected a positive integer, got '$nnodes'"
if [[ -z $nproc ]]; then
  nproc=${TRAIN_GPU_COUNT:-}
  is_count "$nproc" || nproc=$(gpu_count)
fi
is_count "$nproc" || die "--nproc_per_node: expected a positive integer, got '$nproc'"
[[ $restarts =~ ^[0-9]+$ ]] || die "--max_restarts: expected a non-negative integer, got '$restarts'"
if ((restarts > 0)) && [[ -z $endpoint ]]; then  # restarts need the c10d rendezvous (issue 28: 8 of 8 restarts)
  endpoint=${master:-localhost}:${master_port:-29400}
  master="" master_port=""
fi
if ((nnodes > 1)) && [[ -z $endpoint && -z $master ]]; then
  die "--nnodes $nnodes needs --rdzv_endpoint HOST:PORT (or --master_addr)"
fi
[[ -n $master ]] && args+=(--master_addr "$master")
[[ -n $master_port ]] && args+=(--master_port "$master_port")
if [[ -n $endpoint ]]; then
  [[ $endpoint =~ ^[^:]+:[0-9]+$ ]] || die "--rdzv_endpoint: expected HOST:PORT, got '$endpoint'"
  name=$(basename "$job")
  args+=(--rdzv_backend "${backend:-c10d}" --rdzv_endpoint "$endpoint" --rdzv_id "${rdzv_id:-${name%.*}}")
elif [[ -n $backend || -n $rdzv_id ]]; then
  args+=(${backend:+--rdzv_backend "$backend"} ${rdzv_id:+--rdzv_id "$rdzv_id"})
fi
((restarts > 0)) && args+=(--max_restarts "$restarts")
if [[ ${backend:-c10d} == c10d && -n $endpoint ]]; then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
fi
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}
require_command torchrun "it comes with torch"
WORLD_SIZE=$((nnodes * nproc)) preflight torchrun -m astrai.train --check --config "$job" "$@"
run_launcher torchrun --nnodes "$nnodes" --nproc_per_node "$nproc" "${args[@]}" -m astrai.train --config "$job" "$@"
