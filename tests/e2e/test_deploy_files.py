"""The deployment files reference nothing stale: Dockerfile, docker-compose.yml (and the files
it mounts: router configs, nginx, Prometheus, Grafana), the Kubernetes manifests.

Checked against the project itself: CLI flags against ``kvrouter <cmd> --help``, config files
and ``KVROUTER_*`` environment through the real config loader, health/metrics paths against
the router's and the simulator's route tables, ports against the configs, hostnames against
compose services / Kubernetes Services, and every metric the dashboard queries against the
live ``/metrics`` of a running router and a running ``kvrouter sim`` (SGLang names against
the project's SGLang knowledge in ``backends/engines.py``: no SGLang runs here).

``Compose`` (the parsed compose file with ``${VAR:-default}`` interpolation) is also used by
``test_compose_topology.py``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml

from router.config import Config, check_policy, load_config
from tests.support.services import ROOT, kvrouter_argv

COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "config" / "grafana" / "dashboards" / "kvrouter.json"
ENGINE_SERVICES_PORT_FLAG = re.compile(r"^--port(?:=(\d+))?$")
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str] | None = None) -> Any:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` substitution (``env`` wins over defaults)."""
    env = env or {}
    if isinstance(value, str):
        return _VAR.sub(lambda m: env.get(m.group(1), m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


class Compose:
    """docker-compose.yml, interpolated with ``env`` (defaults otherwise)."""

    def __init__(self, env: dict[str, str] | None = None, path: Path = COMPOSE) -> None:
        self.raw = yaml.safe_load(path.read_text())
        self.doc = interpolate(self.raw, env)
        self.services: dict[str, dict[str, Any]] = self.doc["services"]

    def command(self, name: str) -> list[str]:
        cmd = self.services[name].get("command") or []
        return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]

    def env(self, name: str) -> dict[str, str]:
        e = self.services[name].get("environment") or {}
        if isinstance(e, list):
            e = dict(item.split("=", 1) for item in e)
        return {k: "" if v is None else str(v) for k, v in e.items()}

    def kvrouter_services(self) -> list[str]:
        img = self.doc["x-kvrouter"]["image"]
        return [n for n, s in self.services.items() if s.get("image") == img]

    def by_subcommand(self, sub: str) -> list[str]:
        return [n for n in self.kvrouter_services() if self.command(n)[:1] == [sub]]

    def host_path(self, service: str, container_path: str) -> Path:
        """The host file behind ``container_path`` through the service's bind mounts."""
        for v in self.services[service].get("volumes") or []:
            src, dst = v.split(":")[:2]
            if container_path == dst or container_path.startswith(dst.rstrip("/") + "/"):
                return (ROOT / src).resolve() / container_path[len(dst):].lstrip("/")
        raise AssertionError(f"{service}: {container_path} is not mounted")

    def listen_port(self, name: str) -> int:
        """The port the service's process listens on inside its container."""
        cmd = self.command(name)
        if cmd[:1] == ["serve"]:
            return self.router_config(name).listen.port
        for i, a in enumerate(cmd):
            if a == "--port":
                return int(cmd[i + 1])
            if a.startswith("--port="):
                return int(a.split("=", 1)[1])
        image = str(self.services[name].get("image", ""))
        defaults = {"redis": 6379, "prom/prometheus": 9090, "grafana/grafana": 3000}
        for prefix, port in defaults.items():
            if image.startswith(prefix):
                return port
        raise AssertionError(f"{name}: no known listening port")

    def router_config_path(self, name: str) -> Path:
        cmd = self.command(name)
        return self.host_path(name, cmd[cmd.index("--config") + 1])

    def router_config(self, name: str) -> Config:
        env = {k: v for k, v in {**image_env(), **self.env(name)}.items() if k.startswith("KVROUTER_")}
        return load_config(self.router_config_path(name), env=env)


@functools.cache
def cli_flags(sub: str) -> frozenset[str]:
    out = subprocess.run(kvrouter_argv(sub, "--help"), capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout))


def assert_cli(args: list[str], where: str) -> None:
    from router.cli import COMMANDS

    assert args and args[0] in COMMANDS, f"{where}: {args[:1]} is not a kvrouter command"
    flags = cli_flags(args[0])
    for a in args[1:]:
        if a.startswith("--"):
            assert a.split("=", 1)[0] in flags, f"{where}: kvrouter {args[0]} has no flag {a}"


@functools.cache
def router_paths() -> frozenset[str]:
    from router.server import build_app

    app = build_app(Config.from_dict({"replicas": [{"url": "http://127.0.0.1:9", "models": ["m"]}]}))
    return frozenset(r.canonical for r in app.router.resources())


@functools.cache
def sim_paths() -> frozenset[str]:
    from backends.sim.cli import build_server

    server, _ = build_server(["--num-blocks", "64", "--max-model-len", "512"])
    return frozenset(r.canonical for r in server.make_app().router.resources())


def hostport(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    assert u.hostname and u.port, url
    return u.hostname, u.port


# ---------------------------------------------------------------------- Dockerfile


def dockerfile() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def image_env() -> dict[str, str]:
    """The ENV of the image's final stage (every container of the image starts with it)."""
    ins = dockerfile()
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    return dict(re.findall(r"(\w+)=(\S+)", " ".join(r for w, r in final if w == "ENV")))


def test_dockerfile_is_small_non_root_and_runs_real_commands():
    ins = dockerfile()
    assert sum(1 for w, _ in ins if w == "FROM") >= 2, "multi-stage"
    assert ins[[w for w, _ in ins].index("FROM", 1)][1].split()[0].endswith("-slim")
    final_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    final = ins[final_from:]
    assert not any(w == "RUN" and ("apt-get install" in r or "pip install" in r) for w, r in final), \
        "no build tools or installs in the final stage"
    user = [r for w, r in final if w == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    for w, r in ins:
        if w == "COPY" and "--from" not in r:
            for src in r.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: missing"
    entry = json.loads(next(r for w, r in final if w == "ENTRYPOINT"))
    assert entry == ["kvrouter"]
    assert 'kvrouter = "router.cli:main"' in (ROOT / "pyproject.toml").read_text()
    cmd = json.loads(next(r for w, r in final if w == "CMD"))
    assert_cli(cmd, "Dockerfile CMD")
    cfg_in_image = next(r for w, r in final if w == "COPY" and r.endswith(cmd[cmd.index("--config") + 1]))
    env = image_env()
    cfg = load_config(ROOT / cfg_in_image.split()[0], env={k: v for k, v in env.items() if "__" in k},
                      overrides={"listen.host": cmd[cmd.index("--host") + 1]})
    check_policy(cfg)
    exposed = int(next(r for w, r in final if w == "EXPOSE"))
    assert cfg.listen.port == exposed and cfg.listen.host == "0.0.0.0"
    health = next(r for w, r in final if w == "HEALTHCHECK")
    assert "KVROUTER_HEALTHCHECK_URL" in health
    host, port = hostport(env["KVROUTER_HEALTHCHECK_URL"])
    assert port == exposed and urlsplit(env["KVROUTER_HEALTHCHECK_URL"]).path in router_paths()
    assert "/health" in sim_paths()  # the same image runs `kvrouter sim` with the same healthcheck
    ignored = (ROOT / ".dockerignore").read_text().split()
    for needed in ("router", "backends", "loadtest", "pyproject.toml", "README.md", "config"):
        assert needed not in ignored


# ---------------------------------------------------------------------- compose


@pytest.fixture(scope="module", params=["sim", "gpu"])
def compose(request) -> Compose:
    return Compose({"KVROUTER_ENGINES": request.param})


def test_compose_kvrouter_services_use_real_commands_flags_and_env(compose: Compose):
    assert compose.kvrouter_services(), "no service runs the kvrouter image"
    for name in compose.kvrouter_services():
        assert_cli(compose.command(name), f"compose {name}")
        for key in compose.env(name):
            assert key.startswith("KVROUTER_"), key
            if "__" not in key:  # not a config key: must be used by the image
                assert key in (ROOT / "Dockerfile").read_text(), f"{name}: {key} unused"
    routers = compose.by_subcommand("serve")
    assert len(routers) == 2
    for name in routers:
        cfg = compose.router_config(name)  # file + env through the real loader
        check_policy(cfg)
        assert cfg.index.backend == "redis", "both routers share placement through Redis"
        assert cfg.listen.host == "0.0.0.0"
        container_ports = [int(str(p).split(":")[-1]) for p in compose.services[name]["ports"]]
        assert container_ports == [cfg.listen.port]
        hc = compose.env(name).get("KVROUTER_HEALTHCHECK_URL")
        if hc:
            assert hostport(hc)[1] == cfg.listen.port and urlsplit(hc).path in router_paths()
        h, p = hostport(cfg.index.url or "")
        assert h in compose.services and p == compose.listen_port(h)
        assert cfg.health.path in sim_paths() and cfg.scrape.path in sim_paths()
        for rep in cfg.replicas:
            h, p = hostport(rep.url)
            assert h in compose.services, f"{name}: replica host {h} is no compose service"
            assert p == compose.listen_port(h), f"{name}: {rep.url} but {h} listens on {compose.listen_port(h)}"
            if rep.kv_events:
                eh, ep = hostport(rep.kv_events.endpoint.replace("tcp://", "http://"))
                assert eh == h
                engine_cfg = kv_events_config(compose.command(h))
                assert ep == hostport(engine_cfg.endpoint.replace("tcp://*", "http://x"))[1]
        if compose.doc["services"]["sim-1"] and cfg.replicas[0].url.startswith("http://sim-"):
            assert set(cfg.model_names()) == {arg_value(compose.command(h), "--model")
                                               for h in compose.by_subcommand("sim")}
    for v in (s.get("volumes") or [] for s in compose.services.values()):
        for vol in v:
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"volume source {src} missing"


def arg_value(cmd: list[str], flag: str) -> str:
    for i, a in enumerate(cmd):
        if a == flag:
            return cmd[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {cmd}")


def kv_events_config(cmd: list[str]) -> Any:
    from backends.sim.kv_publisher import KVEventsConfig

    cfg = KVEventsConfig.from_json(arg_value(cmd, "--kv-events-config"))
    assert cfg.enabled
    return cfg


def test_compose_profiles_and_gpu_engines():
    c = Compose()
    sims = c.by_subcommand("sim")
    assert len(sims) == 3 and all(c.services[s]["profiles"] == ["sim"] for s in sims)
    gpu = [n for n, s in c.services.items() if "gpu" in (s.get("profiles") or [])]
    vllm = [n for n in gpu if c.services[n]["image"].startswith("vllm/vllm-openai")]
    sglang = [n for n in gpu if c.services[n]["image"].startswith("lmsysorg/sglang")]
    assert len(vllm) >= 2 and sglang
    for n in vllm:
        cmd = c.command(n)
        assert "--enable-prefix-caching" in cmd
        assert arg_value(cmd, "--quantization") in ("awq", "fp8")
        assert arg_value(cmd, "--kv-cache-dtype") == "fp8"
        spec = json.loads(arg_value(cmd, "--speculative-config"))
        assert spec["method"] and spec["num_speculative_tokens"] >= 1
        kv_events_config(cmd)
        dev = c.services[n]["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    for n in sglang:
        cmd = c.command(n)
        assert "sglang.launch_server" in cmd and "--enable-metrics" in cmd
    gpu_routers = Compose({"KVROUTER_ENGINES": "gpu"})
    hosts = {hostport(r.url)[0] for r in gpu_routers.router_config("router-1").replicas}
    assert hosts == set(vllm) | set(sglang)
    assert {hostport(r.url)[0] for r in c.router_config("router-1").replicas} == set(sims)


def test_nginx_prometheus_and_grafana_point_at_real_services():
    c = Compose()
    routers = c.by_subcommand("serve")
    nginx = (ROOT / "config" / "compose" / "nginx.conf").read_text()
    servers = re.findall(r"^\s*server\s+([\w.-]+):(\d+)", nginx, re.M)
    assert {s for s, _ in servers} == set(routers)
    for s, p in servers:
        assert int(p) == c.listen_port(s)
    listen = int(re.search(r"listen\s+(\d+);", nginx).group(1))
    assert [int(str(p).split(":")[-1]) for p in c.services["lb"]["ports"]] == [listen]
    assert "proxy_buffering off" in nginx  # streams pass through
    prom = yaml.safe_load((ROOT / "config" / "compose" / "prometheus.yml").read_text())
    targets: set[str] = set()
    for job in prom["scrape_configs"]:
        path = job.get("metrics_path", "/metrics")
        for sc in job["static_configs"]:
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                assert host in c.services, t
                assert int(port) == c.listen_port(host), t
                targets.add(host)
                if c.command(host)[:1] == ["serve"]:
                    assert path in router_paths()
                elif c.command(host)[:1] == ["sim"]:
                    assert path in sim_paths()
    assert set(routers) | set(c.by_subcommand("sim")) <= targets
    prom_mounts = c.services["prometheus"]["volumes"]
    assert any(v.startswith("./config/compose/prometheus.yml:") for v in prom_mounts)
    ds = yaml.safe_load((ROOT / "config/grafana/provisioning/datasources/prometheus.yml").read_text())
    src = ds["datasources"][0]
    h, p = hostport(src["url"])
    assert h == "prometheus" and p == c.listen_port("prometheus")
    prov = yaml.safe_load((ROOT / "config/grafana/provisioning/dashboards/kvrouter.yml").read_text())
    dash_dir = prov["providers"][0]["options"]["path"]
    assert c.host_path("grafana", dash_dir + "/kvrouter.json") == DASHBOARD.resolve()
    assert c.host_path("grafana", "/etc/grafana/provisioning/datasources/prometheus.yml").exists()
    dash = json.loads(DASHBOARD.read_text())
    uids = {p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p}
    assert uids == {src["uid"]}


# ---------------------------------------------------------------------- Kubernetes


def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for f in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind} {name}")


def pod_containers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod template spec, container) for every kvrouter container."""
    out = []
    for d in docs:
        if d["kind"] == "Deployment":
            spec = d["spec"]["template"]["spec"]
            for c in spec["containers"]:
                if c["image"].split(":")[0].endswith("kvrouter"):
                    out.append((d, c))
    return out


def test_kustomization_lists_existing_files():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for r in k["resources"]:
        assert (K8S / r).exists(), r
    assert {i["name"] for i in k["images"]} == {"kvrouter"}


def test_kubernetes_router_manifests_reference_real_keys_paths_and_ports(tmp_path: Path):
    docs = k8s_docs()
    secrets = {d["metadata"]["name"]: d.get("stringData") or {} for d in docs if d["kind"] == "Secret"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    checked = 0
    for dep, c in pod_containers(docs):
        where = f"{dep['metadata']['name']}/{c['name']}"
        pod = dep["spec"]["template"]
        assert_cli(c["args"], where)
        cfg_path = c["args"][c["args"].index("--config") + 1]
        mount = next(m for m in c["volumeMounts"] if cfg_path.startswith(m["mountPath"].rstrip("/") + "/"))
        vol = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
        cm = find(docs, "ConfigMap", vol["configMap"]["name"])
        text = cm["data"][cfg_path[len(mount["mountPath"]):].lstrip("/")]
        env: dict[str, str] = {k: v for k, v in image_env().items() if "__" in k}  # the image's, then the pod's
        for e in c.get("env") or []:
            if "valueFrom" in e:
                ref = e["valueFrom"]["secretKeyRef"]
                assert ref["key"] in secrets[ref["name"]], f"{where}: secret key {ref}"
                env[e["name"]] = secrets[ref["name"]][ref["key"]]
            else:
                env[e["name"]] = e["value"]
        for k in (e["name"] for e in c.get("env") or []):
            assert k.startswith("KVROUTER_") and "__" in k, f"{where}: {k} is not a config key"
        cfg_file = tmp_path / f"{where.replace('/', '-')}.yaml"
        cfg_file.write_text(text)
        cfg = load_config(cfg_file, env=env)  # the file and the Secret's env, through the real loader
        check_policy(cfg)
        ports = {p["name"]: p["containerPort"] for p in c.get("ports") or []}
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = c.get(kind)
            if not probe:
                continue
            if "httpGet" in probe:
                path, port = probe["httpGet"]["path"], probe["httpGet"]["port"]
                port = ports[port] if isinstance(port, str) else port
                assert "host" not in probe["httpGet"]
            else:
                url = re.search(r"https?://[^'\"]+", " ".join(probe["exec"]["command"])).group(0)
                h, port = hostport(url)
                path = urlsplit(url).path
                assert h == cfg.listen.host
            assert path in router_paths() and port == cfg.listen.port, f"{where}: {kind}"
        assert c["readinessProbe"].get("httpGet", {}).get("path", "/ready") == "/ready" or \
            "/ready" in " ".join(c["readinessProbe"]["exec"]["command"])
        assert "/health" in json.dumps(c["livenessProbe"])
        ann = pod["metadata"].get("annotations") or {}
        if ann.get("prometheus.io/scrape") == "true":
            assert int(ann["prometheus.io/port"]) == cfg.listen.port == ports["http"]
            assert ann["prometheus.io/path"] in router_paths()
            assert cfg.listen.host == "0.0.0.0"
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        assert grace > cfg.lifecycle.drain_delay_s + cfg.lifecycle.shutdown_grace_s, where
        if cfg.index.backend == "redis":
            h, p = hostport(cfg.index.url or "")
            assert p in [sp["port"] for sp in services[h]["spec"]["ports"]]
        if cfg.discovery.mode in ("dns", "kubernetes"):
            for m in cfg.model_names():  # `backend` tokenizes on static replicas only
                assert cfg.model(m).tokenizer != "backend" or cfg.replicas, f"{where}: {m} tokenizer"
            svc = services[cfg.discovery.name.split(".")[0]]
            assert svc["spec"].get("clusterIP") == "None", "DNS discovery needs a headless Service"
            assert cfg.discovery.port in [sp["port"] for sp in svc["spec"]["ports"]]
            engines = [d for d in docs if d["kind"] == "Deployment" and
                       d["spec"]["template"]["metadata"]["labels"].items() >= svc["spec"]["selector"].items()]
            assert engines, "the headless Service selects the engine pods"
            for e in engines:
                eports = [p["containerPort"] for p in e["spec"]["template"]["spec"]["containers"][0]["ports"]]
                assert cfg.discovery.port in eports
        sa = pod["spec"].get("serviceAccountName")
        if sa:
            find(docs, "ServiceAccount", sa)
        checked += 1
    assert checked >= 2  # the shared Deployment and the sidecar
    router_svc = services["kvrouter"]
    dep = find(docs, "Deployment", "kvrouter")
    assert dep["spec"]["replicas"] >= 2
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels.items() >= router_svc["spec"]["selector"].items()
    cport = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert all(p["targetPort"] in cport for p in router_svc["spec"]["ports"])
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= router_svc["metadata"]["labels"].items()
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in router_svc["spec"]["ports"]}
    assert all(e["path"] in router_paths() for e in sm["spec"]["endpoints"])
    role = find(docs, "Role", "kvrouter-endpointslices")
    assert any("endpointslices" in r["resources"] and "list" in r["verbs"] for r in role["rules"])
    redis = find(docs, "Deployment", "kvrouter-redis")
    assert redis["spec"]["replicas"] == 1


def test_kubernetes_engines_have_the_issue_flags():
    docs = k8s_docs()
    vllm = find(docs, "Deployment", "vllm")
    args = vllm["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-prefix-caching" in args
    kv = kv_events_config(args)
    svc = find(docs, "Service", "vllm-headless")
    assert hostport(kv.endpoint.replace("tcp://*", "http://x"))[1] in [p["port"] for p in svc["spec"]["ports"]]


# ---------------------------------------------------------------------- dashboard vs live metrics

_METRIC = re.compile(r"(?:kvrouter_|vllm:|sglang:)[A-Za-z0-9_:]*")


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = []
    for p in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs))
        exprs += [t["expr"] for t in p["targets"]]
    text = json.dumps(dash).lower()
    for topic in ("req", "ttft", "router-added", "reason", "predicted", "per replica", "running", "waiting",
                  "kv-cache usage", "hit rate", "preemption"):
        assert topic in text, f"dashboard lacks {topic}"
    return exprs


def exposition_names(text: str) -> dict[str, set[str]]:
    """sample name → label names, from a Prometheus text page (plus HELP/TYPE'd names)."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            for suffix in {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(kind, ("",)):
                out.setdefault(name + suffix, set())
        elif line and not line.startswith("#"):
            m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?", line)
            if m:
                labels = set(re.findall(r'([A-Za-z_]\w*)="', m.group(2) or ""))
                out.setdefault(m.group(1), set()).update(labels)
    return out


async def test_dashboard_queries_name_metrics_router_and_engine_export(sim_factory):
    from backends.engines import SGLANG_METRICS
    from router.lifecycle import Lifecycle
    from router.server import Server

    exprs = dashboard_queries()
    (sim,) = sim_factory(1, time_scale=0, model="llama-3.1-8b")
    cfg = Compose().router_config("router-1").to_dict()
    cfg.update(listen={"host": "127.0.0.1", "port": 0}, index={"backend": "memory"},
               replicas=[{"id": "sim-1", "url": sim.url, "models": ["llama-3.1-8b"]}])
    cfg["logging"]["requests"] = False
    srv = await Server(Config.from_dict(cfg)).start()
    Lifecycle(srv)  # registers the reload / drain metrics, as `kvrouter serve` does
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "llama-3.1-8b", "prompt": "the same prompt " * 40, "max_tokens": 4}
            for _ in range(3):
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
            async with s.post(srv.url + "/v1/completions", json={"model": "nope"}) as r:
                assert r.status == 404
            async with s.get(srv.url + "/metrics") as r:
                router_names = exposition_names(await r.text())
        # labelled families with no sample yet (retries, upstream errors, ejections: nothing
        # failed) are absent from the page: take their names and labels from the same router's
        # registry, which is what the page renders once they have a sample
            async with s.get(sim.url + "/metrics") as r:
                engine_names = exposition_names(await r.text())
        for coll in list(srv.state.registry._collector_to_names):
            for name in srv.state.registry._collector_to_names[coll]:
                router_names.setdefault(name, set(getattr(coll, "_labelnames", ())))
    finally:
        await srv.stop()
    sglang = set(SGLANG_METRICS.values())
    missing = []
    for expr in exprs:
        names = _METRIC.findall(expr)
        assert names, expr
        labels: set[str] = set()
        unsampled = False  # a labelled metric with no sample yet: its labels are unknown
        for n in names:
            known = router_names if n.startswith("kvrouter_") else engine_names
            if n.startswith("sglang:"):
                if n not in sglang:
                    missing.append(n)
                continue
            if n not in known:
                missing.append(n)
            labels |= known.get(n, set())
            unsampled |= not known.get(n)
        for group in [] if unsampled else re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                if label not in ("le", "instance", "job") and not all(x.startswith("sglang:") for x in names):
                    assert label in labels, f"{expr}: label {label} not on {names}"
    assert not missing, f"dashboard queries metrics nobody exports: {sorted(set(missing))}"


def test_no_env_leaks_into_compose_defaults():
    """Interpolation with an empty environment gives the documented defaults."""
    c = Compose({})
    assert c.command("router-1")[-1] == "/etc/kvrouter/router-sim.yaml"
    assert os.path.basename(str(c.router_config_path("router-1"))) == "router-sim.yaml"
