"""Fixtures for the deployment tests: the Helm chart, loaded once, and a renderer.

The chart is loaded and rendered in-process with helm-python-sdk (Helm's own Go library through ctypes),
so no `helm` binary and no cluster are needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from chartkit import CHART_DIR, NAMESPACE, RELEASE, Manifests, index_manifests, with_backends


@pytest.fixture(scope="session")
def helm() -> Any:
    return pytest.importorskip("helm_python", reason="helm-python-sdk (the `test` extra) is not installed")


@pytest.fixture(scope="session")
def chart(helm: Any) -> Iterator[Any]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart: Any) -> Callable[..., Manifests]:
    """Render the chart with `values` (merged over the defaults by Helm), indexed by kind and name; one
    static backend is added when `values` name none (chartkit.with_backends)."""

    def _render(values: dict[str, Any] | None = None) -> Manifests:
        files = chart.render(values=with_backends(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
        return index_manifests(files)

    return _render
