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

  ipcluster.sh controller start|stop|restart|run [IP]   IP: host 0's internal address (default: first of cluster_internal_ips)
  ipcluster.sh controller wait                          wait until a controller runs and its connection files exist
  ipcluster.sh controller check [engines|all]           can engines be restarted? (engines: a controller runs; all: one could start)
  ipcluster.sh engine start|stop|restart|run            this host's engine (index $MCJAX_HOST_INDEX)
  ipcluster.sh engine check                             could this host start its engine? (venv, connection file)
  ipcluster.sh wait N                                   wait until N engines are registered (host 0); rewrites cluster.json
  ipcluster.sh jupyter start|stop|run|wait|check-port   Jupyter on 127.0.0.1:$MCJAX_JUPYTER_PORT (host 0)
  ipcluster.sh jupyter kernel                           (re)install the kernel "mcjax (dsr1 venv)" (start does it too)
  ipcluster.sh status
  ipcluster.sh smoke                                    host 0: the smoke check of the running cluster (imports,
                                                        versions against the lock, one psum across every process)
  ipcluster.sh --help                                   this text

"start" keeps a running process (idempotent) and returns; "restart" replaces it; "run" starts it
(or keeps it) and then blocks while it lives (Slurm: a job step lasts as long as its command). An
engine that joined a controller which was replaced since is replaced too. Processes are recorded
in pid files under $MCJAX_STATE/pids (mode 700, as are the logs) and only those are ever stopped.
Every process gets JAX_COMPILATION_CACHE_DIR ($MCJAX_JAX_CACHE) and, when MCJAX_COORDINATOR_PORT
is set, JAX_COORDINATOR_PORT; Slurm engines also the variables from which JAX numbers them.
Jupyter fails at once when its port is taken (it never moves to another one). Every process
starts in $MCJAX_STATE/run with PYTHONSAFEPATH=1, and the kernel runs `python -P` with IPython's
ignore_cwd: none of them imports the source tree that the shared folder holds as dsr1/.
EOF
}

host_index() {
  _mcjax_is_uint "${MCJAX_HOST_INDEX:-}" || mcjax_die "MCJAX_HOST_INDEX is not set (run this through cluster_exec)"
  echo "$MCJAX_HOST_INDEX"
}

# Host 0's internal IP, without a pipe into head (its writer can die of SIGPIPE under pipefail).
first_internal_ip() {
  local ips
  ips=$(cluster_internal_ips) || return 1
  printf '%s\n' "${ips%%$'\n'*}"
}

# Block while process NAME (marker MARKER) lives: what "run" does after starting it.
block_while_running() {
  local pid
  pid=$(mcjax_running_pid "$@")
  [ -n "$pid" ] || return 0
  mcjax_log "$1 runs (pid $pid); this command returns when it exits"
  while mcjax_pid_alive "$pid"; do sleep 5; done
}

controller() {
  local action=$1 ip=${2:-} pid n i
  case "$action" in
    start | restart | run)
      if [ -z "$ip" ]; then ip=$(first_internal_ip); fi
      pid=$(mcjax_running_pid controller)
      if [ "$action" != restart ] && [ -n "$pid" ] && [ -s "$(mcjax_client_json)" ]; then
        mcjax_log "the controller is already running (pid $pid): keeping it"
      else
        mcjax_stop controller
        if [ "$MCJAX_JAX_CACHE" != off ]; then mkdir -p "$MCJAX_JAX_CACHE"; fi
        mcjax_controller_start "$ip"
      fi
      n=$(cluster_host_count)
      mcjax_write_cluster_json $((n - 1)) "$ip"
      [ "$action" != run ] || block_while_running controller
      ;;
    stop) mcjax_stop controller ;;
    wait)
      for i in $(seq 1 $((MCJAX_START_TIMEOUT * 10))); do
        if [ -n "$(mcjax_running_pid controller)" ] && [ -s "$(mcjax_client_json)" ] && [ -s "$(mcjax_engine_json)" ]; then
          mcjax_log "the controller is running (pid $(mcjax_running_pid controller))"
          return 0
        fi
        sleep 0.1
      done
      tail -n 20 "$MCJAX_STATE/logs/controller.log" >&2 2>/dev/null || true
      mcjax_die "no controller with connection files after ${MCJAX_START_TIMEOUT}s (log: $MCJAX_STATE/logs/controller.log)"
      ;;
    check)
      "$(mcjax_python)" -c 'import ipyparallel' 2>/dev/null || mcjax_die "$(mcjax_python) cannot import ipyparallel"
      if [ "$ip" != all ]; then
        [ -n "$(mcjax_running_pid controller)" ] && [ -s "$(mcjax_client_json)" ] ||
          mcjax_die "no controller runs on host 0: restart everything (cluster_restart all)"
      fi
      mcjax_log "host 0: ready"
      ;;
    *) mcjax_usage_error "controller needs start, stop, restart, run, wait or check, not '$action'" ;;
  esac
}

engine() {
  local action=$1 i pid line
  case "$action" in
    start | restart | stop | run | check) ;;
    *) mcjax_usage_error "engine needs start, stop, restart, run or check, not '$action'" ;;
  esac
  i=$(host_index)
  case "$action" in
    start | restart | run)
      pid=$(mcjax_running_pid "engine-$i")
      if [ "$action" != restart ] && [ -n "$pid" ]; then
        if mcjax_engine_stale "$i"; then
          mcjax_log "engine $i (pid $pid) joined a controller that was replaced since: replacing the engine"
        else
          mcjax_log "engine $i is already running (pid $pid): keeping it"
          return 0
        fi
      fi
      mcjax_stop "engine-$i"
      set --
      if [ "$MCJAX_PROVIDER" = slurm ] && [ "$MCJAX_NUMBERING" = platform ]; then
        while IFS= read -r line; do set -- "$@" "$line"; done < <(mcjax_platform_env "$i" "$(cluster_host_count)")
      fi
      mcjax_engine_start "$i" "$@"
      [ "$action" != run ] || block_while_running "engine-$i"
      ;;
    stop) mcjax_stop "engine-$i" ;;
    check)
      "$(mcjax_python)" -c 'import ipyparallel' 2>/dev/null || mcjax_die "$(mcjax_python) cannot import ipyparallel"
      [ -s "$(mcjax_engine_json)" ] || mcjax_die "no engine connection file $(mcjax_engine_json) (shared folder not mounted?)"
      mcjax_log "host $i: ready"
      ;;
  esac
}

# The kernel "mcjax (dsr1 venv)": the venv's Python in safe-path mode (-P, PYTHONSAFEPATH) and
# IPython's ignore_cwd, so a notebook anywhere under Jupyter's root (the shared folder, which
# holds the source tree as dsr1/) imports the installed dsr1, never that folder.
kernelspec() {
  local dir
  dir=$(cd "$(mcjax_run_dir)" && "$MCJAX_VENV/bin/python" -P -m ipykernel install --user --name mcjax \
    --display-name "mcjax (dsr1 venv)" 2>&1 | sed -n 's/^Installed kernelspec mcjax in //p')
  [ -n "$dir" ] && [ -f "$dir/kernel.json" ] || mcjax_die "ipykernel could not install the kernel 'mcjax'"
  "$MCJAX_VENV/bin/python" -P - "$dir/kernel.json" "$MCJAX_VENV/bin/python" <<'EOF'
import json, os, sys

path, python = sys.argv[1], sys.argv[2]
with open(path) as f:
    spec = json.load(f)
spec["argv"] = [python, "-P", "-m", "ipykernel_launcher", "--IPKernelApp.ignore_cwd=True", "-f", "{connection_file}"]
spec["env"] = {**spec.get("env", {}), "PYTHONSAFEPATH": "1"}
with open(path + ".tmp", "w") as f:
    json.dump(spec, f, indent=1)
os.replace(path + ".tmp", path)
EOF
  mcjax_log "kernel 'mcjax (dsr1 venv)': $dir/kernel.json"
}

jupyter() {
  local action=$1 pid marker="--port=$MCJAX_JUPYTER_PORT" i line root
  case "$action" in
    check-port)
      if [ -n "$(mcjax_running_pid jupyter "$marker")" ]; then return 0; fi
      port_free "$MCJAX_JUPYTER_PORT" ||
        mcjax_die "127.0.0.1:$MCJAX_JUPYTER_PORT on host 0 is taken (another Jupyter, maybe another user's: ss -ltnp): set MCJAX_JUPYTER_PORT to a free port and run setup again (--steps push,jupyter); cluster_port_forward then uses it too"
      ;;
    start | run)
      pid=$(mcjax_running_pid jupyter "$marker")
      if [ -n "$pid" ]; then
        mcjax_log "Jupyter is already running (pid $pid)"
      else
        jupyter check-port
        kernelspec
        root=""
        if [ "$(id -u)" -eq 0 ]; then root=--allow-root; fi  # containers run as root; Jupyter refuses it otherwise
        set --
        while IFS= read -r line; do set -- "$@" "$line"; done < <(mcjax_process_env)
        # --ServerApp.port_retries=0: a taken port is an error, never a silent move to the next one
        # (the port-forward points at this one).
        mcjax_start_bg jupyter "$MCJAX_STATE/logs/jupyter.log" env MCJAX_STATE="$MCJAX_STATE" "$@" \
          "$MCJAX_VENV/bin/python" -m jupyter lab --no-browser --ip=127.0.0.1 --port="$MCJAX_JUPYTER_PORT" \
          --ServerApp.port_retries=0 --notebook-dir="$MCJAX_NFS_DIR" ${root:+"$root"}
        jupyter wait
      fi
      mcjax_log "Jupyter on host 0 at 127.0.0.1:$MCJAX_JUPYTER_PORT: run cluster_port_forward on your machine; token: $MCJAX_VENV/bin/jupyter server list"
      [ "$action" != run ] || block_while_running jupyter "$marker"
      ;;
    wait)
      for i in $(seq 1 "$MCJAX_START_TIMEOUT"); do
        pid=$(mcjax_running_pid jupyter "$marker")
        if [ -n "$pid" ] && port_listening "$MCJAX_JUPYTER_PORT"; then
          mcjax_log "Jupyter (pid $pid) listens on 127.0.0.1:$MCJAX_JUPYTER_PORT"
          return 0
        fi
        if [ -z "$pid" ] && [ "$i" -gt 5 ]; then break; fi
        sleep 1
      done
      # The log's last lines, without the token.
      grep -v -i token "$MCJAX_STATE/logs/jupyter.log" 2>/dev/null | tail -n 15 >&2 || true
      mcjax_die "Jupyter is not listening on 127.0.0.1:$MCJAX_JUPYTER_PORT (log: $MCJAX_STATE/logs/jupyter.log)"
      ;;
    stop) mcjax_stop jupyter "$marker" ;;
    kernel) kernelspec ;;
    *) mcjax_usage_error "jupyter needs start, stop, run, wait, check-port or kernel, not '$action'" ;;
  esac
}

# The smoke check (dsr1.workbench.smoke) on host 0, where the kernel runs: every engine imports
# dsr1 and reports its versions (against the lock the venvs were installed from), then one psum
# across every process in fresh Pythons. Its exit status is the verdict.
smoke() {
  local line lock
  lock=$(mcjax_lock_file)
  [ -s "$MCJAX_STATE/cluster.json" ] || mcjax_die "no $MCJAX_STATE/cluster.json on host 0: is the controller running? (cluster_status)"
  set --
  while IFS= read -r line; do set -- "$@" "$line"; done < <(mcjax_process_env)
  cd "$(mcjax_run_dir)" || mcjax_die "cannot enter $MCJAX_STATE/run"
  env "$@" "$(mcjax_python)" -P -m dsr1.workbench.smoke --state "$MCJAX_STATE" ${lock:+--lock "$lock"}
}

status() {
  local f name pid mine=0 elsewhere=0
  echo "host ${MCJAX_HOST_INDEX:-?} ($(hostname)):"
  for f in "$MCJAX_STATE"/pids/*.pid; do
    [ -e "$f" ] || break
    name=$(basename "$f" .pid)
    # A state folder on a shared home holds the other nodes' pid files too: theirs are not ours.
    if mcjax_pid_elsewhere "$name"; then
      elsewhere=$((elsewhere + 1))
      continue
    fi
    mine=$((mine + 1))
    if [ "$name" = jupyter ]; then
      pid=$(mcjax_running_pid "$name" "--port=$MCJAX_JUPYTER_PORT")
    else
      pid=$(mcjax_running_pid "$name")
    fi
    if [ -n "$pid" ]; then echo "  $name: running, pid $pid"; else echo "  $name: NOT RUNNING (stale pid file)"; fi
  done
  [ "$mine" -gt 0 ] || echo "  nothing started here"
  [ "$elsewhere" -eq 0 ] || echo "  ($elsewhere processes of other hosts recorded in the shared $MCJAX_STATE: their hosts report them)"
}

case "${1:-}" in
  controller) controller "${2:-}" "${3:-}" ;;
  engine) engine "${2:-}" ;;
  wait)
    _mcjax_is_uint "${2:-}" || mcjax_usage_error "wait needs N, the number of engines, not '${2:-}'"
    mcjax_wait_engines "$2"
    # The engines' settings may have changed with them (a new coordinator port): cluster.json anew.
    if [ -s "$MCJAX_STATE/cluster.json" ]; then
      mcjax_write_cluster_json "$2" "$(first_internal_ip)"
    fi
    ;;
  jupyter) jupyter "${2:-}" ;;
  status) status ;;
  smoke) smoke ;;
  -h | --help) usage ;;
  '') mcjax_usage_error "no command given (controller, engine, wait, jupyter, status or smoke)" ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
