#!/usr/bin/env bash
# The services the test suite needs, up on 127.0.0.1: PostgreSQL on 5432 (user postgres, database test,
# no password from loopback) and Redis on 6379. Each one that answers already is left alone; one that is
# stopped is started; one that is not installed is installed from the system's packages first (Debian's
# apt-get), and a PostgreSQL installed here is given the loopback trust rule and the database the tests use.
# `make test` runs this before the suite, so a fresh machine needs nothing but the README's command.
set -euo pipefail

PG_PORT=5432
REDIS_PORT=6379
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi

pg_up() { pg_isready -h 127.0.0.1 -p "$PG_PORT" -q 2>/dev/null; }
redis_up() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; }
wait_for() { for _ in $(seq 30); do "$1" && return 0; sleep 1; done; return 1; }
as_postgres() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else sudo -u postgres "$@"; fi; }

apt_updated=""
apt_install() {
  command -v apt-get >/dev/null || { echo "services.sh: $* is missing and there is no apt-get to install it" >&2; exit 1; }
  if [ -z "$apt_updated" ]; then $SUDO apt-get update -qq; apt_updated=1; fi
  echo "==> installing $*"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

pg_cluster() { ls /etc/postgresql 2>/dev/null | sort -V | tail -1; }

if ! pg_up; then
  fresh=""
  if [ -z "$(pg_cluster)" ]; then
    apt_install postgresql
    fresh=1
  fi
  version=$(pg_cluster)
  if [ -n "$fresh" ]; then
    # A package's own cluster asks loopback clients for a password; the suite connects as postgres
    # without one. Only a cluster this script installed is changed, and only for 127.0.0.1 and ::1.
    hba=/etc/postgresql/$version/main/pg_hba.conf
    $SUDO sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
  fi
  echo "==> starting PostgreSQL $version"
  $SUDO pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  wait_for pg_up || { echo "PostgreSQL does not answer on 127.0.0.1:$PG_PORT" >&2; exit 1; }
  if [ -n "$fresh" ]; then
    as_postgres psql -h 127.0.0.1 -qc "CREATE DATABASE test" 2>/dev/null || true
  fi
fi

if ! redis_up; then
  command -v redis-server >/dev/null || apt_install redis-server
  echo "==> starting Redis"
  $SUDO mkdir -p /var/lib/redis /var/log/redis
  # Nothing kept on disk: the suite's Redis databases are throwaway.
  $SUDO redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ferry-test.log
  wait_for redis_up || { echo "Redis does not answer on 127.0.0.1:$REDIS_PORT" >&2; exit 1; }
fi
