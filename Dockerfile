# syntax=docker/dockerfile:1
# prefix-router container image.
#
#   docker build -t prefix-router:dev .
#   docker run --rm -p 8080:8080 -e PREFIX_ROUTER_BACKENDS=http://vllm-0:8000,http://vllm-1:8000 prefix-router:dev
#   docker run --rm -p 8080:8080 -v "$PWD/config.yaml:/etc/prefix-router/config.yaml:ro" prefix-router:dev
#
# Two stages: the builder makes a wheel of the project and a virtualenv holding exactly the pins of
# requirements.lock; the runtime stage is the slim base plus that virtualenv, run as UID 10001.
# The base tag must stay on the CPython minor that requirements.lock was generated with (see its header).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /build

# Dependencies first, so editing the source does not invalidate this layer. --no-deps: the lock is complete
# by contract, and `pip check` below fails the build if it is not.
COPY requirements.lock ./
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-deps --requirement requirements.lock

# Only what the wheel needs: never the .git directory, tests, benchmarks or local virtualenvs
# (.dockerignore keeps them out of the build context as well).
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/venv/bin/pip wheel --no-deps --wheel-dir /build/dist . \
    && /opt/venv/bin/pip install --no-deps /build/dist/*.whl \
    && /opt/venv/bin/pip check \
    && /opt/venv/bin/prefix-router --help > /dev/null \
    && /opt/venv/bin/pip uninstall --yes pip setuptools

FROM ${PYTHON_IMAGE} AS runtime

ARG VERSION=dev
LABEL org.opencontainers.image.title="prefix-router" \
      org.opencontainers.image.description="Prefix-cache-aware HTTP routing proxy for vLLM fleets" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:${PATH}

# A fixed numeric UID/GID, so Kubernetes' runAsNonRoot can verify it and runAsUser can name it.
# The base image's own pip/setuptools/wheel are removed: nothing installs packages at run time.
# The default config is an empty mapping (every setting at its default); mount a real one over it
# (the Helm chart mounts its ConfigMap there) or override with PREFIX_ROUTER_<SECTION>__<FIELD> variables.
RUN groupadd --system --gid 10001 prefix-router \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin prefix-router \
    && python -m pip uninstall --yes --no-cache-dir pip setuptools wheel \
    && mkdir -p /etc/prefix-router \
    && echo '{}' > /etc/prefix-router/config.yaml

COPY --from=builder /opt/venv /opt/venv

USER 10001:10001
WORKDIR /tmp

EXPOSE 8080

# slim has no curl: probe /healthz with the interpreter that is already there. Kubernetes ignores this
# and uses the chart's probes; it serves `docker run` and compose.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('PREFIX_ROUTER_SERVER__PORT', '8080') + '/healthz', timeout=2)"]

# SIGTERM (the default stop signal) starts the drain: /readyz fails at once, in-flight streams get up to
# server.drain_timeout_s to finish, then the process exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["prefix-router"]
CMD ["serve", "--config", "/etc/prefix-router/config.yaml"]
