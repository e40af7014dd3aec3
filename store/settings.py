"""One typed settings object for every process (app, worker, CLI).

Every field can be set from the environment with the prefix ``QUANTPLAN_``
(``QUANTPLAN_DATABASE_URL``, ``QUANTPLAN_BROKER_URL``...). The defaults are the
embedded deployment: a SQLite database, Celery over kombu's SQLAlchemy transport on
SQLite, and local folders, all under ``QUANTPLAN_HOME`` (``./var`` by default).
The team deployment (docker-compose.yml) only changes URLs and paths.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_HOME = Path("var")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QUANTPLAN_", extra="ignore")

    home: Path = Field(
        DEFAULT_HOME,
        description="Folder for the embedded deployment's files; the defaults of the paths and URLs below live in it.",
    )
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL of the database. Default: sqlite:///<home>/quantplan.sqlite. "
        "Team: postgresql+psycopg://user@host/db.",
    )
    database_password: SecretStr | None = Field(
        None, description="Password added to database_url when set (kept out of logs)."
    )
    broker_url: str | None = Field(
        None,
        description="Celery broker URL. Default: sqla+sqlite:///<home>/broker.sqlite (kombu's SQLAlchemy "
        "transport). Team: redis://host:6379/0.",
    )
    result_backend: str | None = Field(
        None,
        description="Celery result backend. Default: db+sqlite:///<home>/celery-results.sqlite. Job state "
        "itself lives in the jobs table; this only serves Celery's own bookkeeping.",
    )
    artifact_dir: Path | None = Field(
        None,
        description="Where uploaded checkpoints (content-addressed) and reference caches are stored. "
        "Shared by the app and every worker in a team deployment. Default: <home>/artifacts.",
    )
    data_dir: Path | None = Field(
        None,
        description="Where uploaded calibration / evaluation texts are stored. Default: <home>/data.",
    )
    cache_dir: Path | None = Field(
        None,
        description="Per-machine cache (GGUF conversions). Default: ~/.cache/quantplan.",
    )
    cache_max_gib: float = Field(
        100.0,
        ge=0,
        description="Most disk the files jobs keep beside the models to skip work next time (reference log-probs, "
        "AWQ scales, GPTQ roundings, KV cache maxima; store/cache.py) may take, all models together (GiB). After "
        "each score or sensitivity job a worker deletes the least recently used past it. 0: no limit.",
    )
    reference_full_max_mb: float = Field(
        128.0,
        ge=0,
        description="Largest full-vocabulary reference (every next-token log-prob in float16, tokens x vocabulary x "
        "2 bytes) a score keeps, MiB; a larger one is kept as the compact top-k record (docs/scoring.md). 0: always "
        "compact.",
    )
    reference_topk: int = Field(
        1024, ge=1, le=8192,
        description="The most tokens per position the compact reference keeps (its top-k log-probs; as many tail "
        "tokens are sampled): it keeps vocabulary / 256 of them, at least 64, at most this. More tokens: a smaller "
        "tail bound, a larger file.",
    )
    ui_port: int = Field(8501, description="Port of the Streamlit app.")
    ui_address: str = Field("127.0.0.1", description="Address the Streamlit app binds to.")
    upload_limit_mb: int = Field(
        4096, description="Largest accepted upload, and largest size an archive may expand to (MiB)."
    )
    hf_token: SecretStr | None = Field(
        None,
        description="Hugging Face token for registering private or gated models by hub id (hf://ORG/NAME), set by "
        "an admin. Passed to the download alone: never shown on a page, in a job's parameters or in a log line; "
        "pages and `quantplan system` say only whether it is set. No token is sent when it is not set.",
    )
    hf_endpoint: str = Field(
        "https://huggingface.co",
        validation_alias=AliasChoices("HF_ENDPOINT", "QUANTPLAN_HF_ENDPOINT"),
        description="The Hugging Face Hub (or a company mirror of it) that hub ids are fetched from: HF_ENDPOINT, "
        "as huggingface_hub reads it.",
    )
    hub_max_gib: float = Field(
        256.0, ge=0,
        description="Largest model a registration by hub id downloads (its files, GiB); a larger one is refused "
        "before the download starts, as is one larger than the artifact store's free space. 0: free space only.",
    )
    model_memory_gib: float | None = Field(
        None, ge=0,
        description="Memory a job's model may take on this worker (GiB): a checkpoint whose weights fit with room to "
        "spare runs whole, a larger one streams block by block from its safetensors (docs/results/streaming.md), and "
        "a job refuses a model one of whose blocks does not fit. Unset or 0: the device's free memory (free GPU "
        "memory, or the host's available memory on a CPU worker).",
    )
    worker_queues: str = Field(
        "cpu",
        description="Comma-separated queues this worker consumes: cpu, gpu, or a device class such as gpu.sm90.",
    )
    default_device: str = Field(
        "cpu", description="Device that calibration / scoring jobs run on when the request does not say."
    )
    job_soft_time_limit_s: int = Field(
        3 * 3600, ge=0,
        description="A job running longer fails with 'timed out' where it next reports progress (0: no limit).",
    )
    heartbeat_stale_s: int = Field(
        120, gt=0, description="A running job whose heartbeat (every 30 s) is older than this is failed by the sweep."
    )
    user: str | None = Field(None, description="Name recorded as 'who asked' (default: the OS user).")
    auth: Literal["none", "oidc", "header"] = Field(
        "none",
        description="How the app knows who is there: none (one person on one machine: the app binds a loopback "
        "address only and everyone is the OS user, as admin), oidc (Streamlit's st.login with the OpenID Connect "
        "provider of .streamlit/secrets.toml [auth]) or header (behind an authenticating proxy such as "
        "oauth2-proxy: the person is the value of auth_header). Any mode but none is required on a non-loopback "
        "address (docs/deployment/team.md).",
    )
    auth_header: str = Field(
        "X-Forwarded-Email", description="header mode: the request header that names the signed-in person."
    )
    auth_proxies: str = Field(
        "",
        description="header mode: comma-separated addresses of the authenticating proxy; a request from any other "
        "address gets no access (where Streamlit tells the client's address). Empty: not checked.",
    )
    default_role: Literal["viewer", "member", "admin"] = Field(
        "viewer", description="Role of a person signing in for the first time (the very first one is admin)."
    )
    model_roots: str = Field(
        "",
        description="Folders (separated by commas) under which a server path may be registered, symlinks "
        "resolved first. Empty: anywhere with QUANTPLAN_AUTH=none, nowhere otherwise.",
    )
    log_level: str = Field(
        "INFO", description="Level of quantplan's own log lines on stderr (DEBUG, INFO, WARNING, ERROR)."
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking server or store (http://mlflow:5000, sqlite:///mlflow.db...) every finished "
        "job is also logged to as a run (worker.mlflow_log; needs quantplan[mlflow]). Unset: none.",
    )
    mlflow_experiment: str = Field(
        "quantplan", description="The MLflow experiment jobs are logged under (created where missing)."
    )

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        home = self.home.expanduser().resolve()
        self.home = home
        if self.database_url is None:
            self.database_url = f"sqlite:///{home / 'quantplan.sqlite'}"
        if self.broker_url is None:
            self.broker_url = f"sqla+sqlite:///{home / 'broker.sqlite'}"
        if self.result_backend is None:
            self.result_backend = f"db+sqlite:///{home / 'celery-results.sqlite'}"
        if self.hf_token is not None and not self.hf_token.get_secret_value().strip():
            self.hf_token = None  # QUANTPLAN_HF_TOKEN= (a compose file passing an unset variable): no token
        self.artifact_dir = (self.artifact_dir or home / "artifacts").expanduser().resolve()
        self.data_dir = (self.data_dir or home / "data").expanduser().resolve()
        self.cache_dir = (self.cache_dir or Path.home() / ".cache" / "quantplan").expanduser().resolve()
        if self.user is None:
            import getpass

            try:
                self.user = getpass.getuser()
            except Exception:  # no passwd entry in some containers
                self.user = "anonymous"
        return self

    @property
    def queues(self) -> list[str]:
        return [q.strip() for q in self.worker_queues.split(",") if q.strip()]

    @property
    def model_root_paths(self) -> list[Path]:
        """model_roots as resolved folders."""
        return [Path(p.strip()).expanduser().resolve() for p in self.model_roots.split(",") if p.strip()]

    @property
    def upload_limit_bytes(self) -> int:
        return self.upload_limit_mb * 1024 * 1024

    @property
    def hub_max_bytes(self) -> int:
        """hub_max_gib in bytes; 0: no limit but the free space."""
        return math.ceil(self.hub_max_gib * 2**30)

    @property
    def models_dir(self) -> Path:
        return Path(str(self.artifact_dir)) / "models"

    @property
    def reference_root(self) -> Path:
        """Cache root of the reference log-probs; quantcore.evaluation.reference.reference_cache_path lays them out
        under it as ``reference/<model sha256>/<eval key>.safetensors``."""
        return Path(str(self.artifact_dir)) / "reference"

    def model_reference_dir(self, sha256: str) -> Path:
        """Every cached reference of one model (the layout of quantcore.evaluation.reference.reference_cache_path)."""
        return self.reference_root / "reference" / sha256

    def job_scratch_dir(self, job_id: int) -> Path:
        """Per-job scratch folder on this machine (a streamed job's memory-mapped hidden states): removed when the
        job ends, and by the stale-job sweep for a job whose worker died."""
        return Path(str(self.cache_dir)) / "scratch" / f"job-{job_id}"

    @property
    def cache_max_bytes(self) -> int:
        """cache_max_gib in bytes; 0: no limit."""
        return math.ceil(self.cache_max_gib * 2**30)  # a tiny limit stays a limit (1 byte), not "none"

    @property
    def sqlalchemy_url(self) -> str:
        """database_url with database_password filled in, when one is set."""
        from sqlalchemy.engine import make_url

        assert self.database_url is not None  # filled in by the validator
        url = make_url(self.database_url)
        if self.database_password is not None:
            url = url.set(password=self.database_password.get_secret_value())
        return url.render_as_string(hide_password=False)

    def ensure_dirs(self) -> None:
        for d in (self.home, self.artifact_dir, self.data_dir, self.models_dir):
            assert d is not None  # filled in by the validator
            Path(d).mkdir(parents=True, exist_ok=True)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once from the environment)."""
    return Settings()
