#!/usr/bin/env bash
# Host (controller) packages the lab's package mirror needs: dpkg-deb builds the lab-double .debs,
# apt-ftparchive indexes the apt repository, gpg signs its Release, gpgv verifies it.
# Idempotent: installs only what is missing. Run as root on Debian/Ubuntu.
set -euo pipefail

packages=(
  dpkg-dev   # dpkg-deb, dpkg-scanpackages
  apt-utils  # apt-ftparchive
  gnupg      # gpg: lab signing key, Release signatures
  gpgv       # signature verification (what apt itself uses)
  xz-utils   # .deb member compression
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ "${#missing[@]}" -eq 0 ]; then
  echo "mirror dependencies already installed"
  exit 0
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
