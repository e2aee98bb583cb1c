"""What each backend serves, and one ring per model over the backends that serve it.

A backend says what it serves in its `/v1/models` (vLLM lists its served model names and its loaded
LoRA adapters, each adapter with `parent` naming its base model); a static backend or a discovered pod
may also declare models, which stand in until the backend reports. The `ModelView` built from that is
an immutable value, rebuilt and swapped on every change: a ring per model over the members serving it
(so a model's keys stay where they are when another model's backends come and go), and the candidates
among them. A fleet where no backend has said anything routes over the whole fleet, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from prefix_router.errors import ModelNotFound
from prefix_router.fleet.backends import BackendSet
from prefix_router.routing.picker import Candidates
from prefix_router.routing.ring import HashRing, Member

MAX_MODELS_PER_BACKEND = 1024  # a listing longer than this is cut: models come from backends, not clients


@dataclass(frozen=True, slots=True)
class ModelCard:
    id: str
    parent: str | None  # the base model of a LoRA adapter; None for a base model
    card: Mapping[str, Any]  # the entry as the backend listed it, for the router's own /v1/models


def parse_model_list(body: bytes) -> tuple[ModelCard, ...] | None:
    """The entries of vLLM's `{"object": "list", "data": [{"id": ...}, ...]}`; None for anything else
    (a backend that does not list models, or answers something else on that path)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return None
    cards: list[ModelCard] = []
    seen: set[str] = set()
    for entry in doc["data"][:MAX_MODELS_PER_BACKEND]:
        if not isinstance(entry, dict):
            continue
        model = entry.get("id")
        if not isinstance(model, str) or not model or model in seen:
            continue
        parent = entry.get("parent")
        seen.add(model)
        cards.append(ModelCard(model, parent if isinstance(parent, str) and parent else None, entry))
    return tuple(cards)


def declared_card(model: str) -> ModelCard:
    """The listing entry of a model a backend was declared to serve but has not reported."""
    return ModelCard(model, None, {"id": model, "object": "model", "created": 0, "owned_by": "prefix-router"})


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """The backends of one model: its ring over every member serving it, and those that may take
    requests now."""

    ring: HashRing
    servers: frozenset[str]
    candidates: Candidates  # fleet candidates serving the model, at the time the view was built
    base: Candidates  # the fleet candidates `candidates` was computed from

    def narrow(self, fleet: Candidates) -> Candidates:
        """The model's candidates among `fleet` (the fleet's candidates for one request)."""
        if fleet is self.base:
            return self.candidates
        return Candidates.of([b for b in fleet.ids if b in self.servers])


@dataclass(frozen=True, slots=True)
class ModelView:
    routes: Mapping[str, ModelRoute] = field(default_factory=dict)
    parents: Mapping[str, str] = field(default_factory=dict)  # adapter -> base model, as listed
    undeclared: ModelRoute | None = None  # members that have said nothing: they may serve anything
    known: bool = False  # some member has said what it serves
    listing: tuple[Mapping[str, Any], ...] = ()  # union over the candidates, first listing wins


@dataclass(frozen=True, slots=True)
class AdapterPolicy:
    """What to do with a request for an adapter no backend has loaded."""

    to_base: bool = False  # send it to its base model's backends (vLLM loads it at run time); else 404
    bases: Mapping[str, str] = field(default_factory=dict)  # adapter -> base, for unlisted adapters


class ModelDirectory:
    """Declared and reported models per backend, and the `ModelView` built from them with the backend
    set's members and candidates. Rebuilt on every change of either; read by reference per request."""

    def __init__(self, backends: BackendSet, vnodes: int, adapters: AdapterPolicy | None = None) -> None:
        self._backends = backends
        self._vnodes = vnodes
        self._adapters = adapters or AdapterPolicy()
        self._declared: dict[str, frozenset[str]] = {}
        self._reported: dict[str, tuple[ModelCard, ...]] = {}
        self._rings: dict[tuple[tuple[str, float], ...], HashRing] = {}
        self.view = ModelView()
        backends.on_change(self.rebuild)
        self.rebuild()

    # -- what backends say ---------------------------------------------------------------------

    def declare(self, declared: Mapping[str, Iterable[str]]) -> None:
        """The models configuration or discovery says each backend serves (replaces the last call)."""
        self._declared = {url: frozenset(models) for url, models in declared.items() if models}
        self.rebuild()

    def report(self, url: str, cards: tuple[ModelCard, ...]) -> bool:
        """A backend's own listing; True when it changed what the router knows."""
        if self._backends.get(url) is None or self._reported.get(url) == cards:
            return False
        self._reported[url] = cards
        self.rebuild()
        return True

    def has_report(self, url: str) -> bool:
        return url in self._reported

    def served_by(self, url: str) -> frozenset[str] | None:
        """The model names `url` serves, as reported, else as declared; None when it said nothing."""
        cards = self._reported.get(url)
        if cards is not None:
            return frozenset(c.id for c in cards)
        return self._declared.get(url)

    # -- per request ---------------------------------------------------------------------------

    def is_known(self, model: str | None) -> bool:
        """Is `model` a name the fleet listed (a model or a loaded adapter) or the configuration names
        (an adapter's base)? Only such names become metric labels: they come from the backends, not
        from whatever a client writes in `model`."""
        if model is None:
            return False
        view = self.view
        return model in view.routes or model in view.parents or model in self._adapters.bases

    def route(self, model: str | None) -> ModelRoute | None:
        """The backends a request for `model` may go to; None: the whole fleet. Raises ModelNotFound."""
        view = self.view
        if model is None or not view.known:
            return None
        route = view.routes.get(model)
        if route is not None and route.candidates.ids:
            return route
        base = self._base_of(model, view)
        if base is not None:
            base_route = view.routes.get(base)
            if base_route is not None:
                return base_route
        if route is not None:
            return route  # its backends are all out of service: 503, not 404
        if view.undeclared is not None:
            return view.undeclared
        if model in self._adapters.bases or model in view.parents:
            raise ModelNotFound(
                f"The model `{model}` is a LoRA adapter that no backend has loaded; load it on a backend "
                "(vLLM: runtime LoRA loading), or let the router send it to its base model's backends"
            )
        raise ModelNotFound(f"The model `{model}` does not exist.")

    def _base_of(self, model: str, view: ModelView) -> str | None:
        """The base model an unloaded adapter may go to, when the adapter policy allows it."""
        if not self._adapters.to_base:
            return None
        base = view.parents.get(model) or self._adapters.bases.get(model)
        if base is not None:
            return base
        bases = [name for name in view.routes if name not in view.parents]
        return bases[0] if len(bases) == 1 and bases[0] != model else None

    # -- the view ------------------------------------------------------------------------------

    def rebuild(self) -> None:
        members = {b.url: b.weight for b in self._backends.backends()}
        for url in [u for u in self._reported if u not in members]:
            del self._reported[url]  # it left: its listing goes with it
        fleet = self._backends.candidates
        serving: dict[str, list[str]] = {}
        parents: dict[str, str] = {}
        silent: list[str] = []
        for url in sorted(members):
            served = self.served_by(url)
            if served is None:
                silent.append(url)
                continue
            for model in served:
                serving.setdefault(model, []).append(url)
            for card in self._reported.get(url, ()):
                if card.parent is not None:
                    parents.setdefault(card.id, card.parent)
        if not serving:
            self.view = ModelView()
            self._rings.clear()
            return
        rings: dict[tuple[tuple[str, float], ...], HashRing] = {}

        def route_over(urls: list[str]) -> ModelRoute:
            key = tuple((u, members[u]) for u in urls)
            ring = rings.get(key) or self._rings.get(key)
            if ring is None:
                ring = HashRing([Member(u, w) for u, w in key], self._vnodes)
            rings[key] = ring
            servers = frozenset(urls)
            return ModelRoute(ring, servers, Candidates.of([b for b in fleet.ids if b in servers]), fleet)

        routes = {model: route_over(urls) for model, urls in sorted(serving.items())}
        undeclared = route_over(silent) if silent else None
        self._rings = rings
        self.view = ModelView(routes, parents, undeclared, True, self._listing(fleet))

    def _listing(self, fleet: Candidates) -> tuple[Mapping[str, Any], ...]:
        out: list[Mapping[str, Any]] = []
        seen: set[str] = set()
        for url in fleet.ids:
            cards = self._reported.get(url)
            if cards is None:
                cards = tuple(declared_card(m) for m in sorted(self._declared.get(url, ())))
            for card in cards:
                if card.id not in seen:
                    seen.add(card.id)
                    out.append(card.card)
        return tuple(out)

    def listing_body(self) -> bytes | None:
        """The router's `/v1/models` answer, in vLLM's shape; None while no backend said anything."""
        view = self.view
        if not view.known:
            return None
        return orjson.dumps({"object": "list", "data": list(view.listing)})
