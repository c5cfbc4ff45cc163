# shellcheck shell=bash
# cluster/common.sh: sourced by the pieces in cluster/ (bash only): settings, logging, pid files.
#
# The pieces run on a cluster host from ~/$MCJAX_REMOTE_DIR (copied there by mcjax_setup.sh,
# with mcjax.env holding the operator's settings) or, for the local provider, from the repository.

set -euo pipefail

MCJAX_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export MCJAX_ROOT
if [ -f "$MCJAX_ROOT/mcjax.env" ]; then
  # shellcheck source=/dev/null
  . "$MCJAX_ROOT/mcjax.env"
fi
# shellcheck source-path=SCRIPTDIR/.. source=mcjax_defs.sh
. "$MCJAX_ROOT/mcjax_defs.sh"

mcjax_log() {
  printf '[mcjax%s] %s\n' "${MCJAX_HOST_INDEX:+ host $MCJAX_HOST_INDEX}" "$*"
}

# The programs' side of the error convention (see "Errors" in mcjax_defs.sh); mcjax_setup.sh
# has the same two functions. Each program defines usage(), its --help text.
# mcjax_die MESSAGE...: "<script>: MESSAGE" on stderr, exit status 1.
mcjax_die() {
  printf '%s: %s\n' "${0##*/}" "$*" >&2
  exit 1
}
# mcjax_usage_error MESSAGE...: a wrong command line: the same, a pointer to --help, exit status 2.
mcjax_usage_error() {
  printf "%s: %s\nTry '%s --help'.\n" "${0##*/}" "$*" "${0##*/}" >&2
  exit 2
}

# Run as root: directly when we are root, else through sudo.
mcjax_sudo() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# Install Debian packages PKG... A fresh VM runs its own apt jobs (unattended-upgrades) at boot:
# wait for the dpkg lock (up to MCJAX_APT_LOCK_TIMEOUT seconds) instead of failing on it.
: "${MCJAX_APT_LOCK_TIMEOUT:=600}"
mcjax_apt_install() {
  local i
  # Before the retries: a host without apt or without root for this user never gets there.
  command -v apt-get >/dev/null 2>&1 || mcjax_die "installing $* needs apt-get, which this host lacks: install $* yourself, then run setup again"
  [ "$(id -u)" -eq 0 ] || sudo -n true 2>/dev/null ||
    mcjax_die "installing $* needs root, and sudo asks this user ($(id -un)) for a password or refuses: install $* yourself (or give the user passwordless sudo), then run setup again"
  for i in $(seq 1 10); do
    mcjax_sudo apt-get -o DPkg::Lock::Timeout="$MCJAX_APT_LOCK_TIMEOUT" update -qq && break
    [ "$i" -lt 10 ] || mcjax_die "apt-get update kept failing (another apt running? network?)"
    mcjax_log "apt-get update failed (the package lists are locked?); again in 10 s"
    sleep 10
  done
  mcjax_sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$MCJAX_APT_LOCK_TIMEOUT" \
    install -y -qq "$@"
}

# The lock file the venvs are synced to and the smoke check compares against (nothing when
# MCJAX_LOCK is off).
mcjax_lock_file() {
  if [ -n "$MCJAX_LOCK" ] && [ "$MCJAX_LOCK" != off ]; then echo "$MCJAX_LOCK"; fi
}

# The Python that runs the controller and the engines on this host.
mcjax_python() {
  if [ "$MCJAX_PROVIDER" = local ]; then
    echo "$MCJAX_PYTHON"
  else
    echo "$MCJAX_VENV/bin/python"
  fi
}

mcjax_pidfile() {
  echo "$MCJAX_STATE/pids/$1.pid"
}

# Create the folders DIR... (and the state folder) readable by this user only (mode 700).
mcjax_private_dirs() {
  mkdir -p "$MCJAX_STATE" "$@"
  chmod 700 "$MCJAX_STATE" "$@"
}

# The working directory of every process the scripts start (controller, engines, Jupyter, the
# smoke check): a folder of their own on the host's disk. The shared folder holds the source
# tree as dsr1/ (the repository root, no __init__.py): a process started there would import that
# folder as an empty namespace package instead of the installed dsr1.
mcjax_run_dir() {
  mcjax_private_dirs "$MCJAX_STATE/run"
  echo "$MCJAX_STATE/run"
}

# The host a pid file's process runs on: NAME.host beside the pid file. A state folder on a shared
# home (Slurm) holds every node's pid files; each node speaks only of its own.
mcjax_pid_host() {
  local hostfile
  hostfile="$(dirname "$(mcjax_pidfile "$1")")/$1.host"
  if [ -f "$hostfile" ]; then head -n 1 "$hostfile"; fi
}

# True when NAME's pid file was written by a process on another host.
mcjax_pid_elsewhere() {
  local host
  host=$(mcjax_pid_host "$1")
  [ -n "$host" ] && [ "$host" != "$(hostname)" ]
}

# True when PID is a live process (a zombie is not).
mcjax_pid_alive() {
  local pid=$1 stat
  [ -n "$pid" ] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  stat=$(ps -o stat= -p "$pid" 2>/dev/null || true)
  [ -n "$stat" ] && [ "${stat#Z}" = "$stat" ]
}

# The recorded pid of NAME when that process is alive and is one of ours (its command line holds
# MARKER, by default our cluster id: a pid reused by another program is never taken for ours).
# usage: mcjax_running_pid NAME [MARKER]
mcjax_running_pid() {
  local pidfile pid marker=${2:---cluster-id=$MCJAX_CLUSTER_ID}
  pidfile=$(mcjax_pidfile "$1")
  [ -f "$pidfile" ] || return 0
  pid=$(head -n 1 "$pidfile")
  if mcjax_pid_alive "$pid" && ps -ww -o command= -p "$pid" 2>/dev/null | grep -F -- "$marker" >/dev/null; then
    echo "$pid"
  fi
}

# Start CMD... in the background in a session of its own, as NAME, logging to LOG, in the run
# folder (mcjax_run_dir); the pid file is written by the process itself (a tiny Python launcher
# that execs CMD), so it is exact.
# usage: mcjax_start_bg NAME LOG CMD...
mcjax_start_bg() {
  local name=$1 log=$2 pidfile py pid i
  shift 2
  pidfile=$(mcjax_pidfile "$name")
  py=$(mcjax_python)
  mcjax_private_dirs "$(dirname "$pidfile")" "$(dirname "$log")"
  cd "$(mcjax_run_dir)" || mcjax_die "cannot enter $MCJAX_STATE/run"
  rm -f "$pidfile"
  # The log may hold secrets (Jupyter's token): mode 600, in a mode 700 folder.
  (umask 077 && : >>"$log")
  chmod 600 "$log"
  # shellcheck disable=SC2016
  nohup "$py" -c '
import os, sys
try:
    os.setsid()  # a session and process group of its own: stop kills the whole group
except OSError:
    pass  # already a process group leader (job control)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()}\n")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
os.execvp(sys.argv[2], sys.argv[2:])
' "$pidfile" "$@" >>"$log" 2>&1 </dev/null &
  for i in $(seq 1 100); do
    [ -s "$pidfile" ] && break
    [ "$i" -lt 100 ] || mcjax_die "could not start $name (no pid file after 10 s); see $log"
    sleep 0.1
  done
  pid=$(head -n 1 "$pidfile")
  hostname >"${pidfile%.pid}.host"
  mcjax_log "started $name: pid $pid, log $log"
}

# Stop NAME: SIGTERM to its process group; after 2 s a SIGINT too (an engine busy running code
# only stops once that code is interrupted); SIGKILL after MCJAX_STOP_TIMEOUT seconds (an engine
# that ran jax.distributed ignores SIGTERM: JAX's preemption notifier takes it over). Its
# children in sessions of their own (an engine's nanny, which tells the controller at once that
# its engine is gone) get 3 s to exit by themselves, then the same. Only a process recorded in our
# pid file whose command line holds MARKER (default: our cluster id) is touched.
# usage: mcjax_stop NAME [MARKER]
mcjax_stop() {
  local name=$1 marker=${2:-} pidfile pid kids k i left ticks
  pidfile=$(mcjax_pidfile "$name")
  if mcjax_pid_elsewhere "$name"; then
    mcjax_log "$name runs on $(mcjax_pid_host "$name"), not here: leaving it alone"
    return 0
  fi
  rm -f "${pidfile%.pid}.controller" "${pidfile%.pid}.host"
  if [ ! -f "$pidfile" ]; then
    return 0
  fi
  pid=$(head -n 1 "$pidfile")
  if ! mcjax_pid_alive "$pid"; then
    mcjax_log "$name (pid $pid) is not running; removing its pid file"
    rm -f "$pidfile"
    return 0
  fi
  if [ -z "$(mcjax_running_pid "$name" "$marker")" ]; then
    mcjax_log "pid $pid is no longer $name (pid reused?): leaving it alone, removing the pid file"
    rm -f "$pidfile"
    return 0
  fi
  kids=""
  if command -v pgrep >/dev/null 2>&1; then
    kids=$(pgrep -P "$pid" || true)
  fi
  mcjax_log "stopping $name (pid $pid${kids:+, children $(echo "$kids" | tr '\n' ' ')})"
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  ticks=$((MCJAX_STOP_TIMEOUT * 10))
  for i in $(seq 1 "$ticks"); do
    mcjax_pid_alive "$pid" || break
    if [ "$i" -eq 20 ]; then
      kill -INT "$pid" 2>/dev/null || true
      kill -TERM "$pid" 2>/dev/null || true
    fi
    if [ "$i" -eq "$ticks" ]; then
      mcjax_log "$name: still running after ${MCJAX_STOP_TIMEOUT}s; sending SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
      sleep 0.5
    fi
    sleep 0.1
  done
  for i in $(seq 1 30); do
    left=""
    for k in $kids; do
      if mcjax_pid_alive "$k"; then left="$left $k"; fi
    done
    [ -n "$left" ] || break
    if [ "$i" -eq 30 ]; then
      for k in $left; do kill -TERM "$k" 2>/dev/null || true; done
      sleep 1
      for k in $left; do kill -KILL "$k" 2>/dev/null || true; done
    fi
    sleep 0.1
  done
  rm -f "$pidfile"
}

# The controller's connection files.
mcjax_client_json() {
  echo "$MCJAX_PROFILE_DIR/security/ipcontroller-$MCJAX_CLUSTER_ID-client.json"
}
mcjax_engine_json() {
  echo "$MCJAX_PROFILE_DIR/security/ipcontroller-$MCJAX_CLUSTER_ID-engine.json"
}

# Start the ipyparallel controller bound to IP (never 0.0.0.0), on ports of MCJAX_PORTS
# (mcjax_controller_ports): its connection files are made mode 600 in a mode 700 folder. Waits
# until they exist.
mcjax_controller_start() {
  local ip=$1 py sec i ports
  case "$ip" in
    '' | 0.0.0.0 | '*' | '::' | '[::]') mcjax_die "the controller must bind to one internal address, not '$ip'" ;;
  esac
  py=$(mcjax_python)
  sec="$MCJAX_PROFILE_DIR/security"
  mkdir -p "$sec"
  chmod 700 "$MCJAX_PROFILE_DIR" "$sec"
  # Stale connection files of a previous run would send engines to dead ports.
  rm -f "$(mcjax_client_json)" "$(mcjax_engine_json)"
  # The local provider's (all on loopback, no firewall) take any free ports: local clusters started at
  # once would race for the same ones of the range.
  ports=""
  if [ "$MCJAX_PROVIDER" != local ]; then
    ports=$(mcjax_controller_ports "$ip") || mcjax_die "the controller has no ports (see above)"
  fi
  # The hub counts an engine as registered at its first heartbeat: a 1 s period (3 s by default)
  # makes starts and restarts seconds shorter; 30 misses keep ipyparallel's 30 s before one is dropped.
  mcjax_start_bg controller "$MCJAX_STATE/logs/controller.log" \
    "$py" -m ipyparallel.controller --ip="$ip" ${ports:+"--IPController.ports=$ports"} --profile-dir="$MCJAX_PROFILE_DIR" \
    --cluster-id="$MCJAX_CLUSTER_ID" --log-level=WARN --HeartMonitor.period=1000 --HeartMonitor.max_heartmonitor_misses=30
  for i in $(seq 1 $((MCJAX_START_TIMEOUT * 10))); do
    if [ -s "$(mcjax_client_json)" ] && [ -s "$(mcjax_engine_json)" ]; then break; fi
    if [ -z "$(mcjax_running_pid controller)" ]; then
      tail -n 30 "$MCJAX_STATE/logs/controller.log" >&2 || true
      mcjax_stop controller # whatever is left of it: never leave a half-started controller behind
      mcjax_die "the controller exited during startup (log: $MCJAX_STATE/logs/controller.log)"
    fi
    if [ "$i" -ge $((MCJAX_START_TIMEOUT * 10)) ]; then
      mcjax_stop controller
      mcjax_die "no connection files in $sec after ${MCJAX_START_TIMEOUT}s (log: $MCJAX_STATE/logs/controller.log)"
    fi
    sleep 0.1
  done
  sleep 0.2 # let the controller finish writing them
  chmod 600 "$(mcjax_client_json)" "$(mcjax_engine_json)"
  grep -q "\"interface\": \"tcp://$ip\"" "$(mcjax_client_json)" ||
    mcjax_die "the controller's connection file does not name tcp://$ip: $(mcjax_client_json)"
  mcjax_log "controller listening on $ip only; connection files (mode 600) in $sec"
}

# The environment every JAX process gets (engines here, Jupyter and so the kernel on host 0), as
# NAME=VALUE lines: Python's safe-path mode (no working directory or script folder on sys.path:
# dsr1 is always the installed package), the shared compilation cache and, when one is asked for,
# the coordinator port.
mcjax_process_env() {
  local address
  echo "PYTHONSAFEPATH=1"
  if [ "$MCJAX_JAX_CACHE" != off ]; then
    echo "JAX_COMPILATION_CACHE_DIR=$MCJAX_JAX_CACHE"
    echo "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=$MCJAX_JAX_CACHE_MIN_SECS"
  fi
  if [ -n "$MCJAX_COORDINATOR_PORT" ]; then echo "JAX_COORDINATOR_PORT=$MCJAX_COORDINATOR_PORT"; fi
  echo "MCJAX_PORTS=$MCJAX_PORTS"
  echo "DSR1_CONTROL_PORTS=$MCJAX_PORTS"
  address=$(mcjax_own_address)
  if [ -n "$address" ]; then echo "DSR1_CONTROL_HOST=$address"; fi
  if [ "$MCJAX_PROVIDER" = slurm ]; then mcjax_gpu_env; fi
}

# This host's cluster address: its line of MCJAX_INTERNAL_IPS (host MCJAX_HOST_INDEX; the local
# provider's hosts are all 127.0.0.1), or nothing when that is not known.
mcjax_own_address() {
  if [ "$MCJAX_PROVIDER" = local ]; then echo 127.0.0.1; return 0; fi
  [ -n "${MCJAX_HOST_INDEX:-}" ] && [ -n "$MCJAX_INTERNAL_IPS" ] || return 0
  printf '%s\n' "$MCJAX_INTERNAL_IPS" | tr ', \t;' '\n' | sed '/^$/d' | sed -n "$((MCJAX_HOST_INDEX + 1))p"
}

# The controller's ports: the highest 32 consecutive ports of MCJAX_PORTS free on IP, as LOW-HIGH.
mcjax_controller_ports() {
  [[ $MCJAX_PORTS =~ ^[0-9]+-[0-9]+$ ]] || mcjax_die "MCJAX_PORTS='$MCJAX_PORTS' is not a port range LOW-HIGH"
  "$(mcjax_python)" - "$1" "$MCJAX_PORTS" <<'EOF'
import socket, sys

address, (low, high), need = sys.argv[1], map(int, sys.argv[2].split("-")), 32


def free(port):
    with socket.socket() as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
        return True


top = high
while top - need + 1 >= low:
    taken = [p for p in range(top, top - need, -1) if not free(p)]
    if not taken:
        print(f"{top - need + 1}-{top}")
        sys.exit(0)
    top = taken[-1] - 1
sys.exit(f"MCJAX_PORTS={sys.argv[2]} has no {need} consecutive ports free on {address} for the controller")
EOF
}

# Slurm: JAX takes SLURM_LOCALID as the one GPU a process should use; ours own every GPU of their
# node: JAX_LOCAL_DEVICE_IDS=0,...,k-1 (from CUDA_VISIBLE_DEVICES, else nvidia-smi).
mcjax_gpu_env() {
  local n=0
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    n=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | sed '/^$/d' | wc -l)
  elif command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  if [ "$n" -gt 0 ]; then echo "JAX_LOCAL_DEVICE_IDS=$(seq -s, 0 $((n - 1)))"; fi
}

# The Slurm variables from which JAX numbers process I of N by itself (platform numbering: the
# kernel on host 0 is process 0, the engine of host i process i), as NAME=VALUE lines. Slurm
# provider: the allocation, its nodes in host order (the first, host 0, runs the coordinator: the
# kernel), one process per node. Local provider: a simulation of that on localhost.
mcjax_platform_env() {
  local i=$1 n=$2
  case "$MCJAX_PROVIDER" in
    local)
      printf '%s\n' SLURM_JOB_ID=4242 SLURM_STEP_NODELIST=localhost "SLURM_NTASKS=$n" "SLURM_PROCID=$i" \
        "SLURM_LOCALID=$i" "SLURM_STEP_NUM_NODES=$n"
      ;;
    slurm)
      printf '%s\n' "SLURM_JOB_ID=$MCJAX_SLURM_JOB_ID" \
        "SLURM_STEP_NODELIST=$(_mcjax_host_lines | sed -n "1,${n}p" | tr '\n' ',' | sed 's/,$//')" \
        "SLURM_NTASKS=$n" "SLURM_PROCID=$i" SLURM_LOCALID=0 "SLURM_STEP_NUM_NODES=$n"
      ;;
  esac
  if [ -n "$MCJAX_COORDINATOR_PORT" ]; then echo "JAX_COORDINATOR_PORT=$MCJAX_COORDINATOR_PORT"; fi
}

# 0 when nothing listens on 127.0.0.1:PORT (and we may bind it).
port_free() {
  "$(mcjax_python)" - "$1" <<'EOF'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()
EOF
}

# 0 when something accepts connections on 127.0.0.1:PORT.
port_listening() {
  "$(mcjax_python)" - "$1" <<'EOF'
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2).close()
except OSError:
    sys.exit(1)
EOF
}

# Which controller a process belongs to: a checksum of the engine connection file it started with.
mcjax_controller_fingerprint() {
  cksum <"$(mcjax_engine_json)" 2>/dev/null | awk '{ print $1 "-" $2 }'
}

# Start the engine of host INDEX with the extra environment NAME=VALUE... (after the index), plus
# mcjax_process_env. It records which controller it joined (pids/engine-INDEX.controller).
mcjax_engine_start() {
  local index=$1 py line
  shift
  py=$(mcjax_python)
  [ -s "$(mcjax_engine_json)" ] || mcjax_die "no engine connection file $(mcjax_engine_json): is the controller running?"
  while IFS= read -r line; do set -- "$@" "$line"; done < <(mcjax_process_env)
  if [ "$MCJAX_JAX_CACHE" != off ]; then mkdir -p "$MCJAX_JAX_CACHE"; fi
  mcjax_start_bg "engine-$index" "$MCJAX_STATE/logs/engine-$index.log" \
    env MCJAX_HOST_INDEX="$index" MCJAX_PROVIDER="$MCJAX_PROVIDER" MCJAX_STATE="$MCJAX_STATE" "$@" \
    "$py" -m ipyparallel.engine --profile-dir="$MCJAX_PROFILE_DIR" --cluster-id="$MCJAX_CLUSTER_ID" \
    --log-level=WARN
  mcjax_controller_fingerprint >"$MCJAX_STATE/pids/engine-$index.controller"
}

# True when the running engine of host INDEX joined a controller that is no longer the current one
# (the controller was replaced since: that engine is of no use any more).
mcjax_engine_stale() {
  local recorded="$MCJAX_STATE/pids/engine-$1.controller"
  [ -s "$(mcjax_engine_json)" ] || return 1
  [ -f "$recorded" ] && [ "$(cat "$recorded")" != "$(mcjax_controller_fingerprint)" ]
}

# Wait until N engines are registered with the controller (bounded by MCJAX_START_TIMEOUT).
mcjax_wait_engines() {
  local n=$1 timeout=${2:-$MCJAX_START_TIMEOUT} py
  py=$(mcjax_python)
  "$py" -P - "$(mcjax_client_json)" "$n" "$timeout" <<'EOF'
import sys
import ipyparallel as ipp

url, n, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
client = ipp.Client(url, timeout=timeout)  # positional: ipyparallel 9 ignores url_file=
try:
    client.wait_for_engines(n, timeout=timeout, interactive=False)
except TimeoutError:
    sys.exit(f"only {len(client.ids)} of {n} engines registered after {timeout:.0f}s: see the engine logs")
finally:
    client.close()
print(f"[mcjax] {n} engines registered")
EOF
}

# Write $MCJAX_STATE/cluster.json, which dsr1.workbench.connect() reads: where the
# controller is, how many engines, and how the processes are numbered. "numbering":
# "kernel-last" (the notebook gives the ids; the kernel is process N-1) or "platform" (JAX finds
# them itself; the kernel on host 0 is process 0). "kernel_env": the variables the kernel sets in
# os.environ before jax.distributed.initialize() with no arguments (platform numbering; may be {}).
# "jax_cache_dir": the compilation cache every process uses (null: none).
# usage: mcjax_write_cluster_json ENGINES CONTROLLER_IP
mcjax_write_cluster_json() {
  local engines=$1 controller_ip=$2 py line
  py=$(mcjax_python)
  mkdir -p "$MCJAX_STATE"
  set --
  if [ "$MCJAX_NUMBERING" = platform ]; then
    while IFS= read -r line; do set -- "$@" "$line"; done < <(mcjax_platform_env 0 $((engines + 1)))
  fi
  "$py" - "$MCJAX_STATE/cluster.json" "$engines" "$controller_ip" "$@" <<'EOF'
import json, os, sys

path, engines, ip = sys.argv[1], int(sys.argv[2]), sys.argv[3]  # this Python runs the engines
kernel_env = dict(arg.split("=", 1) for arg in sys.argv[4:])
env = os.environ
cache = env.get("MCJAX_JAX_CACHE", "off")
info = {
    "provider": env["MCJAX_PROVIDER"],
    "profile_dir": env["MCJAX_PROFILE_DIR"],
    "cluster_id": env["MCJAX_CLUSTER_ID"],
    "engines": engines,
    "controller_ip": ip,
    "root": env["MCJAX_ROOT"],
    "state": env["MCJAX_STATE"],
    "local_devices": int(env["MCJAX_LOCAL_DEVICES"]) if env["MCJAX_PROVIDER"] == "local" else None,
    "python": sys.executable,
    "numbering": env["MCJAX_NUMBERING"],
    "kernel_env": kernel_env,
    "coordinator_port": int(env["MCJAX_COORDINATOR_PORT"]) if env.get("MCJAX_COORDINATOR_PORT") else None,
    "jax_cache_dir": None if cache == "off" else cache,
}
with open(path + ".tmp", "w") as f:
    json.dump(info, f, indent=1)
os.replace(path + ".tmp", path)
EOF
}

# 0 when the fstab FILE has LINE's entry for its mount point, 1 when it has none; dies when it has a
# different one for that mount point (an error to fix by hand, never a duplicate).
mcjax_fstab_has() {
  local file=$1 line=$2 mnt existing
  mnt=$(echo "$line" | awk '{ print $2 }')
  existing=$(awk -v m="$mnt" '$1 !~ /^#/ && $2 == m' "$file" 2>/dev/null || true)
  [ -n "$existing" ] || return 1
  if [ "$(echo "$existing" | tr -s ' \t' '  ')" = "$(echo "$line" | tr -s ' \t' '  ')" ]; then
    return 0
  fi
  mcjax_die "$file already has a different entry for $mnt: '$existing' (wanted '$line'); fix it by hand"
}

# Add LINE to the fstab FILE unless a line with the same mount point is there already (then the
# lines must agree). Callers add it only once the mount itself worked: a line that cannot mount
# must not stay behind for the next boot.
mcjax_fstab_ensure() {
  local file=$1 line=$2 mnt
  mnt=$(echo "$line" | awk '{ print $2 }')
  if mcjax_fstab_has "$file" "$line"; then
    mcjax_log "$file already mounts $mnt"
    return 0
  fi
  mcjax_log "adding to $file: $line"
  if [ -w "$file" ] || { [ ! -e "$file" ] && [ -w "$(dirname "$file")" ]; }; then
    echo "$line" >>"$file"
  else
    echo "$line" | mcjax_sudo tee -a "$file" >/dev/null
  fi
}
