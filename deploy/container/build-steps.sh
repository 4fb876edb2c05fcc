#!/bin/sh
# The build steps of README.md's "Install" section, run verbatim by the Containerfile's build stage.
# Run them inside an activated virtual environment (README: `python3 -m venv .venv && . .venv/bin/activate`;
# the Containerfile: /opt/llamagate). tests/unit/test_deploy_container.py fails when the README and this
# file disagree, so change both together.
set -eu
pip install .
llamagate build
llamagate verify
