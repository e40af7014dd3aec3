"""initial schema

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("name", name=op.f("uq_users_name")),
    )
    op.create_table(
        "datasets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("role", sa.String(length=20), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("path", sa.String(length=1000), nullable=False),
        sa.Column("builtin", sa.Boolean(), nullable=False),
        sa.Column("n_documents", sa.Integer(), nullable=False),
        sa.Column("n_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.Integer(), nullable=True),
        sa.CheckConstraint("role IN ('calibration', 'evaluation', 'any')", name=op.f("ck_datasets_role")),
        sa.ForeignKeyConstraint(["created_by"], ["users.id"], name=op.f("fk_datasets_created_by_users")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_datasets")),
        sa.UniqueConstraint("name", name=op.f("uq_datasets_name")),
    )
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("source_kind", sa.String(length=20), nullable=False),
        sa.Column("source_name", sa.String(length=500), nullable=False),
        sa.Column("path", sa.String(length=1000), nullable=False),
        sa.Column("architecture", sa.String(length=200), nullable=False),
        sa.Column("model_type", sa.String(length=100), nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=False),
        sa.Column("num_params", sa.BigInteger(), nullable=False),
        sa.Column("dtype", sa.String(length=40), nullable=False),
        sa.Column("hidden_size", sa.Integer(), nullable=True),
        sa.Column("vocab_size", sa.Integer(), nullable=True),
        sa.Column("total_bytes", sa.BigInteger(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.Integer(), nullable=True),
        sa.CheckConstraint("source_kind IN ('folder', 'archive', 'gguf', 'demo')", name=op.f("ck_models_source_kind")),
        sa.ForeignKeyConstraint(["created_by"], ["users.id"], name=op.f("fk_models_created_by_users")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
        sa.UniqueConstraint("name", name=op.f("uq_models_name")),
        sa.UniqueConstraint("sha256", name=op.f("uq_models_sha256")),
    )
    op.create_table(
        "plans",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["created_by"], ["users.id"], name=op.f("fk_plans_created_by_users")),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_plans_model_id_models"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["parent_id"], ["plans.id"], name=op.f("fk_plans_parent_id_plans")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plans")),
        sa.UniqueConstraint("model_id", "name", "version", name="uq_plans_model_name_version"),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("queue", sa.String(length=50), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=True),
        sa.Column("plan_id", sa.Integer(), nullable=True),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("worker_host", sa.String(length=200), nullable=True),
        sa.Column("device", sa.String(length=200), nullable=True),
        sa.Column("torch_version", sa.String(length=50), nullable=True),
        sa.Column("celery_task_id", sa.String(length=100), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("requested_by", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "kind IN ('register', 'calibrate', 'score', 'sensitivity', 'bench')", name=op.f("ck_jobs_kind")
        ),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')", name=op.f("ck_jobs_status")
        ),
        sa.CheckConstraint("progress >= 0 AND progress <= 1", name=op.f("ck_jobs_progress_range")),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_jobs_model_id_models"), ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["plan_id"], ["plans.id"], name=op.f("fk_jobs_plan_id_plans"), ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["requested_by"], ["users.id"], name=op.f("fk_jobs_requested_by_users")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_status_created", ["status", "created_at"], unique=False)

    op.create_table(
        "activation_stats",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.String(length=300), nullable=False),
        sa.Column("in_features", sa.Integer(), nullable=False),
        sa.Column("out_features", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.BigInteger(), nullable=False),
        sa.Column("outlier_ratio", sa.Float(), nullable=False),
        sa.Column("amax", sa.Float(), nullable=False),
        sa.Column("channel_max", sa.LargeBinary(), nullable=False),
        sa.Column("weight_channel_max", sa.LargeBinary(), nullable=False),
        sa.Column("token_max", sa.JSON(), nullable=False),
        sa.Column("hist_counts", sa.LargeBinary(), nullable=False),
        sa.Column("zeros", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_activation_stats_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_activation_stats_model_id_models"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_activation_stats")),
        sa.UniqueConstraint("job_id", "layer", name="uq_activation_stats_job_layer"),
    )
    op.create_table(
        "kernel_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(length=20), nullable=False),
        sa.Column("device_name", sa.String(length=200), nullable=False),
        sa.Column("torch_version", sa.String(length=50), nullable=False),
        sa.Column("m", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=50), nullable=False),
        sa.Column("ms", sa.Float(), nullable=True),
        sa.Column("tflops", sa.Float(), nullable=True),
        sa.Column("pct_peak", sa.Float(), nullable=True),
        sa.Column("speedup", sa.Float(), nullable=True),
        sa.Column("native", sa.Boolean(), nullable=False),
        sa.Column("max_rel_err", sa.Float(), nullable=True),
        sa.Column("padded_m", sa.Integer(), nullable=True),
        sa.Column("padded_k", sa.Integer(), nullable=True),
        sa.Column("padded_n", sa.Integer(), nullable=True),
        sa.Column("skipped", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_kernel_results_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_kernel_results")),
    )
    with op.batch_alter_table("kernel_results", schema=None) as batch_op:
        batch_op.create_index(
            "ix_kernel_results_lookup", ["device_name", "torch_version", "m", "n", "k", "path"], unique=False
        )

    op.create_table(
        "score_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("plan_id", sa.Integer(), nullable=True),
        sa.Column("plan_label", sa.String(length=300), nullable=False),
        sa.Column("plan_body", sa.JSON(), nullable=False),
        sa.Column("dataset", sa.String(length=200), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("kl_mean", sa.Float(), nullable=False),
        sa.Column("kl_p50", sa.Float(), nullable=False),
        sa.Column("kl_p90", sa.Float(), nullable=False),
        sa.Column("kl_p99", sa.Float(), nullable=False),
        sa.Column("kl_max", sa.Float(), nullable=False),
        sa.Column("top1_agree", sa.Float(), nullable=False),
        sa.Column("ppl_ref", sa.Float(), nullable=False),
        sa.Column("ppl", sa.Float(), nullable=False),
        sa.Column("predicted_kl", sa.Float(), nullable=True),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_score_results_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_score_results_model_id_models"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["plan_id"], ["plans.id"], name=op.f("fk_score_results_plan_id_plans"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_score_results")),
        sa.UniqueConstraint("job_id", name=op.f("uq_score_results_job_id")),
    )
    op.create_table(
        "sensitivity_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("scheme", sa.String(length=100), nullable=False),
        sa.Column("unit", sa.String(length=300), nullable=False),
        sa.Column("layers", sa.JSON(), nullable=False),
        sa.Column("kl_mean", sa.Float(), nullable=False),
        sa.Column("top1_agree", sa.Float(), nullable=False),
        sa.Column("sqnr_db", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_sensitivity_results_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_sensitivity_results_model_id_models"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sensitivity_results")),
        sa.UniqueConstraint("job_id", "unit", name="uq_sensitivity_results_job_unit"),
    )


def downgrade() -> None:
    op.drop_table("sensitivity_results")
    op.drop_table("score_results")
    with op.batch_alter_table("kernel_results", schema=None) as batch_op:
        batch_op.drop_index("ix_kernel_results_lookup")

    op.drop_table("kernel_results")
    op.drop_table("activation_stats")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_status_created")

    op.drop_table("jobs")
    op.drop_table("plans")
    op.drop_table("models")
    op.drop_table("datasets")
    op.drop_table("users")
