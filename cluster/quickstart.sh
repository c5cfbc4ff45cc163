#!/usr/bin/env bash
# cluster/quickstart.sh: the workbench on this machine, headless (notebooks/main.ipynb on a
# simulated cluster). quickstart.sh --help prints the usage: the text of usage() below.
set -euo pipefail

usage() {
  cat <<'EOF'
quickstart.sh: the workbench on this machine, headless: build the environment (.venv, dsr1 with
the notebook extra), start a simulated 4-process cluster, execute notebooks/main.ipynb, print the
generated text and the profile summary, stop the cluster (also on failure).

  cluster/quickstart.sh           all of the above (no arguments)
  cluster/quickstart.sh --help    this text

To use the notebook interactively instead:
  ./mcjax_setup.sh --local 4 && .venv/bin/jupyter lab notebooks/main.ipynb   (then --stop)
EOF
}

# A wrong argument is a usage error, as everywhere (see "Errors" in mcjax_defs.sh, which this
# script does not source: it runs before the environment exists).
case "${1:-}" in
  '') ;;
  -h | --help) usage; exit 0 ;;
  *) printf "%s: unknown argument '%s'\nTry '%s --help'.\n" "${0##*/}" "$1" "${0##*/}" >&2; exit 2 ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

echo "[quickstart] building the environment in .venv (dsr1 with the notebook extra)"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -e ".[notebook]"
export PATH="$root/.venv/bin:$PATH"
export MCJAX_PYTHON="$root/.venv/bin/python" # the engines run the same environment as the kernel
export MCJAX_STATE="${MCJAX_STATE:-$root/.mcjax}"
out="$MCJAX_STATE/quickstart"
mkdir -p "$out"

trap './mcjax_setup.sh --stop' EXIT
echo "[quickstart] starting a simulated cluster: controller + 3 engines on 127.0.0.1; this kernel is the 4th JAX process (id 3)"
./mcjax_setup.sh --local 4

echo "[quickstart] executing notebooks/main.ipynb (output: $out/main.ipynb)"
jupyter nbconvert --to notebook --execute notebooks/main.ipynb --output-dir "$out" \
  --ExecutePreprocessor.timeout=1800

python - "$out/main.ipynb" <<'PY'
import sys
import nbformat

nb = nbformat.read(sys.argv[1], as_version=4)
for cell in nb.cells:
    if cell.cell_type != "code":
        continue
    text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
    if "widget.button.click()" in cell.source:
        print("\n=== generated text (random tiny model unless DSR1_CHECKPOINT is set) ===\n" + text)
    if "profile.summary()" in cell.source:
        print("=== decode profile ===\n" + text)
PY
echo "[quickstart] done; open it interactively with: ./mcjax_setup.sh --local 4 && .venv/bin/jupyter lab notebooks/main.ipynb"
