"""Config audit fixes: a ``models.<m>.tokenizer`` path is checked at load (so ``config
check`` fails where ``serve`` would), and a bad value from a ``KVROUTER_*`` variable is
reported under the variable's name, not the file's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from router.config import ConfigError, load_config
from router.config_cli import main as config_main
from router.serve_cli import main as serve_main

REPLICA = "replicas:\n  - {url: 'http://127.0.0.1:1', models: [m]}\n"


def _with_tokenizer(tmp_path: Path, spec: str) -> Path:
    f = tmp_path / "router.yaml"
    f.write_text(f"models:\n  m: {{tokenizer: '{spec}', block_size: 16}}\n" + REPLICA)
    return f


def test_tokenizer_path_is_checked_at_load(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (model_dir / "tokenizer.json").write_text("{}")
    for spec in ("builtin", "backend", str(model_dir), str(model_dir / "tokenizer.json")):
        assert load_config(_with_tokenizer(tmp_path, spec)).model("m").tokenizer == spec
    for spec, problem in ((str(tmp_path / "missing"), "no such file or directory"),
                          (str(empty_dir), "holds no tokenizer.json")):
        with pytest.raises(ConfigError) as exc:
            load_config(_with_tokenizer(tmp_path, spec))
        assert exc.value.key == "models.m.tokenizer" and problem in exc.value.problem


def test_config_check_and_serve_name_the_tokenizer_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("KVROUTER_")]:
        monkeypatch.delenv(k)
    f = _with_tokenizer(tmp_path, str(tmp_path / "nowhere"))
    assert config_main(["check", str(f)]) == 1
    assert "models.m.tokenizer: no such file or directory" in capsys.readouterr().err
    assert serve_main(["--config", str(f)]) == 2
    assert "models.m.tokenizer: no such file or directory" in capsys.readouterr().err


def test_a_bad_env_value_names_the_variable(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "router.yaml"
    f.write_text(REPLICA)
    env = {"KVROUTER_UPSTREAM__MAX_RETRIES": "lots", "KVROUTER_LISTEN__PORT": "8001"}
    with pytest.raises(ConfigError) as exc:
        load_config(f, env=env)
    assert str(exc.value).startswith("KVROUTER_UPSTREAM__MAX_RETRIES (upstream.max_retries): must be an integer")
    assert exc.value.key == "upstream.max_retries"
    assert exc.value.source == "KVROUTER_UPSTREAM__MAX_RETRIES"  # type: ignore[attr-defined]
    # a CLI override of the same key wins: its error is not blamed on the variable
    with pytest.raises(ConfigError) as exc:
        load_config(f, env=env, overrides=["upstream.max_retries=-1"])
    assert exc.value.key == "upstream.max_retries" and not hasattr(exc.value, "source")
    # an error in the file is still the file's
    f.write_text(REPLICA + "upstream: {max_retries: lots}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f, env={"KVROUTER_LISTEN__PORT": "8001"})
    assert exc.value.key == "upstream.max_retries" and not hasattr(exc.value, "source")
    f.write_text(REPLICA)
    for k in [k for k in os.environ if k.startswith("KVROUTER_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVROUTER_UPSTREAM__MAX_RETRIES", "lots")
    assert config_main(["check", str(f)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("environment: invalid: KVROUTER_UPSTREAM__MAX_RETRIES (upstream.max_retries)")
    assert str(f) not in err
    assert config_main(["check", "--no-env", str(f)]) == 0
