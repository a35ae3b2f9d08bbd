# kvrouter image: the router (`kvrouter serve`), the simulated engine (`kvrouter sim`) and every
# other `kvrouter` command. Multi-stage: dependencies are built in a throwaway stage; the final
# image has the virtualenv and a non-root user, no compiler, no pip cache.
#   docker build -t kvrouter:latest .
#   docker run --rm -p 8000:8000 -v $PWD/config/router.yaml:/etc/kvrouter/router.yaml:ro kvrouter:latest
# See docs/deployment.md.
ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvrouter
WORKDIR /src
# dependencies first (a code change does not reinstall them), then the project itself
COPY pyproject.toml README.md ./
RUN mkdir -p router backends loadtest && touch router/__init__.py backends/__init__.py loadtest/__init__.py \
 && /opt/kvrouter/bin/pip install . && /opt/kvrouter/bin/pip uninstall -y kvrouter
COPY router ./router
COPY backends ./backends
COPY loadtest ./loadtest
RUN /opt/kvrouter/bin/pip install --no-deps . \
 && /opt/kvrouter/bin/pip uninstall -y pip setuptools wheel || true

FROM python:${PYTHON_VERSION}-slim
RUN groupadd --system --gid 10001 kvrouter \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvrouter
COPY --from=build /opt/kvrouter /opt/kvrouter
COPY config/router.yaml /etc/kvrouter/router.yaml
ENV PATH=/opt/kvrouter/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVROUTER_HEALTHCHECK_URL=http://127.0.0.1:8000/health
USER 10001:10001
EXPOSE 8000
# SIGTERM drains: /ready fails, in-flight streams finish (lifecycle.shutdown_grace_s), exit 0
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['KVROUTER_HEALTHCHECK_URL'], timeout=2)"]
ENTRYPOINT ["kvrouter"]
# --host only in the default command: given your own arguments, your config's listen.host rules
CMD ["serve", "--config", "/etc/kvrouter/router.yaml", "--host", "0.0.0.0"]
