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

The host's own python3 fetches uv: uv $MCJAX_UV_VERSION, one binary taken from its wheel on the
package index (checked against the index's sha256) into $MCJAX_UV_DIR. The venv's Python
(MCJAX_HOST_PYTHON_FROM): auto takes the host's own when it is at least $MCJAX_HOST_PYTHON (the
lock's), else uv's CPython $MCJAX_HOST_PYTHON (TPU images ship 3.10), which uv downloads from
$UV_PYTHON_INSTALL_MIRROR (default: python-build-standalone's releases on GitHub); system: the
host's only; uv: uv's only. Every download goes through pip's settings: its configuration files
and PIP_* variables (index-url, extra-index-url, find-links, trusted-host, cert, proxy) become
uv's (UV_DEFAULT_INDEX, UV_INDEX, ...) where no UV_* variable says otherwise, so a host whose only
route is a package index (a mirror, a proxy) installs through it. Idempotent: what is there at the
right version is kept.

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

# uv's index settings from pip's, which uv does not read: pip's configuration files (PIP_CONFIG_FILE,
# then the global, user and site ones) and PIP_* variables, as uv's variables, each only where no
# uv-side one is set; local paths that are not there are left out.
use_pip_settings() {
  local base=${MCJAX_BASE_PYTHON:-python3} line
  command -v "$base" >/dev/null 2>&1 || return 0
  while IFS= read -r line; do
    [ -z "$line" ] || export "${line?}"
  done < <("$base" - <<'EOF'
import configparser, os

env = os.environ
home = os.path.expanduser("~")
# pip's order, later files winning: global, user (not when PIP_CONFIG_FILE names a file), site, PIP_CONFIG_FILE.
own = env.get("PIP_CONFIG_FILE", "")
files = [os.path.join(d, "pip", "pip.conf") for d in env.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":")]
files.append("/etc/pip.conf")
if not os.path.isfile(own):
    files += [os.path.join(home, ".pip", "pip.conf"),
              os.path.join(env.get("XDG_CONFIG_HOME", os.path.join(home, ".config")), "pip", "pip.conf")]
if env.get("VIRTUAL_ENV"):
    files.append(os.path.join(env["VIRTUAL_ENV"], "pip.conf"))
files = [] if own == os.devnull else [*files, own]
pip = {}
for path in [f for f in files if f and os.path.isfile(f)]:
    config = configparser.RawConfigParser()
    config.read(path)
    for section in ("global", "install", "download"):
        if config.has_section(section):
            pip.update(config.items(section))
for key in ("index-url", "extra-index-url", "find-links", "trusted-host", "cert", "proxy"):
    value = env.get("PIP_" + key.upper().replace("-", "_"))
    if value is not None:
        pip[key] = value


def words(key):
    found = pip.get(key, "").split()
    return [w for w in found if "://" in w or os.path.exists(w)] if key == "find-links" else found


def give(name, value, *instead):
    if value and not any(env.get(n) for n in (name, *instead)):
        print(f"{name}={value}")


give("UV_DEFAULT_INDEX", pip.get("index-url", "").strip(), "UV_INDEX_URL")
give("UV_INDEX", " ".join(words("extra-index-url")), "UV_EXTRA_INDEX_URL")
if words("extra-index-url"):
    give("UV_INDEX_STRATEGY", "unsafe-best-match")  # pip's: the best version of every index, not the first's
give("UV_FIND_LINKS", ",".join(words("find-links")))
give("UV_INSECURE_HOST", " ".join(words("trusted-host")))
give("SSL_CERT_FILE", pip.get("cert", "").strip() if os.path.isfile(pip.get("cert", "").strip()) else "")
for name in ("HTTPS_PROXY", "HTTP_PROXY"):
    give(name, pip.get("proxy", "").strip(), name.lower())
EOF
  )
}

# uv at the pinned version, from its wheel on the package index (a zip holding the uv binary):
# fetched by the host's pip when it has one (its configuration: index, proxy, certificates), else
# from the index's simple page ($UV_DEFAULT_INDEX, $UV_INDEX_URL or PyPI's), checked against the
# sha256 the index gives.
ensure_uv() {
  local base=${MCJAX_BASE_PYTHON:-python3} tmp
  if [ -x "$UV" ] && "$UV" --version 2>/dev/null | grep -F " $MCJAX_UV_VERSION" >/dev/null; then
    return 0
  fi
  command -v "$base" >/dev/null 2>&1 || mcjax_die "no $base on this host to fetch uv with"
  mcjax_log "fetching uv $MCJAX_UV_VERSION from the package index into $(dirname "$UV")"
  mkdir -p "$(dirname "$UV")"
  tmp=$(mktemp -d "$(dirname "$UV")/fetch.XXXXXX")
  if "$base" -m pip --version >/dev/null 2>&1; then
    "$base" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "uv==$MCJAX_UV_VERSION" ||
      mcjax_log "pip download failed; trying the index's simple page"
  fi
  "$base" - "$MCJAX_UV_VERSION" "$tmp" <<'EOF' || { rm -rf "$tmp"; mcjax_die "fetching uv $MCJAX_UV_VERSION failed"; }
import glob, hashlib, io, os, platform, re, sys, urllib.parse, urllib.request, zipfile

version, folder = sys.argv[1], sys.argv[2]
found = glob.glob(os.path.join(folder, f"uv-{version}-*.whl"))
if found:
    data = open(found[0], "rb").read()
else:
    arch = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}[platform.machine().lower()]
    index = (os.environ.get("UV_DEFAULT_INDEX") or os.environ.get("UV_INDEX_URL") or "https://pypi.org/simple").rstrip("/")
    page = f"{index}/uv/"
    with urllib.request.urlopen(urllib.request.Request(page, headers={"Accept": "text/html"}), timeout=120) as r:
        html = r.read().decode()
    links = [urllib.parse.urljoin(page, h) for h in re.findall(r'href="([^"]+)"', html)]
    wheel = next((u for u in links if re.search(rf"/uv-{re.escape(version)}-[^/#]*manylinux[^/#]*_{arch}\.whl", u)), None)
    if wheel is None:
        sys.exit(f"{page} has no uv {version} wheel for manylinux {arch}")
    digest = dict([wheel.split("#", 1)[1].split("=", 1)]) if "#" in wheel else {}
    with urllib.request.urlopen(wheel.split("#")[0], timeout=300) as r:
        data = r.read()
    if "sha256" in digest and hashlib.sha256(data).hexdigest() != digest["sha256"]:
        sys.exit(f"{wheel.split('#')[0]}: its sha256 is not the one {page} gives")
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

# This host's own Python when it is at least $MCJAX_HOST_PYTHON (major.minor): python3.X on PATH
# from that version up, then python3; nothing when none runs.
system_python() {
  local want major minor m p
  want=$(printf '%s\n' "$MCJAX_HOST_PYTHON" | cut -d. -f1-2)
  major=${want%%.*}
  minor=${want#*.}
  for p in "python$want" $(for m in $(seq $((minor + 1)) $((minor + 4))); do echo "python$major.$m"; done) python3; do
    p=$(command -v "$p" 2>/dev/null) || continue
    if "$p" -c 'import sys; sys.exit(sys.version_info[:2] < tuple(map(int, sys.argv[1].split("."))))' "$want" 2>/dev/null; then
      echo "$p"
      return 0
    fi
  done
}

# uv's CPython $MCJAX_HOST_PYTHON, installed when missing.
uv_python() {
  local python from="python-build-standalone's releases on GitHub"
  from=${UV_PYTHON_INSTALL_MIRROR:-$from}
  "$UV" python install "$MCJAX_HOST_PYTHON" >&2 ||
    mcjax_die "uv could not install CPython $MCJAX_HOST_PYTHON from $from, and this host has no Python >= $MCJAX_HOST_PYTHON of its own: install one (apt-get install python$MCJAX_HOST_PYTHON), or set UV_PYTHON_INSTALL_MIRROR to a copy of those releases that the host reaches (a folder of a package index's server, file:///path)"
  python=$("$UV" python find --managed-python "$MCJAX_HOST_PYTHON") || python=""
  [ -n "$python" ] || mcjax_die "uv installed CPython $MCJAX_HOST_PYTHON but cannot find it"
  echo "$python"
}

# The interpreter the venv is made with, by MCJAX_HOST_PYTHON_FROM (see usage).
host_python() {
  local python=""
  case "$MCJAX_HOST_PYTHON_FROM" in
    auto | system) python=$(system_python) ;;
    uv) ;;
    *) mcjax_die "MCJAX_HOST_PYTHON_FROM='$MCJAX_HOST_PYTHON_FROM' (want auto, system or uv)" ;;
  esac
  if [ -n "$python" ]; then
    echo "$python"
  elif [ "$MCJAX_HOST_PYTHON_FROM" = system ]; then
    mcjax_die "MCJAX_HOST_PYTHON_FROM=system, but this host has no Python >= $MCJAX_HOST_PYTHON on PATH (python$MCJAX_HOST_PYTHON, python3)"
  else
    uv_python
  fi
}

# The venv with host_python's interpreter, made anew when its Python is another version, down to
# the patch level (a 3.12 venv of another 3.12.x is not this host's Python).
ensure_venv() {
  local python want have
  ensure_uv
  python=$(host_python)
  want=$(python_version "$python")
  [ -n "$want" ] || mcjax_die "$python (the Python for $MCJAX_HOST_PYTHON) does not run"
  have=""
  if [ -x "$MCJAX_VENV/bin/python" ]; then have=$(python_version "$MCJAX_VENV/bin/python"); fi
  if [ "$have" = "$want" ]; then
    mcjax_log "reusing the venv $MCJAX_VENV (Python $have)"
  else
    mcjax_log "creating the venv $MCJAX_VENV with CPython $want${have:+ (it had $have)}: $python"
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

use_pip_settings
case "${1:-install}" in
  install) cmd_install; cmd_check ;;
  deps) cmd_deps ;;
  project) cmd_project ;;
  check) cmd_check ;;
  lock) shift; cmd_lock "$@" ;;
  -h | --help) usage ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
