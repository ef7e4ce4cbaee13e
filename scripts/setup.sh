#!/usr/bin/env bash
# Idempotent set-up: a virtualenv with the CPU build of torch from local disk, then Ferry itself.
# Usage: scripts/setup.sh [demo|test|bench]   ("demo", what `make run` asks for, adds what the demo models
# train with; "test" the test tools and Debian's Chromium for browser tests; "bench" what the benchmarks need)
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's CPython first: it is built with profile-guided and link-time optimisation, pyenv's build here is
# not, and the pure-Python paths (the gateway, the fleet simulator) run 1.3-1.4x faster on it
# (docs/decisions/0023-simulator.md).
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in /usr/bin/python3.11 python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import venv, ensurepip" 2>/dev/null; then
      PY=$candidate
      break
    fi
  done
fi

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# torch first, pinned to the CPU wheel on local disk, so nothing later pulls a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "==> installing torch (CPU build)"
  .venv/bin/pip install -q "torch==2.13.0"
fi

extra=""
case "${1:-}" in
  demo) extra="[demo]" ;;
  test) extra="[test]" ;;
  bench) extra="[bench]" ;;
esac
stamp=".venv/.ferry-installed${extra:+-${1}}"
# An install of another extra that holds all of this one's requirements will do: after `setup.sh test` (make test),
# `make run` (which tests/test_demo_browser.py runs) needs no second pip run for the demo's.
covers() {
  .venv/bin/python - "$1" "$2" <<'PY'
import sys, tomllib
with open("pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
sys.exit(0 if set(extras[sys.argv[2]]) <= set(extras[sys.argv[1]]) else 1)
PY
}
if [ -n "$extra" ] && [ ! -f "$stamp" ]; then
  for other in test bench demo; do
    done_stamp=".venv/.ferry-installed-$other"
    if [ "$other" != "$1" ] && [ -f "$done_stamp" ] && [ ! pyproject.toml -nt "$done_stamp" ] && covers "$other" "$1"; then
      stamp=$done_stamp
      break
    fi
  done
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> installing Ferry${extra}"
  .venv/bin/pip install -q -e ".${extra}" 2>&1 | grep -v "is ignored: it is neither" || true
  .venv/bin/python -c "import django, channels, torch" # fail here, not later, if the install broke
  touch "$stamp"
fi

if [ "${1:-}" = "test" ] && [ ! -x /usr/bin/chromium ]; then
  echo "==> installing Debian's chromium for the browser tests"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
