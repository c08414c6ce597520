# syntax=docker/dockerfile:1
# The control plane's image: `docker build -t burstgate:0.1.0 .`
# (deploy/README.md, "Images"). Every RUN calls deploy/image/build.sh, which
# CI runs on the host (tests/integration/deploy); this file only orders the
# stages and sets the runtime's user, ports, health check and command.
#
# Pin the base by digest in your build (PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...):
# both stages must use the same one, since the venv is copied between them.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY . /src
RUN ["sh", "/src/deploy/image/build.sh", "toolchain"]
RUN ["sh", "/src/deploy/image/build.sh", "build-venv", "/opt/build"]
RUN ["sh", "/src/deploy/image/build.sh", "wheels", "/src", "/wheels", "plane"]
RUN ["sh", "/src/deploy/image/build.sh", "runtime", "/opt/burstgate", "plane"]
RUN ["sh", "/src/deploy/image/build.sh", "app", "/opt/burstgate", "/wheels", "plane"]

# The runtime: the base image and the venv, no compiler, no build tools,
# no pip in the venv.
FROM ${PYTHON_IMAGE}
COPY --from=build /opt/burstgate /opt/burstgate
ENV PATH=/opt/burstgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    BURSTGATE_HOST=0.0.0.0 \
    BURSTGATE_PORT=50051 \
    BURSTGATE_METRICS_PORT=9464 \
    BURSTGATE_LOG_FORMAT=json \
    HOME=/tmp
# Writable state (SQLite, the ledger's spool) goes under /var/lib/burstgate:
# mount a volume there; the root filesystem can stay read-only.
WORKDIR /var/lib/burstgate
# A numeric user (not in /etc/passwd: nothing needs a name), so Kubernetes'
# runAsNonRoot can verify it without a runAsUser.
USER 65532:65532
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["burstgate-healthcheck", "grpc"]
ENTRYPOINT ["burstgate"]
CMD ["serve"]
