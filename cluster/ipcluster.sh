#!/usr/bin/env bash
# cluster/ipcluster.sh: the ipyparallel controller, the engines and Jupyter of a real cluster, run
# on each host by mcjax_setup.sh / cluster_restart through cluster_exec.
# ipcluster.sh --help prints the usage: the text of usage() below.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
ipcluster.sh: the ipyparallel controller (host 0), the engines (hosts 1..N-1) and the Jupyter
server (host 0) of a real cluster, run on the host itself by mcjax_setup.sh / cluster_restart
through cluster_exec.

  ipcluster.sh controller start|stop|restart [IP]   IP: host 0's internal address (default: first of cluster_internal_ips)
  ipcluster.sh engine start|stop|restart            this host's engine (index $MCJAX_HOST_INDEX)
  ipcluster.sh wait N                               wait until N engines are registered (host 0)
  ipcluster.sh jupyter start|stop                   Jupyter on 127.0.0.1:$MCJAX_JUPYTER_PORT (host 0)
  ipcluster.sh status
  ipcluster.sh --help                               this text

"start" keeps a running process (idempotent); "restart" replaces it. Processes are recorded in
pid files under $MCJAX_STATE/pids and only those are ever stopped.
EOF
}

host_index() {
  _mcjax_is_uint "${MCJAX_HOST_INDEX:-}" || mcjax_die "MCJAX_HOST_INDEX is not set (run this through cluster_exec)"
  echo "$MCJAX_HOST_INDEX"
}

controller() {
  local action=$1 ip=${2:-} pid n
  case "$action" in
    start | restart)
      if [ -z "$ip" ]; then ip=$(cluster_internal_ips | head -n 1); fi
      pid=$(mcjax_running_pid controller)
      if [ "$action" = start ] && [ -n "$pid" ] && [ -s "$(mcjax_client_json)" ]; then
        mcjax_log "the controller is already running (pid $pid): keeping it"
      else
        mcjax_stop controller
        mcjax_controller_start "$ip"
      fi
      n=$(cluster_host_count)
      mcjax_write_cluster_json $((n - 1)) "$ip"
      ;;
    stop) mcjax_stop controller ;;
    *) mcjax_usage_error "controller needs start, stop or restart, not '$action'" ;;
  esac
}

engine() {
  local action=$1 i pid
  case "$action" in
    start | restart | stop) ;;
    *) mcjax_usage_error "engine needs start, stop or restart, not '$action'" ;;
  esac
  i=$(host_index)
  case "$action" in
    start | restart)
      pid=$(mcjax_running_pid "engine-$i")
      if [ "$action" = start ] && [ -n "$pid" ]; then
        mcjax_log "engine $i is already running (pid $pid): keeping it"
        return 0
      fi
      mcjax_stop "engine-$i"
      mkdir -p "$MCJAX_NFS_DIR"
      cd "$MCJAX_NFS_DIR" || mcjax_die "cannot enter $MCJAX_NFS_DIR"
      mcjax_engine_start "$i"
      ;;
    stop) mcjax_stop "engine-$i" ;;
  esac
}

jupyter() {
  local action=$1 pid marker="--port=$MCJAX_JUPYTER_PORT"
  case "$action" in
    start)
      pid=$(mcjax_running_pid jupyter "$marker")
      if [ -n "$pid" ]; then
        mcjax_log "Jupyter is already running (pid $pid)"
      else
        "$MCJAX_VENV/bin/python" -m ipykernel install --user --name mcjax --display-name "mcjax (dsr1 venv)" >/dev/null
        cd "$MCJAX_NFS_DIR" || mcjax_die "cannot enter $MCJAX_NFS_DIR"
        mcjax_start_bg jupyter "$MCJAX_STATE/logs/jupyter.log" env MCJAX_STATE="$MCJAX_STATE" \
          "$MCJAX_VENV/bin/python" -m jupyter lab --no-browser --ip=127.0.0.1 --port="$MCJAX_JUPYTER_PORT" \
          --notebook-dir="$MCJAX_NFS_DIR"
      fi
      mcjax_log "Jupyter on host 0 at 127.0.0.1:$MCJAX_JUPYTER_PORT: run cluster_port_forward on your machine; token: $MCJAX_VENV/bin/jupyter server list"
      ;;
    stop) mcjax_stop jupyter "$marker" ;;
    *) mcjax_usage_error "jupyter needs start or stop, not '$action'" ;;
  esac
}

status() {
  local f name pid
  echo "host ${MCJAX_HOST_INDEX:-?} ($(hostname)):"
  for f in "$MCJAX_STATE"/pids/*.pid; do
    [ -e "$f" ] || { echo "  nothing started here"; return 0; }
    name=$(basename "$f" .pid)
    if [ "$name" = jupyter ]; then
      pid=$(mcjax_running_pid "$name" "--port=$MCJAX_JUPYTER_PORT")
    else
      pid=$(mcjax_running_pid "$name")
    fi
    if [ -n "$pid" ]; then echo "  $name: running, pid $pid"; else echo "  $name: NOT RUNNING (stale pid file)"; fi
  done
}

case "${1:-}" in
  controller) controller "${2:-}" "${3:-}" ;;
  engine) engine "${2:-}" ;;
  wait)
    _mcjax_is_uint "${2:-}" || mcjax_usage_error "wait needs N, the number of engines, not '${2:-}'"
    mcjax_wait_engines "$2"
    ;;
  jupyter) jupyter "${2:-}" ;;
  status) status ;;
  -h | --help) usage ;;
  '') mcjax_usage_error "no command given (controller, engine, wait, jupyter or status)" ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
