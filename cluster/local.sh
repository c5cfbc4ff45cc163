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

  local.sh start N            controller + N-1 engines on 127.0.0.1, numbered by $MCJAX_NUMBERING
  local.sh stop               stop exactly the processes this script started (pid files)
  local.sh restart [engines|all|check]   check: only whether a restart could succeed
  local.sh status             exit status 0 when the controller and every engine are running
  local.sh smoke              the smoke check (python -m dsr1.workbench.smoke) of the running cluster
  local.sh --help             this text

Each engine is an ipyparallel engine with JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=$MCJAX_LOCAL_DEVICES, run by the current Python
($MCJAX_PYTHON): no venv is created. Numbering (MCJAX_NUMBERING, or mcjax_setup.sh --numbering):
kernel-last (default): the notebook gives the ids, the kernel is process N-1; platform: engine i
gets Slurm's variables (SLURM_JOB_ID, SLURM_STEP_NODELIST=localhost, SLURM_NTASKS=N,
SLURM_PROCID=i, SLURM_LOCALID=i, SLURM_STEP_NUM_NODES=N) and JAX_COORDINATOR_PORT, so JAX numbers
the processes itself as on a real platform, and the kernel, process 0, takes the same from
cluster.json's kernel_env. Every process gets JAX_COMPILATION_CACHE_DIR=$MCJAX_JAX_CACHE, which
outlives the cluster. Everything lives under $MCJAX_STATE (mode 700): pid files, logs, the
ipyparallel profile (connection files) and cluster.json for dsr1.workbench.connect().
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

# The settings of the running cluster, as the last start recorded them: a restart (perhaps run by
# the notebook's reset_engines, with another environment) starts the same engines again.
# Stop, status and restart act on the cluster the state folder records, whatever the environment.
load_recorded() {
  local var value
  for var in MCJAX_CLUSTER_ID MCJAX_LOCAL_DEVICES MCJAX_NUMBERING MCJAX_COORDINATOR_PORT MCJAX_JAX_CACHE; do
    value=$(sed -n "s/^$var=//p" "$LOCAL_ENV" 2>/dev/null) || true
    if [ -n "$value" ]; then printf -v "$var" '%s' "$value"; fi
  done
}

start_engines() {
  local n=$1 i line
  for i in $(seq 1 $((n - 1))); do
    set -- JAX_PLATFORMS=cpu MCJAX_LOCAL_DEVICES="$MCJAX_LOCAL_DEVICES" XLA_FLAGS="$(engine_xla_flags)"
    if [ "$MCJAX_NUMBERING" = platform ]; then
      while IFS= read -r line; do set -- "$@" "$line"; done < <(mcjax_platform_env "$i" "$n")
    fi
    mcjax_engine_start "$i" "$@"
  done
}

# A free TCP port on 127.0.0.1 (the platform-numbered cluster's coordinator, unless one is set).
free_port() {
  "$MCJAX_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
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
  grep -qx "MCJAX_NUMBERING=$MCJAX_NUMBERING" "$LOCAL_ENV" || return 1
  grep -qx "MCJAX_JAX_CACHE=$MCJAX_JAX_CACHE" "$LOCAL_ENV" || return 1
  if [ -n "$MCJAX_COORDINATOR_PORT" ]; then
    grep -qx "MCJAX_COORDINATOR_PORT=$MCJAX_COORDINATOR_PORT" "$LOCAL_ENV" || return 1
  fi
  [ -n "$(mcjax_running_pid controller)" ] || return 1
  for i in $(seq 1 $((n - 1))); do
    [ -n "$(mcjax_running_pid "engine-$i")" ] || return 1
  done
  [ -s "$(mcjax_client_json)" ] || return 1
  mcjax_wait_engines $((n - 1)) 15 >/dev/null 2>&1
}

cmd_start() {
  local n=${1:-} reused=""
  _mcjax_is_uint "$n" && [ "$n" -ge 2 ] ||
    mcjax_usage_error "start needs N >= 2 (a controller and N-1 engines, plus the notebook kernel), not '$n'"
  _mcjax_is_uint "$MCJAX_LOCAL_DEVICES" && [ "$MCJAX_LOCAL_DEVICES" -ge 1 ] ||
    mcjax_die "MCJAX_LOCAL_DEVICES='$MCJAX_LOCAL_DEVICES' must be a positive number"
  case "$MCJAX_NUMBERING" in
    kernel-last | platform) ;;
    *) mcjax_die "MCJAX_NUMBERING='$MCJAX_NUMBERING': want kernel-last or platform" ;;
  esac
  [ ! -f "$MCJAX_STATE/setup.env" ] ||
    mcjax_die "$MCJAX_STATE records a real cluster (setup.env): use another MCJAX_STATE for a local cluster"
  # As the engines will: from the run folder, in safe-path mode (dsr1 installed, not found by chance).
  (cd "$(mcjax_run_dir)" && "$MCJAX_PYTHON" -P -c 'import ipyparallel, jax, dsr1') 2>/dev/null ||
    mcjax_die "$MCJAX_PYTHON cannot import ipyparallel, jax and dsr1: pip install -e '.[notebook]' (or set MCJAX_PYTHON)"
  if [ "$MCJAX_NUMBERING" = platform ]; then
    mcjax_log "local cluster: $n processes ($((n - 1)) engines + the notebook kernel, process 0; Slurm-style numbering), $MCJAX_LOCAL_DEVICES CPU devices each; state in $MCJAX_STATE"
  else
    mcjax_log "local cluster: $n processes ($((n - 1)) engines + the notebook kernel, process $((n - 1))), $MCJAX_LOCAL_DEVICES CPU devices each; state in $MCJAX_STATE"
  fi
  if healthy "$n"; then
    mcjax_log "a healthy local cluster '$MCJAX_CLUSTER_ID' with $((n - 1)) engines is already running: reusing it"
    load_recorded
    reused=1
  else
    if [ -f "$LOCAL_ENV" ] || [ -d "$MCJAX_STATE/pids" ]; then
      mcjax_log "stopping what is left of a previous local cluster in $MCJAX_STATE"
      cmd_stop
    fi
    if [ "$MCJAX_NUMBERING" = platform ] && [ -z "$MCJAX_COORDINATOR_PORT" ]; then
      MCJAX_COORDINATOR_PORT=$(free_port)
    fi
    mcjax_private_dirs "$MCJAX_STATE/pids" "$MCJAX_STATE/logs"
    printf 'MCJAX_HOSTS=%s\nMCJAX_LOCAL_DEVICES=%s\nMCJAX_CLUSTER_ID=%s\nMCJAX_NUMBERING=%s\nMCJAX_JAX_CACHE=%s\nMCJAX_COORDINATOR_PORT=%s\n' \
      "$n" "$MCJAX_LOCAL_DEVICES" "$MCJAX_CLUSTER_ID" "$MCJAX_NUMBERING" "$MCJAX_JAX_CACHE" "$MCJAX_COORDINATOR_PORT" >"$LOCAL_ENV"
    mcjax_controller_start 127.0.0.1
    start_engines "$n"
    mcjax_wait_engines $((n - 1)) || {
      tail -n 20 "$MCJAX_STATE"/logs/engine-*.log >&2 || true
      mcjax_die "the engines did not register (logs: $MCJAX_STATE/logs); stop with ./mcjax_setup.sh --stop"
    }
  fi
  mcjax_write_cluster_json $((n - 1)) 127.0.0.1
  [ -n "$reused" ] || mcjax_log "ready: in Python, cluster = dsr1.workbench.connect() (MCJAX_STATE=$MCJAX_STATE)"
  if [ "$MCJAX_JAX_CACHE" != off ]; then
    mcjax_log "compilation cache: $MCJAX_JAX_CACHE; for your own kernel (e.g. jupyter lab): export JAX_COMPILATION_CACHE_DIR=$MCJAX_JAX_CACHE JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=$MCJAX_JAX_CACHE_MIN_SECS"
  fi
}

# In a subshell: the recorded settings it loads stay there (cmd_start calls it).
cmd_stop() (
  if [ ! -f "$LOCAL_ENV" ] && [ -z "$(ls "$MCJAX_STATE"/pids/*.pid 2>/dev/null)" ]; then
    mcjax_log "no local cluster in $MCJAX_STATE"
    return 0
  fi
  load_recorded
  stop_engines
  mcjax_stop controller
  rm -f "$(mcjax_client_json)" "$(mcjax_engine_json)" "$MCJAX_STATE/cluster.json" "$LOCAL_ENV"
  mcjax_log "local cluster '$MCJAX_CLUSTER_ID' stopped"
)

cmd_restart() {
  local what=${1:-engines} n
  case "$what" in
    engines | all | check) ;;
    *) mcjax_usage_error "restart takes engines, all or check, not '$what'" ;;
  esac
  n=$(recorded_hosts) || true
  [ -n "$n" ] || mcjax_die "no local cluster recorded in $MCJAX_STATE: start one with ./mcjax_setup.sh --local N"
  load_recorded
  # Whatever runs now stays until we know a restart can succeed.
  "$MCJAX_PYTHON" -c 'import ipyparallel, jax' 2>/dev/null ||
    mcjax_die "$MCJAX_PYTHON cannot import ipyparallel and jax: nothing was stopped"
  if [ "$what" = check ]; then
    mcjax_log "a restart of the local cluster in $MCJAX_STATE can proceed"
    return 0
  fi
  if [ "$what" = all ] || [ -z "$(mcjax_running_pid controller)" ]; then
    cmd_stop
    cmd_start "$n"
    return
  fi
  stop_engines
  start_engines "$n"
  mcjax_wait_engines $((n - 1)) || mcjax_die "the engines did not register again (logs: $MCJAX_STATE/logs)"
  mcjax_write_cluster_json $((n - 1)) 127.0.0.1
}

# The smoke check (dsr1.workbench.smoke) from host 0's place: this machine, with the engines' JAX
# settings (CPU, the same device count) and the lock MCJAX_LOCK when one is set.
cmd_smoke() {
  local n line lock
  n=$(recorded_hosts) || true
  [ -n "$n" ] || mcjax_die "no local cluster recorded in $MCJAX_STATE: start one with ./mcjax_setup.sh --local N"
  load_recorded
  lock=$(mcjax_lock_file)
  set --
  while IFS= read -r line; do set -- "$@" "$line"; done < <(mcjax_process_env)
  cd "$(mcjax_run_dir)" || mcjax_die "cannot enter $MCJAX_STATE/run"
  env "$@" JAX_PLATFORMS=cpu XLA_FLAGS="$(engine_xla_flags)" MCJAX_HOST_INDEX=0 \
    "$MCJAX_PYTHON" -P -m dsr1.workbench.smoke --state "$MCJAX_STATE" ${lock:+--lock "$lock"}
}

cmd_status() {
  local n i pid name ok=0
  n=$(recorded_hosts) || true
  if [ -z "$n" ]; then
    echo "no local cluster in $MCJAX_STATE"
    return 1
  fi
  load_recorded
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
  smoke) cmd_smoke ;;
  -h | --help) usage ;;
  '') mcjax_usage_error "no command given (start, stop, restart, status or smoke)" ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
