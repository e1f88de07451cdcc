"""The host data keys pyinfra itself reads, from the installed pyinfra: its connectors' data keys
(``ssh_user``, ``ssh_port``, ``docker_identifier``…) and its global operation arguments (``_sudo``, ``_env``…).

Read at run time, so a pyinfra upgrade that adds or drops a key changes what gpufleet accepts with it.
"""

from __future__ import annotations

import functools


@functools.cache
def pyinfra_keys() -> frozenset[str]:
    """Every data key a pyinfra connector declares, and every global argument (those that start with ``_``)."""
    from pyinfra.api.arguments import all_global_arguments
    from pyinfra.api.connectors import get_all_connectors

    keys = {name for name, _ in all_global_arguments() if name.startswith("_")}
    for connector in get_all_connectors().values():
        keys.update(getattr(connector, "data_meta", None) or {})
    return frozenset(keys)
