#!/usr/bin/env bash
# The services the test suite needs, where TEST_DATABASE_URL and TEST_REDIS_URL say (the Makefile's defaults:
# PostgreSQL on 127.0.0.1:5432, user postgres, database test, no password; Redis on 127.0.0.1:6379). Each one
# that answers already is left alone; one on this machine that is stopped is started; one that is not
# installed is installed from the system's packages first (Debian's apt-get). On every run: PostgreSQL lets
# the user in from loopback without a password (a trust rule for 127.0.0.1 and ::1, added and reloaded where
# it does not), and the database exists (created as postgres over the Unix socket, where peer
# authentication needs no password). `make test` runs this before the suite, so a fresh machine needs
# nothing but the README's command. A service on another host is only checked.
set -euo pipefail

die() {
  echo "services.sh: $*" >&2
  exit 1
}
# URL parts by Python's own parser (a password or an IPv6 address in the URL included): one field per line.
url_parts() {
  python3 - "$1" <<'PY'
import sys
from urllib.parse import urlsplit
u = urlsplit(sys.argv[1])
print(u.hostname or "127.0.0.1", u.port or {"redis": 6379}.get(u.scheme, 5432), u.username or "postgres", u.path.lstrip("/"), sep="\n")
PY
}
command -v python3 >/dev/null || die "python3 is needed to read TEST_DATABASE_URL and TEST_REDIS_URL"
{ read -r PG_HOST; read -r PG_PORT; read -r PG_USER; read -r PG_DB; } < <(url_parts "${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}")
{ read -r REDIS_HOST; read -r REDIS_PORT; read -r _; read -r _; } < <(url_parts "${TEST_REDIS_URL:-redis://127.0.0.1:6379/15}")
PG_DB=${PG_DB:-test}
local_host() { case "$1" in 127.0.0.1 | localhost | ::1) return 0 ;; *) return 1 ;; esac; }

# What starts or installs a service: root itself, or sudo; a message saying what to do where neither is there.
if [ "$(id -u)" = 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null; then
  SUDO=(sudo)
else
  SUDO=(none)
fi
privileged() {
  [ "${SUDO[*]}" != none ] || die "$1 needs root or sudo, and neither is here: $2"
  "${SUDO[@]}" "${@:3}"
}
as_postgres() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    privileged "running psql as postgres" "create the database $PG_DB yourself" sudo -u postgres "$@"
  fi
}

pg_up() { pg_isready -h "$PG_HOST" -p "$PG_PORT" -q 2>/dev/null; }
redis_up() { redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; }
wait_for() {
  for _ in $(seq 30); do
    "$1" && return 0
    sleep 1
  done
  return 1
}

apt_updated=""
apt_install() {
  command -v apt-get >/dev/null || die "$* is missing and there is no apt-get to install it: install it, then run this again"
  if [ -z "$apt_updated" ]; then
    privileged "installing $*" "install $* yourself" apt-get update -qq
    apt_updated=1
  fi
  echo "==> installing $*"
  privileged "installing $*" "install $* yourself" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

pg_cluster() { find /etc/postgresql -mindepth 1 -maxdepth 1 -type d -printf '%f\n' 2>/dev/null | sort -V | tail -1; }

if local_host "$PG_HOST"; then
  if ! pg_up; then
    # The package starts its own cluster as it installs (on 5432), asking loopback clients for a password.
    [ -n "$(pg_cluster)" ] || apt_install postgresql
    version=$(pg_cluster)
    [ -n "$version" ] || die "PostgreSQL is installed but has no cluster under /etc/postgresql"
    echo "==> starting PostgreSQL $version"
    # "already running" is not a failure: the cluster may listen on another port than TEST_DATABASE_URL's.
    privileged "starting PostgreSQL" "start it yourself" pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    wait_for pg_up || die "PostgreSQL does not answer on $PG_HOST:$PG_PORT (is TEST_DATABASE_URL's port its port?)"
  fi
  command -v psql >/dev/null || apt_install postgresql-client
  # The suite connects as $PG_USER from loopback without a password. Where it cannot, the newest cluster's
  # pg_hba.conf is given trust rules for 127.0.0.1 and ::1 only (first, so they win) and reloaded.
  if ! psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -w -qAtc "SELECT 1" >/dev/null 2>&1; then
    version=$(pg_cluster)
    hba=/etc/postgresql/$version/main/pg_hba.conf
    if [ -z "$version" ] || [ ! -f "$hba" ]; then
      die "$PG_USER cannot connect to $PG_HOST:$PG_PORT without a password, and there is no pg_hba.conf here to allow it"
    fi
    echo "==> letting $PG_USER in from loopback without a password ($hba)"
    privileged "editing $hba" "add 'host all all 127.0.0.1/32 trust' at its top and reload" \
      sed -i '1i host all all 127.0.0.1/32 trust  # scripts/services.sh\nhost all all ::1/128 trust  # scripts/services.sh' "$hba"
    privileged "reloading PostgreSQL" "reload it yourself" pg_ctlcluster --skip-systemctl-redirect "$version" main reload
    wait_for_login() { psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -w -qAtc "SELECT 1" >/dev/null 2>&1; }
    wait_for wait_for_login || die "$PG_USER still cannot connect to $PG_HOST:$PG_PORT without a password after the reload"
  fi
  # Checked on every run, created over the Unix socket as postgres (peer authentication: no password).
  exists=$(psql -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d postgres -w -qAtc \
    "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'")
  if [ "$exists" != 1 ]; then
    echo "==> creating database $PG_DB"
    as_postgres psql -p "$PG_PORT" -v ON_ERROR_STOP=1 -qc "CREATE DATABASE \"$PG_DB\" OWNER \"$PG_USER\"" ||
      die "could not create database $PG_DB (psql's error is above)"
  fi
else
  pg_up || die "PostgreSQL does not answer on $PG_HOST:$PG_PORT (TEST_DATABASE_URL); only one on this machine is started here"
fi

if local_host "$REDIS_HOST"; then
  if ! redis_up; then
    command -v redis-server >/dev/null || apt_install redis-server
    echo "==> starting Redis on port $REDIS_PORT"
    privileged "starting Redis" "start redis-server yourself" mkdir -p /var/lib/redis /var/log/redis
    # Nothing kept on disk: the suite's Redis databases are throwaway.
    privileged "starting Redis" "start redis-server yourself" redis-server --daemonize yes --bind 127.0.0.1 -::1 \
      --port "$REDIS_PORT" --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ferry-test.log
    wait_for redis_up || die "Redis does not answer on $REDIS_HOST:$REDIS_PORT"
  fi
else
  redis_up || die "Redis does not answer on $REDIS_HOST:$REDIS_PORT (TEST_REDIS_URL); only one on this machine is started here"
fi
