"""Shared pieces of the deployment tests: paths, rendering into objects, and the router's settings as
JSON-schema constraints (so the chart's schema can be compared with settings.py field by field)."""

from __future__ import annotations

import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "prefix-router"
RELEASE = "pr"
NAMESPACE = "llm"

Manifests = dict[tuple[str, str], dict[str, Any]]  # (kind, name) -> object

# The one value an install must add to the chart's defaults: where the backends are. Without it (static
# discovery, no backends) the chart refuses to render.
ONE_BACKEND: dict[str, Any] = {"backends": [{"url": f"http://vllm-0.vllm-headless.{NAMESPACE}.svc:8000"}]}


def with_backends(values: dict[str, Any] | None) -> dict[str, Any]:
    """`values`, plus ONE_BACKEND when they say nothing of backends (neither a list nor a discovery mode)."""
    values = dict(values or {})
    config = dict(values.get("config", {}))
    if "backends" not in config and "mode" not in config.get("discovery", {}):
        config.update(ONE_BACKEND)
    values["config"] = config
    return values


def index_manifests(files: dict[str, str]) -> Manifests:
    """Rendered template files -> objects by (kind, name); a duplicate is an error."""
    out: Manifests = {}
    for path, text in files.items():
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} rendered twice ({path})"
            out[key] = doc
    return out


def kinds(manifests: Manifests) -> set[str]:
    return {kind for kind, _ in manifests}


def one(manifests: Manifests, kind: str) -> dict[str, Any]:
    found = [obj for (k, _), obj in manifests.items() if k == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


# ---- the router's settings as JSON-schema constraints -------------------------------------------------


def expected_field_schema(annotation: Any, metadata: list[Any]) -> dict[str, Any]:
    """The JSON-schema constraints a settings field implies: type, enum, bounds (no descriptions)."""
    from pydantic import SecretStr

    nullable = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(annotation))
        (annotation,) = args
    out: dict[str, Any] = {}
    if typing.get_origin(annotation) is typing.Literal:
        out["type"] = "string"
        out["enum"] = list(typing.get_args(annotation))
    elif isinstance(annotation, type) and issubclass(annotation, Enum):
        out["type"] = "string"
        out["enum"] = [m.value for m in annotation]
    elif annotation is bool:
        out["type"] = "boolean"
    elif annotation is int:
        out["type"] = "integer"
    elif annotation is float:
        out["type"] = "number"
    elif annotation is str or annotation is SecretStr:
        out["type"] = "string"
    elif typing.get_origin(annotation) is tuple:  # tuple[X, ...]: a list of X
        out["type"] = "array"
        out["items"] = expected_field_schema(typing.get_args(annotation)[0], [])
    elif typing.get_origin(annotation) is dict:  # dict[str, X]: a mapping to X
        out["type"] = "object"
        out["additionalProperties"] = expected_field_schema(typing.get_args(annotation)[1], [])
    else:  # pragma: no cover - a new kind of field needs a decision in the chart
        raise AssertionError(f"no schema mapping for {annotation!r}")
    for item in metadata:
        for attr, key in (("ge", "minimum"), ("le", "maximum"), ("gt", "exclusiveMinimum")):
            if getattr(item, attr, None) is not None:
                out[key] = getattr(item, attr)
    if nullable:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def settings_sections() -> dict[str, type[Any]]:
    """Section name -> pydantic model, for every nested section of Settings (backends: its item model)."""
    from prefix_router.settings import BackendSettings, Settings

    sections: dict[str, type[Any]] = {}
    for name, field in Settings.model_fields.items():
        if name == "backends":
            sections[name] = BackendSettings
        else:
            assert isinstance(field.annotation, type), name
            sections[name] = field.annotation
    return sections


def load_values_yaml() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))
    return data
