#!/usr/bin/env bash
# launch/deepspeed.sh: run an astrai job with the DeepSpeed launcher (multi-node over ssh/pdsh with a hostfile).
#
# Usage: launch/deepspeed.sh [LAUNCHER OPTIONS] JOB.yaml [--section.key VALUE ...]
#
# Launcher options (DeepSpeed's names; they come before JOB.yaml):
#   --hostfile FILE        one line per node, `hostname slots=GPUS` (see launch/hostfile.example); without it
#                          DeepSpeed runs on this machine only
#   --num_nodes N, --num_gpus N, --include SPEC, --exclude SPEC, --master_addr ADDR, --master_port PORT,
#   --launcher pdsh|openmpi|mvapich|slurm|..., --ssh_port PORT     passed through to deepspeed
# Everything after JOB.yaml goes to `python -m astrai.train` as config overrides.
#
# Runs: deepspeed [options] --no_local_rank --module astrai.train --config JOB.yaml [overrides]
# after checking the job in one process (python -m astrai.train --check; TRAIN_CHECK=0 skips it)
# (--no_local_rank: astrai reads LOCAL_RANK from the environment; it also accepts --local_rank=N).
# Run it on the first node of the hostfile; DeepSpeed starts the other nodes over ssh.
set -euo pipefail
PROG=deepspeed.sh
# shellcheck source=launch/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

args=()
while (($#)); do
  case $1 in
    -h|--help) usage_from_header "$0"; exit 0 ;;
    --hostfile|-H)
      need_value "$1" $#
      [[ -f $2 ]] || die "--hostfile: no such file: $2"
      args+=(--hostfile "$2"); shift 2 ;;
    --num_nodes|--num_gpus|--master_port|--ssh_port)
      need_value "$1" $#
      is_count "$2" || die "$1: expected a positive integer, got '$2'"
      args+=("$1" "$2"); shift 2 ;;
    --include|--exclude|--master_addr|--launcher) need_value "$1" $#; args+=("$1" "$2"); shift 2 ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
    -*) die "unknown launcher option $1 (launcher options come before JOB.yaml; see --help)" ;;
    *) break ;;
  esac
done
job=${1:-}
require_job_file "$job"
shift
require_command deepspeed "pip install 'astrai[deepspeed]'"
preflight deepspeed -m astrai.train --check --config "$job" "$@"
run_launcher deepspeed "${args[@]}" --no_local_rank --module astrai.train --config "$job" "$@"
