"""One exception tree for the router; HTTP statuses are chosen only in router.py / relay.py's table.

RouterError
├── SettingsError          configuration rejected at start-up (exit 2)
├── RequestError           the client's request is unacceptable
│   ├── BodyTooLarge       over server.max_body_bytes
│   ├── BadRequest         malformed framing or a value the router refuses
│   ├── ModelNotFound      no backend serves the model asked for
│   ├── ResponseNotFound   a stored response whose backend has left the fleet
│   ├── NotImplementedHere a transfer coding the router does not decode (501)
│   └── VersionNotSupported an HTTP version other than 1.0 and 1.1 on the HTTP/1 port (505)
├── InternalError          a fault of the router itself (500), never blamed on a backend
├── RoutingError           no backend can take the request
│   ├── NoBackend          no healthy backend at all
│   └── Overloaded         every candidate at its bound after the bounded wait
└── UpstreamError          the backend failed us
    ├── ConnectFailed      could not connect (retryable before the first byte)
    ├── BackendOverloaded  the backend answered 503/429 (retryable before the first byte)
    ├── NoAnswer           connection closed or reset without a response
    ├── FirstByteTimeout   no response head within upstream.first_byte_timeout_s
    └── StreamBroken       failed after the response began (never retried)
"""

from __future__ import annotations


class RouterError(Exception):
    """Base of every error the router raises on purpose."""


class SettingsError(RouterError):
    pass


class RequestError(RouterError):
    pass


class BodyTooLarge(RequestError):
    pass


class BadRequest(RequestError):
    pass


class MethodNotAllowed(RequestError):
    pass


class RequestTimeout(RequestError):
    pass


class HeadersTooLarge(RequestError):
    pass


class ClientDisconnected(RequestError):
    pass


class ModelNotFound(RequestError):
    pass


class ResponseNotFound(RequestError):
    pass


class NotImplementedHere(RequestError):
    pass


class VersionNotSupported(RequestError):
    pass


class InternalError(RouterError):
    pass


class RoutingError(RouterError):
    pass


class NoBackend(RoutingError):
    pass


class Overloaded(RoutingError):
    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamError(RouterError):
    kind = "upstream"  # closed set: the `kind` label of prefix_router_upstream_errors_total


class ConnectFailed(UpstreamError):
    kind = "connect"


class BackendOverloaded(UpstreamError):
    kind = "overloaded"


class NoAnswer(UpstreamError):
    kind = "no_answer"


class FirstByteTimeout(UpstreamError):
    kind = "first_byte_timeout"


class StreamBroken(UpstreamError):
    kind = "stream_broken"


class StreamIdleTimeout(StreamBroken):
    kind = "stream_idle_timeout"
