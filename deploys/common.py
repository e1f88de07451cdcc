"""Converge role ``common`` on every host: ``pyinfra inventories/lab/inventory.py deploys/common.py``."""

from roles.common import common

common()
