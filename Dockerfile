# Ferry's image: one image for every process (web, node, worker, beat); the command picks the role.
#   docker build -t ferry:latest .                                  # CPU torch (web, worker, beat, CPU nodes)
#   docker build -t ferry-cuda:latest \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # GPU nodes
# A CUDA torch wheel carries its CUDA libraries, so the slim Python base serves GPU nodes too; the driver
# comes from the host (NVIDIA container toolkit). BASE_IMAGE may name any Debian-like image with python3.11+.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
# torch first, from the chosen index, so the dependencies below never pull a second (CUDA) build.
RUN /opt/venv/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml /tmp/ferry/
# Only the dependencies (with the demo extra: the compose file trains the demo models; and the s3 extra, so
# FERRY_ARTIFACT_STORAGE=s3 works on the read-only root), the source copied later, so a code change does not
# reinstall them.
RUN /opt/venv/bin/python -c "import tomllib; p = tomllib.load(open('/tmp/ferry/pyproject.toml','rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['demo'] + p['optional-dependencies']['s3']))" \
      > /tmp/ferry/requirements.txt \
 && /opt/venv/bin/pip install -r /tmp/ferry/requirements.txt

FROM ${BASE_IMAGE}
# A fixed non-root uid, so Kubernetes' runAsNonRoot can check it and volumes can be owned by it.
RUN groupadd --system --gid 10001 ferry \
 && useradd --system --uid 10001 --gid ferry --home-dir /var/lib/ferry --shell /usr/sbin/nologin ferry \
 && mkdir -p /var/lib/ferry/artifacts \
 && chown -R ferry:ferry /var/lib/ferry
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY --chown=root:root . /app
# PYTHONPATH lets beat run from its writable working directory and still import config.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    FERRY_DATA_DIR=/var/lib/ferry \
    HOME=/var/lib/ferry
USER 10001:10001
EXPOSE 8000
CMD ["python", "manage.py", "serve", "--host", "0.0.0.0", "--port", "8000"]
