"""Config and discovery errors: one line on stderr, exit 2, naming what to do (the missing extra, the
variable that was meant)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prefix_router.cli import check_discovery
from prefix_router.errors import SettingsError
from prefix_router.settings import load_settings, values_from_environ

from clikit import clean_env, run_cli

EXTRA_HINT = "pip install 'prefix-router[kubernetes]'"
KUBERNETES = {"PREFIX_ROUTER_DISCOVERY__MODE": "kubernetes", "PREFIX_ROUTER_DISCOVERY__K8S_SERVICE": "vllm"}

# Makes kubernetes_asyncio unimportable in the child, as in an install without the `kubernetes` extra.
BLOCK_KUBERNETES = """\
import sys

class _NoKubernetes:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "kubernetes_asyncio":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoKubernetes())
"""


def one_line_exit_2(done: object) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)  # type: ignore[attr-defined]
    assert done.stdout == ""  # type: ignore[attr-defined]
    lines = done.stderr.splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1, lines
    assert lines[0].startswith("prefix-router: ")
    return str(lines[0])


def test_kubernetes_discovery_without_the_extra_names_it(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCK_KUBERNETES, encoding="utf-8")
    env = clean_env(PYTHONPATH=str(tmp_path), **KUBERNETES)
    line = one_line_exit_2(run_cli("serve", "--host", "127.0.0.1", "--port", "0", env=env))
    assert EXTRA_HINT in line and "discovery.mode 'kubernetes'" in line


def test_the_missing_extra_is_named_before_the_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a pod the namespace is missing too; the extra is what the user must install first."""
    monkeypatch.setitem(sys.modules, "kubernetes_asyncio", None)  # `import` now raises ImportError
    settings = load_settings(
        None, {"discovery": {"mode": "kubernetes", "k8s_service": "vllm"}}, environ=False
    )
    with pytest.raises(SettingsError, match=r"pip install 'prefix-router\[kubernetes\]'"):
        check_discovery(settings)


def test_kubernetes_discovery_outside_a_pod_is_one_line() -> None:
    line = one_line_exit_2(run_cli("serve", "--port", "0", env=clean_env(**KUBERNETES)))
    assert "discovery.k8s_namespace" in line


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        pytest.param(
            "PREFIX_ROUTER_BALANCNG__MAX_INFLIGHT", "PREFIX_ROUTER_BALANCING__MAX_INFLIGHT", id="section"
        ),
        pytest.param(
            "PREFIX_ROUTER_BALANCING__MAX_INFLIHGT", "PREFIX_ROUTER_BALANCING__MAX_INFLIGHT", id="field"
        ),
        pytest.param("PREFIX_ROUTER_SERVER_PORT", "PREFIX_ROUTER_SERVER__PORT", id="single-underscore"),
        pytest.param("prefix_router_routng__vnodes", "PREFIX_ROUTER_ROUTING__VNODES", id="lower-case"),
        pytest.param("PREFIX_ROUTER_BALANCNG", "PREFIX_ROUTER_BALANCING", id="section-only"),
    ],
)
def test_a_misspelt_variable_is_an_error_naming_the_nearest(name: str, suggestion: str) -> None:
    env = clean_env(**{name: "16"})
    line = one_line_exit_2(run_cli("serve", "--backend", "http://127.0.0.1:9", env=env))
    assert name in line and f"did you mean {suggestion}?" in line


def test_a_variable_near_nothing_says_the_pattern() -> None:
    env = clean_env(PREFIX_ROUTER_XYZZY="1")
    line = one_line_exit_2(run_cli("serve", "--backend", "http://127.0.0.1:9", env=env))
    assert "PREFIX_ROUTER_XYZZY" in line and "PREFIX_ROUTER_<SECTION>__<FIELD>" in line


def test_known_variables_pass(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("routing: {prefix_chars: 77}\n", encoding="utf-8")
    env = {
        "PREFIX_ROUTER_CONFIG": str(cfg),
        "prefix_router_balancing__max_inflight": "5",  # names are case-insensitive
        "PREFIX_ROUTER_BACKENDS": "http://a:8000, http://b:8000",
        "PREFIX_ROUTER_MODELS__ADAPTER_BASES": '{"sql-lora": "llama"}',
        "PREFIX_ROUTER_SERVER": '{"port": 9001}',
        "OTHER_PREFIX_ROUTER_THING": "ignored",
    }
    s = load_settings(environ=env)
    assert s.routing.prefix_chars == 77 and s.balancing.max_inflight == 5 and s.server.port == 9001
    assert [b.url for b in s.backends] == ["http://a:8000", "http://b:8000"]
    assert s.models.adapter_bases == {"sql-lora": "llama"}


def test_backends_as_json_and_bad_json_is_one_line() -> None:
    s = load_settings(environ={"PREFIX_ROUTER_BACKENDS": '[{"url": "http://a:8000", "weight": 2}]'})
    assert [(b.url, b.weight) for b in s.backends] == [("http://a:8000", 2.0)]
    with pytest.raises(SettingsError, match="PREFIX_ROUTER_MODELS__ADAPTER_BASES is not valid JSON"):
        values_from_environ({"PREFIX_ROUTER_MODELS__ADAPTER_BASES": "{nope"})


def test_one_merge_path_file_then_env_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server: {port: 9000, host: 127.0.0.1}\nbalancing: {max_inflight: 4, queue_max: 3}\n")
    env = {"PREFIX_ROUTER_SERVER__PORT": "9100", "PREFIX_ROUTER_BALANCING__MAX_INFLIGHT": "5"}
    s = load_settings(cfg, {"balancing": {"max_inflight": 6}}, {"balancing": {"queue_max": 7}}, environ=env)
    assert (s.server.port, s.server.host) == (9100, "127.0.0.1")  # env over file, the file's rest kept
    assert (s.balancing.max_inflight, s.balancing.queue_max) == (6, 7)  # flags over env, later over earlier
    # environ=False and a mapping take the same path: only the environment layer differs.
    assert load_settings(cfg, environ=False).server.port == 9000


def test_constructing_settings_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefix_router.settings import Settings

    monkeypatch.setenv("PREFIX_ROUTER_SERVER__PORT", "9999")
    monkeypatch.setenv("PREFIX_ROUTER_BALANCNG__MAX_INFLIGHT", "1")
    assert Settings().server.port == 8080  # only load_settings reads the environment
