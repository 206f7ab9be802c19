#!/usr/bin/env bash
# launch/serve.sh: serve a job's checkpoint through the OpenAI-compatible server (python -m astrai.serve).
#
# Usage: launch/serve.sh local|run|up JOB.yaml [--checkpoint DIR] [--port P] [-- SERVER ARGS...]
#        launch/serve.sh down|logs|status JOB.yaml
#
#   local    run the server on this machine (python3 -m astrai.serve, listening on 127.0.0.1)
#   run      run it in Docker in the foreground (service `server` of docker/compose.yaml, image astrai:latest)
#   up       run it in Docker in the background
#   down | logs | status   stop / follow / show the job's server container
#
# The checkpoint is --checkpoint, else SERVE_CHECKPOINT from the env file (SERVE_ENV_FILE, default .env.serve),
# else the newest complete checkpoint under the job's checkpoint directory (infra.checkpoint_dir, else
# train.output_dir). The model is served under the job name; the port is --port, else SERVE_PORT, else 8000.
# GPUs come from infra.gpus (CUDA_VISIBLE_DEVICES), the environment from runtime.environment. SERVER ARGS go
# to python -m astrai.serve (e.g. -- --max_batch 64). Build the image first with launch/train.sh build.
set -euo pipefail
PROG=serve.sh
# shellcheck source=launch/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

COMPOSE_FILE=$ASTRAI_ROOT/docker/compose.yaml
IMAGE=astrai:latest

cmd=${1:-}
[[ -n $cmd ]] || { usage_from_header "$0" >&2; exit 2; }
shift
case $cmd in -h|--help|help) usage_from_header "$0"; exit 0 ;; local|run|up|down|logs|status) ;;
  *) die "unknown command '$cmd' (expected local, run, up, down, logs or status)" ;; esac
job=${1:-}
require_job_file "$job"
shift
opts=() server_args=()
while (($#)); do
  case $1 in
    --checkpoint|--port) need_value "$1" $#; opts+=("$1" "$2"); shift 2 ;;
    --checkpoint=*|--port=*) opts+=("$1"); shift ;;
    --) shift; server_args=("$@"); break ;;
    *) die "unexpected argument '$1' (server arguments go after --)" ;;
  esac
done
[[ $cmd == local || $cmd == run || $cmd == up || ${#opts[@]} -eq 0 ]] || die "$cmd takes no options"

require_host_python
helper=(python3 "$ASTRAI_ROOT/docker/serve_runtime.py")
env_file=${SERVE_ENV_FILE:-.env.serve}
if [[ $cmd == down || $cmd == logs || $cmd == status ]]; then
  # only the project name is needed; no checkpoint has to exist
  name=$("${helper[@]}" project "$job" --env-file "$env_file") || exit $?
  require_command docker "install Docker with the compose plugin"
  project=(-p "astrai-$name-serve" -f "$COMPOSE_FILE")
  case $cmd in
    down) exec docker compose "${project[@]}" down ;;
    logs) exec docker compose "${project[@]}" logs -f server ;;
    status) exec docker compose "${project[@]}" ps --all server ;;
  esac
fi
lines=$("${helper[@]}" exports "$job" --env-file "$env_file" "${opts[@]}") || exit $?
eval "$lines"
if [[ -z ${CUDA_VISIBLE_DEVICES:-} ]]; then unset CUDA_VISIBLE_DEVICES; fi

if [[ $cmd == local ]]; then
  exec python3 -m astrai.serve --checkpoint "$SERVE_CHECKPOINT" --port "$SERVE_PORT" \
    --served_model_name "$SERVE_MODEL_NAME" "${server_args[@]}"
fi
require_command docker "install Docker with the compose plugin"
docker image inspect "$IMAGE" >/dev/null 2>&1 || die "image $IMAGE not found: run launch/train.sh build first"
override=$(mktemp "${TMPDIR:-/tmp}/astrai-compose.XXXXXX")
trap 'rm -f "$override"' EXIT
"${helper[@]}" compose "$job" --env-file "$env_file" "${opts[@]}" -- "${server_args[@]}" >"$override" || exit $?
project=(-p "astrai-$SERVE_JOB_NAME-serve" -f "$COMPOSE_FILE" -f "$override")
if [[ $cmd == run ]]; then
  docker compose "${project[@]}" run --rm --service-ports server
else
  docker compose "${project[@]}" up -d --no-build server
fi
