#!/usr/bin/env bash
# cluster/venv.sh: the Python venv $MCJAX_VENV on this host, with dsr1 and $MCJAX_JAX_SPEC.
# venv.sh --help prints the usage: the text of usage() below.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
venv.sh: the Python venv $MCJAX_VENV on this host, with dsr1 (editable, from the shared folder
$MCJAX_REPO_DIR) and exactly the versions of the lock $MCJAX_LOCK (default
$MCJAX_REPO_DIR/cluster/locks/$MCJAX_LOCK_PLATFORM.txt: dsr1's dependencies with the notebook
extra and jax[tpu] (tpu), jax[cuda12] (cuda12) or jax (cpu), every file's hash), installed with
`uv pip sync --require-hashes`: every host and every rebuild gets the same versions, and a venv
that has others is brought to the lock. MCJAX_LOCK=off: pyproject's ranges plus $MCJAX_JAX_SPEC.

The host's own python3 only fetches uv: uv $MCJAX_UV_VERSION, one binary taken from its PyPI wheel
(checked against PyPI's sha256) into $MCJAX_UV_DIR. uv then installs CPython $MCJAX_HOST_PYTHON
(a uv-managed build: TPU images ship 3.10, dsr1 needs >= 3.11), makes the venv with it and
installs the packages. Idempotent: what is there at the right version is kept.

  venv.sh [install]  host 0: all of it, dsr1 included (the only install that writes into the shared
                     source); marks the venv as host 0's
  venv.sh deps       other hosts (in parallel): uv, CPython, the venv and the dependencies; nothing
                     when the venv is host 0's (a home folder shared with host 0)
  venv.sh project    other hosts (one at a time): dsr1 itself, editable, without dependencies
  venv.sh check      print the versions; fail when the venv differs from the lock
  venv.sh lock [PLATFORM...]  in the repository: write cluster/locks/PLATFORM.txt (cpu, tpu, cuda12; default
                     all) from pyproject.toml and cluster/locks/PLATFORM.in with uv pip compile --universal
                     --generate-hashes for Python $MCJAX_HOST_PYTHON
  venv.sh --help     this text
EOF
}

UV="$MCJAX_UV_DIR/$MCJAX_UV_VERSION/uv"
OWNER_SHARED="$MCJAX_NFS_DIR/.mcjax/venv-owner"  # written by host 0's install, on the shared folder
OWNER_VENV="$MCJAX_VENV/.mcjax-owner"           # the same, in the venv it made

# uv at the pinned version, from its PyPI wheel (a zip holding the uv binary): fetched by the
# host's pip when it has one (its configuration: index, proxy, certificates), else straight from
# PyPI's JSON API, checked against PyPI's sha256.
ensure_uv() {
  local base=${MCJAX_BASE_PYTHON:-python3} tmp
  if [ -x "$UV" ] && "$UV" --version 2>/dev/null | grep -F " $MCJAX_UV_VERSION" >/dev/null; then
    return 0
  fi
  command -v "$base" >/dev/null 2>&1 || mcjax_die "no $base on this host to fetch uv with"
  mcjax_log "fetching uv $MCJAX_UV_VERSION from PyPI into $(dirname "$UV")"
  mkdir -p "$(dirname "$UV")"
  tmp=$(mktemp -d "$(dirname "$UV")/fetch.XXXXXX")
  if "$base" -m pip --version >/dev/null 2>&1; then
    "$base" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "uv==$MCJAX_UV_VERSION" ||
      mcjax_log "pip download failed; trying PyPI directly"
  fi
  "$base" - "$MCJAX_UV_VERSION" "$tmp" <<'EOF' || { rm -rf "$tmp"; mcjax_die "fetching uv $MCJAX_UV_VERSION failed"; }
import glob, hashlib, io, json, os, platform, sys, urllib.parse, urllib.request, zipfile

version, folder = sys.argv[1], sys.argv[2]
found = glob.glob(os.path.join(folder, f"uv-{version}-*.whl"))
if found:
    data = open(found[0], "rb").read()
else:
    arch = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}[platform.machine().lower()]
    index = "https://pypi.org/pypi/uv/json"
    with urllib.request.urlopen(index, timeout=120) as r:
        files = json.load(r)["releases"][version]
    wheel = next(f for f in files if f["filename"].endswith(".whl") and "manylinux" in f["filename"]
                 and f"_{arch}" in f["filename"])
    with urllib.request.urlopen(urllib.parse.urljoin(index, wheel["url"]), timeout=300) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != wheel["digests"]["sha256"]:
        sys.exit(f"{wheel['filename']}: its sha256 is not PyPI's")
with zipfile.ZipFile(io.BytesIO(data)) as z:
    member = next(n for n in z.namelist() if n.endswith(".data/scripts/uv"))
    with open(os.path.join(folder, "uv"), "wb") as f:
        f.write(z.read(member))
EOF
  chmod 755 "$tmp/uv"
  mv "$tmp/uv" "$UV"
  rm -rf "$tmp"
  "$UV" --version >/dev/null || mcjax_die "$UV does not run"
}

# True when $MCJAX_VENV is the one host 0 made (a home folder shared with host 0).
venv_is_host0s() {
  [ -s "$OWNER_SHARED" ] && cmp -s "$OWNER_SHARED" "$OWNER_VENV"
}

# The full version (3.12.9) of a Python interpreter, or nothing.
python_version() {
  "$1" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || true
}

# The venv with uv's CPython $MCJAX_HOST_PYTHON, made anew when its Python is another version, down
# to the patch level (a 3.12 venv of another 3.12.x is not every host's Python).
ensure_venv() {
  local python want have
  ensure_uv
  "$UV" python install "$MCJAX_HOST_PYTHON" || mcjax_die "uv could not install CPython $MCJAX_HOST_PYTHON"
  python=$("$UV" python find --managed-python "$MCJAX_HOST_PYTHON") && [ -n "$python" ] ||
    mcjax_die "uv installed CPython $MCJAX_HOST_PYTHON but cannot find it"
  want=$(python_version "$python")
  [ -n "$want" ] || mcjax_die "$python (uv's CPython $MCJAX_HOST_PYTHON) does not run"
  have=""
  if [ -x "$MCJAX_VENV/bin/python" ]; then have=$(python_version "$MCJAX_VENV/bin/python"); fi
  if [ "$have" = "$want" ]; then
    mcjax_log "reusing the venv $MCJAX_VENV (Python $have)"
  else
    mcjax_log "creating the venv $MCJAX_VENV with CPython $want${have:+ (it had $have)}"
    "$UV" venv --clear --seed --python "$python" "$MCJAX_VENV" || mcjax_die "uv could not create $MCJAX_VENV"
  fi
}

# The lock's exact versions (uv pip sync: what the lock does not list is removed, hashes are
# checked); without a lock, dsr1's dependencies (read from its pyproject.toml, without building
# it) and $MCJAX_JAX_SPEC.
install_deps() {
  local lock
  [ -f "$MCJAX_REPO_DIR/pyproject.toml" ] ||
    mcjax_die "no dsr1 source at $MCJAX_REPO_DIR (the 'code' step of mcjax_setup.sh copies it there)"
  lock=$(mcjax_lock_file)
  if [ -n "$lock" ]; then
    [ -s "$lock" ] || mcjax_die "no lock $lock (the 'code' step copies cluster/locks/ with the source; MCJAX_LOCK=off installs without one)"
    mcjax_log "uv pip sync --require-hashes $lock"
    "$UV" pip sync --quiet --require-hashes --python "$MCJAX_VENV/bin/python" "$lock" ||
      mcjax_die "installing the lock $lock failed"
    return
  fi
  mcjax_log "uv pip install -r $MCJAX_REPO_DIR/pyproject.toml --extra notebook $MCJAX_JAX_SPEC"
  set -- -r "$MCJAX_REPO_DIR/pyproject.toml" --extra notebook
  if [ -n "$MCJAX_JAX_SPEC" ]; then set -- "$@" "$MCJAX_JAX_SPEC"; fi
  "$UV" pip install --quiet --python "$MCJAX_VENV/bin/python" "$@" || mcjax_die "installing the dependencies failed"
}

# dsr1 itself, editable: this writes build metadata (dsr1.egg-info) into the shared source, so
# mcjax_setup.sh runs it on one host at a time.
install_project() {
  mcjax_log "uv pip install --no-deps -e $MCJAX_REPO_DIR"
  "$UV" pip install --quiet --python "$MCJAX_VENV/bin/python" --no-deps -e "$MCJAX_REPO_DIR" ||
    mcjax_die "installing dsr1 from $MCJAX_REPO_DIR failed"
}

cmd_install() {
  ensure_venv
  install_deps
  install_project
  mkdir -p "$(dirname "$OWNER_SHARED")"
  echo "$(hostname) $(date +%s%N) $$" >"$OWNER_VENV"
  cp "$OWNER_VENV" "$OWNER_SHARED"
}

cmd_deps() {
  if venv_is_host0s; then
    mcjax_log "$MCJAX_VENV is host 0's (a shared home): nothing to install here"
    return 0
  fi
  ensure_venv
  install_deps
}

cmd_project() {
  if venv_is_host0s; then
    mcjax_log "$MCJAX_VENV is host 0's (a shared home): dsr1 is installed"
    return 0
  fi
  ensure_uv
  install_project
}

cmd_check() {
  local lock changes
  "$MCJAX_VENV/bin/python" -P -c '
import sys, jax, ipyparallel, dsr1
print(f"[mcjax] python {sys.executable} {sys.version.split()[0]}; dsr1 {dsr1.__version__}; "
      f"jax {jax.__version__}; ipyparallel {ipyparallel.__version__}")
' || mcjax_die "the venv $MCJAX_VENV cannot import dsr1, jax and ipyparallel"
  lock=$(mcjax_lock_file)
  [ -n "$lock" ] || return 0
  ensure_uv
  # What a sync would change, but dsr1 itself (installed on top of the lock).
  changes=$("$UV" pip sync --dry-run --python "$MCJAX_VENV/bin/python" "$lock" 2>&1 | grep -E '^ [-+] ' | grep -v '^ - dsr1==' || true)
  [ -z "$changes" ] || mcjax_die "the venv $MCJAX_VENV differs from the lock $lock (./mcjax_setup.sh --steps push,code,venv brings it there):
$changes"
  mcjax_log "the venv matches the lock $lock"
}

# In the repository: the locks, from pyproject.toml (dsr1's dependencies, notebook extra) and
# cluster/locks/PLATFORM.in (which jax), for every platform the hosts may run.
cmd_lock() {
  local platform
  [ -f "$MCJAX_ROOT/pyproject.toml" ] || mcjax_die "run this in the repository (no $MCJAX_ROOT/pyproject.toml)"
  if command -v uv >/dev/null 2>&1 && uv --version | grep -F " $MCJAX_UV_VERSION" >/dev/null; then UV=uv; else ensure_uv; fi
  [ "$#" -gt 0 ] || set -- cpu tpu cuda12
  for platform in "$@"; do
    [ -f "$MCJAX_ROOT/cluster/locks/$platform.in" ] || mcjax_usage_error "no cluster/locks/$platform.in (platforms: cpu, tpu, cuda12)"
    mcjax_log "cluster/locks/$platform.txt"
    (cd "$MCJAX_ROOT" && "$UV" pip compile --quiet pyproject.toml "cluster/locks/$platform.in" --extra notebook \
      --generate-hashes --universal --python-version "$MCJAX_HOST_PYTHON" -o "cluster/locks/$platform.txt") ||
      mcjax_die "uv pip compile failed for $platform"
  done
}

case "${1:-install}" in
  install) cmd_install; cmd_check ;;
  deps) cmd_deps ;;
  project) cmd_project ;;
  check) cmd_check ;;
  lock) shift; cmd_lock "$@" ;;
  -h | --help) usage ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
