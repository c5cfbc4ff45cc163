#!/usr/bin/env bash
# cluster/venv.sh: the Python venv $MCJAX_VENV on this host, with dsr1 and $MCJAX_JAX_SPEC.
# venv.sh --help prints the usage: the text of usage() below.
# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'EOF'
venv.sh: the Python venv $MCJAX_VENV on this host, with dsr1 (editable, from the shared folder
$MCJAX_REPO_DIR) and its notebook extra (jupyter, ipyparallel), plus $MCJAX_JAX_SPEC (jax[tpu] on
TPU VMs, jax[cuda12] on GPU hosts). Idempotent: an existing venv is reused.

  venv.sh [install]  create or update the venv (the default)
  venv.sh check      print the versions the notebook's health check compares
  venv.sh --help     this text
EOF
}

cmd_install() {
  local base_python=${MCJAX_BASE_PYTHON:-python3}
  [ -f "$MCJAX_REPO_DIR/pyproject.toml" ] ||
    mcjax_die "no dsr1 source at $MCJAX_REPO_DIR (the 'code' step of mcjax_setup.sh copies it there)"
  if [ ! -x "$MCJAX_VENV/bin/python" ]; then
    "$base_python" -c 'import venv, ensurepip' 2>/dev/null || {
      mcjax_log "installing python3-venv"
      mcjax_sudo apt-get update -qq
      mcjax_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
    }
    mcjax_log "creating the venv $MCJAX_VENV"
    "$base_python" -m venv "$MCJAX_VENV"
  else
    mcjax_log "reusing the venv $MCJAX_VENV"
  fi
  "$MCJAX_VENV/bin/python" -m pip install -q --upgrade pip
  mcjax_log "pip install -e '${MCJAX_REPO_DIR}[notebook]' ${MCJAX_JAX_SPEC}"
  if [ -n "$MCJAX_JAX_SPEC" ]; then
    "$MCJAX_VENV/bin/python" -m pip install -q -e "${MCJAX_REPO_DIR}[notebook]" "$MCJAX_JAX_SPEC"
  else
    "$MCJAX_VENV/bin/python" -m pip install -q -e "${MCJAX_REPO_DIR}[notebook]"
  fi
  cmd_check
}

cmd_check() {
  "$MCJAX_VENV/bin/python" -c '
import sys, jax, ipyparallel, dsr1
print(f"[mcjax] python {sys.executable} {sys.version.split()[0]}; dsr1 {dsr1.__version__}; "
      f"jax {jax.__version__}; ipyparallel {ipyparallel.__version__}")
' || mcjax_die "the venv $MCJAX_VENV cannot import dsr1, jax and ipyparallel"
}

case "${1:-install}" in
  install) cmd_install ;;
  check) cmd_check ;;
  -h | --help) usage ;;
  *) mcjax_usage_error "unknown command '$1'" ;;
esac
