#!/usr/bin/env bash
# The GPU checks in one go, every result in one folder.
#
#   bench/gpu_check.sh [OUTDIR]                    on a machine with CUDA; OUTDIR defaults to $OUT
#   bench/gpu_check.sh --cpu-dry-run [OUTDIR]      the same steps on the CPU with tiny durations
#   bench/gpu_check.sh --fetch-wheels DIR [3.12]   with the package index at hand: download the wheels of
#                                                  Ferry's dependencies (not torch) for that Python, to carry
#
# Steps, each under a hard `timeout` inside an 8-minute budget:
#   1. a Python whose torch sees CUDA: ./.venv if it does; else a venv under /tmp layered over a Python
#      that has such a torch (FERRY_GPU_PYTHON, python3, /opt/torch/.venv/bin/python3), with Ferry's
#      dependencies installed from a local wheelhouse (FERRY_WHEELHOUSE, ./.whl, /opt/wheels) or the
#      index; else a local CUDA torch wheel installed into ./.venv; else it stops and says what is missing.
#   2. the tests marked gpu (`pytest -m gpu` over the files that carry the marker);
#   3. `bench.profile_models`: latency per batch size of the wide MLP, ResNet-50 and a BERT-base-shaped
#      encoder on the device (FP16), as profiles.json in the format the simulator reads (sim.profiles), with
#      the cold start: the load in-process, and a node's whole load of a replica (the sandboxed runtime
#      process, CUDA started in it: `cold_start.isolated`, the line a fleet then reads); before the benchmark, since the simulator's scenarios need it and the benchmark may use up the budget;
#   4. `bench.run --only batching --quick` with FERRY_DEVICE=cuda: the wide MLP raw, then served batched
#      and unbatched, and the two acceptance ratios.
# Writes eight files into OUTDIR (the device tool brings back at most eight): gpu_check.log (all the
# output, the tests' and the benchmark's included), pytest-gpu.xml, bench.json, benchmarks/served.md,
# bench-latency.png, bench-batching.png, profiles.json and SUMMARY.md (with the environment: python, torch,
# the device).
# Needs no PostgreSQL or Redis: the gpu-marked tests use no database, and the benchmark's server runs
# in embedded mode (SQLite in a temporary data dir).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

DRY=0
if [ "${1:-}" = "--fetch-wheels" ]; then
  dir=${2:?usage: bench/gpu_check.sh --fetch-wheels DIR [PYTHON_VERSION]}
  pyver=${3:-3.12}
  # Ferry's dependencies (pyproject.toml) and the test plugins the gpu tests need, less what the GPU image
  # already has (torch, numpy, scikit-learn, matplotlib, prometheus-client, msgpack, pytest): their own
  # dependencies come along, as binary wheels for manylinux x86-64.
  mapfile -t reqs < <(python3 - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
skip = {"torch", "numpy", "scikit-learn", "matplotlib", "prometheus-client", "msgpack"}
for d in deps + ["pytest-django>=4.8", "pytest-asyncio>=0.24"]:
    name = re.split(r"[\[<>=!~ ]", d, maxsplit=1)[0].lower()
    if name not in skip:
        print(d)
EOF
)
  plat=()
  for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
    plat+=(--platform "$p")
  done
  python3 -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp "${plat[@]}" \
    -d "$dir" "${reqs[@]}" 2> >(grep -v "is ignored: it is neither" >&2) || exit 1
  # numpy comes in as a dependency of the list; the image has its own.
  rm -f "$dir"/numpy-*.whl
  du -sh "$dir"
  exit 0
fi
if [ "${1:-}" = "--cpu-dry-run" ]; then DRY=1; shift; fi
OUTDIR=${1:-${OUT:-}}
if [ -z "$OUTDIR" ]; then echo "usage: bench/gpu_check.sh [--cpu-dry-run] OUTDIR (or set OUT)"; exit 2; fi
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
exec > >(tee -a "$OUTDIR/gpu_check.log") 2>&1
SCRATCH=$(mktemp -d /tmp/ferry-gpu-check.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT

BUDGET=470          # seconds for everything: under 8 minutes
START=$SECONDS
declare -A RESULT
ORDER=()
START_EPOCH=$(date +%s)
note() { echo "[gpu_check $(($(date +%s) - START_EPOCH))s] $*"; }
left() { echo $((BUDGET - (SECONDS - START))); }
# step NAME MAX_SECONDS CMD...: runs CMD under `timeout`, never past the budget; records its status.
step() {
  local name=$1 max=$2; shift 2
  local t; t=$(left); [ "$t" -gt "$max" ] && t=$max
  ORDER+=("$name")
  if [ "$t" -lt 10 ]; then RESULT[$name]="not run: the 8-minute budget is spent"; note "$name: ${RESULT[$name]}"; return 1; fi
  note "===== $name (timeout ${t}s) ====="
  local t0=$SECONDS rc
  timeout --kill-after=10 "$t" "$@"; rc=$?
  if [ "$rc" -eq 0 ]; then RESULT[$name]="ok ($((SECONDS - t0)) s)"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then RESULT[$name]="TIMED OUT after ${t} s"
  else RESULT[$name]="FAILED (exit $rc, $((SECONDS - t0)) s)"; fi
  note "$name: ${RESULT[$name]}"
  return "$rc"
}

if [ "$DRY" = 1 ]; then
  DEVICE=cpu; TORCH_OK='import torch'; note "CPU dry run: the same steps on the CPU, tiny durations"
else
  DEVICE=cuda; TORCH_OK='import torch; assert torch.cuda.is_available(), "torch.cuda.is_available() is False"'
fi
export FERRY_DEVICE=$DEVICE PYTHONUNBUFFERED=1
unset DATABASE_URL REDIS_URL   # embedded mode

# ---------------------------------------------------------------------------------------------- 1. Python
WHEELHOUSE_LIST=""
for d in "${FERRY_WHEELHOUSE:-}" "$ROOT/.whl" /opt/wheels; do
  [ -n "$d" ] && [ -d "$d" ] && WHEELHOUSE_LIST+="${WHEELHOUSE_LIST:+:}$d"
done
export ROOT SCRATCH START_EPOCH TORCH_OK WHEELHOUSE_LIST
has_ferry_deps() { "$1" -c "import django, channels, uvicorn, rest_framework, pytest_django, orjson" 2>/dev/null; }

# A venv under /tmp that sees BASE's packages (torch with CUDA among them) through a .pth file, so
# nothing multi-GB is copied; Ferry's dependencies go into the venv itself.
overlay_venv() {
  local base=$1 venv=/tmp/ferry-gpu-venv WHEELHOUSES=()
  [ -n "$WHEELHOUSE_LIST" ] && IFS=: read -ra WHEELHOUSES <<< "$WHEELHOUSE_LIST"
  local site; site=$("$base" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  [ -x "$venv/bin/python" ] || "$base" -m venv --without-pip "$venv" || return 1
  local vsite; vsite=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" > "$vsite/_ferry_base_packages.pth"
  "$venv/bin/python" -c "$TORCH_OK" || return 1
  if ! has_ferry_deps "$venv/bin/python"; then
    local reqs; reqs=$("$venv/bin/python" - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(" ".join(deps + ["pytest>=8", "pytest-django>=4.8", "pytest-asyncio>=0.24"]))
EOF
) || return 1
    local src=(--no-index)
    for w in "${WHEELHOUSES[@]}"; do src+=(--find-links "$w"); done
    [ ${#WHEELHOUSES[@]} -eq 0 ] && src=(--retries 1 --timeout 15)   # no wheelhouse: try the index
    "$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$venv/bin/python" -m ensurepip -q || return 1
    note "installing Ferry's dependencies into $venv ${src[*]:-(from the index)}"
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${src[@]}" $reqs \
      2> >(grep -v "is ignored: it is neither" >&2) || return 1
  fi
  PY=$venv/bin/python
}

find_python() {
  local WHEELHOUSES=()
  [ -n "$WHEELHOUSE_LIST" ] && IFS=: read -ra WHEELHOUSES <<< "$WHEELHOUSE_LIST"
  if [ -x .venv/bin/python ] && [ -z "${FERRY_GPU_FRESH_VENV:-}" ] && .venv/bin/python -c "$TORCH_OK" 2>/dev/null \
     && has_ferry_deps .venv/bin/python; then
    PY=.venv/bin/python; note "using ./.venv"; return 0
  fi
  local cand
  for cand in ${FERRY_GPU_PYTHON:-} python3 /opt/torch/.venv/bin/python3; do
    command -v "$cand" >/dev/null 2>&1 || [ -x "$cand" ] || continue
    if "$cand" -c "$TORCH_OK" 2>/dev/null; then
      note "torch found with $cand: $("$cand" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
      overlay_venv "$cand" && { note "using $PY (over $cand)"; return 0; }
      note "could not layer a venv over $cand"
    fi
  done
  # No Python with such a torch: a CUDA torch wheel on local disk, into ./.venv.
  local wheel=""
  for w in "${WHEELHOUSES[@]}"; do
    wheel=$(ls "$w"/torch-*.whl 2>/dev/null | grep -v '+cpu' | head -1)
    [ -n "$wheel" ] && break
  done
  if [ -n "$wheel" ]; then
    [ -x .venv/bin/python ] || scripts/setup.sh || true
    if [ -x .venv/bin/python ]; then
      note "installing $wheel into ./.venv"
      .venv/bin/pip install -q --no-deps --force-reinstall "$wheel" \
        && .venv/bin/python -c "$TORCH_OK" && has_ferry_deps .venv/bin/python && { PY=.venv/bin/python; return 0; }
    fi
  fi
  echo "STOP: no Python here imports a torch that sees CUDA with Ferry's dependencies available."
  echo "  Looked at: ./.venv, FERRY_GPU_PYTHON, python3, /opt/torch/.venv/bin/python3, and for a CUDA torch"
  echo "  wheel (torch-*.whl without +cpu) in: ${WHEELHOUSES[*]:-no wheelhouse found}."
  echo "  Fix: point FERRY_GPU_PYTHON at a Python whose torch has CUDA, and carry Ferry's dependencies as"
  echo "  wheels (bench/gpu_check.sh --fetch-wheels .whl 3.12 where the package index is reachable), or put"
  echo "  a CUDA build of torch in FERRY_WHEELHOUSE."
  return 1
}

export -f note has_ferry_deps overlay_venv find_python
step "python with torch on $DEVICE" 200 bash -c 'find_python && echo "$PY" > "$SCRATCH/python.txt"'
PY=$(cat "$SCRATCH/python.txt" 2>/dev/null)
[ -n "$PY" ] && note "python: $PY"

{
  echo "date: $(date -u +%FT%TZ)"; echo "dry run: $DRY"; echo "FERRY_DEVICE=$FERRY_DEVICE"; echo "python: $PY"
  nproc | sed 's/^/nproc: /'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  [ -n "$PY" ] && "$PY" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")'
} > "$SCRATCH/env.txt" 2>&1
cat "$SCRATCH/env.txt"

if [ -n "$PY" ]; then
  # ------------------------------------------------------------------------------------------- 2. tests
  mapfile -t GPU_TESTS < <(grep -rl "mark.gpu" tests/ --include='test_*.py' | sort)
  note "gpu-marked tests in: ${GPU_TESTS[*]:-none}"
  if [ ${#GPU_TESTS[@]} -eq 0 ]; then
    ORDER+=("gpu tests"); RESULT["gpu tests"]="FAILED: no test carries the gpu marker"
  else
    mkdir -p "$SCRATCH/test-data"
    FERRY_DATA_DIR="$SCRATCH/test-data" step "gpu tests" 150 \
      "$PY" -m pytest "${GPU_TESTS[@]}" -m gpu -q -rs -p no:cacheprovider --junitxml "$OUTDIR/pytest-gpu.xml" \
      > >(tee "$SCRATCH/pytest-gpu.log") 2>&1
    if [ "$DRY" = 0 ] && grep -q " skipped" "$SCRATCH/pytest-gpu.log"; then
      RESULT["gpu tests"]="SOME SKIPPED on a CUDA run: ${RESULT["gpu tests"]} (see gpu_check.log)"
    fi
  fi
  # ---------------------------------------------------------------------------------------- 3. profiles
  # The latency per batch size of the demo model and a standard vision and text model, in the format the
  # simulator reads (sim.profiles): commit it as sim/profiles/<device>.json for a scenario's `measured:`.
  PROFILE=("$OUTDIR/profiles.json")
  [ "$DRY" = 1 ] && PROFILE+=(--quick)
  step "latency profiles on $DEVICE" 200 "$PY" -m bench.profile_models "${PROFILE[@]}"
  # ------------------------------------------------------------------------------------------- 4. bench
  BENCH=(--only batching --quick --docs "$OUTDIR" --json "$OUTDIR/bench.json")
  [ "$DRY" = 1 ] && BENCH+=(--step 1)
  step "batching benchmark on $DEVICE" 300 "$PY" -m bench.run "${BENCH[@]}"
fi

# ---------------------------------------------------------------------------------------------- summary
{
  echo "# GPU check$([ "$DRY" = 1 ] && echo ' (CPU dry run: tiny durations, not numbers to publish)')"
  echo
  echo "$(date -u '+%F %H:%M UTC'), $((SECONDS - START)) s in all, FERRY_DEVICE=$FERRY_DEVICE."
  echo
  echo "| step | result |"; echo "|---|---|"
  for s in "${ORDER[@]}"; do echo "| $s | ${RESULT[$s]:-not run} |"; done
  echo
  echo '```'; cat "$SCRATCH/env.txt"; echo '```'
  echo
  if [ -n "$PY" ] && [ -f "$OUTDIR/bench.json" ]; then
    "$PY" - "$OUTDIR/bench.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"device: {d['machine'].get('device')}")
print()
print("| raw batch | ms / call | rows/s |")
print("|---|---|---|")
for r in d["raw"]:
    print(f"| {r['batch_size']} | {r['ms_per_call']:.3f} | {r['rows_per_s']:,.1f} |")
print()
for m, sw in d["served"].items():
    b = sw["best"]
    print(f"- served {m}: " + (f"{b['achieved_rate']:,.1f} req/s at p99 {b['p99_ms']:.1f} ms" if b else f"n/a {sw['error']}"))
rt = d["ratios"]
for k in ("efficiency", "speedup_ratio"):
    print(f"- {k}: " + (f"{rt[k]:.2f}" if rt.get(k) is not None else f"n/a ({rt.get('missing', '')})"))
EOF
  fi
} > "$OUTDIR/SUMMARY.md" 2>&1
cat "$OUTDIR/SUMMARY.md"
for s in "${ORDER[@]}"; do
  case "${RESULT[$s]:-}" in ok*) ;; *) note "done: something did not pass (see above)"; exit 1 ;; esac
done
note "done: all steps ok; results in $OUTDIR"
