#!/usr/bin/env bash
# cluster/local.sh: a simulated cluster on this machine (what ./mcjax_setup.sh --local N runs).
# local.sh --help prints the usage: the text of usage() below.
MCJAX_PROVIDER=local
export MCJAX_PROVIDER
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

LOCAL_ENV="$MCJAX_STATE/local.env"

usage() {
  cat <<'EOF'
local.sh: a simulated cluster on this machine (what ./mcjax_setup.sh --local N runs).

  local.sh start N            controller + N-1 engines on 127.0.0.1 (the notebook kernel is process N-1)
  local.sh stop               stop exactly the processes this script started (pid files)
  local.sh restart [engines|all]
  local.sh status             exit status 0 when the controller and every engine are running
  local.sh --help             this text

Each engine is an ipyparallel engine with JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=$MCJAX_LOCAL_DEVICES, run by the current Python
($MCJAX_PYTHON): no venv is created. Everything lives under $MCJAX_STATE: pid files, logs,
the ipyparallel profile (connection files) and cluster.json for dsr1.workbench.cluster.connect().
EOF
}

# The cluster size recorded by the last start.
recorded_hosts() {
  [ -f "$LOCAL_ENV" ] && sed -n 's/^MCJAX_HOSTS=//p' "$LOCAL_ENV"
}

# XLA_FLAGS for an engine: the caller's flags without any device count, plus ours.
engine_xla_flags() {
  local flags=""
  local f
  for f in ${XLA_FLAGS:-}; do
    case "$f" in --xla_force_host_platform_device_count=*) ;; *) flags="$flags $f" ;; esac
  done
  echo "${flags# } --xla_force_host_platform_device_count=$MCJAX_LOCAL_DEVICES" | sed 's/^ //'
}

start_engines() {
  local n=$1 i
  for i in $(seq 1 $((n - 1))); do
    mcjax_engine_start "$i" JAX_PLATFORMS=cpu MCJAX_LOCAL_DEVICES="$MCJAX_LOCAL_DEVICES" \
      XLA_FLAGS="$(engine_xla_flags)"
  done
}

# All engines at once: a busy or hung one may take MCJAX_STOP_TIMEOUT seconds.
stop_engines() {
  local f
  for f in "$MCJAX_STATE"/pids/engine-*.pid; do
    [ -e "$f" ] || continue
    mcjax_stop "$(basename "$f" .pid)" &
  done
  wait
}

# 0 when a cluster of N processes with our settings is running and its engines are registered.
healthy() {
  local n=$1 i
  [ "$(recorded_hosts)" = "$n" ] || return 1
  grep -qx "MCJAX_LOCAL_DEVICES=$MCJAX_LOCAL_DEVICES" "$LOCAL_ENV" || return 1
  grep -qx "MCJAX_CLUSTER_ID=$MCJAX_CLUSTER_ID" "$LOCAL_ENV" || return 1
  [ -n "$(mcjax_running_pid controller)" ] || return 1
  for i in $(seq 1 $((n - 1))); do
    [ -n "$(mcjax_running_pid "engine-$i")" ] || return 1
  done
  [ -s "$(mcjax_client_json)" ] || return 1
  mcjax_wait_engines $((n - 1)) 15 >/dev/null 2>&1
}

cmd_start() {
  local n=${1:-}
  _mcjax_is_uint "$n" && [ "$n" -ge 2 ] ||
    mcjax_usage_error "start needs N >= 2 (a controller, N-1 engines, and the notebook kernel as process N-1), not '$n'"
  _mcjax_is_uint "$MCJAX_LOCAL_DEVICES" && [ "$MCJAX_LOCAL_DEVICES" -ge 1 ] ||
    mcjax_die "MCJAX_LOCAL_DEVICES='$MCJAX_LOCAL_DEVICES' must be a positive number"
  "$MCJAX_PYTHON" -c 'import ipyparallel, jax' 2>/dev/null ||
    mcjax_die "$MCJAX_PYTHON cannot import ipyparallel and jax: pip install -e '.[notebook]' (or set MCJAX_PYTHON)"
  mcjax_log "local cluster: $n processes ($((n - 1)) engines + the notebook kernel), $MCJAX_LOCAL_DEVICES CPU devices each; state in $MCJAX_STATE"
  if healthy "$n"; then
    mcjax_log "a healthy local cluster '$MCJAX_CLUSTER_ID' with $((n - 1)) engines is already running: reusing it"
    mcjax_write_cluster_json $((n - 1)) 127.0.0.1
    return 0
  fi
  if [ -f "$LOCAL_ENV" ] || [ -d "$MCJAX_STATE/pids" ]; then
    mcjax_log "stopping what is left of a previous local cluster in $MCJAX_STATE"
    cmd_stop
  fi
  mkdir -p "$MCJAX_STATE/pids" "$MCJAX_STATE/logs"
  chmod 700 "$MCJAX_STATE"
  printf 'MCJAX_HOSTS=%s\nMCJAX_LOCAL_DEVICES=%s\nMCJAX_CLUSTER_ID=%s\n' "$n" "$MCJAX_LOCAL_DEVICES" \
    "$MCJAX_CLUSTER_ID" >"$LOCAL_ENV"
  # Engines import from the repository root, like the notebook next to it.
  cd "$MCJAX_ROOT" || mcjax_die "cannot enter $MCJAX_ROOT"
  mcjax_controller_start 127.0.0.1
  start_engines "$n"
  mcjax_wait_engines $((n - 1)) || {
    tail -n 20 "$MCJAX_STATE"/logs/engine-*.log >&2 || true
    mcjax_die "the engines did not register (logs: $MCJAX_STATE/logs); stop with ./mcjax_setup.sh --stop"
  }
  mcjax_write_cluster_json $((n - 1)) 127.0.0.1
  mcjax_log "ready: in Python, cluster = dsr1.workbench.cluster.connect() (MCJAX_STATE=$MCJAX_STATE); the kernel is process $((n - 1))"
}

cmd_stop() {
  if [ ! -f "$LOCAL_ENV" ] && [ -z "$(ls "$MCJAX_STATE"/pids/*.pid 2>/dev/null)" ]; then
    mcjax_log "no local cluster in $MCJAX_STATE (a real cluster: MCJAX_PROVIDER=gcloud|ssh ./mcjax_setup.sh --stop)"
    return 0
  fi
  stop_engines
  mcjax_stop controller
  rm -f "$(mcjax_client_json)" "$(mcjax_engine_json)" "$MCJAX_STATE/cluster.json" "$LOCAL_ENV"
  mcjax_log "local cluster '$MCJAX_CLUSTER_ID' stopped"
}

cmd_restart() {
  local what=${1:-engines} n
  case "$what" in
    engines | all) ;;
    *) mcjax_usage_error "restart takes engines or all, not '$what'" ;;
  esac
  n=$(recorded_hosts) || true
  [ -n "$n" ] || mcjax_die "no local cluster recorded in $MCJAX_STATE: start one with ./mcjax_setup.sh --local N"
  if [ "$what" = all ] || [ -z "$(mcjax_running_pid controller)" ]; then
    cmd_stop
    cmd_start "$n"
    return
  fi
  stop_engines
  cd "$MCJAX_ROOT" || mcjax_die "cannot enter $MCJAX_ROOT"
  start_engines "$n"
  mcjax_wait_engines $((n - 1)) || mcjax_die "the engines did not register again (logs: $MCJAX_STATE/logs)"
}

cmd_status() {
  local n i pid name ok=0
  n=$(recorded_hosts) || true
  if [ -z "$n" ]; then
    echo "no local cluster in $MCJAX_STATE"
    return 1
  fi
  for i in $(seq 0 $((n - 1))); do
    if [ "$i" -eq 0 ]; then name=controller; else name="engine-$i"; fi
    pid=$(mcjax_running_pid "$name")
    if [ -n "$pid" ]; then
      echo "$name: running, pid $pid"
    else
      echo "$name: NOT RUNNING"
      ok=1
    fi
  done
  return "$ok"
}

case "${1:-}" in
  start) cmd_start "${2:-}" ;;
  stop) cmd_stop ;;
  restart) cmd_restart "${2:-engines}" ;;
  status) cmd_status ;;
  -h | --help) usage ;;
  '') mcjax_usage_error "no command given (start, stop, restart or status)" ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
