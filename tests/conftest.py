"""Shared fixtures.

Integration tests use the real llama-server built from ``llama-build.lock`` and the real demo model,
both from llamagate's own cache (built/fetched on first use, reused afterwards). Two environment
variables let a developer point at an existing binary or model instead:
``LLAMAGATE_TEST_BINARY`` and ``LLAMAGATE_TEST_MODEL``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The needs_tool marker: checked before a test's fixtures (tests/helpers/system.py).
from tests.helpers.system import pytest_runtest_setup  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "llama-build.lock"


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    override = os.environ.get("LLAMAGATE_TEST_BINARY")
    if override:
        return Path(override)
    from supervisor.artifacts.build import ensure_binary
    from supervisor.progress import ConsoleProgress

    return ensure_binary(LOCK, progress=ConsoleProgress()).path


@pytest.fixture(scope="session")
def demo_model() -> Path:
    override = os.environ.get("LLAMAGATE_TEST_MODEL")
    if override:
        return Path(override)
    from supervisor.artifacts.demo_model import ensure_demo_model
    from supervisor.progress import ConsoleProgress

    return ensure_demo_model(progress=ConsoleProgress())
