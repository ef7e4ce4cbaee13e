#!/usr/bin/env bash
# The suite in two runs: everything but the tests marked `solo` on pytest-xdist workers (PYTEST_ARGS, from
# the Makefile: three workers), then the `solo` tests in one process, alone on the machine. Arguments go to
# both runs (a path, a -k); either run may select nothing, both may not (pytest's exit 5 is a failure here).
set -uo pipefail
cd "$(dirname "$0")/.."
data_dir=$(mktemp -d /tmp/ferry-test.XXXXXX)
# The runs' data directories (databases, artifacts, process logs) go when the suite passes; a failed run keeps
# them for its logs, and says where.
# shellcheck disable=SC2317  # run by the EXIT trap
finish() {
  local status=$?
  if [ "$status" -eq 0 ]; then
    rm -rf "$data_dir"
  else
    echo "==> the runs' data directories and logs are kept in $data_dir"
  fi
}
trap finish EXIT
mkdir -p "$data_dir/parallel" "$data_dir/solo"
export DATABASE_URL="$TEST_DATABASE_URL" DATABASE_CONN_MAX_AGE=0 FERRY_TEST_REDIS_URL="$TEST_REDIS_URL"
# A web process on a shared database refuses a key of its own (config/settings.py): one for the run, which the
# processes the tests start inherit.
SECRET_KEY="${SECRET_KEY:-$(.venv/bin/python -c 'import secrets; print(secrets.token_urlsafe(50))')}"
export SECRET_KEY

# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
FERRY_DATA_DIR="$data_dir/parallel" .venv/bin/python -m pytest ${PYTEST_ARGS:-} -m "not solo" "$@"
parallel=$?
[ "$parallel" -eq 0 ] || [ "$parallel" -eq 5 ] || exit "$parallel"
echo "==> the tests marked solo, alone on the machine"
FERRY_DATA_DIR="$data_dir/solo" .venv/bin/python -m pytest -m solo "$@"
solo=$?
if [ "$parallel" -eq 5 ] && [ "$solo" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here"
  exit 5
fi
[ "$solo" -eq 5 ] && exit 0
exit "$solo"
