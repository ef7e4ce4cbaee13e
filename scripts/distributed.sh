#!/usr/bin/env bash
# Ferry distributed on one machine, without Docker: web, two nodes (CPU, declaring different accelerator
# types and memory budgets), a Celery worker and beat, as local processes against the local PostgreSQL
# and Redis. Each process logs to $FERRY_DATA_DIR/logs/<name>.log. Ctrl-C stops them all, and so does
# any one of them exiting (its log says why).
#
# Usage: scripts/distributed.sh [--no-demo]
#   --no-demo   skip training and registering the demo models and the demo account
# Environment (defaults): DATABASE_URL (postgres://postgres@127.0.0.1:5432/ferry, created if missing),
#   REDIS_URL (redis://127.0.0.1:6379/0), FERRY_DATA_DIR (var/distributed), HOST (127.0.0.1), PORT (8000).
set -euo pipefail
cd "$(dirname "$0")/.."

demo=1
for arg in "$@"; do
  case "$arg" in
    --no-demo) demo=0 ;;
    *) echo "usage: $0 [--no-demo]" >&2; exit 2 ;;
  esac
done

PY=.venv/bin/python
CELERY=.venv/bin/celery
[ -x "$PY" ] || { echo "no .venv here: run 'make setup' first" >&2; exit 1; }
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/ferry}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
export FERRY_DATA_DIR=${FERRY_DATA_DIR:-$PWD/var/distributed}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
LOGS=$FERRY_DATA_DIR/logs
mkdir -p "$LOGS"
# Processes sharing a database share one SECRET_KEY (web refuses to start on a key of its own): generated once
# into the data directory, readable by this user only, unless you set one.
if [ -z "${SECRET_KEY:-}${SECRET_KEY_FILE:-}" ]; then
  [ -s "$FERRY_DATA_DIR/secret_key" ] ||
    (umask 077 && "$PY" -c 'import secrets; print(secrets.token_urlsafe(50))' >"$FERRY_DATA_DIR/secret_key")
  export SECRET_KEY_FILE=$FERRY_DATA_DIR/secret_key
fi

echo "==> database $DATABASE_URL (created if missing), migrations"
"$PY" - <<'PY'
import os

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

params = conninfo_to_dict(os.environ["DATABASE_URL"])
name = params.get("dbname")
with psycopg.connect(**{**params, "dbname": "postgres"}, autocommit=True) as conn:
    if name and not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        print(f"created database {name}")
PY
"$PY" manage.py migrate --noinput -v0
if [ "$demo" = 1 ]; then
  echo "==> demo models (trained once, about a minute) and the demo account"
  "$PY" manage.py build_demo_models
  "$PY" manage.py ensure_demo_user
fi

names=()
pids=()
start() {  # start NAME COMMAND...: in the background, its output to its log
  local name=$1
  shift
  "$@" >"$LOGS/$name.log" 2>&1 &
  names+=("$name")
  pids+=("$!")
  echo "    $name: pid $!, log $LOGS/$name.log"
}

stopping=0
stop_all() {
  [ "$stopping" = 1 ] && return
  stopping=1
  echo "==> stopping"
  local i pid deadline=$((SECONDS + 30))
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  # Celery finishes its running tasks and nodes their batches on SIGTERM: give them time, then insist.
  for i in "${!pids[@]}"; do
    pid=${pids[$i]}
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "    ${names[$i]} did not stop within 30 s: killed"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  wait 2>/dev/null || true
  echo "    all stopped; logs in $LOGS"
}
# Background processes of a script ignore SIGINT, so Ctrl-C reaches only this shell: it stops them.
# The traps only note the signal (it ends `wait -n` below), and the stopping runs outside them: bash
# loses its variable context when a trap runs a function during `wait -n`.
signalled=0
trap 'signalled=130' INT
trap 'signalled=143' TERM

echo "==> starting"
start web env FERRY_EMBEDDED_NODE=false "$PY" manage.py serve --host "$HOST" --port "$PORT"
start node-a env FERRY_TORCH_THREADS=1 "$PY" manage.py runnode --name node-a --accelerator a10g --memory 2GiB
start node-b env FERRY_TORCH_THREADS=1 "$PY" manage.py runnode --name node-b --accelerator l4 --memory 1GiB
start worker "$CELERY" -A config worker -l info --concurrency 2
# Beat's schedule file goes with the data, not into the working tree.
start beat "$CELERY" -A config beat -l info --schedule "$FERRY_DATA_DIR/celerybeat-schedule"
echo "==> Ferry on http://$HOST:$PORT (web, node-a, node-b, worker, beat); Ctrl-C stops all"
[ "$demo" = 1 ] && echo "    demo API key: $FERRY_DATA_DIR/demo-api-key; console login admin, password in $FERRY_DATA_DIR/demo-admin-password"

# Any process ending on its own ends the whole set: a half-started deployment only misleads.
[ "$signalled" != 0 ] || wait -n || true
if [ "$signalled" != 0 ]; then
  stop_all
  exit "$signalled"
fi
for i in "${!pids[@]}"; do
  if ! kill -0 "${pids[$i]}" 2>/dev/null; then
    echo "==> ${names[$i]} exited; the end of $LOGS/${names[$i]}.log:"
    tail -n 5 "$LOGS/${names[$i]}.log" | sed 's/^/    /'
  fi
done
stop_all
exit 1
