"""Settings sources and their precedence, one-line errors with exit code 2, the example config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from prefix_router.errors import SettingsError
from prefix_router.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "config" / "example.yaml"


def test_example_config_loads_and_shows_every_field() -> None:
    settings = load_settings(EXAMPLE, environ=False)
    assert [b.url for b in settings.backends] == ["http://vllm-0:8000", "http://vllm-1:8000"]
    data = yaml.safe_load(EXAMPLE.read_text())
    for name, field in Settings.model_fields.items():
        assert name in data, f"section {name} missing from config/example.yaml"
        section = field.default
        if isinstance(section, BaseModel):
            missing = set(type(section).model_fields) - set(data[name])
            assert not missing, f"{name}: fields missing from config/example.yaml: {missing}"


def test_env_beats_file_and_flags_beat_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server: {port: 9000, host: 127.0.0.1}\nbalancing: {max_inflight: 4}\n")
    monkeypatch.setenv("PREFIX_ROUTER_SERVER__PORT", "9100")
    monkeypatch.setenv("PREFIX_ROUTER_BALANCING__MAX_INFLIGHT", "5")
    s = load_settings(cfg, {"balancing": {"max_inflight": 6}})
    assert s.server.port == 9100  # env over file
    assert s.server.host == "127.0.0.1"  # the file's other fields stay
    assert s.balancing.max_inflight == 6  # flags over env


def test_config_file_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("routing: {prefix_chars: 77}\n")
    monkeypatch.setenv("PREFIX_ROUTER_CONFIG", str(cfg))
    assert load_settings().routing.prefix_chars == 77


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param({"routing": {"prefix_chars": 0}}, "routing.prefix_chars", id="prefix-chars-zero"),
        pytest.param({"balancing": {"load_factor": 0.5}}, "balancing.load_factor", id="load-factor-below-1"),
        pytest.param({"balancing": {"policy": "fastest"}}, "balancing.policy", id="unknown-policy"),
        pytest.param({"backends": [{"url": "vllm:8000"}]}, "backends.0.url", id="url-without-scheme"),
        pytest.param({"backends": [{"url": "http://a:1/v1"}]}, "backends.0.url", id="url-with-path"),
        pytest.param({"server": {"prot": 1}}, "server.prot", id="typo-field"),
        pytest.param({"routing": {"set_cache_salt": True}}, "cache_salt_secret", id="salt-without-secret"),
        pytest.param({"discovery": {"mode": "dns"}}, "dns_name", id="dns-without-name"),
        pytest.param(
            {"routing": {"shared_state_url": "http://redis:6379"}},
            "routing.shared_state_url",
            id="store-scheme",
        ),
        pytest.param(
            {"routing": {"shared_state_timeout_s": 0}}, "routing.shared_state_timeout_s", id="store-timeout"
        ),
    ],
)
def test_bad_values_name_the_field(overrides: dict[str, object], expected: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(None, overrides, environ=False)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_bad_yaml_is_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server: [unclosed\n")
    with pytest.raises(SettingsError) as info:
        load_settings(cfg, environ=False)
    assert "not valid YAML" in str(info.value) and "\n" not in str(info.value)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefix_router", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_cli_wrong_value_exits_2_with_one_line() -> None:
    import os

    env = {**os.environ, "PREFIX_ROUTER_ROUTING__PREFIX_CHARS": "-1"}
    done = _cli("serve", "--backend", "http://127.0.0.1:9", env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "routing.prefix_chars" in lines[0]


def test_cli_serve_without_backends_exits_2() -> None:
    done = _cli("serve")
    assert done.returncode == 2
    assert "backends" in done.stderr


def test_cli_help_documents_every_flag() -> None:
    done = _cli("serve", "--help")
    assert done.returncode == 0
    for flag in ("--config", "--backend", "--host", "--port", "--policy", "--max-inflight", "--prefix-chars"):
        assert flag in done.stdout


@pytest.mark.parametrize(
    ("first_placement", "preamble_share"),
    [pytest.param("cache_room", 0.5, id="cache-room"), pytest.param("ring", None, id="ring")],
)
def test_the_preamble_alone_is_a_ring_key_only_where_cache_room_places(
    first_placement: str, preamble_share: float | None
) -> None:
    """Placed by the ring, a system prompt as the ring key would send every conversation behind it to
    one backend from every replica."""
    s = load_settings(None, {"routing": {"first_placement": first_placement}}, environ=False)
    assert s.key_config().preamble_share == preamble_share
