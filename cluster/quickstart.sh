#!/usr/bin/env bash
# cluster/quickstart.sh: the workbench on this machine, headless (notebooks/main.ipynb on a
# simulated cluster). quickstart.sh --help prints the usage: the text of usage() below.
set -euo pipefail

usage() {
  cat <<'EOF'
quickstart.sh: the workbench on this machine, headless: build the environment (.venv, dsr1 with
the notebook extra; python3 -m venv, else uv with its own CPython 3.12), start a simulated 4-process cluster, execute notebooks/main.ipynb, print the
generated text, the profile summary and how long the notebook took, stop the cluster (also on
failure).

  cluster/quickstart.sh                 all of the above
  cluster/quickstart.sh --processes N   a cluster of N processes instead of 4
  cluster/quickstart.sh --help          this text

Every process uses JAX's persistent compilation cache in $MCJAX_STATE/jax_cache (default
.mcjax/jax_cache), which outlives the cluster: a second run reuses the first one's compiled
programs, and prints both runs' times. The cluster is this script's own (its state folder,
$MCJAX_STATE, default .mcjax): MCJAX_PROVIDER and the other settings of a real cluster in your
shell neither change it nor are reached by its stop.

To use the notebook interactively instead:
  ./mcjax_setup.sh --local 4 && .venv/bin/jupyter lab notebooks/main.ipynb   (then --stop)
EOF
}

# A wrong argument is a usage error, as everywhere (see "Errors" in mcjax_defs.sh, which this
# script does not source: it runs before the environment exists).
usage_error() {
  printf "%s: %s\nTry '%s --help'.\n" "${0##*/}" "$*" "${0##*/}" >&2
  exit 2
}
processes=4
while [ "$#" -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --processes)
      [ "$#" -ge 2 ] || usage_error "--processes needs N"
      processes=$2; shift ;;
    --processes=*) processes=${1#--processes=} ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
  shift
done
case "$processes" in
  '' | *[!0-9]* | 0 | 1) usage_error "--processes needs N >= 2, not '$processes'" ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# .venv with python3's venv module when that is Python >= 3.11 and has it (Debian and Ubuntu ship
# it apart, as python3-venv; TPU VM images have Python 3.10), else with uv and its own CPython.
make_venv() {
  local uv
  if python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && python3 -m venv .venv 2>/dev/null; then
    return 0
  fi
  rm -rf .venv
  uv=$(command -v uv || true)
  if [ -z "$uv" ]; then
    printf '%s\n' "${0##*/}: python3 cannot build .venv (it needs Python >= 3.11 with its venv module) and uv is not on PATH:" \
      "  install uv (pip install --user uv, or https://docs.astral.sh/uv/getting-started/installation/) and run this again" >&2
    exit 1
  fi
  echo "[quickstart] python3 cannot build .venv (Python >= 3.11 with venv needed): uv ($uv) builds it with CPython 3.12"
  "$uv" venv --seed --python 3.12 .venv
}

echo "[quickstart] building the environment in .venv (dsr1 with the notebook extra)"
[ -x .venv/bin/python ] || make_venv
.venv/bin/pip install -q -e ".[notebook]"
export PATH="$root/.venv/bin:$PATH"
export MCJAX_PYTHON="$root/.venv/bin/python" # the engines run the same environment as the kernel
export MCJAX_STATE="${MCJAX_STATE:-$root/.mcjax}"
out="$MCJAX_STATE/quickstart"
mkdir -p "$out"

# Stop acts on the cluster MCJAX_STATE records: this one, whatever MCJAX_PROVIDER says.
trap './mcjax_setup.sh --stop' EXIT
echo "[quickstart] starting a simulated cluster: controller + $((processes - 1)) engines on 127.0.0.1, and this notebook's kernel"
./mcjax_setup.sh --local "$processes"

# The kernel uses the compilation cache the engines use (cluster.json names it).
cache=$(python -c 'import json, sys; print(json.load(open(sys.argv[1])).get("jax_cache_dir") or "")' \
  "$MCJAX_STATE/cluster.json")
if [ -n "$cache" ]; then
  export JAX_COMPILATION_CACHE_DIR="$cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${MCJAX_JAX_CACHE_MIN_SECS:-0}"
  echo "[quickstart] compilation cache: $cache ($(find "$cache" -type f 2>/dev/null | wc -l) entries before this run)"
fi

echo "[quickstart] executing notebooks/main.ipynb (output: $out/main.ipynb)"
start=$(date +%s)
jupyter nbconvert --to notebook --execute notebooks/main.ipynb --output-dir "$out" \
  --ExecutePreprocessor.timeout=1800
took=$(($(date +%s) - start))
previous=$(tail -n 1 "$out/timings.log" 2>/dev/null || true)
echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $took" >>"$out/timings.log"

python - "$out/main.ipynb" <<'PY'
import sys
import nbformat

nb = nbformat.read(sys.argv[1], as_version=4)
for cell in nb.cells:
    if cell.cell_type != "code":
        continue
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    if "widget.button.click()" in cell.source:
        print("\n=== generated text (the embedded demo model unless DSR1_CHECKPOINT is set) ===\n" + text)
    if "profile.summary()" in cell.source:
        print("=== decode profile ===\n" + text)
PY
echo "[quickstart] the notebook took ${took} s this run${previous:+; the previous run (${previous% *}) took ${previous##* } s}"
if [ -n "$cache" ]; then
  echo "[quickstart] compilation cache: $cache, $(find "$cache" -type f 2>/dev/null | wc -l) entries (the next run reuses them)"
fi
echo "[quickstart] done; open it interactively with: ./mcjax_setup.sh --local 4 && .venv/bin/jupyter lab notebooks/main.ipynb"
