"""Role nvidia_driver's defaults (roles/nvidia_driver/defaults.yml), as the role reads them."""

from __future__ import annotations

from typing import Any

import yaml

from tests.conftest import ROOT

DEFAULTS: dict[str, Any] = yaml.safe_load((ROOT / "roles" / "nvidia_driver" / "defaults.yml").read_text())
