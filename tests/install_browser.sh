#!/usr/bin/env bash
# tests/install_browser.sh: what tests/test_browser.py (JupyterLab in a headless browser) and the
# zsh case of tests/test_scripts.py need from the distribution: Debian's Chromium and zsh; and
# nftables, the hosts' firewall of the namespace harness (tests/netns, tests/test_netns.py).
# Idempotent: installs only what is missing, with apt-get, as root; otherwise says what to do.
set -euo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v zsh >/dev/null 2>&1 || missing+=(zsh)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
if [ "${#missing[@]}" -eq 0 ]; then
  echo "install_browser.sh: chromium, zsh and nftables are installed"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser.sh: no apt-get here: install ${missing[*]} with your package manager" >&2
  exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install_browser.sh: run as root to install ${missing[*]} (sudo $0)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends "${missing[@]}" ||
  { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }
echo "install_browser.sh: installed ${missing[*]}"
