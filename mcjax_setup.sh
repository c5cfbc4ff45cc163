#!/usr/bin/env bash
# mcjax_setup.sh: prepare a cluster for the multi-host JAX notebook (settings: mcjax_defs.sh).
# ./mcjax_setup.sh --help prints the usage: the text of usage() below.
set -euo pipefail

SETUP_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ALL_STEPS="check push keys nfs gcsfuse code venv ipcluster jupyter smoke"

usage() {
  cat <<'EOF'
mcjax_setup.sh: prepare a cluster for the multi-host JAX notebook (settings: mcjax_defs.sh).

  ./mcjax_setup.sh [--steps LIST] [--dry-run]   set up the cluster of $MCJAX_PROVIDER (gcloud, ssh or slurm)
                                                and record it in $MCJAX_STATE/setup.env
  ./mcjax_setup.sh --local N [--numbering M]    a simulated cluster here: controller + N-1 engines on 127.0.0.1;
                                                M: kernel-last (default: the kernel is process N-1) or platform
                                                (Slurm-style variables, JAX numbers the processes, kernel = 0)
  ./mcjax_setup.sh --single                     this one machine's accelerators (a one-host TPU VM, one GPU box, or
                                                this CPU machine): no controller, no engines; records it in
                                                $MCJAX_STATE/single.env and starts Jupyter with MCJAX_SINGLE=1
  ./mcjax_setup.sh --stop [--dry-run]           stop the cluster that $MCJAX_STATE records: the local cluster
                                                started with it, or the real cluster set up from it (its
                                                controller, engines and Jupyter); never one chosen by
                                                $MCJAX_PROVIDER, and nothing when the folder records none
  ./mcjax_setup.sh --status                     the same choice: the cluster $MCJAX_STATE records
  ./mcjax_setup.sh --check                      the smoke check of that cluster (setup's last step): every engine
                                                imports dsr1, versions against the lock, one psum across all
                                                processes; a report per host, exit status 1 on any mismatch
  ./mcjax_setup.sh --stop|--status --provider P the cluster that the MCJAX_* settings describe, with provider P
                                                (a cluster set up from another machine or state folder)
  ./mcjax_setup.sh --name NAME ...              any of the above for the cluster NAME: its own state folder
                                                $MCJAX_STATE/clusters/NAME (and cluster id), so several clusters
                                                are kept side by side; on the hosts ~/.mcjax-setup-NAME and
                                                host 0's key ~/.ssh/mcjax_ed25519-NAME (homes may be shared)
  ./mcjax_setup.sh --forget                     forget the real cluster $MCJAX_STATE records (hosts gone: allocation
                                                ended, TPU deleted), after printing what it forgets; stops nothing
  ./mcjax_setup.sh --local-stop                 stop the local cluster of $MCJAX_STATE
  ./mcjax_setup.sh --print-exports              print the NFS export lines host 0 would get (changes nothing)
  ./mcjax_setup.sh --print-env                  print the settings file (mcjax.env) the hosts would get
  ./mcjax_setup.sh --help                       this text

--dry-run prints every command that would reach a host, one a line ("+ COMMAND"), and runs none
(it still asks the provider for the hosts unless MCJAX_HOSTS and MCJAX_INTERNAL_IPS are set).
--provider P sets MCJAX_PROVIDER for setup, --print-env and --print-exports too.

Steps (default: all, in this order; every one is idempotent, so rerunning setup is safe):
  check      the provider's tools, the hosts, their internal IPs, the same uid and gid everywhere
  push       copy mcjax_defs.sh, cluster/ and the settings (mcjax.env) to ~/$MCJAX_REMOTE_DIR on every host
  keys       an ssh key on host 0 that every host accepts (from host 0's address only; --stop removes
             it), so cluster_restart runs on host 0 (gcloud, ssh)
  nfs        host 0 exports $MCJAX_NFS_DIR to the hosts' internal IPs only; the others mount it (fstab);
             a shared file system (MCJAX_SHARED_FS=1; slurm's default): checks that every host sees it
  gcsfuse    mount gs://$MCJAX_BUCKET on $MCJAX_BUCKET_DIR on every host (skipped when MCJAX_BUCKET is empty)
  code       copy this repository (without .git, ._*) to $MCJAX_REPO_DIR on the shared folder; files
             it no longer has are deleted there (only those an earlier copy brought)
  venv       uv, the host's Python >= $MCJAX_HOST_PYTHON (else uv's CPython), a venv $MCJAX_VENV per host with
             dsr1[notebook] (+ $MCJAX_JAX_SPEC), all from the package index of pip's settings
  ipcluster  ipyparallel controller on host 0 (bound to its internal IP), one engine on hosts 1..N-1
  jupyter    Jupyter on host 0, bound to 127.0.0.1 (reach it with cluster_port_forward)
  smoke      the smoke check (./mcjax_setup.sh --check): imports, versions, one psum across every process
EOF
}

# Errors: the convention of mcjax_defs.sh ("Errors"); the same two functions as cluster/common.sh,
# which this script does not source.
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

step() {
  printf '\n==> %s\n' "$*"
}

steps=$ALL_STEPS
mode=setup
name=""
local_n=""
numbering=""
provider=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --local)
      [ "$#" -ge 2 ] || mcjax_usage_error "--local needs N, the number of processes"
      mode=local; local_n=$2; shift ;;
    --local=*) mode=local; local_n=${1#--local=} ;;
    --single) mode=single ;;
    --numbering)
      [ "$#" -ge 2 ] || mcjax_usage_error "--numbering needs kernel-last or platform"
      numbering=$2; shift ;;
    --numbering=*) numbering=${1#--numbering=} ;;
    --provider)
      [ "$#" -ge 2 ] || mcjax_usage_error "--provider needs gcloud, ssh, slurm or local"
      provider=$2; shift ;;
    --provider=*) provider=${1#--provider=} ;;
    --stop) mode=stop ;;
    --forget) mode=forget ;;
    --name)
      [ "$#" -ge 2 ] || mcjax_usage_error "--name needs NAME"
      name=$2; shift ;;
    --name=*) name=${1#--name=} ;;
    --local-stop) mode=local-stop ;;
    --status) mode=status ;;
    --check) mode=check ;;
    --print-exports) mode=exports ;;
    --print-env) mode=print-env ;;
    --steps)
      [ "$#" -ge 2 ] || mcjax_usage_error "--steps needs a LIST, e.g. --steps push,code,venv"
      steps=$(echo "$2" | tr ',' ' '); shift ;;
    --steps=*) steps=$(echo "${1#--steps=}" | tr ',' ' ') ;;
    --dry-run) export MCJAX_DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    *) mcjax_usage_error "unknown argument '$1'" ;;
  esac
  shift
done

if [ "$mode" = local ] && ! { [[ $local_n =~ ^[0-9]+$ ]] && [ "$local_n" -ge 2 ]; }; then
  mcjax_usage_error "--local needs N >= 2 (a controller and N-1 engines, plus the notebook kernel), not '$local_n'"
fi
if [ -n "$numbering" ]; then
  [ "$mode" = local ] || mcjax_usage_error "--numbering goes with --local N (a real cluster's numbering is its platform's)"
  case "$numbering" in
    kernel-last | platform) ;;
    *) mcjax_usage_error "--numbering takes kernel-last or platform, not '$numbering'" ;;
  esac
fi
if [ -n "$name" ]; then
  [[ $name =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ ]] || mcjax_usage_error "--name takes letters, digits, '.', '_' and '-', not '$name'"
  # The named cluster's own state folder (and cluster id): its record, pid files and logs.
  export MCJAX_STATE="${MCJAX_STATE:-$HOME/.mcjax}/clusters/$name"
  export MCJAX_CLUSTER_ID="${MCJAX_CLUSTER_ID:-$name}"
fi
case "$provider" in
  '' | gcloud | ssh | slurm | local) ;;
  *) mcjax_usage_error "--provider takes gcloud, ssh, slurm or local, not '$provider'" ;;
esac
if [ -n "$provider" ] && { [ "$mode" = local ] || [ "$mode" = single ]; }; then
  mcjax_usage_error "--provider does not go with --$mode"
fi
if [ "$mode" = setup ]; then
  for s in $steps; do
    case " $ALL_STEPS " in *" $s "*) ;; *) mcjax_usage_error "unknown step '$s' (steps: $ALL_STEPS)" ;; esac
  done
fi

# The state folder holds at most one cluster: local.env for a local one (cluster/local.sh), setup.env
# for a real one set up from here. --stop and --status act on that cluster, whatever MCJAX_PROVIDER
# says (it may well be exported for another cluster), so that a caller's exit trap stops its own.
STATE=${MCJAX_STATE:-$HOME/.mcjax}
RECORD="$STATE/setup.env"
# A cluster.json field ("provider", "cluster_id") of the state folder, or nothing.
recorded_field() {
  [ -f "$STATE/cluster.json" ] || return 0
  sed -n "s/^ *\"$1\": *\"\([^\"]*\)\".*/\1/p" "$STATE/cluster.json" | sed -n 1p
}
# A host of a real cluster: its processes' pid files and a cluster.json naming another provider than
# local, without setup.env (which is on the machine that set the cluster up).
host_of_real_cluster() {
  local p
  [ ! -f "$STATE/local.env" ] && [ ! -f "$RECORD" ] || return 1
  p=$(recorded_field provider)
  [ -n "$p" ] && [ "$p" != local ]
}
local_recorded() {
  [ -f "$STATE/local.env" ] || { [ ! -f "$RECORD" ] && ! host_of_real_cluster && compgen -G "$STATE/pids/*.pid" >/dev/null; }
}

SINGLE="$STATE/single.env"
# MCJAX_PROVIDER, MCJAX_CLUSTER, ... of the record, one line: which cluster it is.
recorded_identity() {
  (
    for var in $(compgen -v MCJAX_); do case "$var" in MCJAX_STATE) ;; *) unset "$var" ;; esac; done
    # shellcheck source=/dev/null
    . "$RECORD"
    identity
  )
}
identity() {
  echo "$MCJAX_PROVIDER cluster=$MCJAX_CLUSTER zone=$MCJAX_ZONE project=$MCJAX_PROJECT hosts=$MCJAX_HOST_LIST job=$MCJAX_SLURM_JOB_ID"
}
case "$mode" in
  forget)
    if [ ! -f "$RECORD" ]; then
      echo "mcjax_setup.sh: MCJAX_STATE=$STATE records no real cluster: nothing to forget"
      exit 0
    fi
    echo "mcjax_setup.sh: forgetting the cluster MCJAX_STATE=$STATE records (nothing is stopped; if its hosts still run, stop them yourself):"
    (
      for var in $(compgen -v MCJAX_); do case "$var" in MCJAX_STATE) ;; *) unset "$var" ;; esac; done
      # shellcheck source=/dev/null
      . "$RECORD"
      echo "  provider $MCJAX_PROVIDER, cluster id $MCJAX_CLUSTER_ID"
      [ -z "$MCJAX_CLUSTER" ] || [ "$MCJAX_PROVIDER" != gcloud ] || echo "  TPU VM $MCJAX_CLUSTER (zone ${MCJAX_ZONE:-default}, project ${MCJAX_PROJECT:-default})"
      [ -z "$MCJAX_HOST_LIST" ] || echo "  hosts $MCJAX_HOST_LIST"
      [ -z "$MCJAX_INTERNAL_IPS" ] || echo "  internal IPs $MCJAX_INTERNAL_IPS"
      [ -z "$MCJAX_SLURM_JOB_ID" ] || [ "$MCJAX_PROVIDER" != slurm ] || echo "  Slurm job $MCJAX_SLURM_JOB_ID"
    )
    rm -f "$RECORD"
    echo "mcjax_setup.sh: removed $RECORD"
    exit 0
    ;;
  single)
    if [ "${MCJAX_DRY_RUN:-0}" = 1 ]; then
      printf '+ %s\n' "bash $SETUP_DIR/cluster/single.sh start"
      exit 0
    fi
    exec bash "$SETUP_DIR/cluster/single.sh" start
    ;;
  local)
    [ ! -f "$SINGLE" ] || mcjax_die "MCJAX_STATE=$STATE records this machine's single-host workbench: stop it first (./mcjax_setup.sh --stop) or use another MCJAX_STATE"
    [ ! -f "$RECORD" ] || mcjax_die "MCJAX_STATE=$STATE records the $(sed -n '/MCJAX_PROVIDER=/{s/.*MCJAX_PROVIDER=\([a-z]*\).*/\1/p;q;}' "$RECORD") cluster set up from here: use another MCJAX_STATE for a local cluster (or stop that one first: ./mcjax_setup.sh --stop)"
    [ -z "$numbering" ] || export MCJAX_NUMBERING="$numbering"
    exec bash "$SETUP_DIR/cluster/local.sh" start "$local_n"
    ;;
  local-stop) exec bash "$SETUP_DIR/cluster/local.sh" stop ;;
  stop | status | check)
    if [ -z "$provider" ] && [ -f "$SINGLE" ]; then
      if [ "$mode" = check ]; then
        echo "mcjax_setup.sh: MCJAX_STATE=$STATE records a single machine: no engines to check (the notebook's first cells check this process)"
        exit 0
      fi
      if [ "${MCJAX_DRY_RUN:-0}" = 1 ]; then
        printf '+ %s\n' "bash $SETUP_DIR/cluster/single.sh $mode"
        exit 0
      fi
      exec bash "$SETUP_DIR/cluster/single.sh" "$mode"
    fi
    if [ -z "$provider" ] && host_of_real_cluster; then
      mcjax_die "MCJAX_STATE=$STATE is a host's of the $(recorded_field provider) cluster '$(recorded_field cluster_id)' (its cluster.json), not a local cluster: --$mode it from the machine that set it up (./mcjax_setup.sh --$mode there, with the same --name)"
    fi
    if [ "$provider" = local ] || { [ -z "$provider" ] && local_recorded; }; then
      local_cmd=$mode
      [ "$mode" != check ] || local_cmd=smoke
      if [ "${MCJAX_DRY_RUN:-0}" = 1 ]; then
        printf '+ %s\n' "bash $SETUP_DIR/cluster/local.sh $local_cmd"
        exit 0
      fi
      exec bash "$SETUP_DIR/cluster/local.sh" "$local_cmd"
    fi
    if [ -z "$provider" ]; then
      if [ ! -f "$RECORD" ]; then
        echo "mcjax_setup.sh: MCJAX_STATE=$STATE records no cluster: nothing to $mode (a cluster set up elsewhere: --$mode --provider P)"
        [ "$mode" = stop ] && exit 0
        exit 1
      fi
      # The recorded settings, not the environment's: only the state folder and --dry-run stay.
      for var in $(compgen -v MCJAX_); do
        case "$var" in MCJAX_STATE | MCJAX_DRY_RUN) ;; *) unset "$var" ;; esac
      done
      # shellcheck source=/dev/null
      . "$RECORD"
    fi
    ;;
esac
if [ -n "$provider" ]; then
  export MCJAX_PROVIDER="$provider"
fi

# shellcheck source-path=SCRIPTDIR source=mcjax_defs.sh
. "$SETUP_DIR/mcjax_defs.sh"
if [ "$MCJAX_PROVIDER" = local ] && [ "$mode" != exports ]; then
  mcjax_die "MCJAX_PROVIDER=local: use ./mcjax_setup.sh --local N"
fi

# remote SCRIPT ARGS...: the command line that runs cluster/SCRIPT on a host (from ~/$MCJAX_REMOTE_DIR).
remote() {
  local script=$1
  shift
  _mcjax_q bash "$MCJAX_REMOTE_DIR/cluster/$script" "$@"
}

if [ "$mode" = exports ]; then
  # shellcheck disable=SC2046  # one argument per IP
  exec bash "$SETUP_DIR/cluster/nfs.sh" exports $(cluster_internal_ips)
fi

if [ "$MCJAX_PROVIDER" = slurm ] && [ -z "$MCJAX_HOST_LIST" ]; then
  MCJAX_HOST_LIST=$(_mcjax_host_lines | tr '\n' ' ' | sed 's/ $//') || mcjax_die "cannot list the allocation's nodes"
fi
# The IPs first: a TPU's host count is its worker list's length (asked of worker 0 once).
IPS=$(cluster_internal_ips) || mcjax_die "cannot get the hosts' internal IPs"
[ -n "$MCJAX_INTERNAL_IPS" ] || MCJAX_INTERNAL_IPS=$(echo "$IPS" | tr '\n' ' ' | sed 's/ $//')
N=$(cluster_host_count) || mcjax_die "cannot tell how many hosts the cluster has"
[ "$(echo "$IPS" | wc -l)" -eq "$N" ] || mcjax_die "$N hosts but $(echo "$IPS" | wc -l) internal IPs: $(echo "$IPS" | tr '\n' ' ')"
HOST0_IP=${IPS%%$'\n'*}  # the first line, without a pipe into head (SIGPIPE under pipefail)
LAST=$((N - 1))
# Asked once: every cluster_* call below uses these instead of asking the provider again.
MCJAX_HOSTS=$N
MCJAX_INTERNAL_IPS=$(echo "$IPS" | tr '\n' ' ' | sed 's/ $//')
export MCJAX_HOSTS MCJAX_INTERNAL_IPS MCJAX_HOST_LIST

# How host 0 reaches the other hosts (cluster_restart, reset_engines run there): over ssh to their
# internal IPs, with the key the `keys` step makes and the host keys it collected (no prompt, no
# trust on first use). Slurm: srun, as from here.
# shellcheck disable=SC2088  # ssh expands the ~ (on host 0)
HOST_KEY="~/.ssh/mcjax_ed25519$(mcjax_cluster_tag)"
HOST_SSH_OPTS="-i $HOST_KEY -o IdentitiesOnly=yes -o UserKnownHostsFile=~/.ssh/mcjax_known_hosts$(mcjax_cluster_tag) -o StrictHostKeyChecking=yes -o BatchMode=yes -o ConnectTimeout=$MCJAX_CONNECT_TIMEOUT -o ServerAliveInterval=15 -o ServerAliveCountMax=4"

# The hosts' internal IPs as host 0 addresses them (user@IP where the host list names a user).
host_side_list() {
  local i=0 ip entry out=""
  for ip in $IPS; do
    entry=""
    if [ "$MCJAX_PROVIDER" = ssh ]; then entry=$(_mcjax_host_addr "$i"); fi
    case "$entry" in *@*) ip="${entry%%@*}@$ip" ;; esac
    out="$out $ip"
    i=$((i + 1))
  done
  echo "${out# }"
}

NOTEBOOK_SETTINGS="DSR1_CHECKPOINT DSR1_API_KEY"  # set here: into mcjax.env, for host 0's Jupyter
# write_env hosts|record: the settings as shell assignments. hosts: mcjax.env, which every host gets
# in ~/$MCJAX_REMOTE_DIR: defaults there, so a variable set in a host's own environment wins; paths
# under $HOME are taken under each host's home. record: setup.env in the state folder here, what
# --stop and --status use (read with every MCJAX_* variable unset, so it is what counts).
write_env() {
  local kind=$1 var value vars=$MCJAX_SETTINGS
  echo "# written by mcjax_setup.sh ($kind); sourced by cluster/common.sh (hosts) or mcjax_setup.sh --stop (record)"
  # The notebooks' settings given here reach the kernel on host 0 (serve.ipynb, main.ipynb).
  if [ "$kind" = hosts ]; then
    for var in $NOTEBOOK_SETTINGS; do [ -z "${!var:-}" ] || vars="$vars $var"; done
    # The proxies and package index set here (MCJAX_FORWARD_ENV): ssh and gcloud do not pass them on.
    vars="$vars $(_mcjax_forward_names | tr '\n' ' ')"
  fi
  for var in $vars; do
    value=${!var}
    if [ "$kind" = hosts ]; then
      case "$MCJAX_PROVIDER:$var" in
        slurm:MCJAX_TRANSPORT) value="" ;;
        *:MCJAX_TRANSPORT) value=ssh ;;
        gcloud:MCJAX_HOST_LIST | ssh:MCJAX_HOST_LIST) value=$(host_side_list) ;;
        gcloud:MCJAX_SSH_OPTS | ssh:MCJAX_SSH_OPTS) value=$HOST_SSH_OPTS ;;
        gcloud:MCJAX_USER)
          # The user gcloud logs in as: the host's own.
          # shellcheck disable=SC2016  # expanded on the host
          printf '[ -n "${MCJAX_USER+x}" ] || MCJAX_USER=$(id -un); export MCJAX_USER\n'
          continue
          ;;
      esac
    fi
    if [ "${value#"$HOME"/}" != "$value" ]; then
      # shellcheck disable=SC2016  # $HOME is expanded on the host
      printf '[ -n "${%s+x}" ] || %s="$HOME"/%q; export %s\n' "$var" "$var" "${value#"$HOME"/}" "$var"
    else
      # shellcheck disable=SC2016
      printf '[ -n "${%s+x}" ] || %s=%q; export %s\n' "$var" "$var" "$value" "$var"
    fi
  done
}

dry() { [ "$MCJAX_DRY_RUN" = 1 ]; }

# What the code step leaves out of the repository: git, venvs, caches, build output, training runs,
# checkpoints and macOS metadata (._* files; COPYFILE_DISABLE keeps macOS's tar from adding them for
# extended attributes).
CODE_EXCLUDES=(.git .venv venv .mcjax __pycache__ '*.egg-info' '._*' .DS_Store runs checkpoints .ipynb_checkpoints
  .pytest_cache build dist .whl)
CODE_MAX_MB=100  # a file over this is weights, wherever it sits (the demo model, which dsr1 ships, is 21 MB)

# The code step's tar command line, in the array CODE_TAR: CODE_EXCLUDES, and each file over
# CODE_MAX_MB, named on stderr.
code_archive() {
  local f
  CODE_TAR=(tar -C "$SETUP_DIR")
  for f in "${CODE_EXCLUDES[@]}"; do CODE_TAR+=("--exclude=$f"); done
  while IFS= read -r f; do
    printf 'code: leaving out %s (over %s MB: weights belong on the shared folder or in a bucket)\n' "$f" "$CODE_MAX_MB" >&2
    CODE_TAR+=("--exclude=$f")
  done < <(cd "$SETUP_DIR" && find . \( -name .git -o -name .venv -o -name venv -o -name runs -o -name checkpoints \) \
    -prune -o -type f -size +"$CODE_MAX_MB"M -print)
  CODE_TAR+=(-czf - .)
}

# True for an IPv4 address of a private range (RFC 1918, carrier-grade NAT, loopback, link-local):
# what the controller, JAX's coordinator and NFS may listen on.
private_ip() {
  local a b rest
  IFS=. read -r a b rest <<<"$1"
  _mcjax_is_uint "$a" && _mcjax_is_uint "$b" || return 1
  case "$a" in
    10 | 127) return 0 ;;
    172) [ "$b" -ge 16 ] && [ "$b" -le 31 ] ;;
    192) [ "$b" -eq 168 ] ;;
    100) [ "$b" -ge 64 ] && [ "$b" -le 127 ] ;;
    169) [ "$b" -eq 254 ] ;;
    *) return 1 ;;
  esac
}

# Where host 0's key is accepted from (authorized_keys' from=): MCJAX_KEY_FROM, else host 0's
# internal IP, the address it reaches the others from; "off": anywhere.
key_from() {
  case "$MCJAX_KEY_FROM" in
    off) echo "" ;;
    '') echo "$HOST0_IP" ;;
    *) echo "$MCJAX_KEY_FROM" ;;
  esac
}

# The smoke check on host 0 (where the kernel runs). Slurm: in a step with MCJAX_SRUN_OPTS, as the
# engines and Jupyter get, so that its JAX process sees the node's GPUs.
run_smoke() {
  local cmd line
  cmd=$(remote ipcluster.sh smoke)
  if [ "$MCJAX_PROVIDER" != slurm ] || [ -z "$MCJAX_SRUN_OPTS" ]; then
    cluster_exec 0 0 "$cmd"
    return
  fi
  # shellcheck disable=SC2086  # several options
  line=$(_mcjax_srun_line 0 $MCJAX_SRUN_OPTS bash -c "cd || exit 1; export MCJAX_HOST_INDEX=0; $cmd") || return 1
  if dry; then printf '+ %s\n' "$line"; else eval "$line"; fi
}

case "$mode" in
  print-env) write_env hosts; exit ;;
  status) cluster_status; exit ;;
  check)
    step "check: the smoke check of the $MCJAX_PROVIDER cluster '$MCJAX_CLUSTER_ID' (on host 0)"
    run_smoke || mcjax_die "the smoke check failed (see the report above)"
    exit 0
    ;;
  stop)
    if [ "$MCJAX_PROVIDER" = slurm ]; then what=""; else what="; host 0's key removed from every host"; fi
    if [ "$MCJAX_SHARED_FS" != 1 ]; then what="$what; the NFS mounts, their fstab lines and host 0's exports removed"; fi
    step "stop: Jupyter and the controller on host 0, the engines on hosts 1..$LAST$what ($MCJAX_PROVIDER cluster '$MCJAX_CLUSTER_ID')"
    rc=0
    [ "$N" -lt 2 ] || cluster_exec 1 "$LAST" "$(remote ipcluster.sh engine stop)" || rc=$?
    cluster_exec 0 0 "$(remote ipcluster.sh jupyter stop) && $(remote ipcluster.sh controller stop)" || rc=$?
    # Host 0's key (setup's keys step) is no longer accepted anywhere.
    if [ "$rc" -eq 0 ] && [ "$MCJAX_PROVIDER" != slurm ]; then
      cluster_exec 0 "$LAST" "$(remote ssh.sh unauthorize)" || rc=$?
    fi
    # The shared folder host 0 exported (setup's nfs step): the others' mounts and fstab lines, then
    # the exports (the folder's files stay on host 0).
    if [ "$rc" -eq 0 ] && [ "$MCJAX_SHARED_FS" != 1 ]; then
      [ "$N" -lt 2 ] || cluster_exec 1 "$LAST" "$(remote nfs.sh unmount "$HOST0_IP")" || rc=$?
      [ "$rc" -ne 0 ] || cluster_exec 0 0 "$(remote nfs.sh unexport)" || rc=$?
    fi
    if [ "$rc" -ne 0 ]; then
      mcjax_die "stopping failed on some hosts (see above); $RECORD kept: run --stop again (hosts gone for good: --forget)"
    fi
    if ! dry && [ -f "$RECORD" ] && [ -z "$provider" ]; then
      rm -f "$RECORD"
    fi
    exit 0
    ;;
esac

# Setup: this state folder now records this cluster (before anything is started, so that --stop
# finds what a failed setup left).
if ! dry; then
  [ ! -f "$STATE/local.env" ] || mcjax_die "MCJAX_STATE=$STATE holds a local cluster: stop it (./mcjax_setup.sh --stop) or use another MCJAX_STATE"
  [ ! -f "$SINGLE" ] || mcjax_die "MCJAX_STATE=$STATE holds a single-machine workbench: stop it (./mcjax_setup.sh --stop) or use another MCJAX_STATE"
  mkdir -p "$STATE"
  chmod 700 "$STATE"
  if [ -f "$RECORD" ] && [ "$(recorded_identity)" != "$(identity)" ]; then
    mcjax_die "MCJAX_STATE=$STATE records another cluster ($(recorded_identity)): stop it (./mcjax_setup.sh --stop), forget it if its hosts are gone (--forget), or keep both: --name NAME"
  fi
  (umask 077 && write_env record >"$RECORD.tmp" && mv "$RECORD.tmp" "$RECORD")
fi

for s in $steps; do
  case "$s" in
    check)
      step "check: provider $MCJAX_PROVIDER, $N hosts"
      case "$MCJAX_PROVIDER" in
        gcloud) command -v gcloud >/dev/null || mcjax_die "gcloud is not installed (https://cloud.google.com/sdk)" ;;
        ssh) command -v ssh >/dev/null || mcjax_die "ssh is not installed" ;;
        slurm) command -v srun >/dev/null || mcjax_die "srun is not on PATH (run this inside a Slurm allocation)" ;;
        *) mcjax_die "unknown MCJAX_PROVIDER '$MCJAX_PROVIDER' (gcloud, ssh, slurm or local)" ;;
      esac
      [ "$N" -ge 2 ] || mcjax_die "a cluster needs at least 2 hosts (host 0: controller + kernel; hosts 1..N-1: engines), this one has $N: for one machine (a TPU VM such as a v6e-8, one GPU box) run ./mcjax_setup.sh --single on it"
      i=0
      for ip in $IPS; do
        echo "  host $i: internal IP $ip"
        if ! private_ip "$ip"; then
          echo "mcjax_setup.sh: warning: host $i's address $ip is public: the controller, JAX's coordinator (no authentication) and NFS (cleartext) would be reached over it; set MCJAX_INTERNAL_IPS to private addresses (or a VPN's) and firewall the ports (cluster/README.md)" >&2
        fi
        i=$((i + 1))
      done
      # The same uid and gid everywhere: the shared folder's files (connection files, the code, the
      # compilation cache) are created by one host and read by the others.
      # shellcheck disable=SC2016  # expanded on each host
      ids=$(cluster_exec 0 "$LAST" 'echo "mcjax-id $(id -un) $(id -u):$(id -g) $(hostname) $(uname -sm | tr " " _) $(nproc)"') ||
        { printf '%s\n' "$ids"; mcjax_die "some hosts did not answer (see above)"; }
      if dry; then
        printf '%s\n' "$ids"
      else
        printf '%s\n' "$ids" | awk '$3 == "mcjax-id" { printf "  host %s %s: user %s, uid:gid %s, %s, %s cores\n", substr($2, 1, length($2) - 1), $6, $4, $5, $7, $8 }'
        ref=$(printf '%s\n' "$ids" | awk '$1 == "[host" && $2 == "0]" && $3 == "mcjax-id" { print $4, $5 }')
        bad=$(printf '%s\n' "$ids" | awk -v ref="$ref" '$3 == "mcjax-id" && ($4 " " $5) != ref { printf "host %s has %s %s, ", substr($2, 1, length($2) - 1), $4, $5 }')
        [ -z "$bad" ] || mcjax_die "the user differs between hosts: host 0 has $ref but ${bad%, }; the shared folder needs the same user, uid and gid on every host (OS Login / LDAP, or create the user with the same ids)"
      fi
      ;;
    push)
      step "push: scripts and settings to ~/$MCJAX_REMOTE_DIR on every host"
      if dry; then
        echo "# STAGE: a new temporary folder holding $MCJAX_REMOTE_DIR/{mcjax_defs.sh,cluster/*.sh,mcjax.env} (mcjax.env: see --print-env)"
        _mcjax_stdin=$(_mcjax_q tar -C STAGE -czf - "$MCJAX_REMOTE_DIR")
        for i in $(seq 0 "$LAST"); do _mcjax_exec_one "$i" "mkdir -p . && tar -xzf - -C ."; done
        unset _mcjax_stdin
        continue
      fi
      stage=$(mktemp -d "${TMPDIR:-/tmp}/mcjax_push.XXXXXX")
      trap 'rm -rf "$stage"' EXIT
      mkdir -p "$stage/$MCJAX_REMOTE_DIR/cluster"
      cp "$SETUP_DIR/mcjax_defs.sh" "$stage/$MCJAX_REMOTE_DIR/"
      cp "$SETUP_DIR"/cluster/*.sh "$stage/$MCJAX_REMOTE_DIR/cluster/"
      (umask 077 && write_env hosts >"$stage/$MCJAX_REMOTE_DIR/mcjax.env")
      for i in $(seq 0 "$LAST"); do
        tar -C "$stage" -czf - "$MCJAX_REMOTE_DIR" | _mcjax_exec_one "$i" "mkdir -p . && tar -xzf - -C ." ||
          mcjax_die "copying the scripts to host $i failed"
      done
      ;;
    keys)
      if [ "$MCJAX_PROVIDER" = slurm ]; then
        step "keys: skipped (slurm: host 0 reaches the nodes with srun)"
        continue
      fi
      step "keys: host 0's ssh key ($HOST_KEY), accepted by every host, with their host keys as host 0 knows them"
      out=$(cluster_exec 0 0 "$(remote ssh.sh key)") || { printf '%s\n' "$out"; mcjax_die "making host 0's ssh key failed"; }
      if dry; then
        printf '%s\n' "$out"
        pub='<host 0 public key>'
      else
        pub=$(printf '%s\n' "$out" | grep -E '^(ssh-|ecdsa-)' | tail -n 1)
        [ -n "$pub" ] || mcjax_die "host 0 gave no public key: $out"
      fi
      out=$(cluster_exec 0 "$LAST" "$(remote ssh.sh hostkey)") ||
        { printf '%s\n' "$out"; mcjax_die "reading the hosts' ssh host keys failed"; }
      if dry; then
        printf '%s\n' "$out"
        out=$(i=0; for ip in $IPS; do echo "[host $i] $ip <host $i ssh host key>"; i=$((i + 1)); done)
      fi
      set --
      while IFS= read -r line; do
        if [[ $line =~ ^\[host\ [0-9]+\]\ ([0-9.]+\ (ssh-|ecdsa-|[<]).*)$ ]]; then set -- "$@" "${BASH_REMATCH[1]}"; fi
      done <<<"$out"
      [ "$#" -eq "$N" ] || mcjax_die "got $# host keys for $N hosts: $out"
      # shellcheck disable=SC2046  # no FROM argument when key_from is empty
      cluster_exec 0 "$LAST" "$(remote ssh.sh authorize "$pub" $(key_from))" || mcjax_die "adding host 0's key failed (see above)"
      cluster_exec 0 0 "$(remote ssh.sh known-hosts "$@")" || mcjax_die "writing host 0's known hosts failed"
      set --
      ;;
    nfs)
      if [ "$MCJAX_SHARED_FS" = 1 ]; then
        step "nfs: a shared file system (MCJAX_SHARED_FS=1, nothing exported): checking that every host sees the same $MCJAX_NFS_DIR"
        token="$MCJAX_CLUSTER_ID-${MCJAX_SLURM_JOB_ID:-$HOST0_IP}"
        cluster_exec 0 0 "$(remote nfs.sh shared-mark "$token")" || mcjax_die "cannot write to $MCJAX_NFS_DIR on host 0"
        cluster_exec 1 "$LAST" "$(remote nfs.sh shared-check "$token")" ||
          mcjax_die "MCJAX_NFS_DIR=$MCJAX_NFS_DIR is not one folder for every host: set it to a folder of the shared file system (home, scratch), or MCJAX_SHARED_FS=0 for host 0 to export it over NFS"
        continue
      fi
      step "nfs: host 0 exports $MCJAX_NFS_DIR to the $N hosts' internal IPs; hosts 1..$LAST mount it"
      # shellcheck disable=SC2086  # one argument per IP
      bash "$SETUP_DIR/cluster/nfs.sh" exports $IPS
      # shellcheck disable=SC2086
      cluster_exec 0 0 "$(remote nfs.sh server $IPS)" || mcjax_die "NFS server setup on host 0 failed"
      cluster_exec 1 "$LAST" "$(remote nfs.sh client "$HOST0_IP")" || mcjax_die "NFS mounts failed (see the hosts named above)"
      ;;
    gcsfuse)
      if [ -z "$MCJAX_BUCKET" ]; then
        step "gcsfuse: skipped (MCJAX_BUCKET is empty)"
      else
        step "gcsfuse: gs://$MCJAX_BUCKET on $MCJAX_BUCKET_DIR on every host"
        cluster_exec 0 "$LAST" "$(remote gcsfuse.sh mount)" || mcjax_die "gcsfuse mounts failed (see the hosts named above)"
      fi
      ;;
    code)
      step "code: $SETUP_DIR -> $MCJAX_REPO_DIR (shared folder, via host 0; files the repository no longer has are deleted there)"
      code_archive
      set -- "${CODE_TAR[@]}"
      if dry; then
        _mcjax_stdin="COPYFILE_DISABLE=1 $(_mcjax_q "$@")"
        _mcjax_exec_one 0 "$(remote nfs.sh receive "$MCJAX_REPO_DIR")"
        unset _mcjax_stdin
        set --
        continue
      fi
      COPYFILE_DISABLE=1 "$@" | cluster_exec 0 0 "$(remote nfs.sh receive "$MCJAX_REPO_DIR")" ||
        mcjax_die "copying the code to host 0 failed"
      set --
      ;;
    venv)
      if [ "$MCJAX_LOCK" = off ]; then what="dsr1[notebook] $MCJAX_JAX_SPEC (no lock)"; else what="the lock $MCJAX_LOCK"; fi
      step "venv: uv $MCJAX_UV_VERSION, Python >= $MCJAX_HOST_PYTHON, $MCJAX_VENV with $what on every host"
      if dry; then
        if [ "$MCJAX_LOCK" = off ]; then
          deps="uv pip install -r $MCJAX_REPO_DIR/pyproject.toml --extra notebook $MCJAX_JAX_SPEC"
        else
          deps="uv pip sync --require-hashes $MCJAX_LOCK"
        fi
        echo "# venv.sh on a host: install|deps: uv $MCJAX_UV_VERSION from its wheel on the package index into $MCJAX_UV_DIR/$MCJAX_UV_VERSION/uv;" \
          "the host's Python >= $MCJAX_HOST_PYTHON, else uv python install $MCJAX_HOST_PYTHON; uv venv --seed --python PYTHON $MCJAX_VENV;" \
          "$deps; install|project: uv pip install --no-deps -e $MCJAX_REPO_DIR; check: the venv against the lock"
      fi
      # Host 0 first, alone: its editable install writes build metadata into the shared source.
      cluster_exec 0 0 "$(remote venv.sh install)" || mcjax_die "venv setup on host 0 failed"
      # The others in parallel (their own disks; nothing to do where the venv is host 0's, on a
      # shared home), then dsr1 itself one host at a time: no two installs write the shared tree.
      cluster_exec 1 "$LAST" "$(remote venv.sh deps)" || mcjax_die "venv setup failed (see the hosts named above)"
      for i in $(seq 1 "$LAST"); do
        cluster_exec "$i" "$i" "$(remote venv.sh project)" || mcjax_die "installing dsr1 on host $i failed"
      done
      cluster_exec 0 "$LAST" "$(remote venv.sh check)" || mcjax_die "some venvs are broken (see above)"
      ;;
    ipcluster)
      step "ipcluster: controller on host 0 ($HOST0_IP), engines on hosts 1..$LAST"
      if [ "$MCJAX_PROVIDER" = slurm ]; then
        # Each long-running process in a job step of its own (a step's processes end with it).
        _mcjax_launch controller 0 0 "$(remote ipcluster.sh controller run "$HOST0_IP")" || mcjax_die "srun failed"
        cluster_exec 0 0 "$(remote ipcluster.sh controller wait)" || mcjax_die "the controller did not start"
        _mcjax_launch engine 1 "$LAST" "$(remote ipcluster.sh engine run)" || mcjax_die "srun failed"
      else
        cluster_exec 0 0 "$(remote ipcluster.sh controller start "$HOST0_IP")" || mcjax_die "the controller did not start"
        # An engine of a replaced controller is replaced too (ipcluster.sh engine start).
        cluster_exec 1 "$LAST" "$(remote ipcluster.sh engine start)" || mcjax_die "engines did not start (see the hosts named above)"
      fi
      cluster_exec 0 0 "$(remote ipcluster.sh wait "$LAST")" || mcjax_die "the engines did not register; try cluster_restart"
      ;;
    jupyter)
      step "jupyter: on host 0, 127.0.0.1:$MCJAX_JUPYTER_PORT"
      if [ "$MCJAX_PROVIDER" = slurm ]; then
        cluster_exec 0 0 "$(remote ipcluster.sh jupyter check-port)" || mcjax_die "Jupyter cannot have its port"
        _mcjax_launch jupyter 0 0 "$(remote ipcluster.sh jupyter run)" || mcjax_die "srun failed"
        cluster_exec 0 0 "$(remote ipcluster.sh jupyter wait)" || mcjax_die "Jupyter did not start"
      else
        cluster_exec 0 0 "$(remote ipcluster.sh jupyter start)" || mcjax_die "Jupyter did not start"
      fi
      ;;
    smoke)
      step "smoke: every engine imports dsr1, versions against the lock ($MCJAX_LOCK), one psum across the $N processes"
      run_smoke || mcjax_die "the smoke check failed (see the report above): fix the hosts it names, then ./mcjax_setup.sh --check"
      ;;
  esac
done

if dry; then
  step "dry run: nothing was run"
else
  step "done: source mcjax_defs.sh; cluster_port_forward; open http://127.0.0.1:$MCJAX_JUPYTER_PORT ($RECORD records this cluster: ./mcjax_setup.sh --stop stops it)"
fi
