#!/usr/bin/env bash
# cluster/single.sh: the workbench on this one machine's accelerators, no controller or engines
# (what ./mcjax_setup.sh --single runs). single.sh --help prints the usage: the text of usage() below.
MCJAX_PROVIDER=local
export MCJAX_PROVIDER
PYTHON_GIVEN=${MCJAX_PYTHON:+1}  # before common.sh gives MCJAX_PYTHON its default
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SINGLE_ENV="$MCJAX_STATE/single.env"

usage() {
  cat <<'EOF'
single.sh: the workbench on this one machine (a one-host TPU VM, one GPU box, a CPU machine):
no controller and no engines; Jupyter on 127.0.0.1:$MCJAX_JUPYTER_PORT with MCJAX_SINGLE=1 in
its environment, so the notebooks' %%everywhere cells run in the kernel only, on every device of
this machine.

  single.sh start     record the machine in $MCJAX_STATE/single.env and cluster.json, start Jupyter
  single.sh stop      stop that Jupyter, forget the record
  single.sh status    exit status 0 when it runs
  single.sh --help    this text

The Python is $MCJAX_PYTHON (dsr1 with the notebook extra installed). Jupyter starts in
$MCJAX_STATE/run with PYTHONSAFEPATH=1 and the compilation cache ($MCJAX_JAX_CACHE); its root is
this repository. On a machine whose device files show TPU or GPU chips, without MCJAX_PYTHON
given and JAX_PLATFORMS unset, start first builds the venv $MCJAX_VENV with the platform's lock
(cluster/venv.sh install: cluster/locks/tpu.txt or cuda12.txt, dsr1 from this repository) and
runs Jupyter from it. A machine without an accelerator gets JAX_PLATFORMS=cpu and
$MCJAX_LOCAL_DEVICES CPU devices (XLA_FLAGS); one with accelerators uses them (MCJAX_LOCAL_DEVICES
does not reach its kernel), and one whose jax cannot use its chips (a CPU-only jax) is refused,
naming the lock to install (cluster/locks/tpu.txt, cuda12.txt), unless JAX_PLATFORMS=cpu asks for
the CPU.
EOF
}

MARKER="--port=$MCJAX_JUPYTER_PORT"

# Why this machine would run on CPU although it has accelerators (JAX's plugin for them is not
# installed), naming the lock to install; nothing when JAX uses what it has.
unused_accelerator() {
  (cd "$(mcjax_run_dir)" && "$MCJAX_PYTHON" -P -c 'import sys
from dsr1.workbench.process import unused_accelerator
print(unused_accelerator(sys.argv[1]) or "")' "$MCJAX_ROOT")
}

# tpu, gpu or cpu: what JAX would use here (without starting it).
platform() {
  (cd "$(mcjax_run_dir)" && "$MCJAX_PYTHON" -P -c 'from dsr1.workbench.process import detect_platform; print(detect_platform())')
}

# The lock of this machine's chips by its device files (under $MCJAX_DEV_DIR, else /dev, as
# dsr1.workbench.process.accelerator_files reads them): tpu, cuda12, or nothing for none.
chips_lock() {
  local dev=${MCJAX_DEV_DIR:-/dev}
  if compgen -G "$dev/accel*" >/dev/null || compgen -G "$dev/vfio/[0-9]*" >/dev/null; then
    echo tpu
  elif compgen -G "$dev/nvidia[0-9]*" >/dev/null || compgen -G "$dev/kfd" >/dev/null; then
    echo cuda12
  fi
}

# A machine with chips and no Python given: the venv $MCJAX_VENV with the platform's lock, which
# then runs Jupyter (MCJAX_PYTHON).
install_platform_lock() {
  local lock
  [ -z "$PYTHON_GIVEN" ] && [ -z "${JAX_PLATFORMS:-}" ] || return 0
  lock=$(chips_lock)
  [ -n "$lock" ] || return 0
  mcjax_log "this machine has ${lock/cuda12/GPU} chips: the venv $MCJAX_VENV with the lock cluster/locks/$lock.txt"
  MCJAX_LOCK_PLATFORM=$lock MCJAX_LOCK="$MCJAX_ROOT/cluster/locks/$lock.txt" MCJAX_REPO_DIR="$MCJAX_ROOT" \
    MCJAX_NFS_DIR="$MCJAX_STATE" bash "$MCJAX_ROOT/cluster/venv.sh" install ||
    mcjax_die "installing the lock cluster/locks/$lock.txt into $MCJAX_VENV failed (see above); MCJAX_PYTHON names a Python to use instead"
  MCJAX_PYTHON="$MCJAX_VENV/bin/python"
  export MCJAX_PYTHON
}

cmd_start() {
  local kind pid line root unused keep
  if [ -f "$MCJAX_STATE/setup.env" ] || [ -f "$MCJAX_STATE/local.env" ]; then
    mcjax_die "MCJAX_STATE=$MCJAX_STATE records another cluster: stop it (./mcjax_setup.sh --stop) or use another MCJAX_STATE"
  fi
  install_platform_lock
  (cd "$(mcjax_run_dir)" && "$MCJAX_PYTHON" -P -c 'import jax, jupyterlab, dsr1') 2>/dev/null ||
    mcjax_die "$MCJAX_PYTHON cannot import jax, jupyterlab and dsr1: pip install -e '.[notebook]' (or set MCJAX_PYTHON)"
  pid=$(mcjax_running_pid jupyter "$MARKER")
  if [ -n "$pid" ] && [ -f "$SINGLE_ENV" ]; then
    mcjax_log "Jupyter already runs for this machine (pid $pid): keeping it"
    return 0
  fi
  kind=$(platform) || mcjax_die "cannot tell this machine's platform"
  if [ "$kind" = cpu ]; then
    unused=$(unused_accelerator) || mcjax_die "cannot tell whether this machine has accelerators"
    [ -z "$unused" ] || mcjax_die "$unused"
  fi
  set -- MCJAX_SINGLE=1 MCJAX_STATE="$MCJAX_STATE"
  while IFS= read -r line; do set -- "$@" "$line"; done < <(mcjax_process_env)
  root=""
  if [ "$(id -u)" -eq 0 ]; then root=--allow-root; fi  # containers run as root; Jupyter refuses it otherwise
  keep=(-u MCJAX_LOCAL_DEVICES)  # the accelerators' own devices, not MCJAX_LOCAL_DEVICES fake CPU ones
  if [ "$kind" = cpu ]; then
    keep=()
    set -- "$@" JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$MCJAX_LOCAL_DEVICES"
  fi
  port_free "$MCJAX_JUPYTER_PORT" ||
    mcjax_die "127.0.0.1:$MCJAX_JUPYTER_PORT is taken: set MCJAX_JUPYTER_PORT to a free port"
  if [ "$MCJAX_JAX_CACHE" != off ]; then mkdir -p "$MCJAX_JAX_CACHE"; fi
  mcjax_private_dirs "$MCJAX_STATE/pids" "$MCJAX_STATE/logs"
  printf 'MCJAX_SINGLE=1\nMCJAX_PLATFORM=%s\nMCJAX_JUPYTER_PORT=%s\nMCJAX_PYTHON=%s\nMCJAX_LOCAL_DEVICES=%s\nMCJAX_JAX_CACHE=%s\n' \
    "$kind" "$MCJAX_JUPYTER_PORT" "$MCJAX_PYTHON" "$MCJAX_LOCAL_DEVICES" "$MCJAX_JAX_CACHE" >"$SINGLE_ENV"
  write_cluster_json "$kind"
  mcjax_start_bg jupyter "$MCJAX_STATE/logs/jupyter.log" env ${keep[@]+"${keep[@]}"} "$@" \
    "$MCJAX_PYTHON" -m jupyter lab --no-browser --ip=127.0.0.1 "$MARKER" --ServerApp.port_retries=0 \
    --notebook-dir="$MCJAX_ROOT" ${root:+"$root"}
  for _ in $(seq 1 "$MCJAX_START_TIMEOUT"); do
    if port_listening "$MCJAX_JUPYTER_PORT"; then
      mcjax_log "one machine ($kind): Jupyter on 127.0.0.1:$MCJAX_JUPYTER_PORT with MCJAX_SINGLE=1 (token: $MCJAX_PYTHON -m jupyter server list)"
      return 0
    fi
    [ -n "$(mcjax_running_pid jupyter "$MARKER")" ] || break
    sleep 1
  done
  grep -v -i token "$MCJAX_STATE/logs/jupyter.log" 2>/dev/null | tail -n 15 >&2 || true
  mcjax_die "Jupyter is not listening on 127.0.0.1:$MCJAX_JUPYTER_PORT (log: $MCJAX_STATE/logs/jupyter.log)"
}

# cluster.json for a single machine: no engines, no controller; what the notebook reads.
write_cluster_json() {
  (cd "$(mcjax_run_dir)" && "$MCJAX_PYTHON" -P - "$MCJAX_STATE/cluster.json" "$1") <<'EOF'
import json, os, sys

path, platform = sys.argv[1], sys.argv[2]
env = os.environ
cache = env.get("MCJAX_JAX_CACHE", "off")
info = {"provider": "single", "single": True, "engines": 0, "platform": platform, "root": env["MCJAX_ROOT"],
        "state": env["MCJAX_STATE"], "python": sys.executable, "numbering": "kernel-last", "kernel_env": {},
        "local_devices": int(env["MCJAX_LOCAL_DEVICES"]) if platform == "cpu" else None,
        "jax_cache_dir": None if cache == "off" else cache}
with open(path + ".tmp", "w") as f:
    json.dump(info, f, indent=1)
os.replace(path + ".tmp", path)
EOF
}

cmd_stop() {
  mcjax_stop jupyter "$MARKER"
  rm -f "$SINGLE_ENV" "$MCJAX_STATE/cluster.json"
  mcjax_log "single machine: Jupyter stopped, record removed"
}

cmd_status() {
  local pid
  [ -f "$SINGLE_ENV" ] || { echo "no single-machine workbench in $MCJAX_STATE"; return 1; }
  pid=$(mcjax_running_pid jupyter "$MARKER")
  if [ -n "$pid" ]; then echo "jupyter: running, pid $pid (127.0.0.1:$MCJAX_JUPYTER_PORT)"; return 0; fi
  echo "jupyter: NOT RUNNING"
  return 1
}

# The recorded port: stop and status act on the Jupyter the record names.
if [ -f "$SINGLE_ENV" ] && [ "${1:-}" != start ]; then
  MCJAX_JUPYTER_PORT=$(sed -n 's/^MCJAX_JUPYTER_PORT=//p' "$SINGLE_ENV")
  MARKER="--port=$MCJAX_JUPYTER_PORT"
fi

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  -h | --help) usage ;;
  '') mcjax_usage_error "no command given (start, stop or status)" ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
