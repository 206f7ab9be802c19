#!/usr/bin/env bash
# launch/accelerate.sh: run an astrai job with `accelerate launch`, on one machine or several.
#
# Usage: launch/accelerate.sh [LAUNCHER OPTIONS] JOB.yaml [--section.key VALUE ...]
#
# Launcher options (accelerate's names; they come before JOB.yaml):
#   --config_file FILE          an accelerate config, e.g. configs/zero/zero2.yaml (it then defines the setup)
#   --num_processes N           processes over all machines (default: TRAIN_GPU_COUNT, else the GPUs this node
#                               sees, times --num_machines; 1 on a CPU-only machine)
#   --num_machines M            machines in the job (default 1)
#   --machine_rank R            this machine's rank, 0 .. M-1 (required when M > 1 without --config_file)
#   --main_process_ip IP        address of machine 0 (required when M > 1 without --config_file)
#   --main_process_port PORT    its port (default 29500)
#   --mixed_precision no|fp16|bf16, --gpu_ids LIST, --same_network, --cpu   passed through to accelerate
#   --max_restarts N            restart the whole group up to N times when a rank fails (default TRAIN_MAX_RESTARTS,
#                               else 0); the restarted job resumes its latest checkpoint itself. N > 0 adds
#                               --rdzv_backend c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the reliable restart)
# Everything after JOB.yaml goes to `python -m astrai.train` as config overrides.
# Signals: accelerate's torchrun forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT and (set here, PET_SIGNALS_TO_HANDLE)
# SIGUSR1 to every rank, which stops at the next step with a checkpoint (exit 75); it waits
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (600 unless set) before it kills the ranks.
#
# Runs: accelerate launch [options] [--multi_gpu] -m astrai.train --config JOB.yaml [overrides], after checking the
# job in one process with the environment the ranks would get (python -m astrai.distributed.preflight; a refusal
# is one line and exit 2; TRAIN_CHECK=0 skips it, TRAIN_PYTHON picks the python)
# (--multi_gpu is added when more than one process is asked for without --config_file or --cpu).
# Multi-node: run the same command on every machine with its own --machine_rank.
set -euo pipefail
PROG=accelerate.sh
# shellcheck source=launch/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

args=() config_file="" num_processes="" num_machines=1 machine_rank="" main_ip="" cpu=0 port=29500
restarts=${TRAIN_MAX_RESTARTS:-0}
while (($#)); do
  case $1 in
    -h|--help) usage_from_header "$0"; exit 0 ;;
    --config_file) need_value "$1" $#; config_file=$2; shift 2 ;;
    --num_processes) need_value "$1" $#; num_processes=$2; shift 2 ;;
    --num_machines) need_value "$1" $#; num_machines=$2; shift 2 ;;
    --machine_rank) need_value "$1" $#; machine_rank=$2; shift 2 ;;
    --main_process_ip) need_value "$1" $#; main_ip=$2; shift 2 ;;
    --main_process_port) need_value "$1" $#; port=$2; shift 2 ;;
    --max_restarts) need_value "$1" $#; restarts=$2; shift 2 ;;
    --mixed_precision|--gpu_ids) need_value "$1" $#; args+=("$1" "$2"); shift 2 ;;
    --same_network) args+=("$1"); shift ;;
    --cpu) cpu=1; args+=("$1"); shift ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
    -*) die "unknown launcher option $1 (launcher options come before JOB.yaml; see --help)" ;;
    *) break ;;
  esac
done
job=${1:-}
require_job_file "$job"
shift
is_count "$num_machines" || die "--num_machines: expected a positive integer, got '$num_machines'"
[[ $port =~ ^[0-9]+$ ]] || die "--main_process_port: expected a port number, got '$port'"
if [[ -n $config_file ]]; then
  [[ -f $config_file ]] || die "--config_file: no such file: $config_file"
  args=(--config_file "$config_file" "${args[@]}")
fi
if [[ -z $num_processes && -z $config_file ]]; then
  per_node=${TRAIN_GPU_COUNT:-}
  is_count "$per_node" || per_node=$(gpu_count)
  ((cpu)) && per_node=1
  num_processes=$((per_node * num_machines))
fi
if [[ -n $num_processes ]]; then
  is_count "$num_processes" || die "--num_processes: expected a positive integer, got '$num_processes'"
  args+=(--num_processes "$num_processes")
fi
if ((num_machines > 1)) || [[ -n $machine_rank || -n $main_ip ]]; then
  if [[ -z $config_file ]]; then
    [[ -n $machine_rank && -n $main_ip ]] ||
      die "--num_machines $num_machines needs --machine_rank and --main_process_ip (or a --config_file)"
  fi
  [[ -z $machine_rank || ( $machine_rank =~ ^[0-9]+$ && machine_rank -lt num_machines ) ]] ||
    die "--machine_rank: expected 0 .. $((num_machines - 1)), got '$machine_rank'"
  args+=(--num_machines "$num_machines")
  [[ -n $machine_rank ]] && args+=(--machine_rank "$machine_rank")
  [[ -n $main_ip ]] && args+=(--main_process_ip "$main_ip" --main_process_port "$port")
fi
if [[ -z $config_file ]] && ((cpu == 0)) && [[ -n $num_processes ]] && ((num_processes > 1)); then
  args+=(--multi_gpu)
fi
[[ $restarts =~ ^[0-9]+$ ]] || die "--max_restarts: expected a non-negative integer, got '$restarts'"
if ((restarts > 0)); then
  args+=(--max_restarts "$restarts" --rdzv_backend c10d)
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
fi
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}
require_command accelerate "it comes with astrai: pip install -e ."
preflight accelerate -m astrai.distributed.preflight "${args[@]}" -m astrai.train --config "$job" "$@"
run_launcher accelerate launch "${args[@]}" -m astrai.train --config "$job" "$@"
