"""Converge role ``common`` on every host: ``pyinfra inventories/lab.py deploys/common.py``."""

from roles.common import common

common()
