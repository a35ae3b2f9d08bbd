"""Router config: defaults, YAML, env and CLI overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import Config, ConfigError, check_policy, load_config
from router.config_cli import main as config_main

ROOT = Path(__file__).resolve().parents[2]
REP = {"url": "http://127.0.0.1:9001", "models": ["m"]}


def test_defaults_match_the_seams():
    c = Config.from_dict({"replicas": [REP]})
    assert (c.listen.host, c.listen.port) == ("127.0.0.1", 8000)
    assert c.index.backend == "memory" and c.index.namespace == "kvrouter"
    assert c.replicas[0].id == "r0" and c.replicas[0].models == ("m",)
    assert c.model("m").block_size == 16 and c.model("m").tokenizer == "builtin"
    assert c.headers.replica_header == "x-kvrouter-replica"


def test_example_file_is_valid_and_documents_every_key():
    path = ROOT / "config" / "router.yaml"
    cfg = Config.from_file(path)
    check_policy(cfg)
    text = path.read_text()
    for section, value in cfg.to_dict().items():
        assert f"{section}:" in text, section
        if isinstance(value, dict) and section not in ("models",):
            for key in value:
                if section == "policy" and key == "options":
                    continue
                assert f"  {key}:" in text, f"{section}.{key} missing from config/router.yaml"
    for key in cfg.to_dict()["replicas"][0]:
        assert f"{key}:" in text, f"replicas[].{key}"


@pytest.mark.parametrize("data, key", [
    ({"replicas": [REP, REP, {"url": "ftp://x:1", "models": ["m"]}]}, "replicas[2].url"),
    ({"replicas": [{"url": "http://h", "models": ["m"]}]}, "replicas[0].url"),
    ({"replicas": [{"url": "http://h:1"}]}, "replicas[0].models"),
    ({"replicas": [{"url": "http://h:1", "models": []}]}, "replicas[0].models"),
    ({"replicas": [{**REP, "id": "a"}, {**REP, "id": "a"}]}, "replicas[1].id"),
    ({"listen": {"port": 70000}}, "listen.port"),
    ({"listen": {"port": "80"}}, "listen.port"),
    ({"listen": {"prot": 80}}, "listen.prot"),
    ({"upstream": {"connect_timeout_s": 0}}, "upstream.connect_timeout_s"),
    ({"health": {"path": "health"}}, "health.path"),
    ({"logging": {"format": "xml"}}, "logging.format"),
    ({"index": {"backend": "redis"}}, "index.url"),
    ({"models": {"m": {"block_size": 0}}}, "models.m.block_size"),
    ({"auth": {"api_keys": [1]}}, "auth.api_keys"),
    ({"bogus": {}}, "bogus"),
])
def test_errors_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        Config.from_dict(data)
    assert e.value.key == key
    assert str(e.value).startswith(key + ": ")


def test_url_error_message():
    with pytest.raises(ConfigError, match=r"^replicas\[0\]\.url: must be http\(s\)://host:port$"):
        Config.from_dict({"replicas": [{"url": "localhost:9000", "models": ["m"]}]})


def test_env_and_overrides_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("listen: {port: 8100}\npolicy: {name: random}\nreplicas:\n"
                 "  - {url: 'http://127.0.0.1:9001', models: [m]}\n")
    env = {"KVROUTER_LISTEN__PORT": "8200", "KVROUTER_AUTH__API_KEYS": "a,b",
           "KVROUTER_UPSTREAM__MAX_RETRIES": "4", "OTHER": "x"}
    c = load_config(f, env=env)
    assert c.listen.port == 8200 and c.auth.api_keys == ("a", "b") and c.upstream.max_retries == 4
    assert c.policy.name == "random"
    c = load_config(f, env=env, overrides=["listen.port=8300", "replicas[0].api_key=sk"])
    assert c.listen.port == 8300 and c.replicas[0].api_key == "sk"
    with pytest.raises(ConfigError) as e:
        load_config(f, env={"KVROUTER_LISTEN__PORT": "eighty"})
    assert e.value.key == "listen.port"


def test_unknown_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="policy.name"):
        check_policy(Config.from_dict({"policy": {"name": "nope"}}))


def test_round_trip():
    c = Config.from_file(ROOT / "config" / "router.yaml")
    assert Config.from_dict(c.to_dict()) == c


def test_config_check_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVROUTER_LISTEN__PORT", raising=False)
    assert config_main(["check", str(ROOT / "config" / "router.yaml")]) == 0
    assert "ok" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas:\n  - {url: 'http://x:1', models: [m]}\n  - {url: nope, models: [m]}\n")
    assert config_main(["check", str(bad)]) == 1
    assert "replicas[1].url: must be http(s)://host:port" in capsys.readouterr().err
    (tmp_path / "y.yaml").write_text("listen: [\n")
    assert config_main(["check", str(tmp_path / "y.yaml")]) == 1
    assert "invalid YAML" in capsys.readouterr().err
    assert config_main(["show", str(ROOT / "config" / "router.yaml"), "--set", "auth.admin_key=s3"]) == 0
    out = capsys.readouterr().out
    assert "admin_key: '***'" in out and "s3" not in out


def test_config_show_redacts_every_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Passwords inside URLs (index, shared load, replicas) and every key are printed as ***."""
    cfg = tmp_path / "secrets.yaml"
    cfg.write_text(
        "index: {backend: redis, url: 'rediss://user:idxPW1@a:1,b:2/0'}\n"
        "shared_load: {enabled: true, url: 'redis://:slPW2@h:1/0?password=qPW3&db=1'}\n"
        "auth: {api_keys: [clientK4, clientK5], admin_key: admK6}\n"
        "discovery: {api_key: discK7}\n"
        "replicas:\n  - {id: r0, url: 'http://u:repPW8@127.0.0.1:9', models: [m], api_key: repK9}\n")
    assert config_main(["show", str(cfg), "--no-env"]) == 0
    out = capsys.readouterr().out
    for secret in ("idxPW1", "slPW2", "qPW3", "clientK4", "clientK5", "admK6", "discK7", "repPW8", "repK9"):
        assert secret not in out, secret
    assert "url: rediss://user:***@a:1,b:2/0" in out  # what is not secret stays readable
    assert "url: redis://:***@h:1/0?password=***&db=1" in out
    assert "url: http://u:***@127.0.0.1:9" in out
    assert "admin_key: '***'" in out and "api_keys: '***'" in out
