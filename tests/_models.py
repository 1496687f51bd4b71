"""Registered test models (:mod:`kvpack.models.registry`) for the tests that need one: installed by ``make install``."""

from __future__ import annotations

import pytest

from kvpack.errors import ConfigError


def installed_model(name: str) -> str:
    """The converted folder of registered test model ``name`` (converted and cached on first use); fails the test
    with the install command when its wheels are missing."""
    from kvpack.models import registry

    model = registry.get(name)
    try:
        registry.find_chunks(model)
    except ConfigError:
        pytest.fail(f"test model {name} is not installed (make install installs it): {model.install_command}")
    return str(registry.ensure_converted(name=name))
