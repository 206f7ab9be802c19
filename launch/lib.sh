# Shared helpers of the launch/ scripts (sourced, not run). Each script sets PROG before sourcing.
# shellcheck shell=bash

ASTRAI_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

die() {  # one line on stderr, exit 2 (bad input)
  echo "${PROG:-launch}: $*" >&2
  exit 2
}

need_value() {  # need_value OPTION REMAINING_ARGC
  (($2 >= 2)) || die "$1 needs a value"
}

require_command() {  # require_command NAME HINT
  command -v "$1" >/dev/null 2>&1 || die "$1 not found on PATH ($2)"
}

require_host_python() {  # host python3 with PyYAML: reads the job YAML's infra: and runtime: sections
  command -v python3 >/dev/null 2>&1 ||
    die "host python3 not found: it reads the job YAML (install python3 >= 3.9 with PyYAML)"
  python3 -c 'import yaml' >/dev/null 2>&1 ||
    die "host python3 has no PyYAML: pip install pyyaml (or apt-get install python3-yaml)"
}

require_job_file() {  # require_job_file PATH
  [[ -n ${1:-} ]] || die "missing JOB.yaml (see --help)"
  [[ -f $1 ]] || die "job file not found: $1"
}

is_count() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }

gpu_count() {  # GPUs this node may use: CUDA_VISIBLE_DEVICES, else nvidia-smi -L, else 1 (CPU: one process)
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    local ids
    IFS=, read -r -a ids <<<"$CUDA_VISIBLE_DEVICES"
    echo "${#ids[@]}"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    local n
    n=$(nvidia-smi -L | grep -c '^GPU ' || true)
    if ((n > 0)); then echo "$n"; else echo 1; fi
  else
    echo 1
  fi
}

preflight() {  # preflight LAUNCHER ARGS...: check the job in one process before LAUNCHER starts the ranks
  # ARGS are `python` arguments (-m astrai.distributed.preflight ... or -m astrai.train --check ...). A refusal
  # is its one-line error and exit 2, instead of one error per rank and the launcher's traceback. The python is
  # TRAIN_PYTHON, else the one installed beside LAUNCHER, else python3. TRAIN_CHECK=0 skips the check.
  [[ ${TRAIN_CHECK:-1} == 0 ]] && return 0
  local launcher=$1 py=${TRAIN_PYTHON:-} rc=0
  shift
  if [[ -z $py ]]; then
    py=$(dirname "$(command -v "$launcher")")/python
    [[ -x $py ]] || py=python3
  fi
  "$py" "$@" || rc=$?
  ((rc == 0)) || exit "$rc"
}

usage_from_header() {  # print the script's leading comment block (after the shebang) as its help
  sed -n '2,/^[^#]/{/^#/!q;s/^# \{0,1\}//;p}' "$1"
}

run_launcher() {  # run_launcher COMMAND...: run a launcher, pass stop signals to it, exit with the job's code
  # The launcher's own code hides the ranks' (torchrun exits 1 when a rank exits non-zero, `accelerate launch`
  # 128 + N after signal N). Rank 0 writes the job's code to ASTRAI_EXIT_FILE (75: stopped by a signal with a
  # checkpoint, 2: refused, 124: a rank stopped answering) and, on a second line, its one-line error, which this
  # prints last, after anything the launcher said (its failure report). When every rank ended together the ranks
  # exit 0, so the launcher reports nothing, and the code in the file is this script's (python -m astrai.train).
  local exit_file rc=0 pid code="" line="" sig
  exit_file=$(mktemp "${TMPDIR:-/tmp}/astrai-exit.XXXXXX")
  export ASTRAI_EXIT_FILE=$exit_file
  "$@" &
  pid=$!
  for sig in TERM HUP USR1; do
    # shellcheck disable=SC2064  # expand pid and sig now
    trap "kill -s $sig $pid 2>/dev/null || true" "$sig"
  done
  # a background command ignores INT and QUIT (bash without job control): they reach it as TERM, which the ranks
  # treat alike (stop at the next step with a checkpoint)
  trap "kill -s TERM $pid 2>/dev/null || true" INT QUIT
  while :; do  # `wait` returns early when a trapped signal arrives: wait again until the launcher has ended
    wait "$pid" && rc=0 || rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  { IFS= read -r code && IFS= read -r line; } <"$exit_file" 2>/dev/null || true
  rm -f "$exit_file"
  if [[ $code =~ ^[0-9]+$ ]] && ((rc != 0 || code != 0)); then
    if ((code != 0)) && [[ -n $line ]]; then
      echo "$line" >&2
    fi
    exit "$code"
  fi
  exit "$rc"
}
