"""An extra apt source line (``node_exporter_apt_source``): signed, checked as apt checks, keyring where apt keeps
keyrings.

``deb [signed-by=/usr/share/keyrings/site.gpg] https://mirror.example/debian/ stable main``: no option that
weakens apt's checks (``trusted`` in any spelling or value, ``allow-insecure``, ``allow-weak``,
``allow-downgrade-to-insecure``, each also as ``option+=`` or ``option-=``), and a ``signed-by=`` keyring, one
normalised path below ``/usr/share/keyrings/`` or ``/etc/apt/keyrings/`` (gpufleet writes the keyring there, as
root, from ``node_exporter_apt_keyring``).
"""

from __future__ import annotations

import posixpath

from gpufleet.values import grammar

WEAKENING_OPTIONS = ("trusted", "allow-insecure", "allow-weak", "allow-downgrade-to-insecure")
KEYRING_DIRS = ("/usr/share/keyrings", "/etc/apt/keyrings")


def keyring_path(path: str) -> str | None:
    """A keyring's path on a node: normalised, and below one of :data:`KEYRING_DIRS`."""
    inside = any(path.startswith(directory + "/") for directory in KEYRING_DIRS)
    if not inside or posixpath.normpath(path) != path:
        return (f"expected a keyring path below {' or '.join(d + '/' for d in KEYRING_DIRS)} (normalised),"
                f" found {grammar.show(path)}")
    return None


def apt_source(value: str, plain_http: bool) -> str | None:
    """The problem with an apt source line that the schema's pattern has let through, if any."""
    options, _, rest = value.removeprefix("deb [").partition("] ")
    parsed = [(key, key.lower().rstrip("+-"), setting)
              for key, _, setting in (option.partition("=") for option in options.split())]
    for key, name, _ in parsed:
        if name in WEAKENING_OPTIONS:
            return (f"expected no option that weakens apt's checks, found {key}="
                    " (apt would accept what it cannot verify)")
    keyrings = [setting for _, name, setting in parsed if name == "signed-by"]
    if len(keyrings) != 1:
        return f"expected one signed-by= keyring, found {len(keyrings)}"
    if problem := keyring_path(keyrings[0]):
        return f"signed-by: {problem}"
    return grammar.url(rest.split(" ")[0], plain_http, ("https", "http"), grammar.NOT_SECRET_URL)
