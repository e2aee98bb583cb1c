"""Build tests/http/corpus/*.json: raw HTTP/1.1 payloads from public corpora, with the expected outcome.

Payloads are taken as data from git checkouts of the public projects (their test code is not used):

- llhttp: the request and response messages of test/request/*.md and test/response/*.md;
- http-garden: the payloads of TROPHIES.md and README.md;
- smuggler: the Transfer-Encoding gadgets of configs/*.py (a table written as a loop, run against a
  stand-in to collect its strings), each in a CL.TE and a TE.CL probe; of the bytes 0x7f-0xff, which
  the configs repeat in every position, a few stand for the rest (HIGH_BYTES_KEPT);
- h11 and uvicorn: the HTTP byte strings of their test modules (literals only, read with ast).

An HTTP/1.1 request without Host gets one (`host_added`), so that it tests what it was written for
rather than the missing Host, which both proxies refuse.

Each request payload is sent to nginx (a proxy in front of a raw loopback backend) and to the router, and
what each did is recorded: the requests the backend received, or the refusal. The expected outcome is
nginx's unless the router differs in a way RFC 9112/9110 allows, in which case the router's is expected
and the case carries the reason (`REASONS` below). A difference no reason covers is left expecting
nginx's outcome, so the test fails until the router is fixed or the difference is justified here.
A reason that starts with "deviation:" is a difference the RFC does not allow: listed to be fixed.
Response payloads are answered by the raw backend to a plain GET; the client must get a well-framed
response or a 502 (the tests hold that whatever is recorded); the router's outcome is expected, with
nginx's beside it and the reason where they differ.

    python tools/build_http_corpus.py --llhttp DIR --garden DIR --smuggler DIR --h11 DIR --uvicorn DIR
    python tools/build_http_corpus.py --summary      # the counts of the files as built

Each DIR is a git directory (bare or not) of that project; HEAD is read. nginx must be on PATH
(Debian's nginx-light package will do); the tests themselves need only the built files.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import codecs
import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "http")]

from corpus_wire import (  # noqa: E402
    CORPUS_DIR,
    Lane,
    Outcome,
    RequestOutcome,
    ResponseOutcome,
    router_lanes,
    run_lanes,
    start_backend,
)

REPOS = {
    "llhttp": "nodejs/llhttp",
    "garden": "narfindustries/http-garden",
    "smuggler": "defparam/smuggler",
    "h11": "python-hyper/h11",
    "uvicorn": "encode/uvicorn",
}
LANES = 6


@dataclass
class Source:
    name: str
    git_dir: Path

    def commit(self) -> str:
        return self._git("rev-parse", "HEAD").strip()

    def files(self, prefix: str) -> list[str]:
        return [p for p in self._git("ls-tree", "-r", "--name-only", "HEAD", prefix).splitlines() if p]

    def show(self, path: str) -> str:
        return self._git("show", f"HEAD:{path}")

    def _git(self, *args: str) -> str:
        out = subprocess.run(["git", "-C", str(self.git_dir), *args], capture_output=True, check=True)
        return out.stdout.decode("utf-8", "surrogateescape")


def case(
    corpus: str, ident: str, kind: str, payload: bytes, path: str, name: str, **extra: Any
) -> dict[str, Any]:
    return {
        "id": ident,
        "kind": kind,
        "source": {"repo": REPOS[corpus], "path": path, "name": name},
        "payload": payload.decode("latin-1"),
        **extra,
    }


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "case"


def unique(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One case per payload (the first), with ids made unique."""
    seen_payloads: set[tuple[str, str]] = set()
    ids: Counter[str] = Counter()
    out = []
    for c in cases:
        key = (c["kind"], c["payload"])
        if key in seen_payloads:
            continue
        seen_payloads.add(key)
        ids[c["id"]] += 1
        if ids[c["id"]] > 1:
            c["id"] = f"{c['id']}-{ids[c['id']]}"
        out.append(c)
    return out


_REQUEST_LINE = re.compile(rb"^[!-~]+ [^ \r\n]+ HTTP/1\.1\r?\n")


def with_host(payload: bytes) -> tuple[bytes, bool]:
    """An HTTP/1.1 request without Host gets one (RFC 9112 §3.2 requires it, and both proxies refuse
    its absence), so the case tests what it was written for. Only the first request of the payload."""
    m = _REQUEST_LINE.match(payload)
    if m is None:
        return payload, False
    head = payload.split(b"\r\n\r\n", 1)[0]
    if re.search(rb"(?im)^host[ \t]*:", head):
        return payload, False
    return payload[: m.end()] + b"Host: corpus\r\n" + payload[m.end() :], True


# -- llhttp ------------------------------------------------------------------------------------------

_ESCAPES: list[tuple[str, Callable[[re.Match[str]], str]]] = [
    (r"\\r", lambda m: "\r"),
    (r"\\n", lambda m: "\n"),
    (r"\\t", lambda m: "\t"),
    (r"\\f", lambda m: "\f"),
    (r"\\x([0-9a-fA-F]+)", lambda m: chr(int(m.group(1), 16))),
    (r"\\([0-7]{1,3})", lambda m: chr(int(m.group(1), 8))),
]


def llhttp_input(block: str) -> bytes | None:
    """The bytes a test block stands for, by the conventions its README and md-test runner state."""
    text = re.sub(r"\n\Z", "", block)
    text = re.sub(r"\\(\r\n|\r|\n)", "", text)
    text = re.sub(r"\r\n|\r|\n", "\r\n", text)
    for pattern, repl in _ESCAPES:
        text = re.sub(pattern, repl, text)
    if "${" in text:
        return None  # inline JavaScript: not data
    return text.encode("latin-1", "replace")


def extract_llhttp(src: Source) -> list[dict[str, Any]]:
    out = []
    for path in src.files("test/request") + src.files("test/response"):
        if not path.endswith(".md"):
            continue
        text = src.show(path)
        heading = ""
        meta: dict[str, Any] = {}
        pending: bytes | None = None
        for m in re.finditer(
            r"^#+ ([^\n]*)$|<!-- meta=(\{.*?\}) -->|^```(\w+)\n(.*?)^```", text, re.M | re.S
        ):
            if m.group(1) is not None:
                heading = m.group(1).strip()
            elif m.group(2) is not None:
                meta = json.loads(m.group(2))
            elif m.group(3) == "http":
                pending = llhttp_input(m.group(4))
            elif m.group(3) == "log" and pending is not None:
                kind = str(meta.get("type", ""))
                base = "response" if kind.startswith("response") else "request"
                verdict = "error" if re.search(r"error code=", m.group(4)) else "ok"
                payload, added = with_host(pending) if base == "request" else (pending, False)
                stem = Path(path).stem
                extra: dict[str, Any] = {"llhttp_mode": kind, "llhttp_verdict": verdict}
                if added:
                    extra["host_added"] = True
                out.append(
                    case("llhttp", f"{base}-{stem}-{slug(heading)}", base, payload, path, heading, **extra)
                )
                pending, meta = None, {}
    return unique(out)


# -- http-garden -------------------------------------------------------------------------------------


def garden_bytes(literal: str) -> bytes | None:
    try:
        return codecs.decode(literal, "unicode_escape").encode("latin-1")
    except (UnicodeDecodeError, UnicodeEncodeError):
        return None


def extract_garden(src: Source) -> list[dict[str, Any]]:
    out = []
    for path, pattern in (
        ("TROPHIES.md", r"^\s*\d+\. (.*?)$.*?^\s*- Payload: `(.*?)`"),
        ("README.md", r"()garden> payload '(.*?)'"),
    ):
        text = src.show(path)
        for n, m in enumerate(re.finditer(pattern, text, re.M | re.S)):
            payload = garden_bytes(m.group(2))
            if payload is None or not payload:
                continue
            kind = "response" if payload.startswith(b"HTTP/") else "request"
            title = m.group(1).strip() or f"example {n + 1}"
            out.append(
                case(
                    "garden",
                    f"{kind}-{Path(path).stem.lower()}-{n + 1}-{slug(title)[:40]}",
                    kind,
                    payload,
                    path,
                    title,
                )
            )
    return unique(out)


# -- smuggler ----------------------------------------------------------------------------------------

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: corpus\r\n\r\n"


class _Template:
    """Stands in for smuggler's Payload object: its configs only set `.header` on one."""

    header = ""


def smuggler_gadgets(src: Source, path: str) -> dict[str, str]:
    """The mutation names and their gadget lines, by running the config file against stand-ins (it
    is a table written as a loop; nothing of it is kept but the strings it makes)."""
    namespace: dict[str, Any] = {"Payload": _Template, "mutations": {}}
    exec(compile(src.show(path), path, "exec"), namespace)
    gadgets: dict[str, str] = {}
    for name, template in namespace["mutations"].items():
        lines = template.header.split("\r\n")
        gadgets[name] = lines[1]  # line 0 is the request line; the gadget comes next
    return gadgets


def smuggler_probes(gadget: str) -> dict[str, bytes]:
    g = gadget.encode("latin-1")
    head = b"POST /?cb=1 HTTP/1.1\r\n" + g + b"\r\nHost: corpus\r\nContent-Type: text/plain\r\n"
    # CL.TE: Content-Length covers everything; read as chunked, the body ends early and a request follows.
    clte_body = b"0\r\n\r\n" + SMUGGLED
    # TE.CL: the chunked body holds a request; read by Content-Length (4), that request follows.
    chunk = SMUGGLED
    tecl_body = b"%x\r\n%b\r\n0\r\n\r\n" % (len(chunk), chunk)
    return {
        "clte": head + b"Content-Length: %d\r\n\r\n" % len(clte_body) + clte_body,
        "tecl": head + b"Content-Length: 4\r\n\r\n" + tecl_body,
    }


# The configs repeat each gadget for every byte 0x7f-0xff; these stand for the rest (DEL, the first
# high byte, NEL, NBSP, a UTF-8 lead byte, 0xff): the router's parser treats every byte of that range
# alike in a name (not a token) and in a value (obs-text).
HIGH_BYTES_KEPT = {0x7F, 0x80, 0x85, 0xA0, 0xC2, 0xFF}


def _kept(gadget: str) -> bool:
    return all(ord(ch) < 0x7F or ord(ch) in HIGH_BYTES_KEPT for ch in gadget)


def extract_smuggler(src: Source) -> list[dict[str, Any]]:
    out = []
    for path in src.files("configs"):
        if not path.endswith(".py"):
            continue
        for name, gadget in smuggler_gadgets(src, path).items():
            if not _kept(gadget):
                continue
            for probe, payload in smuggler_probes(gadget).items():
                ident = f"{probe}-{slug(name)}"
                out.append(
                    case("smuggler", ident, "request", payload, path, name, gadget=gadget, probe=probe)
                )
    return unique(out)


# -- h11, uvicorn: byte strings in test modules -------------------------------------------------------

_HTTP_START = re.compile(rb"^(HTTP/\d|[A-Z]+ \S+ HTTP/\d)")


def evaluate_bytes(node: ast.AST) -> bytes | None:
    """A bytes value made of literals only: constants, +, * int, and b"sep".join([...])."""
    if isinstance(node, ast.Constant) and isinstance(node.value, bytes):
        return node.value
    if isinstance(node, ast.BinOp):
        left = evaluate_bytes(node.left)
        if isinstance(node.op, ast.Add):
            right = evaluate_bytes(node.right)
            return left + right if left is not None and right is not None else None
        if isinstance(node.op, ast.Mult) and left is not None and isinstance(node.right, ast.Constant):
            count = node.right.value
            return left * count if isinstance(count, int) and 0 <= count <= 1 << 20 else None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "join"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.List | ast.Tuple)
    ):
        sep = evaluate_bytes(node.func.value)
        parts = [evaluate_bytes(e) for e in node.args[0].elts]
        if sep is not None and all(p is not None for p in parts):
            return sep.join(p for p in parts if p is not None)
    return None


def python_messages(text: str) -> Iterator[tuple[int, bytes]]:
    taken: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if id(node) in taken:
            continue
        value = evaluate_bytes(node)
        if value is None:
            continue
        taken.update(id(n) for n in ast.walk(node))
        if _HTTP_START.match(value):
            yield node.lineno, value


def extract_python_tests(corpus: str, src: Source, paths: list[str]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        for line, value in python_messages(src.show(path)):
            kind = "response" if value.startswith(b"HTTP/") else "request"
            payload, added = with_host(value) if kind == "request" else (value, False)
            extra = {"host_added": True} if added else {}
            stem = Path(path).stem
            out.append(
                case(
                    corpus,
                    f"{kind}-{stem}-l{line}",
                    kind,
                    payload,
                    f"{path}:{line}",
                    f"{stem} line {line}",
                    **extra,
                )
            )
    return unique(out)


# -- running the payloads ----------------------------------------------------------------------------

NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log error;
events {{ worker_connections 512; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    client_header_timeout 1s;
    client_body_timeout 1s;
    keepalive_timeout 200ms;
    lingering_timeout 200ms;
    client_max_body_size 1m;
{servers}
}}
"""
NGINX_SERVER = """
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://127.0.0.1:{backend};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 2s;
        }}
    }}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def nginx_lanes(n: int) -> Any:
    backends = [await start_backend() for _ in range(n)]
    ports = [free_port() for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        servers = "".join(
            NGINX_SERVER.format(port=p, backend=b.port) for p, b in zip(ports, backends, strict=True)
        )
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=tmp, servers=servers))
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        proc = await asyncio.create_subprocess_exec(nginx, "-c", str(conf), "-p", tmp)
        try:
            for _ in range(200):
                with contextlib.suppress(OSError):
                    _, w = await asyncio.open_connection("127.0.0.1", ports[-1])
                    w.close()
                    break
                await asyncio.sleep(0.02)
            yield [Lane(p, b) for p, b in zip(ports, backends, strict=True)]
        finally:
            proc.terminate()
            await proc.wait()
            for b in backends:
                await b.stop()


# Where the router differs from nginx and RFC 9112/9110 allow both: (why, test on the case and both
# outcomes). The first that matches is recorded as the case's reason. The first three are about the
# status only; the others are where the router refuses, at the same point or earlier, what nginx reads
# leniently. One the RFC does not allow would say so (DEVIATION), to be fixed; none is left.
Check = Callable[[dict[str, Any], RequestOutcome, RequestOutcome], bool]
DEVIATION = "deviation: "


def _payload(c: dict[str, Any]) -> bytes:
    return bytes(c["payload"], "latin-1")


def _head(c: dict[str, Any]) -> bytes:
    return _payload(c).split(b"\r\n\r\n", 1)[0]


def _refuses(o: RequestOutcome) -> bool:
    return o.refusal is not None and o.refusal >= 400


def _silent(r: RequestOutcome) -> bool:
    """nginx said nothing of its own: it closed (a timeout, or bytes it would not answer)."""
    return r.refusal is None


def _earlier(o: RequestOutcome, r: RequestOutcome) -> bool:
    """The router refused, having forwarded a prefix of what nginx forwarded (perhaps all of it)."""
    return _refuses(o) and r.forwarded[: len(o.forwarded)] == o.forwarded


_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def _bad_field_line(head: bytes) -> bool:
    for line in re.split(rb"\r?\n", head)[1:]:
        name, sep, _ = line.partition(b":")
        if not sep or not _TOKEN.match(name):
            return True
    return False


_KNOWN = set(
    b"GET HEAD POST PUT DELETE CONNECT OPTIONS TRACE PATCH PROPFIND PROPPATCH MKCOL COPY MOVE LOCK "
    b"UNLOCK SEARCH REPORT MKACTIVITY CHECKOUT MERGE M-SEARCH NOTIFY SUBSCRIBE UNSUBSCRIBE PURGE "
    b"MKCALENDAR LINK UNLINK SOURCE BIND REBIND UNBIND ACL QUERY".split()
)


def _unknown_method(payload: bytes) -> bool:
    return any(m.group(1) not in _KNOWN for m in re.finditer(rb"(?:^|\n)([!-~]+) [^ \r\n]+ HTTP/", payload))


def _request_line(c: dict[str, Any]) -> bytes:
    return re.split(rb"\r?\n", _payload(c), maxsplit=1)[0]


_CHUNK_LINE = re.compile(rb"^[0-9A-Fa-f]+(;[!#$%&'*+\-.^_`|~0-9A-Za-z]+(=[^\r\n;]*)?)*$")


def _bad_chunk_line(c: dict[str, Any]) -> bool:
    body = _payload(c).split(b"\r\n\r\n", 1)[-1]
    return b"chunked" in _head(c).lower() and any(
        line and not _CHUNK_LINE.match(line) for line in body.split(b"\r\n")[:1]
    )


REASONS: list[tuple[str, Check]] = [
    (
        "both refuse; the router answers a request that is cut short or times out with 408 "
        "(RFC 9110 §15.5.9) where nginx closes without an answer",
        lambda c, o, r: o.forwarded == r.forwarded and o.refusal == 408 and _silent(r),
    ),
    (
        "both refuse the same request; the status differs (the router: 400 for a malformed message, "
        "405 for CONNECT, 408 for a request cut short, 501 for a transfer coding it does not implement "
        "(RFC 9112 §6.1), 505 for a version it does not speak; nginx picks others of these in places)",
        lambda c, o, r: o.forwarded == r.forwarded and _refuses(o) and _refuses(r),
    ),
    (
        "the router answers bytes that are not a valid request with 400 at once; nginx closes without "
        "an answer (RFC 9112 §2.2 lets a server refuse with 400 or close)",
        lambda c, o, r: o.forwarded == r.forwarded and _refuses(o) and _silent(r),
    ),
    (
        "a bare LF as a line end: RFC 9112 §2.2 lets a recipient accept it (nginx does); the router's "
        "parser refuses it, the safe side against a peer that reads the line differently",
        lambda c, o, r: _earlier(o, r) and re.search(rb"[^\r]\n", _payload(c)) is not None,
    ),
    (
        "a field line that is not `token: value` (a name with a character outside the token set, "
        "whitespace before the colon, no colon): nginx drops the line (ignore_invalid_headers) and goes "
        "on; RFC 9112 §5 makes the message invalid and the router refuses it with 400, so no peer can "
        "read that field differently from it",
        lambda c, o, r: _earlier(o, r) and _bad_field_line(_head(c)),
    ),
    (
        "a control character (NUL, bare CR, VT, FF, DEL...) in the request line or a field: RFC 9110 "
        "§5.5 lets a recipient reject the message; the router does, nginx lets some through",
        lambda c, o, r: (
            _earlier(o, r) and re.search(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)", _head(c)) is not None
        ),
    ),
    (
        "a chunk-size line outside RFC 9112 §7.1's grammar (whitespace, an empty or unquoted-broken "
        "extension): nginx reads past it; the router refuses the message (400), the safe side for framing",
        lambda c, o, r: _earlier(o, r) and _bad_chunk_line(c),
    ),
    (
        "a method llhttp does not know: RFC 9110 §9.1 lets a server answer 501 or 400; nginx forwards "
        "any token, the router's parser knows the methods it relays and refuses the others",
        lambda c, o, r: _earlier(o, r) and _unknown_method(_payload(c)),
    ),
    (
        "a request target with a byte outside RFC 3986 (non-ASCII): an invalid request-line, which "
        "RFC 9112 §3 lets a server refuse with 400; nginx forwards it as it came",
        lambda c, o, r: _earlier(o, r) and re.search(rb"[\x80-\xff]", _request_line(c)) is not None,
    ),
    (
        "an HTTP/0.9 request line (no version): RFC 9112 does not require HTTP/0.9; the router refuses "
        "it with 400, nginx serves it",
        lambda c, o, r: _earlier(o, r) and re.match(rb"^[A-Z]+ \S+$", _request_line(c)) is not None,
    ),
    (
        "an absolute-form target the router does not serve (a scheme other than http or https), or one "
        "beside an invalid Host header: the router refuses it with 400 (RFC 9110 §7.4 lets a server "
        "refuse a target that is not its own, and RFC 9112 §3.2 calls for 400 on an invalid Host); nginx "
        "ignores the scheme and the Host header of an absolute-form request",
        lambda c, o, r: (
            _earlier(o, r) and re.match(rb"^[A-Z]+ [a-zA-Z][a-zA-Z0-9+.-]*://", _request_line(c)) is not None
        ),
    ),
]


def same(ours: Outcome, ref: Outcome) -> bool:
    if isinstance(ours, RequestOutcome) and isinstance(ref, RequestOutcome):
        if ours.forwarded != ref.forwarded:
            return False
        if ours.refusal is None and ref.refusal is None:
            return True
        return ours.refusal == ref.refusal
    assert isinstance(ours, ResponseOutcome) and isinstance(ref, ResponseOutcome)
    if ours.status == ref.status == 502:
        return True  # each proxy's own 502 page
    return ours.expectation() == ref.expectation()


def decide(c: dict[str, Any], ours: Outcome, ref: Outcome) -> None:
    c["nginx"] = ref.expectation()
    if same(ours, ref):
        c["expect"] = ours.expectation()
        return
    for reason, check in REASONS:
        if isinstance(ours, RequestOutcome) and isinstance(ref, RequestOutcome) and check(c, ours, ref):
            c["expect"] = ours.expectation()
            c["reason"] = reason
            return
    if isinstance(ours, ResponseOutcome):
        # The upstream side: the invariants (well framed or 502) are what the test holds; the
        # router's own outcome is recorded with how it differs, for review.
        c["expect"] = ours.expectation()
        c["reason"] = "response: " + response_difference(ours, ref)
        return
    c["expect"] = ref.expectation()
    c["unexplained"] = {"router": ours.expectation()}


def response_difference(ours: ResponseOutcome, ref: ResponseOutcome) -> str:
    if ours.status == 502 and ref.status == 101:
        return (
            "a 101 to a request that offered no Upgrade: RFC 9110 §7.8 lets a server switch only to a "
            "protocol the client asked for; nginx relays it, the router answers 502"
        )
    if ours.status == 502 and "Transfer-Encoding the router cannot relay" in ours.body:
        return (
            "a Transfer-Encoding other than chunked alone: the router cannot frame such a body for the "
            "client without decoding it or passing it on unlabelled, and answers 502 as nginx does for a "
            "coding it does not know (RFC 9112 §6.3 would have the body run to the close)"
        )
    if ours.status == 502 and ref.status is None:
        return (
            "nginx passes bytes that are not an HTTP/1.x response through raw (as HTTP/0.9); the "
            "router answers 502 (RFC 9110 §15.6.3: an invalid response from the inbound server)"
        )
    if ours.status == 502:
        return (
            "a response outside RFC 9112's grammar (bare LF or CR line ends, a bad version or status "
            "line): RFC 9112 §2.2 lets a recipient reject it; the router's parser does (502), nginx "
            "reads it leniently"
        )
    if ref.status is None and ours.status is not None:
        return "nginx passes the bytes through raw; the router relays the response well framed"
    if ours.status == ref.status and not ours.complete:
        return (
            "the backend closed before the body its framing announced: the router ends the answer "
            "by closing, so the client sees it cut (RFC 9112 §8); nginx sends it as if whole"
        )
    if ours.status == ref.status:
        return (
            "Transfer-Encoding whose final coding is not chunked: RFC 9112 §6.3 has the body run to "
            "the close, and the router relays it so; nginx decodes chunked framing anyway"
        )
    return "the status differs"


async def run_all(cases: list[dict[str, Any]]) -> None:
    async with nginx_lanes(LANES) as lanes:
        ref = await run_lanes(lanes, cases)
    async with router_lanes(LANES) as lanes:
        ours = await run_lanes(lanes, cases)
    for c in cases:
        decide(c, ours[c["id"]], ref[c["id"]])


def summarize(out: Path) -> None:
    """Counts per corpus from the built files: outcomes, and differences from nginx by reason."""
    for name in REPOS:
        cases = json.loads((out / f"{name}.json").read_text())["cases"]
        requests = [c for c in cases if c["kind"] == "request"]
        responses = [c for c in cases if c["kind"] == "response"]
        refused = sum(1 for c in requests if c["expect"]["refusal"] is not None)
        answered_502 = sum(1 for c in responses if c["expect"]["status"] == 502)
        print(
            f"{name}: {len(cases)} cases; requests {len(requests)} (forwarded {len(requests) - refused}, "
            f"refused {refused}); responses {len(responses)} (relayed {len(responses) - answered_502}, "
            f"502 {answered_502}); differ from nginx {sum(1 for c in cases if 'reason' in c)}"
        )
        for reason, n in Counter(c["reason"] for c in cases if "reason" in c).most_common():
            print(f"  {n:5d}  {reason[:150]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    for name in REPOS:
        parser.add_argument(f"--{name}", type=Path, help=f"git directory of {REPOS[name]}")
    parser.add_argument("--out", type=Path, default=CORPUS_DIR)
    parser.add_argument("--summary", action="store_true", help="print the counts of the built files only")
    args = parser.parse_args()
    if args.summary:
        summarize(args.out)
        return 0
    missing = [f"--{name}" for name in REPOS if getattr(args, name) is None]
    if missing:
        parser.error(f"the git directories are needed: {' '.join(missing)}")
    sources = {name: Source(name, getattr(args, name)) for name in REPOS}
    corpora = {
        "llhttp": extract_llhttp(sources["llhttp"]),
        "garden": extract_garden(sources["garden"]),
        "smuggler": extract_smuggler(sources["smuggler"]),
        "h11": extract_python_tests(
            "h11", sources["h11"], [p for p in sources["h11"].files("h11/tests") if p.endswith(".py")]
        ),
        "uvicorn": extract_python_tests("uvicorn", sources["uvicorn"], ["tests/protocols/test_http.py"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name, cases in corpora.items():
        asyncio.run(run_all(cases))
        doc = {
            "source": {"repo": REPOS[name], "commit": sources[name].commit()},
            "about": "payloads are the public project's test data; expect is what the router must do",
            "cases": cases,
        }
        (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=True) + "\n")
        kinds = Counter(c["kind"] for c in cases)
        differ = sum(1 for c in cases if "reason" in c)
        unexplained = sum(1 for c in cases if "unexplained" in c)
        print(f"{name}: {dict(kinds)}, differ from nginx with a reason: {differ}, unexplained: {unexplained}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
