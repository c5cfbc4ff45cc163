#!/usr/bin/env bash
# cluster/gcsfuse.sh: mount the GCS bucket $MCJAX_BUCKET on $MCJAX_BUCKET_DIR (every host; optional).
# gcsfuse.sh --help prints the usage: the text of usage() below.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
gcsfuse.sh: mount the GCS bucket $MCJAX_BUCKET on $MCJAX_BUCKET_DIR (every host; optional).

  gcsfuse.sh mount     install gcsfuse if missing, mount the bucket (mount -t gcsfuse, with the
                       options of its fstab line), then persist it in /etc/fstab (nofail)
  gcsfuse.sh unmount
  gcsfuse.sh --help    this text

Idempotent: an existing mount and fstab line are kept. Does nothing when MCJAX_BUCKET is empty.
EOF
}

: "${MCJAX_FSTAB:=/etc/fstab}"

install_gcsfuse() {
  command -v gcsfuse >/dev/null 2>&1 && return 0
  mcjax_log "installing gcsfuse from Google's apt repository"
  local codename
  # shellcheck source=/dev/null
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  [ -n "$codename" ] || mcjax_die "cannot tell the distribution's codename: install gcsfuse by hand"
  echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-$codename main" |
    mcjax_sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
  curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | mcjax_sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
  mcjax_apt_install gcsfuse
}

# The mount's options, the same for the fstab line (at boot, by root) and the mount made now (by
# root too, so both are the same mount): the files owned by this user, visible to every local user
# (allow_other: the engines, Jupyter), folders implied by object names. nofail: a boot whose bucket
# cannot be mounted (credentials, network) goes on without it instead of stopping.
mount_options() {
  echo "rw,_netdev,nofail,allow_other,implicit_dirs,uid=$(id -u),gid=$(id -g)"
}

# An fstab line for this bucket and mount point with other options (an earlier setup's, without
# nofail) is replaced by LINE: removed here, added back once the mount works.
drop_older_line() {
  local line=$1 tmp older
  [ -f "$MCJAX_FSTAB" ] || return 0
  older=$(awk -v b="$MCJAX_BUCKET" -v m="$MCJAX_BUCKET_DIR" '$1 == b && $2 == m && $3 == "gcsfuse"' "$MCJAX_FSTAB" |
    tr -s ' \t' '  ')
  [ -n "$older" ] && [ "$older" != "$(echo "$line" | tr -s ' \t' '  ')" ] || return 0
  mcjax_log "replacing the older $MCJAX_FSTAB line of gs://$MCJAX_BUCKET"
  tmp=$(mktemp) || mcjax_die "cannot make a temporary file"
  awk -v b="$MCJAX_BUCKET" -v m="$MCJAX_BUCKET_DIR" '!($1 == b && $2 == m && $3 == "gcsfuse")' "$MCJAX_FSTAB" >"$tmp"
  if [ -w "$MCJAX_FSTAB" ]; then cat "$tmp" >"$MCJAX_FSTAB"; else mcjax_sudo tee "$MCJAX_FSTAB" <"$tmp" >/dev/null; fi
  rm -f "$tmp"
}

cmd_mount() {
  if [ -z "$MCJAX_BUCKET" ]; then
    mcjax_log "MCJAX_BUCKET is empty: no bucket to mount"
    return 0
  fi
  install_gcsfuse
  local line
  line="$MCJAX_BUCKET $MCJAX_BUCKET_DIR gcsfuse $(mount_options) 0 0"
  drop_older_line "$line"
  mcjax_fstab_has "$MCJAX_FSTAB" "$line" || true  # a conflicting entry stops us before mounting
  mcjax_sudo mkdir -p "$MCJAX_BUCKET_DIR"
  mcjax_sudo chown "$(id -u):$(id -g)" "$MCJAX_BUCKET_DIR"
  if mountpoint -q "$MCJAX_BUCKET_DIR"; then
    mcjax_log "gs://$MCJAX_BUCKET is already mounted on $MCJAX_BUCKET_DIR"
  else
    mcjax_log "mounting gs://$MCJAX_BUCKET on $MCJAX_BUCKET_DIR ($(mount_options))"
    # What mount(8) runs for the fstab line at boot (mount.gcsfuse, from the gcsfuse package), with
    # its options but those that only order the boot (_netdev, nofail).
    mcjax_sudo mount -t gcsfuse -o "$(mount_options | sed -e 's/_netdev,//' -e 's/nofail,//')" "$MCJAX_BUCKET" "$MCJAX_BUCKET_DIR" ||
      mcjax_die "gcsfuse could not mount gs://$MCJAX_BUCKET (does the VM's service account have storage access?); nothing was added to $MCJAX_FSTAB"
  fi
  mcjax_fstab_ensure "$MCJAX_FSTAB" "$line"
}

cmd_unmount() {
  if mountpoint -q "$MCJAX_BUCKET_DIR"; then
    fusermount -u "$MCJAX_BUCKET_DIR" || mcjax_sudo umount "$MCJAX_BUCKET_DIR"
    mcjax_log "unmounted $MCJAX_BUCKET_DIR"
  fi
}

case "${1:-}" in
  mount) cmd_mount ;;
  unmount) cmd_unmount ;;
  -h | --help) usage ;;
  '') mcjax_usage_error "no command given (mount or unmount)" ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
