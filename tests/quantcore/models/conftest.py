"""The local Hugging Face Hub's fixtures (tests/hub_server.py) for the hub id tests here."""

from tests.hub_server import hub, hub_checkpoints  # noqa: F401
