#!/bin/sh
# Install the Debian packages the lab and the tests need on the host, and only those that are missing.
# Idempotent: a second run installs nothing. Needs root (the Makefile's setup calls it only as root).
#
#   debootstrap            builds the nodes' Debian rootfs
#   debian-archive-keyring verifies what debootstrap downloads
#   systemd-container      systemd-nspawn: boots each node with systemd as PID 1
#   iproute2               the lab bridge, veths and node addresses (ip)
#   util-linux             nsenter (addresses inside a node's network namespace), setsid, mount
#   openssh-client         ssh-keygen for the lab key; ssh for operators
#   procps                 ps / pgrep for status and cleanup checks
#   haproxy                the router's tests run the router's HAProxy (Debian's, as on a router node) themselves
#   keepalived             keepalived's tests check the keepalived role's configuration (keepalived -t), its unit
#                          drop-in on Debian's unit, and move a virtual address between two keepalived processes in
#                          network namespaces of their own; the service the package enables is disabled: no
#                          keepalived runs on this host
#   prometheus             promtool, which the alert rules' tests run (check rules, test rules); the server the
#                          package also starts is stopped and disabled: no Prometheus runs on this host
#   prometheus-alertmanager amtool, which the monitoring role's tests run (check-config), and Debian's unit the
#                          role's drop-in is checked with; its server is stopped and disabled too
set -eu

PACKAGES="debootstrap debian-archive-keyring systemd-container iproute2 util-linux openssh-client procps haproxy keepalived prometheus prometheus-alertmanager"

if [ "$(id -u)" -ne 0 ]; then
    echo "install-lab-deps: must run as root" >&2
    exit 1
fi

missing=""
for pkg in $PACKAGES; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
    if [ "$status" != "installed" ]; then
        missing="$missing $pkg"
    fi
done

if [ -z "$missing" ]; then
    echo "install-lab-deps: all present"
    exit 0
fi

echo "install-lab-deps: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=300 update -qq
# shellcheck disable=SC2086
apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends $missing
for service in prometheus prometheus-alertmanager keepalived; do
    case " $missing " in
        *" $service "*)
            systemctl stop "$service.service" 2>/dev/null || true
            systemctl disable "$service.service" 2>/dev/null || true
            ;;
    esac
done
