"""The local lab fleet: every node of the running lab (``gpufleet lab up``), read from its state file.

Hosts are the nodes' addresses on the lab bridge, reached as root with the lab's key and checked against
the host keys the lab generated (``<lab dir>/ssh/known_hosts``). Each node's hardware profile is its
``gpu_profile``: the simulated NVML on the node answers from the same profile. Lab-wide values live in
``group_vars/lab.yml``. ``GPUFLEET_LAB_DIR`` selects a lab other than the default one.
"""

import sys

from gpufleet.config.inventory import apply_group_vars
from gpufleet.lab.errors import LabError
from gpufleet.lab.hooks import mirror_base_url
from gpufleet.lab.mirror import node_exporter_sources
from gpufleet.lab.state import lab_dir, load_state

try:
    _state = load_state()
except LabError as _error:
    sys.exit(f"inventories/lab.py: {_error}")
if _state is None or not _state.nodes:
    sys.exit(f"inventories/lab.py: no lab is up in {lab_dir()}; run `gpufleet lab up` first")

_mirror = mirror_base_url(_state.bridge_address)
lab = [
    (
        node.address,
        {
            "ssh_user": "root",
            "ssh_key": _state.ssh_key,
            "ssh_known_hosts_file": _state.known_hosts,
            "ssh_strict_host_key_checking": "yes",
            "ssh_look_for_keys": False,
            "ssh_allow_agent": False,
            "gpu_profile": node.profile,
            # NVIDIA's repository: the mirror's signed repository of lab doubles, and the key it is signed with
            "nvidia_repo_url": _mirror + "apt/",
            "nvidia_repo_keyring_url": _mirror + "keys/gpufleet-lab.gpg",
            # node_exporter from the mirror: its release-layout tarball (sha256 read from the mirror's
            # sha256sums.txt) and, for node_exporter_install=package, its repository of Debian's package
            **node_exporter_sources(_mirror),
        },
    )
    for node in _state.nodes
]

apply_group_vars(globals())
