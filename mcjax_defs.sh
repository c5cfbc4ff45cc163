# shellcheck shell=bash
# mcjax_defs.sh: definitions for the multi-host JAX workbench (source it from bash or zsh).
#
#   source ./mcjax_defs.sh
#   cluster_exec 0 3 'hostname'      # run a command on hosts 0..3
#
# Every value below can be overridden by setting the MCJAX_* variable before sourcing.
# Providers:
#   gcloud  TPU VMs: `gcloud compute tpus tpu-vm ssh NAME --worker=i` (MCJAX_CLUSTER, MCJAX_ZONE, MCJAX_PROJECT)
#   ssh     any hosts reachable by ssh, e.g. a GPU cluster (MCJAX_HOST_LIST: host 0 first)
#   local   a simulated cluster on this machine: "hosts" are local processes (see cluster/local.sh)
#
# Host 0 runs the ipyparallel controller, the Jupyter server and the notebook kernel (the last JAX
# process); hosts 1..N-1 run one ipyparallel engine each.

: "${MCJAX_PROVIDER:=gcloud}"                 # gcloud | ssh | local
: "${MCJAX_CLUSTER:=mcjax}"                   # gcloud: the TPU VM (pod slice) name
: "${MCJAX_ZONE:=}"                           # gcloud: zone (empty: gcloud's configured compute/zone)
: "${MCJAX_PROJECT:=}"                        # gcloud: project (empty: gcloud's configured project)
: "${MCJAX_HOSTS:=}"                          # number of hosts (empty: from the provider)
: "${MCJAX_HOST_LIST:=}"                      # ssh: host names or addresses, host 0 first (spaces or commas)
: "${MCJAX_INTERNAL_IPS:=}"                   # internal IPs, host 0 first (empty: from the provider)
: "${MCJAX_USER:=${USER:-$(id -un)}}"         # remote user (ssh provider)
: "${MCJAX_SSH_OPTS:=-o BatchMode=yes -o ConnectTimeout=20}"  # extra ssh options (ssh provider)
: "${MCJAX_NFS_DIR:=/mnt/mcjax}"              # shared folder: exported by host 0, same path on every host
: "${MCJAX_BUCKET:=}"                         # optional GCS bucket mounted with gcsfuse on every host
: "${MCJAX_BUCKET_DIR:=/mnt/mcjax-bucket}"    # where the bucket is mounted
: "${MCJAX_VENV:=$HOME/mcjax-venv}"           # the Python venv on every host (local disk)
: "${MCJAX_REPO_DIR:=$MCJAX_NFS_DIR/dsr1}"    # the dsr1 source on the shared folder
: "${MCJAX_JAX_SPEC:=}"                       # extra pip requirement for jax (default by provider, see below)
: "${MCJAX_STATE:=$HOME/.mcjax}"              # pid files, logs, cluster.json (per host, local disk)
: "${MCJAX_PROFILE:=mcjax}"                   # ipyparallel profile name
: "${MCJAX_PROFILE_DIR:=}"                    # ipyparallel profile dir (default below)
: "${MCJAX_CLUSTER_ID:=mcjax}"                # ipyparallel cluster id (names the connection files)
: "${MCJAX_PYTHON:=python3}"                  # local provider: the Python running controller/engines
: "${MCJAX_LOCAL_DEVICES:=2}"                 # local provider: fake CPU devices per JAX process
: "${MCJAX_JUPYTER_PORT:=8888}"               # Jupyter on host 0 (bound to 127.0.0.1)
: "${MCJAX_REMOTE_DIR:=.mcjax-setup}"         # where mcjax_setup.sh copies these scripts (relative to home)
: "${MCJAX_START_TIMEOUT:=120}"               # seconds to wait for the controller / engines to come up
: "${MCJAX_STOP_TIMEOUT:=5}"                  # seconds between SIGTERM and SIGKILL when stopping
: "${MCJAX_DRY_RUN:=0}"                       # 1: cluster_exec / cluster_scp print what they would run

if [ -z "$MCJAX_JAX_SPEC" ]; then
  case "$MCJAX_PROVIDER" in
    gcloud) MCJAX_JAX_SPEC="jax[tpu]" ;;
    ssh) MCJAX_JAX_SPEC="jax[cuda12]" ;;
    *) MCJAX_JAX_SPEC="" ;;
  esac
fi
if [ -z "$MCJAX_PROFILE_DIR" ]; then
  if [ "$MCJAX_PROVIDER" = local ]; then
    MCJAX_PROFILE_DIR="$MCJAX_STATE/profile_$MCJAX_PROFILE"
  else
    # On the shared folder: the engines read the controller's engine connection file from there.
    MCJAX_PROFILE_DIR="$MCJAX_NFS_DIR/.mcjax/profile_$MCJAX_PROFILE"
  fi
fi

# The folder holding this file (the repository root, or ~/$MCJAX_REMOTE_DIR on a cluster host).
if [ -z "${MCJAX_ROOT:-}" ]; then
  if [ -n "${ZSH_VERSION:-}" ]; then
    eval '_mcjax_defs_file=${(%):-%x}'
  else
    _mcjax_defs_file=${BASH_SOURCE[0]:-$0}
  fi
  MCJAX_ROOT=$(cd "$(dirname "$_mcjax_defs_file")" && pwd)
  unset _mcjax_defs_file
fi

export MCJAX_PROVIDER MCJAX_CLUSTER MCJAX_ZONE MCJAX_PROJECT MCJAX_HOSTS MCJAX_HOST_LIST \
  MCJAX_INTERNAL_IPS MCJAX_USER MCJAX_SSH_OPTS MCJAX_NFS_DIR MCJAX_BUCKET MCJAX_BUCKET_DIR \
  MCJAX_VENV MCJAX_REPO_DIR MCJAX_JAX_SPEC MCJAX_STATE MCJAX_PROFILE MCJAX_PROFILE_DIR \
  MCJAX_CLUSTER_ID MCJAX_PYTHON MCJAX_LOCAL_DEVICES MCJAX_JUPYTER_PORT MCJAX_REMOTE_DIR \
  MCJAX_START_TIMEOUT MCJAX_STOP_TIMEOUT MCJAX_DRY_RUN MCJAX_ROOT

# Every function starts with `emulate -L ksh` under zsh: bash-like word splitting and arrays,
# restored when the function returns, so the same code runs in both shells.

# Errors: one convention for every script of the workbench.
#  - A script run as a program (mcjax_setup.sh, cluster/*.sh) stops with `mcjax_die MESSAGE`:
#    "<script>: MESSAGE" on stderr, exit status 1. A wrong command line is
#    `mcjax_usage_error MESSAGE`: the same line plus a pointer to --help, exit status 2. Both are
#    defined in cluster/common.sh and, identically, in mcjax_setup.sh (which runs before any of
#    this is sourced); `--help` prints the script's usage() to stdout and exits 0.
#  - The functions below run in the user's interactive shell, so they never exit: they fail
#    with `_mcjax_fail STATUS MESSAGE; return` ("<function>: MESSAGE" on stderr, where
#    <function> is the cluster_* function that was called, then return STATUS): 2 for a wrong
#    call (usage), 1 for anything else.

# _mcjax_fail STATUS MESSAGE...: print "<function>: MESSAGE" on stderr and return STATUS.
_mcjax_fail() {
  local rc=$1 name="" f  # not "status": read-only in zsh
  shift
  # The outermost cluster_* function on the call stack: the one the user (or a script) called.
  if [ -n "${ZSH_VERSION:-}" ]; then
    # shellcheck disable=SC2154  # zsh's call stack, innermost first
    for f in "${funcstack[@]}"; do case "$f" in cluster_*) name=$f ;; esac; done
  else
    for f in "${FUNCNAME[@]}"; do case "$f" in cluster_*) name=$f ;; esac; done
  fi
  printf '%s: %s\n' "${name:-mcjax}" "$*" >&2
  return "$rc"
}

_mcjax_is_uint() {
  case "$1" in
    '' | *[!0-9]*) return 1 ;;
    *) return 0 ;;
  esac
}

# The ssh provider's hosts, one a line.
_mcjax_host_lines() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  printf '%s\n' "$MCJAX_HOST_LIST" | tr ', \t' '\n' | sed '/^$/d'
}

# Address of host $1 for the ssh provider.
_mcjax_host_addr() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local addr
  addr=$(_mcjax_host_lines | sed -n "$(($1 + 1))p")
  [ -n "$addr" ] || { _mcjax_fail 1 "host $1 is not in MCJAX_HOST_LIST ($MCJAX_HOST_LIST)"; return; }
  echo "$addr"
}

# gcloud compute tpus tpu-vm SUBCOMMAND ARGS... with the zone and project flags.
_mcjax_gcloud_tpu() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local sub=$1
  shift
  if [ -n "$MCJAX_PROJECT" ]; then set -- "--project=$MCJAX_PROJECT" "$@"; fi
  if [ -n "$MCJAX_ZONE" ]; then set -- "--zone=$MCJAX_ZONE" "$@"; fi
  gcloud compute tpus tpu-vm "$sub" "$@"
}

# cluster_internal_ips: the hosts' internal IPs, host 0 first, one a line.
cluster_internal_ips() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local ips host ip n
  if [ -n "$MCJAX_INTERNAL_IPS" ]; then
    printf '%s\n' "$MCJAX_INTERNAL_IPS" | tr ', \t;' '\n' | sed '/^$/d'
    return 0
  fi
  case "$MCJAX_PROVIDER" in
    gcloud)
      ips=$(_mcjax_gcloud_tpu describe "$MCJAX_CLUSTER" --format='value(networkEndpoints[].ipAddress)') ||
        { _mcjax_fail 1 "gcloud could not describe TPU VM '$MCJAX_CLUSTER' (zone '${MCJAX_ZONE:-default}')"; return; }
      printf '%s\n' "$ips" | tr ';, ' '\n' | sed '/^$/d'
      ;;
    ssh)
      [ -n "$MCJAX_HOST_LIST" ] || { _mcjax_fail 1 "MCJAX_HOST_LIST is empty (the ssh provider needs the hosts, host 0 first)"; return; }
      for host in $(_mcjax_host_lines); do
        host=${host#*@}
        case "$host" in
          *[!0-9.]*)
            ip=$(getent ahostsv4 "$host" 2>/dev/null | awk 'NR == 1 { print $1 }')
            [ -n "$ip" ] || { _mcjax_fail 1 "cannot resolve host '$host' to an IPv4 address (set MCJAX_INTERNAL_IPS)"; return; }
            echo "$ip"
            ;;
          *) echo "$host" ;;
        esac
      done
      ;;
    local)
      n=$(cluster_host_count) || return 1
      ip=0
      while [ "$ip" -lt "$n" ]; do
        echo 127.0.0.1
        ip=$((ip + 1))
      done
      ;;
    *)
      _mcjax_fail 1 "unknown MCJAX_PROVIDER '$MCJAX_PROVIDER' (gcloud, ssh or local)"
      return
      ;;
  esac
}

# cluster_host_count: the number of hosts N (host 0 and N-1 engine hosts).
cluster_host_count() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local n
  if [ -n "$MCJAX_HOSTS" ]; then
    _mcjax_is_uint "$MCJAX_HOSTS" || { _mcjax_fail 1 "MCJAX_HOSTS='$MCJAX_HOSTS' is not a number"; return; }
    echo "$MCJAX_HOSTS"
    return 0
  fi
  case "$MCJAX_PROVIDER" in
    local)
      if [ -f "$MCJAX_STATE/local.env" ]; then
        n=$(sed -n 's/^MCJAX_HOSTS=//p' "$MCJAX_STATE/local.env")
      fi
      [ -n "${n:-}" ] || { _mcjax_fail 1 "no local cluster in $MCJAX_STATE: set MCJAX_HOSTS or run ./mcjax_setup.sh --local N"; return; }
      echo "$n"
      ;;
    ssh) _mcjax_host_lines | wc -l | tr -d ' ' ;;
    *) cluster_internal_ips | wc -l | tr -d ' ' ;;
  esac
}

# Run the command string $2 on host $1 (no prefix, stdin passed through); returns its status.
_mcjax_exec_one() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local i=$1 cmd=$2 addr
  if [ "$MCJAX_DRY_RUN" = 1 ]; then
    printf '[dry-run] host %s (%s): %s\n' "$i" "$MCJAX_PROVIDER" "$cmd"
    return 0
  fi
  case "$MCJAX_PROVIDER" in
    local)
      # A "host" is a subshell of this machine, in the state dir, with its host index set.
      (
        mkdir -p "$MCJAX_STATE" && cd "$MCJAX_STATE" || exit 1
        MCJAX_HOST_INDEX=$i bash -c "$cmd"
      )
      ;;
    ssh)
      addr=$(_mcjax_host_addr "$i") || return 1
      case "$addr" in *@*) ;; *) addr="$MCJAX_USER@$addr" ;; esac
      # shellcheck disable=SC2086,SC2029  # several options; $cmd is meant for the remote shell
      ssh $MCJAX_SSH_OPTS "$addr" "export MCJAX_HOST_INDEX=$i; $cmd"
      ;;
    gcloud)
      _mcjax_gcloud_tpu ssh "$MCJAX_CLUSTER" --quiet --worker="$i" --command="export MCJAX_HOST_INDEX=$i; $cmd"
      ;;
    *)
      _mcjax_fail 1 "unknown MCJAX_PROVIDER '$MCJAX_PROVIDER' (gcloud, ssh or local)"
      ;;
  esac
}

# cluster_exec FIRST LAST CMD...: run CMD (one string, run by the host's shell) on hosts
# FIRST..LAST, in parallel when there are several, each output line prefixed by "[host i]".
# Returns 0 when every host succeeded, else the exit status of the first failing host (lowest
# index), and names every failing host on stderr. With one host, stdin is passed through.
cluster_exec() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  if [ "$#" -lt 3 ]; then
    _mcjax_fail 2 "usage: cluster_exec FIRST LAST CMD..."
    return
  fi
  local first=$1 last=$2 cmd n tmp i rc ret failed
  shift 2
  cmd="$*"
  if ! _mcjax_is_uint "$first" || ! _mcjax_is_uint "$last" || [ "$first" -gt "$last" ]; then
    _mcjax_fail 2 "bad host range '$first'..'$last' (want 0 <= FIRST <= LAST; usage: cluster_exec FIRST LAST CMD...)"
    return
  fi
  n=$(cluster_host_count) || return 2
  if [ "$last" -ge "$n" ]; then
    _mcjax_fail 2 "host $last does not exist (the cluster has $n hosts: 0..$((n - 1)))"
    return
  fi
  if [ "$first" -eq "$last" ]; then
    _mcjax_exec_one "$first" "$cmd"
    rc=$?
    [ "$rc" -eq 0 ] || _mcjax_fail "$rc" "host $first failed (exit status $rc)"
    return "$rc"
  fi
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/mcjax_exec.XXXXXX") || return 1
  # A subshell: no job-control chatter from interactive shells.
  (
    i=$first
    while [ "$i" -le "$last" ]; do
      (
        _mcjax_exec_one "$i" "$cmd" </dev/null 2>&1
        echo "$?" >"$tmp/$i.rc"
      ) | while IFS= read -r line || [ -n "$line" ]; do printf '[host %s] %s\n' "$i" "$line"; done &
      i=$((i + 1))
    done
    wait
  )
  ret=0
  failed=""
  i=$first
  while [ "$i" -le "$last" ]; do
    rc=$(cat "$tmp/$i.rc" 2>/dev/null || echo 255)
    if [ "$rc" -ne 0 ]; then
      [ "$ret" -ne 0 ] || ret=$rc
      failed="$failed host $i (exit status $rc),"
    fi
    i=$((i + 1))
  done
  rm -rf "$tmp"
  if [ "$ret" -ne 0 ]; then
    _mcjax_fail "$ret" "failed on${failed%,}"
  fi
  return "$ret"
}

# cluster_ssh HOST [CMD...]: an interactive shell (or CMD) on host HOST.
cluster_ssh() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local i=${1:-0} addr
  [ "$#" -eq 0 ] || shift
  _mcjax_is_uint "$i" || { _mcjax_fail 2 "bad host '$i' (want a host number; usage: cluster_ssh HOST [CMD...])"; return; }
  case "$MCJAX_PROVIDER" in
    local)
      if [ "$#" -gt 0 ]; then _mcjax_exec_one "$i" "$*"; else (cd "$MCJAX_STATE" && MCJAX_HOST_INDEX=$i bash -i); fi
      ;;
    ssh)
      addr=$(_mcjax_host_addr "$i") || return 1
      case "$addr" in *@*) ;; *) addr="$MCJAX_USER@$addr" ;; esac
      # shellcheck disable=SC2086
      ssh -t $MCJAX_SSH_OPTS "$addr" "$@"
      ;;
    gcloud)
      if [ "$#" -gt 0 ]; then
        _mcjax_gcloud_tpu ssh "$MCJAX_CLUSTER" --worker="$i" --command="$*"
      else
        _mcjax_gcloud_tpu ssh "$MCJAX_CLUSTER" --worker="$i"
      fi
      ;;
    *) _mcjax_fail 1 "unknown MCJAX_PROVIDER '$MCJAX_PROVIDER' (gcloud, ssh or local)" ;;
  esac
}

# cluster_scp SRC DEST_DIR [FIRST [LAST]]: copy a local file or folder SRC into the folder
# DEST_DIR (created if missing; relative to the remote home) on hosts FIRST..LAST (default: all).
# It streams a tar archive through cluster_exec, so it works the same for every provider.
cluster_scp() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  if [ "$#" -lt 2 ]; then
    _mcjax_fail 2 "usage: cluster_scp SRC DEST_DIR [FIRST [LAST]]"
    return
  fi
  local src=$1 dest=$2 first=${3:-0} last=${4:-} n i rc ret=0 parent base
  [ -e "$src" ] || { _mcjax_fail 2 "'$src' does not exist"; return; }
  n=$(cluster_host_count) || return 2
  [ -n "$last" ] || last=$((n - 1))
  if [ "$MCJAX_DRY_RUN" = 1 ]; then
    echo "[dry-run] copy $src into $dest on hosts $first..$last ($MCJAX_PROVIDER)"
    return 0
  fi
  if [ "$MCJAX_PROVIDER" = local ]; then
    # The local "hosts" share this machine's disk: one copy (relative paths from the state dir).
    (mkdir -p "$MCJAX_STATE" && cd "$MCJAX_STATE" && mkdir -p "$dest") || return 1
    case "$dest" in /*) ;; *) dest="$MCJAX_STATE/$dest" ;; esac
    cp -R "$src" "$dest/"
    return
  fi
  parent=$(cd "$(dirname "$src")" && pwd) || return 1
  base=$(basename "$src")
  i=$first
  while [ "$i" -le "$last" ]; do
    tar -C "$parent" -czf - "$base" | _mcjax_exec_one "$i" "mkdir -p $dest && tar -xzf - -C $dest"
    rc=$?
    if [ "$rc" -ne 0 ]; then
      _mcjax_fail "$rc" "copy to host $i failed (exit status $rc)" || true  # go on with the next host
      [ "$ret" -ne 0 ] || ret=$rc
    fi
    i=$((i + 1))
  done
  return "$ret"
}

# cluster_restart [engines|all]: restart the engines (default) or the controller and the engines.
# Local provider: restarts only the local processes that ./mcjax_setup.sh --local started.
cluster_restart() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local what=${1:-engines} n remote
  case "$what" in
    engines | all) ;;
    *) _mcjax_fail 2 "unknown argument '$what' (usage: cluster_restart [engines|all])"; return ;;
  esac
  if [ "$MCJAX_PROVIDER" = local ]; then
    bash "$MCJAX_ROOT/cluster/local.sh" restart "$what"
    return
  fi
  n=$(cluster_host_count) || return 1
  remote="bash $MCJAX_REMOTE_DIR/cluster/ipcluster.sh"
  cluster_exec 1 $((n - 1)) "$remote engine stop" || return
  if [ "$what" = all ]; then
    cluster_exec 0 0 "$remote controller restart" || return
  fi
  cluster_exec 1 $((n - 1)) "$remote engine start" || return
  cluster_exec 0 0 "$remote wait $((n - 1))"
}

# cluster_status: hosts, internal IPs and whether the controller / engines are running.
cluster_status() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local n
  echo "provider: $MCJAX_PROVIDER  state: $MCJAX_STATE  profile: $MCJAX_PROFILE_DIR  cluster id: $MCJAX_CLUSTER_ID"
  if [ "$MCJAX_PROVIDER" = local ]; then
    bash "$MCJAX_ROOT/cluster/local.sh" status
    return
  fi
  n=$(cluster_host_count) || return 1
  echo "hosts: $n; internal IPs: $(cluster_internal_ips | tr '\n' ' ')"
  cluster_exec 0 $((n - 1)) "bash $MCJAX_REMOTE_DIR/cluster/ipcluster.sh status"
}

# cluster_port_forward [PORT]: forward 127.0.0.1:PORT here to Jupyter on host 0 (blocks; Ctrl-C
# ends it). Both ends are bound to localhost: nothing is exposed on the network.
cluster_port_forward() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local port=${1:-$MCJAX_JUPYTER_PORT} addr
  _mcjax_is_uint "$port" || { _mcjax_fail 2 "bad port '$port' (usage: cluster_port_forward [PORT])"; return; }
  echo "forwarding http://127.0.0.1:$port -> host 0 127.0.0.1:$port (Ctrl-C to stop)"
  case "$MCJAX_PROVIDER" in
    local)
      echo "local provider: Jupyter runs on this machine, nothing to forward"
      ;;
    ssh)
      addr=$(_mcjax_host_addr 0) || return 1
      case "$addr" in *@*) ;; *) addr="$MCJAX_USER@$addr" ;; esac
      # shellcheck disable=SC2086
      ssh -N $MCJAX_SSH_OPTS -L "127.0.0.1:$port:127.0.0.1:$port" "$addr"
      ;;
    gcloud)
      _mcjax_gcloud_tpu ssh "$MCJAX_CLUSTER" --worker=0 -- -N -L "127.0.0.1:$port:127.0.0.1:$port"
      ;;
    *) _mcjax_fail 1 "unknown MCJAX_PROVIDER '$MCJAX_PROVIDER' (gcloud, ssh or local)" ;;
  esac
}
