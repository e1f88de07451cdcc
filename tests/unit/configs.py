"""A host's config for a test: every role's defaults, a model, and the test's values, validated as a deploy does."""

from __future__ import annotations

from gpufleet.config.layers import HostLayers, Layer, role_default_layers
from gpufleet.config.schema import HostConfig
from gpufleet.config.validate import validate_host


def _validated(values: dict[str, object]) -> HostConfig:
    """The config of host 10.0.0.5 from every role's defaults and ``values``; fails on any problem."""
    layers, problems = role_default_layers()
    assert problems == []
    config, found = validate_host(HostLayers("10.0.0.5", [*layers, Layer("test", values)]), "test")
    assert found == [], [p.line() for p in found]
    assert config is not None
    return config


def host_config(**values: object) -> HostConfig:
    """A host's config from every role's defaults, a model, and ``values``; fails on any problem."""
    return _validated({"vllm_model": "org/model", "allow_plain_http": True,  # the tests' mirrors are plain http
                       **values})


def https_host_config(**values: object) -> HostConfig:
    """:func:`host_config` with plain http refused, as the defaults have it (unless ``values`` allow it)."""
    return _validated({"vllm_model": "org/model", **values})


def config_problems(**values: object) -> list[str]:
    """The problems, one line each, of a host's config from every role's defaults, a model, and ``values`` (plain
    http refused, as the defaults have it)."""
    layers, _ = role_default_layers()
    _, found = validate_host(HostLayers("h", [*layers, Layer("test", {"vllm_model": "org/model", **values})]), "test")
    return [p.line() for p in found]
