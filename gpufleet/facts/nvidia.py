"""NVIDIA's repository key on a node: the fingerprints of an OpenPGP key file."""

from __future__ import annotations

import re
import shlex

from pyinfra.api.facts import FactBase


def key_fingerprints_command(path_word: str) -> str:
    """Shell printing the fingerprint of each primary key in an OpenPGP key file (armored or binary), one a
    line, from ``gpg --show-keys`` in a throwaway home (nothing is imported anywhere). ``path_word``: the
    file as a shell word (already quoted)."""
    return ('{ home="$(mktemp -d)"; GNUPGHOME="$home" gpg --batch --show-keys --with-colons'
            f" {path_word} 2>/dev/null | awk -F: '/^pub:/{{p=1; next}} /^fpr:/{{if (p) print $10; p=0}}';"
            ' rm -rf "$home"; }')


class KeyFingerprints(FactBase[list[str]]):
    """
    Returns the fingerprints of the primary keys in an OpenPGP key file, armored or binary; [] when the file
    is missing or holds no key.

    + path: the key file

    .. code:: python

        ["EB693B3035CD5710E231E123A4B469963BF863CC"]
    """

    def command(self, path: str) -> str:
        return f"if [ -f {shlex.quote(path)} ]; then {key_fingerprints_command(shlex.quote(path))}; fi"

    @staticmethod
    def default() -> list[str]:  # pyinfra's value when the command prints nothing (no file, no key)
        return []

    def process(self, output: list[str]) -> list[str]:
        return [line.strip().upper() for line in output if re.fullmatch(r"[0-9A-Fa-f]{40}", line.strip())]
