"""Prometheus node_exporter's settings.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/node_exporter/defaults.yml`` is written
from them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.values import grammar
from gpufleet.values.types import Port, text


class NodeExporterSettings(RoleSettings):
    """Prometheus node_exporter: host metrics, systemd unit states (systemd collector) and the .prom files other jobs
    write into /var/lib/node_exporter/textfile_collector (textfile collector). It runs as its own system user,
    node_exporter, under a hardened systemd unit.
    """

    node_exporter_install: Literal["tarball", "package"] = setting(
        "tarball",
        "Where the binary comes from:\n"
        "  tarball  the upstream release tarball (node_exporter_tarball_url), fetched once on the controller,\n"
        "           checked against node_exporter_tarball_sha256, pushed to each node and installed as\n"
        "           /usr/local/bin/node_exporter, run by gpufleet's own node_exporter.service\n"
        "  package  the distribution's package (Debian's prometheus-node-exporter, from the node's apt sources or\n"
        "           node_exporter_apt_source), run by Debian's prometheus-node-exporter.service with a drop-in\n"
        "           that hardens it and sets gpufleet's flags (Debian's /etc/default file is then not read)\n"
        "Switching from one to the other removes the first one's binary, unit or package.",
    )

    node_exporter_version: Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+$")] = setting(
        "1.9.1",
        "Release of node_exporter the tarball holds; fills {version} in node_exporter_tarball_url. With install: "
        "package, the distribution's version is installed instead (Debian 12: 1.5.0).",
    )

    node_exporter_tarball_url: str = setting(
        "https://github.com/prometheus/node_exporter/releases/download/v{version}/node_exporter-{version}.linux-amd64.tar.gz",
        "Where the controller fetches the release tarball ({version} is node_exporter_version). An air-gapped site "
        "points this at its own mirror (http, https or file URL).",
    )

    node_exporter_tarball_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] = setting(
        "becb950ee80daa8ae7331d77966d94a611af79ad0d3307380907e0ec08f5b4e8",
        "SHA-256 of that tarball, as published in the release's sha256sums.txt. This one is 1.9.1 linux-amd64's: "
        "change it with the version or the URL. A tarball with another digest stops the deploy before any change.",
    )

    node_exporter_port: Port = setting(
        9100,
        "Port node_exporter listens on.",
    )

    node_exporter_listen_address: text(grammar.ip_address) | None = setting(  # type: ignore[valid-type]
        None,
        "Address it listens on; null: the node's fleet address (fleet_address, else the inventory host name), so "
        "metrics, which name every unit, mount and interface of the node, stay on the fleet network where "
        "Prometheus scrapes them. \"0.0.0.0\" or \"::\" listens on every interface.",
    )

    node_exporter_apt_source: Annotated[
        str, Field(pattern=r"^deb \[([^\]]* )?signed-by=/\S+( [^\]]*)?\] \S+ \S+( \S+)*$")] | None = setting(
        None,
        "With install: package, an extra apt source for the package, one line whose options name the keyring apt "
        "trusts for it, e.g. \"deb [signed-by=/usr/share/keyrings/site.gpg] http://mirror.example/debian/ /\". null: "
        "the node's own apt sources (Debian's archive or the site's mirror of it).",
    )

    node_exporter_apt_keyring: text(grammar.controller_path) | None = setting(  # type: ignore[valid-type]
        None,
        "Path on the controller of the keyring that signs node_exporter_apt_source; it is copied to the signed-by= "
        "path of the source. null: that keyring is already on the nodes.",
    )
