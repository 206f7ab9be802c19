#!/usr/bin/env bash
# launch/train.sh: train an astrai job in Docker (docker/compose.yaml, service `trainer`, image astrai:latest).
#
# Usage: launch/train.sh build
#        launch/train.sh run|up JOB.yaml [--section.key VALUE ...]
#        launch/train.sh down|logs|status JOB.yaml
#
#   build    build the image astrai:latest (the only command that builds; run/up reuse it)
#   run      train in the foreground (docker compose run --rm trainer); overrides go to astrai.train
#   up       train in the background (docker compose up -d trainer)
#   down     stop and remove the job's containers
#   logs     follow the job's log
#   status   show the job's containers
#
# load_infra reads the job YAML's top-level `infra:` section (job_name, data, model, checkpoint_dir, gpus; see
# docs/launch.md) and exports TRAIN_JOB_NAME, TRAIN_DATA, TRAIN_MODEL, TRAIN_CHECKPOINT_DIR, TRAIN_GPU_COUNT and
# CUDA_VISIBLE_DEVICES. Values in `infra:` take precedence over the env file (TRAIN_ENV_FILE, default
# .env.train in the current directory); keys absent from both fall back to the defaults. The job's compose project
# is astrai-<job_name>. Needs host python3 (>= 3.9) with PyYAML, and docker with the compose plugin.
# Before resuming an online_ppo job, the checkpoint must hold the critic extras
# (python -m astrai.checkpoint verify --require-critic), or the job is refused.
set -euo pipefail
PROG=train.sh
# shellcheck source=launch/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

COMPOSE_FILE=$ASTRAI_ROOT/docker/compose.yaml
IMAGE=astrai:latest

load_infra() {  # load_infra JOB.yaml [overrides]: export the job's TRAIN_* variables
  require_host_python
  local lines
  lines=$(python3 "$ASTRAI_ROOT/docker/train_runtime.py" exports "$1" --env-file "${TRAIN_ENV_FILE:-.env.train}" \
    -- "${@:2}") || exit $?
  eval "$lines"
  # an empty CUDA_VISIBLE_DEVICES would hide every GPU in the container: unset it (= all GPUs)
  if [[ -z ${CUDA_VISIBLE_DEVICES:-} ]]; then unset CUDA_VISIBLE_DEVICES; fi
}

check_resume() {  # refuse to resume an online_ppo job from a checkpoint without the critic extras
  [[ $TRAIN_TYPE == online_ppo && -n $TRAIN_RESUME_CHECKPOINT ]] || return 0
  local report
  if ! report=$(PYTHONPATH="$ASTRAI_ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 -m astrai.checkpoint verify \
      --require-critic "$TRAIN_RESUME_CHECKPOINT" 2>&1); then
    die "refusing to resume online_ppo job '$TRAIN_JOB_NAME' from $TRAIN_RESUME_CHECKPOINT: $(
      grep -E '^(MISSING|MISMATCH|UNSAFE|INVALID|NOT-CKPT)' <<<"$report" | head -n 3 | tr -s ' \n' ' ')"
  fi
}

require_compose() {  # docker and its compose plugin, each named when missing
  require_command docker "install Docker (https://docs.docker.com/engine/install/) with its compose plugin"
  docker compose version >/dev/null 2>&1 ||
    die "docker is installed but its compose plugin is not (\`docker compose\` fails): install docker-compose-plugin \
(Docker Compose v2; the old docker-compose v1 command is not used)"
}

compose() {  # docker compose for this job's project
  docker compose -p "astrai-$TRAIN_JOB_NAME" -f "$COMPOSE_FILE" "$@"
}

start() {  # start run|up JOB.yaml [overrides]
  local mode=$1 job=$2
  shift 2
  check_resume
  docker image inspect "$IMAGE" >/dev/null 2>&1 || die "image $IMAGE not found: run launch/train.sh build first"
  mkdir -p "$TRAIN_CHECKPOINT_DIR"
  OVERRIDE=$(mktemp "${TMPDIR:-/tmp}/astrai-compose.XXXXXX")
  trap 'rm -f "$OVERRIDE"' EXIT
  python3 "$ASTRAI_ROOT/docker/train_runtime.py" compose "$job" --env-file "${TRAIN_ENV_FILE:-.env.train}" \
    -- "$@" >"$OVERRIDE" || exit $?
  if [[ $mode == run ]]; then
    compose -f "$OVERRIDE" run --rm trainer
  else
    compose -f "$OVERRIDE" up -d --no-build trainer
  fi
}

cmd=${1:-}
[[ -n $cmd ]] || { usage_from_header "$0" >&2; exit 2; }
shift
case $cmd in
  -h|--help|help) usage_from_header "$0" ;;
  build)
    require_compose
    docker compose -f "$COMPOSE_FILE" build "$@" trainer ;;
  run|up|down|logs|status)
    job=${1:-}
    require_job_file "$job"
    shift
    [[ $cmd == run || $cmd == up || $# -eq 0 ]] || die "$cmd takes no overrides"
    load_infra "$job" "$@"
    require_compose
    case $cmd in
      run|up) start "$cmd" "$job" "$@" ;;
      down) compose down ;;
      logs) compose logs -f trainer ;;
      status) compose ps --all trainer ;;
    esac ;;
  *) die "unknown command '$cmd' (expected build, run, up, down, logs or status)" ;;
esac
