#!/usr/bin/env bash
# Idempotent set-up: a virtualenv with the CPU build of torch, then Ferry itself.
# Usage: scripts/setup.sh [demo|test|bench]   ("demo", what `make run` asks for, adds what the demo models
# train with; "test" the test tools, at the versions of scripts/constraints-test.txt, and Debian's Chromium for
# browser tests; "bench" what the benchmarks need)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
TEST_CONSTRAINTS=scripts/constraints-test.txt

die() {
  echo "setup.sh: $*" >&2
  exit 1
}
# What installs a system package: apt-get as root, or through sudo; nothing where neither is there.
if [ "$(id -u)" = 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null; then
  SUDO=(sudo)
else
  SUDO=(none)
fi
can_apt() { command -v apt-get >/dev/null && [ "${SUDO[*]}" != none ]; }
apt_install() {
  "${SUDO[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq "$@" >/dev/null
}

# A Python 3.11+ that can make a virtualenv with pip in it (venv and ensurepip: Debian ships ensurepip apart,
# in python3.X-venv). Debian's CPython first: it is built with profile-guided and link-time optimisation,
# pyenv's build here is not, and the pure-Python paths (the gateway, the fleet simulator) run 1.3-1.4x faster
# on it (docs/decisions/0023-simulator.md).
recent() { "$1" -c "import sys; sys.exit(sys.version_info < (3, 11))" 2>/dev/null; }
has_venv() { "$1" -c "import venv, ensurepip" 2>/dev/null; }
find_python() {
  local candidate
  for candidate in ${PYTHON:-/usr/bin/python3.11 python3.11 python3}; do
    if command -v "$candidate" >/dev/null && recent "$candidate" && has_venv "$candidate"; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  if ! PY=$(find_python); then
    # A recent Python without venv or ensurepip: Debian's python3.X-venv adds them, where it can be installed.
    base=""
    for candidate in ${PYTHON:-/usr/bin/python3.11 python3.11 python3}; do
      if command -v "$candidate" >/dev/null && recent "$candidate"; then
        base=$candidate
        break
      fi
    done
    [ -n "$base" ] || die "no Python 3.11 or later found (${PYTHON:-python3.11, python3}): install one (Debian: apt-get install python3) or set PYTHON=/path/to/python3.11"
    package="python$("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv"
    can_apt || die "$base cannot create a virtualenv (no venv or ensurepip module): install $package (as root: apt-get install $package), then run this again"
    echo "==> installing $package ($base has no venv or ensurepip module)"
    apt_install "$package" || die "could not install $package: install it by hand, then run this again"
    PY=$(find_python) || die "$base still cannot create a virtualenv after installing $package"
  fi
  echo "==> creating .venv with $PY"
  "$PY" -m venv .venv || die "$PY -m venv .venv failed"
  .venv/bin/pip install -q --upgrade pip || die "could not upgrade pip in .venv: see pip's error above"
fi

# torch first, the CPU build, so nothing later pulls a multi-GB CUDA build (PyPI's Linux torch is CUDA's). From
# what pip is configured with but no index (a wheel in find-links on local disk, as on CI's machine: no network);
# else from PyTorch's CPU index. Without its dependencies at first (they are on no local disk), which the second
# call then brings from the usual indexes: torch itself is installed by then, so it is not fetched again.
cpu_torch() {
  .venv/bin/python - <<'PY'
import sys
import torch
if torch.version.cuda:
    sys.exit(f"setup.sh: .venv holds a CUDA build of torch ({torch.__version__}, CUDA {torch.version.cuda}), not the"
             " CPU build; remove .venv and run this again")
PY
}
torch_version() { .venv/bin/python -c "from importlib.metadata import version; print(version('torch'))"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "==> installing torch $TORCH_VERSION (CPU build)"
  if ! .venv/bin/pip install -q --no-index --no-deps "torch==$TORCH_VERSION" 2>/dev/null; then
    echo "    (no local wheel: from $TORCH_CPU_INDEX)"
    .venv/bin/pip install -q --no-deps --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION" ||
      die "could not install torch $TORCH_VERSION's CPU build: no wheel in pip's find-links and $TORCH_CPU_INDEX failed (see pip's error above)"
  fi
  .venv/bin/pip install -q "torch==$TORCH_VERSION" || die "could not install torch's dependencies (see pip's error above)"
  cpu_torch || exit 1
fi
torch_build=$(torch_version)

extra=""
case "${1:-}" in
  demo) extra="[demo]" ;;
  test) extra="[test]" ;;
  bench) extra="[bench]" ;;
  "") ;;
  *) die "unknown set-up '$1' (demo, test, bench or nothing)" ;;
esac
constraints=()
[ "${1:-}" = test ] && constraints=(-c "$TEST_CONSTRAINTS")
stamp=".venv/.ferry-installed${extra:+-${1}}"
# Reinstall when pyproject.toml (or the test tools' constraints) changed since the stamp.
stale() { [ ! -f "$1" ] || [ pyproject.toml -nt "$1" ] || { [ "${2:-}" = test ] && [ "$TEST_CONSTRAINTS" -nt "$1" ]; }; }
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
    if [ "$other" != "$1" ] && ! stale "$done_stamp" "$other" && covers "$other" "$1"; then
      stamp=$done_stamp
      break
    fi
  done
fi
if stale "$stamp" "${1:-}"; then
  echo "==> installing Ferry${extra}"
  # pip's own status, not grep's (pipefail): a failed install must not be stamped as done.
  if ! .venv/bin/pip install -q "${constraints[@]}" -e ".${extra}" 2>&1 | { grep -v "is ignored: it is neither" || true; }; then
    die "pip could not install Ferry${extra} (its error is above); nothing was stamped, so the next run tries again"
  fi
  .venv/bin/python -c "import django, channels, torch" || die "Ferry${extra} installed but does not import (see above)"
  now=$(torch_version)
  [ "$now" = "$torch_build" ] || die "installing Ferry${extra} replaced torch $torch_build with $now: remove .venv and run this again"
  touch "$stamp"
fi

if [ "${1:-}" = "test" ] && [ ! -x /usr/bin/chromium ]; then
  can_apt || die "the browser tests need Debian's chromium at /usr/bin/chromium: install it (as root: apt-get install chromium), then run this again"
  echo "==> installing Debian's chromium for the browser tests"
  apt_install chromium || die "could not install chromium: install it by hand (apt-get install chromium)"
fi
