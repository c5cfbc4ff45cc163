#!/usr/bin/env bash
# cluster/gcsfuse.sh: mount the GCS bucket $MCJAX_BUCKET on $MCJAX_BUCKET_DIR (every host; optional).
# gcsfuse.sh --help prints the usage: the text of usage() below.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
gcsfuse.sh: mount the GCS bucket $MCJAX_BUCKET on $MCJAX_BUCKET_DIR (every host; optional).

  gcsfuse.sh mount     install gcsfuse if missing, mount the bucket, then persist it in /etc/fstab
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

cmd_mount() {
  if [ -z "$MCJAX_BUCKET" ]; then
    mcjax_log "MCJAX_BUCKET is empty: no bucket to mount"
    return 0
  fi
  install_gcsfuse
  local line
  line="$MCJAX_BUCKET $MCJAX_BUCKET_DIR gcsfuse rw,_netdev,allow_other,implicit_dirs,uid=$(id -u),gid=$(id -g) 0 0"
  mcjax_fstab_has "$MCJAX_FSTAB" "$line" || true  # a conflicting entry stops us before mounting
  mcjax_sudo mkdir -p "$MCJAX_BUCKET_DIR"
  mcjax_sudo chown "$(id -u):$(id -g)" "$MCJAX_BUCKET_DIR"
  if mountpoint -q "$MCJAX_BUCKET_DIR"; then
    mcjax_log "gs://$MCJAX_BUCKET is already mounted on $MCJAX_BUCKET_DIR"
  else
    mcjax_log "mounting gs://$MCJAX_BUCKET on $MCJAX_BUCKET_DIR"
    gcsfuse --implicit-dirs "$MCJAX_BUCKET" "$MCJAX_BUCKET_DIR" ||
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
