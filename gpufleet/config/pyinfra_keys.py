"""The host data keys pyinfra itself reads, from the installed pyinfra: its connectors' data keys
(``ssh_user``, ``ssh_port``, ``docker_identifier``…) and its global operation arguments (``_sudo``, ``_env``…).

Read at run time, so a pyinfra upgrade that adds or drops a key changes what gpufleet accepts with it.
"""

from __future__ import annotations

import functools

from gpufleet.pyinfra_seam import connector_data_keys, global_argument_names


@functools.cache
def pyinfra_keys() -> frozenset[str]:
    """Every data key a pyinfra connector declares, and every global argument (those that start with ``_``)."""
    return frozenset({name for name in global_argument_names() if name.startswith("_")} | connector_data_keys())
