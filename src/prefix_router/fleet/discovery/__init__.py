"""Backend discovery: keeps the backend set equal to what DNS or the Kubernetes API says the fleet is.

The app builds one source with `build_discovery` and runs `source.run(backend_set.replace_members)` as a
lifespan-owned task; removed backends then drain in the backend set. Static mode needs no task at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefix_router.errors import SettingsError
from prefix_router.fleet.backends import BackendSpec
from prefix_router.fleet.discovery.base import ApplyBackends, Discovery
from prefix_router.fleet.discovery.dns import DnsDiscovery
from prefix_router.fleet.discovery.kubernetes import KubernetesDiscovery, read_pod_namespace
from prefix_router.settings import DiscoveryMode, DiscoverySettings

__all__ = ["ApplyBackends", "Discovery", "DnsDiscovery", "KubernetesDiscovery", "build_discovery"]


def build_discovery(settings: DiscoverySettings, static: Sequence[BackendSpec]) -> Discovery | None:
    """None for mode static (the app then just uses the static list).

    `static` is the set the app starts from; discovery reports its first answer even when it is the same,
    and until then failures keep that set. Raises SettingsError when the mode cannot work here (missing
    kubernetes extra, no namespace outside a pod).
    """
    initial = [spec.url for spec in static]
    if settings.mode is DiscoveryMode.STATIC:
        return None
    if settings.mode is DiscoveryMode.DNS:
        if not settings.dns_name:
            raise SettingsError("config error: discovery.mode 'dns' needs discovery.dns_name")
        return DnsDiscovery(
            settings.dns_name,
            settings.dns_port,
            scheme=settings.scheme,
            interval_s=settings.dns_interval_s,
            nameserver=settings.dns_nameserver,
            nameserver_port=settings.dns_nameserver_port,
            initial=initial,
        )
    if not settings.k8s_service:
        raise SettingsError("config error: discovery.mode 'kubernetes' needs discovery.k8s_service")
    return KubernetesDiscovery(
        settings.k8s_namespace or read_pod_namespace(),
        settings.k8s_service,
        port_name=settings.k8s_port_name,
        scheme=settings.scheme,
        api_url=settings.k8s_api_url,
        model_label=settings.k8s_model_label,
        initial=initial,
    )
