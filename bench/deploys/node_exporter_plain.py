"""The node_exporter role's job (tarball method) done with pyinfra's own operations only: the comparison for
bench/node_exporter_role.py. Same user, group, textfile directory, binary, unit text and service as the role."""

import io
import tarfile
import tempfile
from pathlib import Path

from pyinfra.context import host
from pyinfra.operations import files, server, systemd
from pyinfra.operations.util import any_changed

from gpufleet.downloads import fetch_verified
from gpufleet.node_paths import TEXTFILE_DIR
from gpufleet.plan import access
from gpufleet.run.context import host_config
from roles.node_exporter import BINARY, UNIT, UNIT_PATH, USER, render, tarball_url

cfg = host_config()
tarball = fetch_verified(tarball_url(cfg), cfg.node_exporter_tarball_sha256)
binary = Path(tempfile.mkdtemp()) / "node_exporter"
with tarfile.open(tarball, "r:gz") as tar:
    member = next(m for m in tar if m.isfile() and m.name.endswith("/node_exporter"))
    binary.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]

server.group(name=f"Group {USER}", group=USER, system=True)
server.user(name=f"User {USER}", user=USER, group=USER, system=True, home="/nonexistent",
            shell="/usr/sbin/nologin", ensure_home=False)
files.directory(name="/var/lib/node_exporter", path=str(Path(TEXTFILE_DIR).parent), user="root", group="root",
                mode="0755")
files.directory(name=TEXTFILE_DIR, path=TEXTFILE_DIR, user="root", group="root", mode="0755")
installed = files.put(name=BINARY, src=str(binary), dest=BINARY, user="root", group="root", mode="0755")
unit = files.put(name=UNIT_PATH, src=io.StringIO(render(cfg, host.name, access.deploy_group())), dest=UNIT_PATH,
                 user="root", group="root", mode="0644")
systemd.daemon_reload(name="daemon-reload", _if=unit.did_change)
systemd.service(name=f"restart {UNIT}", service=UNIT, running=True, restarted=True, _if=any_changed(installed, unit))
systemd.service(name=UNIT, service=UNIT, running=True, enabled=True)
