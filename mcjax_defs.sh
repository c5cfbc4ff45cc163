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
#   slurm   the nodes of a Slurm allocation (run inside `salloc -N 4 ...`): `srun --overlap -w NODE`
#   local   a simulated cluster on this machine: "hosts" are local processes (see cluster/local.sh)
#
# Host 0 runs the ipyparallel controller, the Jupyter server and the notebook kernel; hosts 1..N-1
# run one ipyparallel engine each. Which JAX process the kernel is depends on MCJAX_NUMBERING.

# mcjax_cluster_tag: what keeps one cluster's files in a home apart from another's where the hosts
# share that home (Slurm, NFS homes): "" for the default cluster id (mcjax), else "-ID"
# (./mcjax_setup.sh --name ID). It ends ~/$MCJAX_REMOTE_DIR (scripts, mcjax.env), host 0's ssh key,
# its known hosts and the comment of its authorized_keys lines.
mcjax_cluster_tag() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  [ "${MCJAX_CLUSTER_ID:-mcjax}" = mcjax ] || printf '%s' "-$MCJAX_CLUSTER_ID"
}
# _mcjax_slurm_cpus SLURM_JOB_CPUS_PER_NODE: the fewest CPUs a node of the allocation has ("64(x2),32"
# -> 32; empty: none).
_mcjax_slurm_cpus() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  printf '%s\n' "$1" | tr ',' '\n' | sed -n 's/^\([0-9][0-9]*\).*/\1/p' | sort -n | sed -n 1p
}

: "${MCJAX_PROVIDER:=gcloud}"                 # gcloud | ssh | slurm | local
: "${MCJAX_STATE:=$HOME/.mcjax}"              # pid files, logs, cluster.json (per host, local disk, mode 700); on
                                              #   your machine also what setup started from it (setup.env): --stop
                                              #   and --status act on the cluster this folder records, never another
# Settings left empty get a value that depends on the provider and the state folder (the end of
# this list); those are remembered in MCJAX_DERIVED, so that sourcing this file again for another
# provider or state folder (cluster/local.sh run from a shell set up for gcloud) derives them anew.
if [ "${MCJAX_DERIVED_KEY:-}" != "$MCJAX_PROVIDER $MCJAX_STATE" ]; then
  [ -z "${MCJAX_DERIVED:-}" ] || eval "unset $MCJAX_DERIVED"
  MCJAX_DERIVED=""
  MCJAX_DERIVED_KEY="$MCJAX_PROVIDER $MCJAX_STATE"
fi
: "${MCJAX_CLUSTER:=mcjax}"                   # gcloud: the TPU VM (pod slice) name
: "${MCJAX_ZONE:=}"                           # gcloud: zone (empty: gcloud's configured compute/zone)
: "${MCJAX_PROJECT:=}"                        # gcloud: project (empty: gcloud's configured project)
: "${MCJAX_GCLOUD_SSH:=default}"              # gcloud: how `gcloud ... ssh` reaches the workers: default (their
                                              #   external IPs), internal-ip (--internal-ip: from a machine in the
                                              #   VPC), iap (--tunnel-through-iap: workers without external IPs)
: "${MCJAX_GCLOUD_PARALLEL:=8}"               # gcloud: at most this many `gcloud ... ssh` at once (cluster_exec)
: "${MCJAX_GCLOUD_RETRIES:=4}"                # gcloud: tries of a call that failed on "database is locked"
: "${MCJAX_HOSTS:=}"                          # number of hosts (empty: from the provider)
: "${MCJAX_HOST_LIST:=}"                      # ssh: host names or addresses, host 0 first (spaces or commas);
                                              #   slurm: the nodes (empty: scontrol show hostnames $SLURM_JOB_NODELIST)
: "${MCJAX_INTERNAL_IPS:=}"                   # internal IPs, host 0 first (empty: from the provider)
: "${MCJAX_USER:=${USER:-$(id -un)}}"         # remote user (ssh provider)
: "${MCJAX_CONNECT_TIMEOUT:=20}"              # seconds an ssh connection may take to open (ssh, gcloud ssh)
: "${MCJAX_SSH_OPTS:=-o BatchMode=yes -o ConnectTimeout=$MCJAX_CONNECT_TIMEOUT -o ServerAliveInterval=15 -o ServerAliveCountMax=4}"  # ssh options (ssh): a dead host ends the call in ~1 min
: "${MCJAX_TRANSPORT:=}"                      # how cluster_exec reaches a host; empty: the provider's way. The
                                              #   mcjax.env of the hosts sets ssh: host 0 reaches the others over
                                              #   their internal IPs with the key that setup's `keys` step made
: "${MCJAX_SLURM_JOB_ID:=${SLURM_JOB_ID:-}}"  # slurm: the allocation every srun joins (srun --jobid)
: "${MCJAX_FORWARD_ENV:=}"                    # variables of this environment every host gets (in mcjax.env, where a
                                              #   host's own value wins; Slurm: srun --export): empty: the proxies
                                              #   (http_proxy, https_proxy, no_proxy, all_proxy, either case) and the
                                              #   PIP_* and UV_* set here (the package index, its certificates), but
                                              #   those naming a local path (*_DIR, *_FILE, *_PATH, *_CERT); else the names
                                              #   given (spaces or commas); none: nothing
: "${MCJAX_SRUN_OPTS:=}"                      # slurm: extra srun options for the engines' and Jupyter's steps,
                                              #   e.g. --gpus-per-node=8 where a step does not get the job's GPUs
: "${MCJAX_SRUN_CPUS:=${SLURM_JOB_CPUS_PER_NODE:+$(_mcjax_slurm_cpus "$SLURM_JOB_CPUS_PER_NODE")}}"  # slurm: step CPUs
                                              #   (--cpus-per-task, with --mem=0: all the job's memory on the
                                              #   node; empty: the fewest CPUs per node of the allocation,
                                              #   SLURM_JOB_CPUS_PER_NODE; srun's default step gets one)
: "${MCJAX_NFS_DIR:=}"                        # shared folder, same path on every host (empty: /mnt/mcjax, exported
                                              #   by host 0 over NFS; slurm: ~/mcjax-shared, a folder the nodes share)
: "${MCJAX_SHARED_FS:=}"                      # 1: MCJAX_NFS_DIR is on a file system every host shares already (setup
                                              #   only checks it); 0: host 0 exports it over NFS (empty: 1 for
                                              #   slurm, else 0)
: "${MCJAX_KEY_FROM:=}"                       # where host 0's ssh key is accepted from (authorized_keys from=;
                                              #   empty: host 0's internal IP; off: anywhere)
: "${MCJAX_BUCKET:=}"                         # optional GCS bucket mounted with gcsfuse on every host
: "${MCJAX_BUCKET_DIR:=/mnt/mcjax-bucket}"    # where the bucket is mounted
: "${MCJAX_VENV:=$HOME/mcjax-venv}"           # the Python venv on every host (local disk; a venv on a shared
                                              #   home is built once, by host 0, and used by every host)
# Python on the hosts. cluster/venv.sh puts uv $MCJAX_UV_VERSION (one binary, taken from its wheel
# on the package index) in $MCJAX_UV_DIR and builds $MCJAX_VENV with the host's own Python when it
# is at least $MCJAX_HOST_PYTHON, else with uv's CPython $MCJAX_HOST_PYTHON (TPU VM images ship
# 3.10; uv installs its build under ~/.local/share/uv). Pinned here, once; the local provider
# downloads nothing and uses MCJAX_PYTHON.
: "${MCJAX_UV_VERSION:=0.13.9}"               # uv, from the package index (pip download uv==VERSION)
: "${MCJAX_HOST_PYTHON:=3.12}"                # the lock's Python: the least a host's own may be, and the CPython
                                              #   uv installs where it has none (its newest 3.12.x)
: "${MCJAX_HOST_PYTHON_FROM:=auto}"           # auto: the host's own Python when new enough, else uv's; system: the
                                              #   host's only; uv: uv's only (from UV_PYTHON_INSTALL_MIRROR, default
                                              #   python-build-standalone's releases on GitHub)
: "${MCJAX_UV_DIR:=$HOME/.mcjax-uv}"          # where the uv binary goes on each host
: "${MCJAX_LOCK_PLATFORM:=}"                  # the platform extra of the lock: cpu, tpu or cuda12 (empty: tpu for
                                              #   gcloud, cuda12 for ssh and slurm, cpu for local)
: "${MCJAX_LOCK:=}"                           # the requirements lock (exact versions, hashes) every host's venv is
                                              #   synced to (uv pip sync) and the smoke check compares against; empty:
                                              #   $MCJAX_REPO_DIR/cluster/locks/$MCJAX_LOCK_PLATFORM.txt (local: off);
                                              #   off: no lock (pyproject's ranges plus MCJAX_JAX_SPEC)
: "${MCJAX_JAX_SPEC:=}"                       # without a lock: extra pip requirement for jax (default by provider)
: "${MCJAX_PROFILE:=mcjax}"                   # ipyparallel profile name
: "${MCJAX_PROFILE_DIR:=}"                    # ipyparallel profile dir (default below)
: "${MCJAX_CLUSTER_ID:=mcjax}"                # ipyparallel cluster id (names the connection files)
: "${MCJAX_PYTHON:=python3}"                  # local provider: the Python running controller/engines
: "${MCJAX_LOCAL_DEVICES:=2}"                 # local provider: fake CPU devices per JAX process
: "${MCJAX_NUMBERING:=}"                      # who numbers the JAX processes: kernel-last (the notebook gives the
                                              #   ids, the kernel is process N-1) or platform (JAX finds them itself,
                                              #   the kernel on host 0 is process 0; cluster.json's kernel_env holds
                                              #   the kernel's variables). Empty: platform for gcloud (TPU) and
                                              #   slurm, kernel-last for ssh and local (--local N --numbering platform
                                              #   simulates Slurm's variables)
: "${MCJAX_COORDINATOR_PORT:=}"               # the jax.distributed coordinator's port, passed to every process as
                                              #   JAX_COORDINATOR_PORT (empty: JAX's or the notebook's default; a
                                              #   local platform-numbered cluster picks a free one)
: "${MCJAX_PORTS:=8476-8575}"                # the one port range of every listener a host opens for the others:
                                              #   the ipyparallel controller (its highest 32 free), JAX's coordinator
                                              #   (8476 unless MCJAX_COORDINATOR_PORT says), the smoke check, the
                                              #   serving control channel, serve.ipynb's server; each on the host's
                                              #   cluster address only. Firewalls let it through between the hosts
: "${MCJAX_JAX_CACHE:=}"                      # JAX's persistent compilation cache, shared by every process
                                              #   (JAX_COMPILATION_CACHE_DIR); empty: $MCJAX_NFS_DIR/jax_cache,
                                              #   local: $MCJAX_STATE/jax_cache; off: none
: "${MCJAX_JAX_CACHE_MIN_SECS:=0}"            # cache programs that took at least this long to compile
: "${MCJAX_JUPYTER_PORT:=8888}"               # Jupyter on host 0 (bound to 127.0.0.1; setup fails if it is taken)
: "${MCJAX_REMOTE_DIR:=.mcjax-setup$(mcjax_cluster_tag)}"  # where mcjax_setup.sh copies these scripts and
                                              #   mcjax.env (relative to home; -ID for a cluster --name ID)
: "${MCJAX_START_TIMEOUT:=120}"               # seconds to wait for the controller / engines to come up
: "${MCJAX_STOP_TIMEOUT:=5}"                  # seconds between SIGTERM and SIGKILL when stopping
: "${MCJAX_DRY_RUN:=0}"                       # 1: cluster_exec / cluster_scp / cluster_restart print each command
                                              #   they would run ("+ COMMAND", one a line) instead of running it

# The provider's defaults for what is still empty (each name derived is added to MCJAX_DERIVED).
_mcjax_derive() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  # shellcheck disable=SC2034  # value is read by the eval
  local var=$1 value=$2
  eval "[ -z \"\${$var:-}\" ]" || return 0
  eval "$var=\$value"
  MCJAX_DERIVED="${MCJAX_DERIVED# } $var"
}
case "$MCJAX_PROVIDER" in
  slurm) _mcjax_derive MCJAX_NFS_DIR "$HOME/mcjax-shared"; _mcjax_derive MCJAX_SHARED_FS 1 ;;
  *) _mcjax_derive MCJAX_NFS_DIR /mnt/mcjax; _mcjax_derive MCJAX_SHARED_FS 0 ;;
esac
_mcjax_derive MCJAX_REPO_DIR "$MCJAX_NFS_DIR/dsr1"   # the dsr1 source on the shared folder
case "$MCJAX_PROVIDER" in
  gcloud) _mcjax_derive MCJAX_JAX_SPEC "jax[tpu]"; _mcjax_derive MCJAX_LOCK_PLATFORM tpu ;;
  ssh | slurm) _mcjax_derive MCJAX_JAX_SPEC "jax[cuda12]"; _mcjax_derive MCJAX_LOCK_PLATFORM cuda12 ;;
  *) _mcjax_derive MCJAX_LOCK_PLATFORM cpu ;;
esac
case "$MCJAX_PROVIDER" in
  local) _mcjax_derive MCJAX_LOCK off ;;  # the local cluster runs your own environment
  *) _mcjax_derive MCJAX_LOCK "$MCJAX_REPO_DIR/cluster/locks/$MCJAX_LOCK_PLATFORM.txt" ;;
esac
case "$MCJAX_PROVIDER" in
  gcloud | slurm) _mcjax_derive MCJAX_NUMBERING platform ;;
  *) _mcjax_derive MCJAX_NUMBERING kernel-last ;;
esac
case "$MCJAX_PROVIDER" in
  local)
    _mcjax_derive MCJAX_JAX_CACHE "$MCJAX_STATE/jax_cache"
    _mcjax_derive MCJAX_PROFILE_DIR "$MCJAX_STATE/profile_$MCJAX_PROFILE"
    ;;
  *)
    _mcjax_derive MCJAX_JAX_CACHE "$MCJAX_NFS_DIR/jax_cache"
    # On the shared folder: the engines read the controller's engine connection file from there.
    _mcjax_derive MCJAX_PROFILE_DIR "$MCJAX_NFS_DIR/.mcjax/profile_$MCJAX_PROFILE"
    ;;
esac

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

# Every setting above, in one list (mcjax_setup.sh writes them into mcjax.env and setup.env).
MCJAX_SETTINGS="MCJAX_PROVIDER MCJAX_CLUSTER MCJAX_ZONE MCJAX_PROJECT MCJAX_GCLOUD_SSH MCJAX_GCLOUD_PARALLEL \
MCJAX_GCLOUD_RETRIES MCJAX_HOSTS \
MCJAX_HOST_LIST MCJAX_INTERNAL_IPS MCJAX_USER MCJAX_CONNECT_TIMEOUT MCJAX_SSH_OPTS MCJAX_TRANSPORT \
MCJAX_SLURM_JOB_ID MCJAX_FORWARD_ENV MCJAX_SRUN_OPTS MCJAX_SRUN_CPUS MCJAX_NFS_DIR MCJAX_SHARED_FS MCJAX_KEY_FROM MCJAX_BUCKET MCJAX_BUCKET_DIR MCJAX_VENV \
MCJAX_UV_VERSION MCJAX_HOST_PYTHON MCJAX_HOST_PYTHON_FROM MCJAX_UV_DIR MCJAX_REPO_DIR MCJAX_LOCK_PLATFORM MCJAX_LOCK MCJAX_JAX_SPEC MCJAX_STATE \
MCJAX_PROFILE MCJAX_PROFILE_DIR MCJAX_CLUSTER_ID MCJAX_PYTHON MCJAX_LOCAL_DEVICES MCJAX_NUMBERING \
MCJAX_COORDINATOR_PORT MCJAX_PORTS MCJAX_JAX_CACHE MCJAX_JAX_CACHE_MIN_SECS MCJAX_JUPYTER_PORT MCJAX_REMOTE_DIR \
MCJAX_START_TIMEOUT MCJAX_STOP_TIMEOUT"
eval "export $MCJAX_SETTINGS MCJAX_DRY_RUN MCJAX_ROOT MCJAX_DERIVED MCJAX_DERIVED_KEY"

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

# _mcjax_q WORD...: the words on one line, each quoted for a POSIX shell where it needs it. The
# functions below build every command that reaches a host this way and eval it, and --dry-run
# prints the same line: what a dry run shows is exactly what a real run runs.
_mcjax_q() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local a out="" sep="" sq="'" esc="'\\''"
  for a in "$@"; do
    case "$a" in
      '') a="''" ;;
      *[!A-Za-z0-9_@%+=:,./-]*) a="'${a//$sq/$esc}'" ;;
    esac
    out="$out$sep$a"
    sep=" "
  done
  printf '%s\n' "$out"
}

# The hosts (ssh: MCJAX_HOST_LIST; slurm: MCJAX_HOST_LIST, else the allocation's nodes), one a line.
_mcjax_host_lines() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  if [ -z "$MCJAX_HOST_LIST" ] && [ "$MCJAX_PROVIDER" = slurm ]; then
    if [ -z "${SLURM_JOB_NODELIST:-}" ]; then
      _mcjax_fail 1 "no Slurm allocation here (SLURM_JOB_NODELIST is empty): run inside salloc, or set MCJAX_HOST_LIST"
      return
    fi
    scontrol show hostnames "$SLURM_JOB_NODELIST"
    return
  fi
  printf '%s\n' "$MCJAX_HOST_LIST" | tr ', \t' '\n' | sed '/^$/d'
}

# Address of host $1 (ssh transport, slurm): its line of _mcjax_host_lines.
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

# The command line (quoted) of `gcloud ... ssh` to TPU worker $1 followed by ARGS...: with the zone,
# project, a connect timeout and the network path of MCJAX_GCLOUD_SSH.
_mcjax_gcloud_ssh_line() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local i=$1 net=""
  shift
  case "$MCJAX_GCLOUD_SSH" in
    default | '') ;;
    internal-ip) net=--internal-ip ;;
    iap) net=--tunnel-through-iap ;;
    *) _mcjax_fail 2 "MCJAX_GCLOUD_SSH='$MCJAX_GCLOUD_SSH' (want default, internal-ip or iap)"; return ;;
  esac
  set -- gcloud compute tpus tpu-vm ssh "$MCJAX_CLUSTER" ${MCJAX_ZONE:+"--zone=$MCJAX_ZONE"} \
    ${MCJAX_PROJECT:+"--project=$MCJAX_PROJECT"} "--worker=$i" --quiet ${net:+"$net"} \
    "--ssh-flag=-o ConnectTimeout=$MCJAX_CONNECT_TIMEOUT -o ServerAliveInterval=15 -o ServerAliveCountMax=4" "$@"
  _mcjax_q "$@"
}

# _mcjax_forward_names: the names of the variables set here that reach every host (MCJAX_FORWARD_ENV),
# one a line.
_mcjax_forward_names() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local name
  case "$MCJAX_FORWARD_ENV" in
    none) ;;
    '')
      env | sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p' |
        grep -E '^((https?|no|all)_proxy|(HTTPS?|NO|ALL)_PROXY|(PIP|UV)_[A-Z0-9_]+)$' | grep -v -E '_(DIR|FILE|PATH|CERT)$' | sort -u || true
      ;;
    *)
      for name in $(printf '%s\n' "$MCJAX_FORWARD_ENV" | tr ',' ' '); do
        case "$name" in '' | [0-9]* | *[!A-Za-z0-9_]*) continue ;; esac
        if eval "[ -n \"\${$name+x}\" ]"; then echo "$name"; fi
      done
      ;;
  esac
}

# The command line (quoted) of srun on the node of host $1 in our allocation, followed by ARGS...
# The step's environment is HOME, PATH, USER and the variables to forward (_mcjax_forward_names).
_mcjax_srun_line() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local node keep=HOME,PATH,USER name
  if [ -z "$MCJAX_SLURM_JOB_ID" ]; then
    _mcjax_fail 1 "no Slurm allocation: MCJAX_SLURM_JOB_ID (SLURM_JOB_ID) is empty; run inside salloc"
    return
  fi
  node=$(_mcjax_host_addr "$1") || return 1
  shift
  for name in $(_mcjax_forward_names); do keep="$keep,$name"; done
  # --overlap: every step shares the node's CPUs, memory and GPUs; each may use all the job's.
  _mcjax_q srun "--jobid=$MCJAX_SLURM_JOB_ID" --overlap --nodes=1 --ntasks=1 "--nodelist=$node" \
    ${MCJAX_SRUN_CPUS:+"--cpus-per-task=$MCJAX_SRUN_CPUS"} --mem=0 "--export=$keep" "$@"
}

# The command line (quoted) that runs the command string $2 on host $1, by MCJAX_TRANSPORT (empty:
# the provider's way). The command runs in the host's shell, in the home folder (local: the state
# folder), with MCJAX_HOST_INDEX set; stdin is passed through.
_mcjax_host_line() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local i=$1 cmd=$2 addr
  case "${MCJAX_TRANSPORT:-$MCJAX_PROVIDER}" in
    local)
      _mcjax_q bash -c "mkdir -p $(_mcjax_q "$MCJAX_STATE") && cd $(_mcjax_q "$MCJAX_STATE") || exit 1; export MCJAX_HOST_INDEX=$i; $cmd"
      ;;
    ssh)
      addr=$(_mcjax_host_addr "$i") || return 1
      case "$addr" in *@*) ;; *) addr="$MCJAX_USER@$addr" ;; esac
      # shellcheck disable=SC2086  # several options
      _mcjax_q ssh $MCJAX_SSH_OPTS "$addr" "export MCJAX_HOST_INDEX=$i; $cmd"
      ;;
    gcloud) _mcjax_gcloud_ssh_line "$i" "--command=export MCJAX_HOST_INDEX=$i; $cmd" ;;
    slurm) _mcjax_srun_line "$i" bash -c "cd || exit 1; export MCJAX_HOST_INDEX=$i; $cmd" ;;
    *) _mcjax_fail 1 "unknown MCJAX_PROVIDER '$MCJAX_PROVIDER' (gcloud, ssh, slurm or local)" ;;
  esac
}

# Run the command string $2 on host $1 (no prefix, stdin passed through); returns its status. A dry
# run prints "+ COMMAND" instead ("+ $_mcjax_stdin | COMMAND" when the caller pipes something in).
_mcjax_exec_one() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local line
  line=$(_mcjax_host_line "$1" "$2") || return 1
  if [ "$MCJAX_DRY_RUN" = 1 ]; then
    printf '+ %s%s\n' "${_mcjax_stdin:+$_mcjax_stdin | }" "$line"
    return 0
  fi
  eval "$line"
}

# _mcjax_exec_retry I CMD: _mcjax_exec_one for a host of a parallel cluster_exec (stdin is
# /dev/null there). gcloud keeps its credentials in a local SQLite database: several `gcloud ...
# ssh` at once may fail with "database is locked" before they reach the host, so such a call is
# made again (MCJAX_GCLOUD_RETRIES tries in all, a few seconds apart); any other failure is final.
_mcjax_exec_retry() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local i=$1 cmd=$2 try=1 rc err
  if [ "${MCJAX_TRANSPORT:-$MCJAX_PROVIDER}" != gcloud ]; then
    _mcjax_exec_one "$i" "$cmd"
    return
  fi
  err=$(mktemp "${TMPDIR:-/tmp}/mcjax_gcloud.XXXXXX") || return 1
  while :; do
    rc=0
    _mcjax_exec_one "$i" "$cmd" 2>"$err" || rc=$?
    if [ "$rc" -ne 0 ] && [ "$try" -lt "$MCJAX_GCLOUD_RETRIES" ] && grep -q "database is locked" "$err"; then
      echo "gcloud's database was locked (several gcloud at once): trying host $i again" >&2
      try=$((try + 1))
      sleep $((try + i % 3))
      continue
    fi
    cat "$err" >&2
    rm -f "$err"
    return "$rc"
  done
}

# _mcjax_launch NAME FIRST LAST CMD: start the long-running command string CMD on hosts
# FIRST..LAST and return at once. Slurm ends every process of a step when the step ends, so there
# each one runs in a step of its own (srun in the background here, its output in
# $MCJAX_STATE/logs/srun-NAME-<host>.log; MCJAX_SRUN_OPTS for all but the controller, which needs
# no GPU) and CMD must block while its process lives (ipcluster.sh ... run). Elsewhere CMD starts
# a daemon and returns: cluster_exec.
_mcjax_launch() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local name=$1 first=$2 last=$3 cmd=$4 i line log opts=$MCJAX_SRUN_OPTS
  if [ "$MCJAX_PROVIDER" != slurm ]; then
    cluster_exec "$first" "$last" "$cmd"
    return
  fi
  [ "$name" != controller ] || opts=""
  i=$first
  while [ "$i" -le "$last" ]; do
    log="$MCJAX_STATE/logs/srun-$name-$i.log"
    # shellcheck disable=SC2086  # several options
    line=$(_mcjax_srun_line "$i" $opts bash -c "cd || exit 1; export MCJAX_HOST_INDEX=$i; $cmd") || return 1
    line="setsid nohup $line >$(_mcjax_q "$log") 2>&1 </dev/null &"
    if [ "$MCJAX_DRY_RUN" = 1 ]; then
      printf '+ %s\n' "$line"
    else
      mkdir -p "$MCJAX_STATE/logs" && chmod 700 "$MCJAX_STATE" "$MCJAX_STATE/logs" || return 1
      eval "$line"
    fi
    i=$((i + 1))
  done
}

# _mcjax_worker_ips LIST: the workers' addresses from a TPU's worker-network-endpoints LIST (one
# entry per worker, comma-separated), one a line. An entry is name:id:ip, or the worker's address
# alone, or its host name alone: host names are resolved on worker 0 (the VPC's DNS knows them,
# this machine may not), each to the address it has there, which is the one JAX's workers use.
_mcjax_worker_ips() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local entries names line resolved out="" entry ip
  entries=$(printf '%s\n' "$1" | tr ',' '\n' | tr -d ' \t\r' | sed '/^$/d')
  names=$(printf '%s\n' "$entries" | awk -F: 'NF == 1 && $1 !~ /^[0-9.]+$/ && $1 ~ /^[A-Za-z0-9][A-Za-z0-9.-]*$/')
  if [ -n "$names" ]; then
    # One "NAME IP" line per name, IP empty where worker 0 cannot resolve it.
    # shellcheck disable=SC2016  # expanded on worker 0
    line=$(_mcjax_gcloud_ssh_line 0 "--command=for h in $(printf '%s\n' "$names" | tr '\n' ' ')"'; do printf "%s %s\n" "$h" "$(getent ahostsv4 "$h" | awk "NR == 1 { print \$1 }")"; done') || return 1
    resolved=$(eval "$line" 2>/dev/null) || resolved=""
  fi
  for entry in $entries; do
    case "$entry" in
      *:*:*) ip=${entry##*:} ;;
      *:*) ip="" ;;
      *[!0-9.]*) ip=$(printf '%s\n' "$resolved" | awk -v h="$entry" '$1 == h { print $2; exit }') ;;
      *) ip=$entry ;;
    esac
    case "$ip" in
      '' | *[!0-9.]*)
        _mcjax_fail 1 "worker list entry '$entry' of TPU VM '$MCJAX_CLUSTER' gives no IPv4 address (worker 0 could not resolve it): set MCJAX_HOSTS and MCJAX_INTERNAL_IPS"
        return
        ;;
    esac
    out="$out$ip
"
  done
  printf '%s' "$out"
}

# cluster_internal_ips: the hosts' internal IPs, host 0 first, one a line.
cluster_internal_ips() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local ips host ip n line err
  if [ -n "$MCJAX_INTERNAL_IPS" ]; then
    printf '%s\n' "$MCJAX_INTERNAL_IPS" | tr ', \t;' '\n' | sed '/^$/d'
    return 0
  fi
  case "$MCJAX_PROVIDER" in
    gcloud)
      # One entry per worker, as JAX counts them: the worker list in worker 0's metadata. (The
      # TPU's networkEndpoints lists every network interface, several per worker on a TPU with
      # more than one network: never counted.)
      line=$(_mcjax_gcloud_ssh_line 0 "--command=curl -fsS -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/worker-network-endpoints") || return 1
      err=$(mktemp "${TMPDIR:-/tmp}/mcjax_gcloud.XXXXXX") || return 1
      ips=$(eval "$line" 2>"$err") || ips=""
      if [ -z "$ips" ]; then
        tail -n 5 "$err" >&2
        rm -f "$err"
        _mcjax_fail 1 "worker 0 of TPU VM '$MCJAX_CLUSTER' did not give its worker list (metadata worker-network-endpoints): is the TPU VM up, gcloud ssh working (see above)? Or set MCJAX_HOSTS and MCJAX_INTERNAL_IPS"
        return
      fi
      rm -f "$err"
      _mcjax_worker_ips "$ips"
      ;;
    ssh | slurm)
      if [ "$MCJAX_PROVIDER" = ssh ] && [ -z "$MCJAX_HOST_LIST" ]; then
        _mcjax_fail 1 "MCJAX_HOST_LIST is empty (the ssh provider needs the hosts, host 0 first)"
        return
      fi
      host=$(_mcjax_host_lines) || return 1
      for host in $host; do
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
      _mcjax_fail 1 "unknown MCJAX_PROVIDER '$MCJAX_PROVIDER' (gcloud, ssh, slurm or local)"
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
    ssh | slurm)
      n=$(_mcjax_host_lines) || return 1
      printf '%s\n' "$n" | sed '/^$/d' | wc -l | tr -d ' '
      ;;
    *)
      n=$(cluster_internal_ips) || return 1
      printf '%s\n' "$n" | sed '/^$/d' | wc -l | tr -d ' '
      ;;
  esac
}

# cluster_exec FIRST LAST CMD...: run CMD (one string, run by the host's shell) on hosts
# FIRST..LAST, in parallel when there are several, each output line prefixed by "[host i]".
# Returns 0 when every host succeeded, else the exit status of the first failing host (lowest
# index), and names every failing host on stderr, also under `set -e`. With one host, stdin is
# passed through. MCJAX_DRY_RUN=1: prints the command for each host, in order, and runs nothing.
cluster_exec() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  if [ "$#" -lt 3 ]; then
    _mcjax_fail 2 "usage: cluster_exec FIRST LAST CMD..."
    return
  fi
  local first=$1 last=$2 cmd n tmp i rc ret failed cap
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
  if [ "$MCJAX_DRY_RUN" = 1 ]; then
    i=$first
    while [ "$i" -le "$last" ]; do
      _mcjax_exec_one "$i" "$cmd" || return
      i=$((i + 1))
    done
    return 0
  fi
  if [ "$first" -eq "$last" ]; then
    rc=0
    _mcjax_exec_one "$first" "$cmd" || rc=$?
    [ "$rc" -eq 0 ] || _mcjax_fail "$rc" "host $first failed (exit status $rc)" || return
    return 0
  fi
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/mcjax_exec.XXXXXX") || return 1
  # A subshell: no job-control chatter from interactive shells. Every status is caught with `||`,
  # so that a caller's `set -e` cannot end a host's subshell before it wrote its status.
  # gcloud: at most MCJAX_GCLOUD_PARALLEL calls at once (gcloud does not support many parallel
  # runs), in batches; every other transport reaches all hosts at once.
  cap=$((last - first + 1))
  if [ "${MCJAX_TRANSPORT:-$MCJAX_PROVIDER}" = gcloud ] && _mcjax_is_uint "$MCJAX_GCLOUD_PARALLEL" &&
    [ "$MCJAX_GCLOUD_PARALLEL" -gt 0 ]; then
    cap=$MCJAX_GCLOUD_PARALLEL
  fi
  (
    i=$first
    while [ "$i" -le "$last" ]; do
      (
        rc=0
        _mcjax_exec_retry "$i" "$cmd" </dev/null 2>&1 || rc=$?
        echo "$rc" >"$tmp/$i.rc"
      ) | while IFS= read -r line || [ -n "$line" ]; do printf '[host %s] %s\n' "$i" "$line"; done &
      i=$((i + 1))
      [ $(((i - first) % cap)) -ne 0 ] || wait
    done
    wait
  ) || true
  ret=0
  failed=""
  i=$first
  while [ "$i" -le "$last" ]; do
    rc=$(cat "$tmp/$i.rc" 2>/dev/null) || rc=""
    _mcjax_is_uint "$rc" || rc=255  # the host's subshell died before it could tell (killed?)
    if [ "$rc" -ne 0 ]; then
      [ "$ret" -ne 0 ] || ret=$rc
      failed="$failed host $i (exit status $rc),"
    fi
    i=$((i + 1))
  done
  rm -rf "$tmp"
  if [ "$ret" -ne 0 ]; then
    _mcjax_fail "$ret" "failed on${failed%,}" || return
  fi
  return 0
}

# cluster_ssh HOST [CMD...]: an interactive shell (or CMD) on host HOST.
cluster_ssh() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local i=${1:-0} addr line
  [ "$#" -eq 0 ] || shift
  _mcjax_is_uint "$i" || { _mcjax_fail 2 "bad host '$i' (want a host number; usage: cluster_ssh HOST [CMD...])"; return; }
  if [ "$#" -gt 0 ]; then
    _mcjax_exec_one "$i" "$*"
    return
  fi
  case "${MCJAX_TRANSPORT:-$MCJAX_PROVIDER}" in
    local) (cd "$MCJAX_STATE" && MCJAX_HOST_INDEX=$i bash -i) ;;
    ssh)
      addr=$(_mcjax_host_addr "$i") || return 1
      case "$addr" in *@*) ;; *) addr="$MCJAX_USER@$addr" ;; esac
      # shellcheck disable=SC2086
      ssh -t $MCJAX_SSH_OPTS "$addr"
      ;;
    gcloud)
      line=$(_mcjax_gcloud_ssh_line "$i") || return 1
      eval "$line"
      ;;
    slurm)
      line=$(_mcjax_srun_line "$i" --pty bash -i) || return 1
      eval "$line"
      ;;
    *) _mcjax_fail 1 "unknown MCJAX_PROVIDER '$MCJAX_PROVIDER' (gcloud, ssh, slurm or local)" ;;
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
  local src=$1 dest=$2 first=${3:-0} last=${4:-} n i rc ret=0 parent base _mcjax_stdin
  [ -e "$src" ] || { _mcjax_fail 2 "'$src' does not exist"; return; }
  n=$(cluster_host_count) || return 2
  [ -n "$last" ] || last=$((n - 1))
  if [ "$MCJAX_PROVIDER" = local ] && [ "$MCJAX_DRY_RUN" != 1 ]; then
    # The local "hosts" share this machine's disk: one copy (relative paths from the state dir).
    (mkdir -p "$MCJAX_STATE" && cd "$MCJAX_STATE" && mkdir -p "$dest") || return 1
    case "$dest" in /*) ;; *) dest="$MCJAX_STATE/$dest" ;; esac
    cp -R "$src" "$dest/"
    return
  fi
  parent=$(cd "$(dirname "$src")" && pwd) || return 1
  base=$(basename "$src")
  _mcjax_stdin=$(_mcjax_q tar -C "$parent" -czf - "$base")
  i=$first
  while [ "$i" -le "$last" ]; do
    rc=0
    tar -C "$parent" -czf - "$base" | _mcjax_exec_one "$i" "mkdir -p $(_mcjax_q "$dest") && tar -xzf - -C $(_mcjax_q "$dest")" || rc=$?
    if [ "$rc" -ne 0 ]; then
      _mcjax_fail "$rc" "copy to host $i failed (exit status $rc)" || true  # go on with the next host
      [ "$ret" -ne 0 ] || ret=$rc
    fi
    i=$((i + 1))
  done
  return "$ret"
}

# cluster_restart [engines|all|check]: restart the engines (default), or the controller and the
# engines; check: only find out whether a restart could succeed. Nothing is stopped before every
# host has answered that it can start again (host 0: the controller is running, or for `all` can
# be started; hosts 1..N-1: reachable, with their scripts and venv), so a restart that cannot
# succeed leaves the running engines alone. Local provider: the processes ./mcjax_setup.sh --local
# started. Under MCJAX_DRY_RUN=1 it prints the commands.
cluster_restart() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local what=${1:-engines} n last remote
  case "$what" in
    engines | all | check) ;;
    *) _mcjax_fail 2 "unknown argument '$what' (usage: cluster_restart [engines|all|check])"; return ;;
  esac
  if [ "$MCJAX_PROVIDER" = local ]; then
    if [ "$MCJAX_DRY_RUN" = 1 ]; then
      printf '+ %s\n' "$(_mcjax_q bash "$MCJAX_ROOT/cluster/local.sh" restart "$what")"
      return 0
    fi
    bash "$MCJAX_ROOT/cluster/local.sh" restart "$what"
    return
  fi
  n=$(cluster_host_count) || return 1
  last=$((n - 1))
  remote="$(_mcjax_q bash "$MCJAX_REMOTE_DIR/cluster/ipcluster.sh")"
  # A coordinator port asked for here (MCJAX_COORDINATOR_PORT=P cluster_restart) reaches the new
  # processes and cluster.json (each host's mcjax.env keeps the one of setup otherwise).
  if [ -n "$MCJAX_COORDINATOR_PORT" ]; then
    remote="MCJAX_COORDINATOR_PORT=$(_mcjax_q "$MCJAX_COORDINATOR_PORT") $remote"
  fi
  if [ "$what" = check ]; then
    cluster_exec 0 0 "$remote controller check engines" && cluster_exec 1 "$last" "$remote engine check"
    return
  fi
  if ! cluster_exec 0 0 "$remote controller check $what" || ! cluster_exec 1 "$last" "$remote engine check"; then
    _mcjax_fail 1 "a restart could not succeed (see above): nothing was stopped"
    return
  fi
  cluster_exec 1 "$last" "$remote engine stop" || return
  if [ "$what" = all ]; then
    if [ "$MCJAX_PROVIDER" = slurm ]; then
      cluster_exec 0 0 "$remote controller stop" || return
      _mcjax_launch controller 0 0 "$remote controller run" || return
      cluster_exec 0 0 "$remote controller wait" || return
    else
      cluster_exec 0 0 "$remote controller restart" || return
    fi
  fi
  if [ "$MCJAX_PROVIDER" = slurm ]; then
    _mcjax_launch engine 1 "$last" "$remote engine run" || return
  else
    cluster_exec 1 "$last" "$remote engine start" || return
  fi
  cluster_exec 0 0 "$remote wait $last"
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
  cluster_exec 0 $((n - 1)) "$(_mcjax_q bash "$MCJAX_REMOTE_DIR/cluster/ipcluster.sh") status"
}

# cluster_port_forward [LOCAL_PORT [REMOTE_PORT]]: forward 127.0.0.1:LOCAL_PORT here to
# 127.0.0.1:REMOTE_PORT on host 0 (default: Jupyter's port, MCJAX_JUPYTER_PORT, for both; a taken
# port here needs only another LOCAL_PORT). Blocks; Ctrl-C ends it. Both ends are bound to
# localhost: nothing is exposed on the network.
cluster_port_forward() {
  [ -z "${ZSH_VERSION:-}" ] || emulate -L ksh
  local port=${1:-$MCJAX_JUPYTER_PORT} remote=${2:-$MCJAX_JUPYTER_PORT} addr line
  _mcjax_is_uint "$port" || { _mcjax_fail 2 "bad port '$port' (usage: cluster_port_forward [LOCAL_PORT [REMOTE_PORT]])"; return; }
  _mcjax_is_uint "$remote" || { _mcjax_fail 2 "bad port '$remote' (usage: cluster_port_forward [LOCAL_PORT [REMOTE_PORT]])"; return; }
  echo "forwarding http://127.0.0.1:$port -> host 0 127.0.0.1:$remote (Ctrl-C to stop)"
  case "$MCJAX_PROVIDER" in
    local)
      echo "local provider: Jupyter runs on this machine, nothing to forward"
      ;;
    ssh | slurm)
      # slurm: from a login node that may ssh to the nodes of your job (pam_slurm_adopt); from
      # your own machine add -J LOGIN_NODE to MCJAX_SSH_OPTS.
      addr=$(_mcjax_host_addr 0) || return 1
      case "$addr" in *@*) ;; *) addr="$MCJAX_USER@$addr" ;; esac
      # shellcheck disable=SC2086
      ssh -N $MCJAX_SSH_OPTS -L "127.0.0.1:$port:127.0.0.1:$remote" "$addr"
      ;;
    gcloud)
      line=$(_mcjax_gcloud_ssh_line 0 -- -N -L "127.0.0.1:$port:127.0.0.1:$remote") || return 1
      eval "$line"
      ;;
    *) _mcjax_fail 1 "unknown MCJAX_PROVIDER '$MCJAX_PROVIDER' (gcloud, ssh, slurm or local)" ;;
  esac
}
