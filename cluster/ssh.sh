#!/usr/bin/env bash
# cluster/ssh.sh: host 0's ssh access to every host, for what runs on host 0 and needs the others
# (cluster_restart, the notebook's reset_engines). ssh.sh --help prints the usage: usage() below.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
ssh.sh: host 0's ssh access to every host, so that cluster_restart and the notebook's
reset_engines work on host 0 (a TPU VM's workers cannot `gcloud ... ssh` each other).

  ssh.sh key                  on host 0: make ~/.ssh/mcjax_ed25519 unless it exists; print its public key
  ssh.sh hostkey              print "IP TYPE KEY": this host's internal IP and its ssh host key
  ssh.sh authorize PUBKEY [FROM]
                              add PUBKEY to ~/.ssh/authorized_keys (once), accepted only from the
                              address FROM (from="FROM": host 0's internal IP) when given
  ssh.sh unauthorize          remove host 0's key (the lines ending in mcjax-host0) from it
  ssh.sh known-hosts LINE...  on host 0: write ~/.ssh/mcjax_known_hosts with these "IP TYPE KEY" lines
  ssh.sh --help               this text

The host keys are read on each host through the provider's own authenticated channel (gcloud or
ssh from your machine), so host 0 checks them strictly and never trusts a key on first use.
mcjax.env on the hosts then has MCJAX_TRANSPORT=ssh, the internal IPs and these files in
MCJAX_SSH_OPTS. Idempotent. The cluster named ID (mcjax_setup.sh --name ID) has its own key, known
hosts and lines: mcjax_ed25519-ID, mcjax_known_hosts-ID and mcjax-host0-ID, so that clusters whose
hosts share a home leave each other's alone.
EOF
}

TAG=$(mcjax_cluster_tag)
KEY="$HOME/.ssh/mcjax_ed25519$TAG"
MARK="mcjax-host0$TAG"             # the comment ending this cluster's authorized_keys lines
KNOWN="$HOME/.ssh/mcjax_known_hosts$TAG"

ssh_dir() {
  mkdir -p "$HOME/.ssh"
  chmod 700 "$HOME/.ssh"
}

cmd_key() {
  ssh_dir
  if [ ! -f "$KEY" ]; then
    ssh-keygen -q -t ed25519 -N '' -C "mcjax host 0 ($(id -un)@$(hostname))" -f "$KEY" >/dev/null ||
      mcjax_die "ssh-keygen failed"
  fi
  cut -d ' ' -f 1,2 "$KEY.pub"
}

cmd_hostkey() {
  local i ip key
  i=${MCJAX_HOST_INDEX:-}
  _mcjax_is_uint "$i" || mcjax_die "MCJAX_HOST_INDEX is not set (run this through cluster_exec)"
  ip=$(cluster_internal_ips | sed -n "$((i + 1))p")
  [ -n "$ip" ] || mcjax_die "no internal IP for host $i in MCJAX_INTERNAL_IPS"
  for key in /etc/ssh/ssh_host_ed25519_key.pub /etc/ssh/ssh_host_ecdsa_key.pub /etc/ssh/ssh_host_rsa_key.pub; do
    if [ -r "$key" ]; then
      echo "$ip $(cut -d ' ' -f 1,2 "$key")"
      return 0
    fi
  done
  mcjax_die "no readable ssh host key in /etc/ssh"
}

cmd_authorize() {
  local pub=${1:-} from=${2:-} file="$HOME/.ssh/authorized_keys" line
  case "$pub" in
    ssh-* | ecdsa-*) ;;
    *) mcjax_usage_error "authorize needs a public key (TYPE KEY), not '$pub'" ;;
  esac
  case "$from" in
    *[!A-Za-z0-9.:,*?!/-]*) mcjax_usage_error "authorize: FROM must be addresses or patterns, not '$from'" ;;
  esac
  line="$pub $MARK"
  if [ -n "$from" ]; then line="from=\"$from\" $line"; fi
  ssh_dir
  if [ -f "$file" ] && grep -qxF -- "$line" "$file"; then
    mcjax_log "host 0's key is already authorized"
    return 0
  fi
  # Another line for this key (another FROM) is replaced.
  drop_lines "$file" "$pub"
  (umask 077 && echo "$line" >>"$file")
  chmod 600 "$file"
  mcjax_log "authorized host 0's key${from:+ from $from}"
}

# Remove the lines of FILE holding the fixed string TEXT and ending in " $MARK"; the other
# lines, their order and the file's mode stay.
drop_lines() {
  local file=$1 text=$2
  [ -f "$file" ] || return 0
  awk -v t="$text" -v m="$MARK" '!((t == "" || index($0, t)) && $NF == m)' "$file" >"$file.mcjax.tmp" &&
    chmod 600 "$file.mcjax.tmp" && mv "$file.mcjax.tmp" "$file"
}

cmd_unauthorize() {
  local file="$HOME/.ssh/authorized_keys"
  if [ -f "$file" ] && awk -v m="$MARK" '$NF == m { found = 1 } END { exit !found }' "$file"; then
    drop_lines "$file" ""
    mcjax_log "removed host 0's key from $file"
  else
    mcjax_log "host 0's key is not authorized here"
  fi
}

cmd_known_hosts() {
  [ "$#" -ge 1 ] || mcjax_usage_error "known-hosts needs LINEs (IP TYPE KEY)"
  ssh_dir
  (umask 077 && printf '%s\n' "$@" >"$KNOWN.tmp")
  mv "$KNOWN.tmp" "$KNOWN"
  mcjax_log "host 0 knows the host keys of $# hosts"
}

# The hosts of a cluster on a shared home edit one authorized_keys at the same time (cluster_exec
# runs them in parallel): one at a time, under a lock beside it.
with_keys_lock() {
  ssh_dir
  if command -v flock >/dev/null 2>&1; then
    (umask 077 && exec 9>>"$HOME/.ssh/.mcjax-keys.lock" && flock 9 && "$@")  # 0600, as the rest of ~/.ssh
  else
    "$@"
  fi
}

case "${1:-}" in
  key) cmd_key ;;
  hostkey) cmd_hostkey ;;
  authorize) with_keys_lock cmd_authorize "${2:-}" "${3:-}" ;;
  unauthorize) with_keys_lock cmd_unauthorize ;;
  known-hosts) shift; cmd_known_hosts "$@" ;;
  -h | --help) usage ;;
  '') mcjax_usage_error "no command given (key, hostkey, authorize, unauthorize or known-hosts)" ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
