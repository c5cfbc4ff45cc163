#!/usr/bin/env bash
# cluster/nfs.sh: the shared folder $MCJAX_NFS_DIR, exported by host 0 over NFS.
# nfs.sh --help prints the usage: the text of usage() below.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

EXPORT_OPTIONS="rw,sync,no_subtree_check,root_squash"
MOUNT_OPTIONS="rw,hard,noatime"
# At boot: after the network (_netdev), and a host 0 that is gone does not stop the boot (nofail).
FSTAB_OPTIONS="$MOUNT_OPTIONS,_netdev,nofail"
: "${MCJAX_EXPORTS_FILE:=/etc/exports.d/mcjax.exports}"
: "${MCJAX_FSTAB:=/etc/fstab}"

usage() {
  cat <<'EOF'
nfs.sh: the shared folder $MCJAX_NFS_DIR, exported by host 0 over NFS.

  nfs.sh exports IP...          print the export lines for these hosts (changes nothing)
  nfs.sh server IP...           on host 0: install the NFS server, export $MCJAX_NFS_DIR to IP... only
  nfs.sh fstab-line SERVER_IP   print the /etc/fstab line a client host gets
  nfs.sh fstab-ensure SERVER_IP add that line to $MCJAX_FSTAB (default /etc/fstab) unless it is there
  nfs.sh client SERVER_IP       on hosts 1..N-1: mount $MCJAX_NFS_DIR from SERVER_IP, then persist it in fstab
  nfs.sh unmount SERVER_IP      on hosts 1..N-1 (./mcjax_setup.sh --stop): remove the fstab line client wrote,
                                then unmount $MCJAX_NFS_DIR (lazily when it is busy)
  nfs.sh unexport               on host 0 (--stop): remove $MCJAX_EXPORTS_FILE and re-export; the folder's
                                files stay on host 0
  nfs.sh shared-mark TOKEN      (a shared file system) write TOKEN into $MCJAX_NFS_DIR/.mcjax-shared on host 0
  nfs.sh shared-check TOKEN     (a shared file system) fail unless this host sees that TOKEN
  nfs.sh receive DIR            on host 0: unpack the code archive on stdin into DIR, then delete what
                                the previous one brought and this one no longer has
  nfs.sh --help                 this text

The exports go to their own file, /etc/exports.d/mcjax.exports (MCJAX_EXPORTS_FILE), rewritten
whole on every run: one entry per host IP, never a network range or '*'. The fstab line is
written only after the mount worked. apt waits for the dpkg lock of a fresh VM. receive lists
what it unpacked in DIR/.mcjax-manifest and deletes only files that list named before: files made
on the cluster (notebooks, build metadata) are never touched. A file it brought and that was edited
on the cluster since (its sha256 is not the one in DIR/.mcjax-sums) stays as it is: the repository's
version goes next to it (notebooks/main.ipynb: notebooks/main.repo.ipynb). Idempotent.
EOF
}

check_dir() {
  case "$MCJAX_NFS_DIR" in
    /*) ;;
    *) mcjax_die "MCJAX_NFS_DIR='$MCJAX_NFS_DIR' must be an absolute path" ;;
  esac
  case "$MCJAX_NFS_DIR" in
    *[[:space:]]* | / ) mcjax_die "MCJAX_NFS_DIR='$MCJAX_NFS_DIR' cannot be exported (spaces or /)" ;;
  esac
}

# One export line per host, for exactly the given IPv4 addresses (duplicates dropped).
exports_lines() {
  local ip seen=" " a b c d rest
  [ "$#" -ge 1 ] || mcjax_die "no host IPs to export $MCJAX_NFS_DIR to"
  check_dir
  for ip in "$@"; do
    IFS=. read -r a b c d rest <<<"$ip"
    if [ -n "$rest" ] || ! _mcjax_is_uint "$a" || ! _mcjax_is_uint "$b" || ! _mcjax_is_uint "$c" ||
      ! _mcjax_is_uint "$d" || [ "$a" -gt 255 ] || [ "$b" -gt 255 ] || [ "$c" -gt 255 ] || [ "$d" -gt 255 ]; then
      mcjax_die "'$ip' is not one host's IPv4 address: exports go to single hosts, never ranges or '*'"
    fi
    case "$seen" in *" $ip "*) continue ;; esac
    seen="$seen$ip "
    printf '%s %s(%s)\n' "$MCJAX_NFS_DIR" "$ip" "$EXPORT_OPTIONS"
  done
}

cmd_server() {
  local lines
  lines=$(exports_lines "$@")
  if ! command -v exportfs >/dev/null 2>&1; then
    mcjax_log "installing the NFS server (nfs-kernel-server)"
    mcjax_apt_install nfs-kernel-server
  fi
  mcjax_log "shared folder $MCJAX_NFS_DIR (owned by $(id -un))"
  mcjax_sudo mkdir -p "$MCJAX_NFS_DIR"
  mcjax_sudo chown "$(id -u):$(id -g)" "$MCJAX_NFS_DIR"
  mcjax_sudo mkdir -p "$(dirname "$MCJAX_EXPORTS_FILE")"
  mcjax_log "writing $MCJAX_EXPORTS_FILE ($# hosts):"
  printf '%s\n' "$lines"
  printf '# written by mcjax_setup.sh (cluster/nfs.sh): one line per cluster host\n%s\n' "$lines" |
    mcjax_sudo tee "$MCJAX_EXPORTS_FILE.tmp" >/dev/null
  mcjax_sudo mv "$MCJAX_EXPORTS_FILE.tmp" "$MCJAX_EXPORTS_FILE"
  if command -v systemctl >/dev/null 2>&1; then
    mcjax_sudo systemctl enable --now nfs-kernel-server >/dev/null 2>&1 ||
      mcjax_sudo systemctl enable --now nfs-server
  fi
  mcjax_sudo exportfs -ra
  mcjax_log "exported $MCJAX_NFS_DIR to: $*"
}

fstab_line() {
  local server=${1:-}
  [ -n "$server" ] || mcjax_usage_error "SERVER_IP missing (nfs.sh fstab-line|fstab-ensure|client SERVER_IP)"
  check_dir
  printf '%s:%s %s nfs %s 0 0\n' "$server" "$MCJAX_NFS_DIR" "$MCJAX_NFS_DIR" "$FSTAB_OPTIONS"
}

# The fstab line of LINE's server folder on this mount point, when it has other options (an earlier
# setup's, without nofail), squeezed; nothing otherwise.
older_line() {
  local spec
  [ -f "$MCJAX_FSTAB" ] || return 0
  spec=$(echo "$1" | awk '{ print $1 }')
  awk -v s="$spec" -v m="$MCJAX_NFS_DIR" -v l="$(echo "$1" | tr -s ' \t' '  ')" \
    '{ x = $0; gsub(/[ \t]+/, " ", x) } $1 == s && $2 == m && $3 == "nfs" && x != l { print x }' "$MCJAX_FSTAB"
}

# An earlier setup's line for LINE's mount (older_line) is removed, before LINE is added.
drop_older_line() {
  local spec tmp
  [ -n "$(older_line "$1")" ] || return 0
  spec=$(echo "$1" | awk '{ print $1 }')
  mcjax_log "replacing the older $MCJAX_FSTAB line of $spec"
  tmp=$(mktemp) || mcjax_die "cannot make a temporary file"
  awk -v s="$spec" -v m="$MCJAX_NFS_DIR" '!($1 == s && $2 == m && $3 == "nfs")' "$MCJAX_FSTAB" >"$tmp"
  if [ -w "$MCJAX_FSTAB" ]; then cat "$tmp" >"$MCJAX_FSTAB"; else mcjax_sudo tee "$MCJAX_FSTAB" <"$tmp" >/dev/null; fi
  rm -f "$tmp"
}

# LINE in the fstab, replacing an earlier setup's line for the same mount.
fstab_ensure() {
  drop_older_line "$1"
  mcjax_fstab_ensure "$MCJAX_FSTAB" "$1"
}

cmd_client() {
  local server=${1:-} line
  line=$(fstab_line "$server")
  if ! command -v mount.nfs >/dev/null 2>&1 && [ ! -x /sbin/mount.nfs ]; then
    mcjax_log "installing the NFS client (nfs-common)"
    mcjax_apt_install nfs-common
  fi
  # A conflicting entry stops us before mounting (an earlier setup's is replaced once the mount works).
  [ -n "$(older_line "$line")" ] || mcjax_fstab_has "$MCJAX_FSTAB" "$line" || true
  mcjax_sudo mkdir -p "$MCJAX_NFS_DIR"
  if mountpoint -q "$MCJAX_NFS_DIR"; then
    mcjax_log "$MCJAX_NFS_DIR is already mounted"
  else
    mcjax_log "mounting $server:$MCJAX_NFS_DIR on $MCJAX_NFS_DIR"
    mcjax_sudo mount -t nfs -o "$MOUNT_OPTIONS" "$server:$MCJAX_NFS_DIR" "$MCJAX_NFS_DIR" ||
      mcjax_die "mount of $server:$MCJAX_NFS_DIR failed: is host 0 exporting it (nfs.sh server) and reachable? (nothing was added to $MCJAX_FSTAB)"
  fi
  fstab_ensure "$line"
}

# --stop on a client: the fstab line of SERVER's folder on our mount point goes (whatever its
# options), then the mount (lazily when something still holds it: the boot's fstab no longer names it).
cmd_unmount() {
  local server=${1:-} spec tmp
  fstab_line "$server" >/dev/null
  spec="$server:$MCJAX_NFS_DIR"
  if [ -f "$MCJAX_FSTAB" ] && awk -v s="$spec" -v m="$MCJAX_NFS_DIR" '$1 == s && $2 == m && $3 == "nfs" { f = 1 } END { exit !f }' "$MCJAX_FSTAB"; then
    mcjax_log "removing the $MCJAX_FSTAB line of $spec"
    tmp=$(mktemp) || mcjax_die "cannot make a temporary file"
    awk -v s="$spec" -v m="$MCJAX_NFS_DIR" '!($1 == s && $2 == m && $3 == "nfs")' "$MCJAX_FSTAB" >"$tmp"
    if [ -w "$MCJAX_FSTAB" ]; then cat "$tmp" >"$MCJAX_FSTAB"; else mcjax_sudo tee "$MCJAX_FSTAB" <"$tmp" >/dev/null; fi
    rm -f "$tmp"
  fi
  if mountpoint -q "$MCJAX_NFS_DIR" 2>/dev/null; then
    mcjax_log "unmounting $MCJAX_NFS_DIR"
    mcjax_sudo umount "$MCJAX_NFS_DIR" 2>/dev/null || mcjax_sudo umount -l "$MCJAX_NFS_DIR" ||
      mcjax_die "cannot unmount $MCJAX_NFS_DIR"
  fi
}

# --stop on host 0: no more exports of ours.
cmd_unexport() {
  if [ ! -e "$MCJAX_EXPORTS_FILE" ]; then return 0; fi
  mcjax_log "removing $MCJAX_EXPORTS_FILE"
  mcjax_sudo rm -f "$MCJAX_EXPORTS_FILE"
  if command -v exportfs >/dev/null 2>&1; then mcjax_sudo exportfs -ra; fi
}

# The code step's receiving end: unpack the archive on stdin into DIR. The previous archive's names
# are in DIR/.mcjax-manifest: those this one lacks (files removed from the repository) are deleted,
# deepest first, a folder only when it is empty. A file edited on the cluster since (its sha256 is
# not the one in DIR/.mcjax-sums, what the last copy brought: a notebook saved in Jupyter) is kept
# as it is, neither overwritten nor deleted; the repository's version goes next to it (edited_copy).
# Nothing else in DIR is touched.
cmd_receive() {
  local dir=${1:-} manifest listed f removed=0 edited
  [ -n "$dir" ] || mcjax_usage_error "receive needs DIR"
  mkdir -p "$dir" || mcjax_die "cannot create $dir"
  manifest="$dir/.mcjax-manifest"
  edited=$(edited_files "$dir")
  while IFS= read -r f; do [ -z "$f" ] || mv "$dir/$f" "$dir/$f.mcjax-edited"; done <<<"$edited"
  listed=$(mktemp "$dir/.mcjax-manifest.XXXXXX") || mcjax_die "cannot write in $dir"
  # tar -v names each member it unpacks: "./", "./dsr1/", "./dsr1/api.py".
  if ! tar -xzvf - -C "$dir" >"$listed"; then
    rm -f "$listed"
    restore_edited "$dir" "$edited"
    mcjax_die "unpacking the code into $dir failed"
  fi
  sed -e 's#^\./##' -e 's#/$##' -e '/^\.\{0,1\}$/d' "$listed" | LC_ALL=C sort -u >"$listed.sorted"
  rm -f "$listed"
  write_sums "$dir" "$listed.sorted"
  restore_edited "$dir" "$edited"
  if [ -f "$manifest" ]; then
    while IFS= read -r f; do
      case "$f" in '' | /* | ../* | */../* | *.. | .mcjax-manifest* | .mcjax-sums*) continue ;; esac
      case $'\n'"$edited"$'\n' in *$'\n'"$f"$'\n'*) continue ;; esac  # edited here: kept
      if [ -d "$dir/$f" ] && [ ! -L "$dir/$f" ]; then
        rmdir "$dir/$f" 2>/dev/null || continue  # not empty: holds files made here
      elif [ -e "$dir/$f" ] || [ -L "$dir/$f" ]; then
        rm -f "$dir/$f"
      else
        continue
      fi
      removed=$((removed + 1))
    done < <(LC_ALL=C comm -23 "$manifest" "$listed.sorted" | LC_ALL=C sort -r)
  fi
  mv "$listed.sorted" "$manifest"
  mcjax_log "unpacked $(wc -l <"$manifest" | tr -d ' ') entries into $dir; deleted $removed that the repository no longer has"
}

# The files under DIR that were edited since the last copy: their sha256 differs from the one in
# DIR/.mcjax-sums (files gone since are not listed), one a line, relative to DIR.
edited_files() {
  [ -s "$1/.mcjax-sums" ] || return 0
  (cd "$1" || exit 0; sha256sum --quiet -c .mcjax-sums 2>/dev/null || true) | sed -n 's#^\./\(.*\): FAILED$#\1#p'
}

# DIR/.mcjax-sums: the sha256 of each regular file that LIST (names relative to DIR) names, as unpacked.
write_sums() {
  local dir=$1 list=$2 f
  while IFS= read -r f; do
    if [ -f "$dir/$f" ] && [ ! -L "$dir/$f" ]; then printf './%s\0' "$f"; fi
  done <"$list" | (cd "$dir" && xargs -0 -r sha256sum) >"$dir/.mcjax-sums.tmp" &&
    mv "$dir/.mcjax-sums.tmp" "$dir/.mcjax-sums"
}

# The name of the repository's version of an edited FILE: notebooks/main.ipynb -> notebooks/main.repo.ipynb.
edited_copy() {
  local f=$1 base=${1##*/}
  case "$base" in
    ?*.*) echo "${f%.*}.repo.${f##*.}" ;;
    *) echo "$f.repo" ;;
  esac
}

# Put the edited files (moved aside to NAME.mcjax-edited before unpacking) back in place; where the
# archive brought a different version, it goes to edited_copy's name.
restore_edited() {
  local dir=$1 f copy
  while IFS= read -r f; do
    if [ -z "$f" ] || [ ! -e "$dir/$f.mcjax-edited" ]; then continue; fi
    if [ -f "$dir/$f" ] && ! cmp -s "$dir/$f" "$dir/$f.mcjax-edited"; then
      copy=$(edited_copy "$f")
      mv "$dir/$f" "$dir/$copy"
      mcjax_log "kept $f as edited on the cluster; the repository's version is $copy"
    fi
    mv "$dir/$f.mcjax-edited" "$dir/$f"
  done <<<"$2"
}

# A shared file system (Slurm, or MCJAX_SHARED_FS=1): check that $MCJAX_NFS_DIR is on it.
shared_mark() {
  [ -n "${1:-}" ] || mcjax_usage_error "shared-mark needs a TOKEN"
  mkdir -p "$MCJAX_NFS_DIR" || mcjax_die "cannot create $MCJAX_NFS_DIR"
  echo "$1" >"$MCJAX_NFS_DIR/.mcjax-shared"
}
shared_check() {
  [ -n "${1:-}" ] || mcjax_usage_error "shared-check needs a TOKEN"
  grep -qxF -- "$1" "$MCJAX_NFS_DIR/.mcjax-shared" 2>/dev/null ||
    mcjax_die "$(hostname) does not see host 0's $MCJAX_NFS_DIR/.mcjax-shared: that folder is not shared"
  mcjax_log "$MCJAX_NFS_DIR is shared with host 0"
}

case "${1:-}" in
  exports) shift; exports_lines "$@" ;;
  server) shift; cmd_server "$@" ;;
  fstab-line) fstab_line "${2:-}" ;;
  fstab-ensure) fstab_line "${2:-}" >/dev/null; fstab_ensure "$(fstab_line "${2:-}")" ;;
  client) cmd_client "${2:-}" ;;
  unmount) cmd_unmount "${2:-}" ;;
  unexport) cmd_unexport ;;
  shared-mark) shared_mark "${2:-}" ;;
  shared-check) shared_check "${2:-}" ;;
  receive) cmd_receive "${2:-}" ;;
  -h | --help) usage ;;
  '') mcjax_usage_error "no command given (exports, server, fstab-line, fstab-ensure, client, unmount, unexport, shared-mark, shared-check or receive)" ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
