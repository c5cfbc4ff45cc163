#!/usr/bin/env bash
# mcjax_setup.sh: prepare a cluster for the multi-host JAX notebook (settings: mcjax_defs.sh).
# ./mcjax_setup.sh --help prints the usage: the text of usage() below.
set -euo pipefail

SETUP_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROVIDER_WAS_SET=${MCJAX_PROVIDER+x}
ALL_STEPS="check push nfs gcsfuse code venv ipcluster jupyter"

usage() {
  cat <<'EOF'
mcjax_setup.sh: prepare a cluster for the multi-host JAX notebook (settings: mcjax_defs.sh).

  ./mcjax_setup.sh [--steps LIST] [--dry-run]   set up the cluster of $MCJAX_PROVIDER (gcloud or ssh)
  ./mcjax_setup.sh --local N                    a simulated cluster here: controller + N-1 engines on 127.0.0.1
  ./mcjax_setup.sh --stop | --local-stop        stop what setup started: the local cluster, or with
                                                MCJAX_PROVIDER=gcloud|ssh the real cluster's
                                                controller, engines and Jupyter
  ./mcjax_setup.sh --status                     the same choice: local, or MCJAX_PROVIDER's cluster
  ./mcjax_setup.sh --print-exports              print the NFS export lines host 0 would get (changes nothing)
  ./mcjax_setup.sh --print-env                  print the settings file (mcjax.env) the hosts would get
  ./mcjax_setup.sh --help                       this text

Steps (default: all, in this order; every one is idempotent, so rerunning setup is safe):
  check      the provider's tools, the hosts and their internal IPs
  push       copy mcjax_defs.sh, cluster/ and the settings (mcjax.env) to ~/$MCJAX_REMOTE_DIR on every host
  nfs        host 0 exports $MCJAX_NFS_DIR to the hosts' internal IPs only; the others mount it (fstab)
  gcsfuse    mount gs://$MCJAX_BUCKET on $MCJAX_BUCKET_DIR on every host (skipped when MCJAX_BUCKET is empty)
  code       copy this repository (without .git) to $MCJAX_REPO_DIR on the shared folder
  venv       a venv $MCJAX_VENV per host with dsr1[notebook] (+ $MCJAX_JAX_SPEC)
  ipcluster  ipyparallel controller on host 0 (bound to its internal IP), one engine on hosts 1..N-1
  jupyter    Jupyter on host 0, bound to 127.0.0.1 (reach it with cluster_port_forward)
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
local_n=""
while [ "$#" -gt 0 ]; do
  case "$1" in
    --local)
      [ "$#" -ge 2 ] || mcjax_usage_error "--local needs N, the number of processes"
      mode=local; local_n=$2; shift ;;
    --local=*) mode=local; local_n=${1#--local=} ;;
    --stop) mode=stop ;;
    --local-stop) mode=local-stop ;;
    --status) mode=status ;;
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
  mcjax_usage_error "--local needs N >= 2 (a controller, N-1 engines, and the notebook kernel as process N-1), not '$local_n'"
fi
if [ "$mode" = setup ]; then
  for s in $steps; do
    case " $ALL_STEPS " in *" $s "*) ;; *) mcjax_usage_error "unknown step '$s' (steps: $ALL_STEPS)" ;; esac
  done
fi

# Without a provider named, --stop and --status mean the local cluster (a real one needs
# MCJAX_PROVIDER set), so that they never reach out to a cloud by default.
if [ -z "$PROVIDER_WAS_SET" ]; then
  case "$mode" in
    stop) mode=local-stop ;;
    status) exec bash "$SETUP_DIR/cluster/local.sh" status ;;
  esac
fi
case "$mode" in
  local) exec bash "$SETUP_DIR/cluster/local.sh" start "$local_n" ;;
  local-stop) exec bash "$SETUP_DIR/cluster/local.sh" stop ;;
esac

# shellcheck source-path=SCRIPTDIR source=mcjax_defs.sh
. "$SETUP_DIR/mcjax_defs.sh"
if [ "$MCJAX_PROVIDER" = local ]; then
  case "$mode" in
    stop) exec bash "$SETUP_DIR/cluster/local.sh" stop ;;
    status) exec bash "$SETUP_DIR/cluster/local.sh" status ;;
    exports) ;;
    *) mcjax_die "MCJAX_PROVIDER=local: use ./mcjax_setup.sh --local N" ;;
  esac
fi

REMOTE="bash $MCJAX_REMOTE_DIR/cluster"

if [ "$mode" = exports ]; then
  # shellcheck disable=SC2046  # one argument per IP
  exec bash "$SETUP_DIR/cluster/nfs.sh" exports $(cluster_internal_ips)
fi

N=$(cluster_host_count) || mcjax_die "cannot tell how many hosts the cluster has"
IPS=$(cluster_internal_ips) || mcjax_die "cannot get the hosts' internal IPs"
[ "$(echo "$IPS" | wc -l)" -eq "$N" ] || mcjax_die "$N hosts but $(echo "$IPS" | wc -l) internal IPs: $(echo "$IPS" | tr '\n' ' ')"
HOST0_IP=$(echo "$IPS" | head -n 1)
LAST=$((N - 1))

# The settings the pieces need on the hosts (~/$MCJAX_REMOTE_DIR/mcjax.env): defaults there, so a
# variable set in a host's own environment wins; paths under $HOME are taken under each host's home.
write_env() {
  local var value
  echo "# written by mcjax_setup.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ); sourced by cluster/common.sh"
  for var in MCJAX_PROVIDER MCJAX_CLUSTER MCJAX_ZONE MCJAX_PROJECT MCJAX_HOSTS MCJAX_INTERNAL_IPS \
    MCJAX_NFS_DIR MCJAX_BUCKET MCJAX_BUCKET_DIR MCJAX_VENV MCJAX_REPO_DIR MCJAX_JAX_SPEC MCJAX_STATE \
    MCJAX_PROFILE MCJAX_PROFILE_DIR MCJAX_CLUSTER_ID MCJAX_JUPYTER_PORT MCJAX_REMOTE_DIR \
    MCJAX_START_TIMEOUT MCJAX_STOP_TIMEOUT; do
    value=${!var}
    case "$var" in
      MCJAX_HOSTS) value=$N ;;
      MCJAX_INTERNAL_IPS) value=$(echo "$IPS" | tr '\n' ' ' | sed 's/ $//') ;;
    esac
    if [ "${value#"$HOME"/}" != "$value" ]; then
      # shellcheck disable=SC2016  # $HOME is expanded on the host
      printf '[ -n "${%s+x}" ] || %s="$HOME"/%q; export %s\n' "$var" "$var" "${value#"$HOME"/}" "$var"
    else
      # shellcheck disable=SC2016
      printf '[ -n "${%s+x}" ] || %s=%q; export %s\n' "$var" "$var" "$value" "$var"
    fi
  done
}

case "$mode" in
  print-env) write_env; exit ;;
  status) cluster_status; exit ;;
  stop)
    step "stopping Jupyter and the controller on host 0, the engines on hosts 1..$LAST"
    [ "$N" -lt 2 ] || cluster_exec 1 "$LAST" "$REMOTE/ipcluster.sh engine stop"
    cluster_exec 0 0 "$REMOTE/ipcluster.sh jupyter stop && $REMOTE/ipcluster.sh controller stop"
    exit
    ;;
esac

for s in $steps; do
  case "$s" in
    check)
      step "check: provider $MCJAX_PROVIDER, $N hosts"
      case "$MCJAX_PROVIDER" in
        gcloud) command -v gcloud >/dev/null || mcjax_die "gcloud is not installed (https://cloud.google.com/sdk)" ;;
        ssh) command -v ssh >/dev/null || mcjax_die "ssh is not installed" ;;
        *) mcjax_die "unknown MCJAX_PROVIDER '$MCJAX_PROVIDER' (gcloud, ssh or local)" ;;
      esac
      [ "$N" -ge 2 ] || mcjax_die "a cluster needs at least 2 hosts (host 0: controller + kernel; hosts 1..N-1: engines)"
      i=0
      for ip in $IPS; do
        echo "  host $i: internal IP $ip"
        i=$((i + 1))
      done
      # shellcheck disable=SC2016  # expanded on each host
      cluster_exec 0 "$LAST" 'echo "$(hostname): $(uname -sm), $(nproc) cores"'
      ;;
    push)
      step "push: scripts and settings to ~/$MCJAX_REMOTE_DIR on every host"
      stage=$(mktemp -d "${TMPDIR:-/tmp}/mcjax_push.XXXXXX")
      trap 'rm -rf "$stage"' EXIT
      mkdir -p "$stage/$MCJAX_REMOTE_DIR/cluster"
      cp "$SETUP_DIR/mcjax_defs.sh" "$stage/$MCJAX_REMOTE_DIR/"
      cp "$SETUP_DIR"/cluster/*.sh "$stage/$MCJAX_REMOTE_DIR/cluster/"
      write_env >"$stage/$MCJAX_REMOTE_DIR/mcjax.env"
      i=0
      while [ "$i" -le "$LAST" ]; do
        cluster_scp "$stage/$MCJAX_REMOTE_DIR" . "$i" "$i" || mcjax_die "copying the scripts to host $i failed"
        i=$((i + 1))
      done
      ;;
    nfs)
      step "nfs: host 0 exports $MCJAX_NFS_DIR to the $N hosts' internal IPs; hosts 1..$LAST mount it"
      # shellcheck disable=SC2086  # one argument per IP
      bash "$SETUP_DIR/cluster/nfs.sh" exports $IPS
      cluster_exec 0 0 "$REMOTE/nfs.sh server $(echo "$IPS" | tr '\n' ' ')" || mcjax_die "NFS server setup on host 0 failed"
      cluster_exec 1 "$LAST" "$REMOTE/nfs.sh client $HOST0_IP" || mcjax_die "NFS mounts failed (see the hosts named above)"
      ;;
    gcsfuse)
      if [ -z "$MCJAX_BUCKET" ]; then
        step "gcsfuse: skipped (MCJAX_BUCKET is empty)"
      else
        step "gcsfuse: gs://$MCJAX_BUCKET on $MCJAX_BUCKET_DIR on every host"
        cluster_exec 0 "$LAST" "$REMOTE/gcsfuse.sh mount" || mcjax_die "gcsfuse mounts failed (see the hosts named above)"
      fi
      ;;
    code)
      step "code: $SETUP_DIR -> $MCJAX_REPO_DIR (shared folder, via host 0)"
      if [ "$MCJAX_DRY_RUN" = 1 ]; then
        echo "[dry-run] tar of $SETUP_DIR (without .git, .venv) extracted into $MCJAX_REPO_DIR on host 0"
        continue
      fi
      tar -C "$SETUP_DIR" --exclude=.git --exclude=.venv --exclude=__pycache__ --exclude='*.egg-info' -czf - . |
        cluster_exec 0 0 "mkdir -p '$MCJAX_REPO_DIR' && tar -xzf - -C '$MCJAX_REPO_DIR'" ||
        mcjax_die "copying the code to host 0 failed"
      ;;
    venv)
      step "venv: $MCJAX_VENV with dsr1[notebook] ${MCJAX_JAX_SPEC} on host 0, then hosts 1..$LAST"
      # Host 0 first: the editable install writes build metadata into the shared source folder.
      cluster_exec 0 0 "$REMOTE/venv.sh install" || mcjax_die "venv setup on host 0 failed"
      cluster_exec 1 "$LAST" "$REMOTE/venv.sh install" || mcjax_die "venv setup failed (see the hosts named above)"
      ;;
    ipcluster)
      step "ipcluster: controller on host 0 ($HOST0_IP), engines on hosts 1..$LAST"
      cluster_exec 0 0 "$REMOTE/ipcluster.sh controller start $HOST0_IP" || mcjax_die "the controller did not start"
      cluster_exec 1 "$LAST" "$REMOTE/ipcluster.sh engine start" || mcjax_die "engines did not start (see the hosts named above)"
      cluster_exec 0 0 "$REMOTE/ipcluster.sh wait $LAST" || mcjax_die "the engines did not register; try cluster_restart"
      ;;
    jupyter)
      step "jupyter: on host 0, 127.0.0.1:$MCJAX_JUPYTER_PORT"
      cluster_exec 0 0 "$REMOTE/ipcluster.sh jupyter start" || mcjax_die "Jupyter did not start"
      ;;
  esac
done

step "done: source mcjax_defs.sh; cluster_port_forward; open http://127.0.0.1:$MCJAX_JUPYTER_PORT"
