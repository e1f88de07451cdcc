"""A replica's Ray cluster: how many nodes it lists as active."""

from __future__ import annotations

import shlex

from pyinfra.api.facts import FactBase


def ray_status_command(ray: str, gcs: str, token_file: str) -> str:
    """Shell running ``ray status`` against ``gcs`` with the replica's token (read from its 0600 file)."""
    return (f"(set -a; . {shlex.quote(token_file)}; set +a; RAY_AUTH_MODE=token {shlex.quote(ray)} status"
            f" --address={shlex.quote(gcs)} 2>/dev/null)")


def ray_count_command(ray: str, gcs: str, token_file: str) -> str:
    """Shell printing how many nodes ``ray status`` at ``gcs`` lists as active."""
    return f"{ray_status_command(ray, gcs, token_file)} | sed -n '/^Active:/,/^Pending:/p' | grep -c ' node_'"


class RayActiveNodes(FactBase[int]):
    """
    Returns how many nodes the Ray cluster at ``gcs`` lists as active (0 when it does not answer).

    + ray: the ``ray`` program of the replica's virtualenv
    + gcs: the head's ``address:port``
    + token_file: the EnvironmentFile holding ``RAY_AUTH_TOKEN`` (read on the node)

    .. code:: python

        2
    """

    def command(self, ray: str, gcs: str, token_file: str) -> str:
        return f"{ray_count_command(ray, gcs, token_file)} || true"

    @staticmethod
    def default() -> int:  # pyinfra's value when the command prints nothing
        return 0

    def process(self, output: list[str]) -> int:
        text = output[0].strip() if output else ""
        return int(text) if text.isdigit() else 0
