#!/usr/bin/env bash
# Installs the Debian packages dnvmefs needs to build, test and benchmark. Idempotent: runs
# apt-get only when a package is missing, and `apt-get update` only when the package lists are
# empty or more than a day old.
set -euo pipefail

# shellcheck source=scripts/packages.sh
source "$(dirname "${BASH_SOURCE[0]}")/packages.sh"
PACKAGES=("${DNVME_PACKAGES[@]}" "${DNVME_HOST_PACKAGES[@]}")

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: not root and sudo is missing" >&2; exit 1; }
  SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
  [[ $status == installed ]] || missing+=("$pkg")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages already installed"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
lists=(/var/lib/apt/lists/*_Packages)
if [[ ! -e ${lists[0]} ]] || [[ -n $(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages' -mmin +1440 -print -quit) ]]; then
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
fi
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
