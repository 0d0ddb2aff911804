#!/usr/bin/env bash
# Checks every host of a hostfile before a multi-node launch, in parallel, with a timeout:
#   scripts/check_hosts.sh [HOSTFILE]          # default ./hostfile; exit 0 when all hosts pass
#   SSH_TIMEOUT=5 SSH_PORT=2222 scripts/check_hosts.sh hostfile
# For each host: passwordless ssh works (BatchMode, ConnectTimeout=$SSH_TIMEOUT, default 10 s), and the
# host sees this repository and this Python at the same paths (the launchers start ranks with them).
# A host that fails is named, with ssh's own reason, and the exit status is 2. Without this, DeepSpeed's
# runner only tests the first host, and pdsh/mpirun leave the ranks that did start waiting for the
# missing ones. scripts/launch_multi_node.sh and scripts/launch_mpirun.sh run it first
# (SKIP_HOST_CHECK=1 skips it).
set -uo pipefail
cd "$(dirname "$0")/.."
HOSTFILE="${1:-${HOSTFILE:-hostfile}}"
SSH_TIMEOUT="${SSH_TIMEOUT:-10}"
ROOT="$(pwd)"
PY="${PYTHON_BIN:-$(command -v python3 || command -v python)}"
[[ -f "$HOSTFILE" ]] || { echo "check_hosts.sh: no hostfile at $HOSTFILE (see hostfile.example)" >&2; exit 2; }

mapfile -t hosts < <(sed -e 's/#.*//' "$HOSTFILE" | awk 'NF {print $1}')
((${#hosts[@]})) || { echo "check_hosts.sh: $HOSTFILE names no host (one '<host> slots=<N>' per line)" >&2; exit 2; }

ssh_opts=(-o BatchMode=yes -o ConnectTimeout="$SSH_TIMEOUT" -o ServerAliveInterval=5 -o ServerAliveCountMax=2)
[[ -n "${SSH_PORT:-}" ]] && ssh_opts+=(-p "$SSH_PORT")
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2016  # expanded on the remote host
remote='test -d "$1" || { echo "the repository path $1 does not exist there"; exit 3; }
test -x "$2" || { echo "the Python $2 does not exist there (same venv path on every host?)"; exit 3; }'
pids=()
for i in "${!hosts[@]}"; do
  # `timeout` bounds the whole exchange too: a host that accepts the connection and then stalls.
  timeout "$((SSH_TIMEOUT * 2 + 5))" ssh "${ssh_opts[@]}" "${hosts[$i]}" bash -c "'$remote'" _ "$(printf %q "$ROOT")" "$(printf %q "$PY")" \
    >"$tmp/$i.out" 2>&1 </dev/null &
  pids+=("$!")
done
bad=0
for i in "${!hosts[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  ((rc == 0)) && continue
  bad=1
  why="$(grep -v '^\s*$' "$tmp/$i.out" | tail -n 2 | tr '\n' ' ' | sed 's/ *$//')"
  ((rc == 124)) && why="no answer within $((SSH_TIMEOUT * 2 + 5)) s"
  if ((rc == 3)); then
    echo "check_hosts.sh: host ${hosts[$i]} (from $HOSTFILE) is reachable, but $why" >&2
  else
    echo "check_hosts.sh: host ${hosts[$i]} (from $HOSTFILE) cannot be reached by passwordless ssh" \
      "within ${SSH_TIMEOUT} s: ${why:-ssh exit status $rc}" >&2
  fi
done
((bad)) && exit 2
echo "check_hosts.sh: all ${#hosts[@]} hosts of $HOSTFILE reachable by ssh, with $ROOT and $PY"
