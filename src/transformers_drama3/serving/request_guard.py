"""Which requests reach the server's routes at all: the Host and Origin a browser sends, one framing
per request, heads of bounded size. An ASGI middleware, on HTTP and the WebSocket alike.

A keyless server on loopback is reachable by any web page its user opens: the page cannot read the
answers (no CORS headers), but it can make the browser send requests, and a host name the page's
owner controls can be made to resolve to 127.0.0.1 (DNS rebinding: then the page is "same-origin"
with the server and reads everything). So:

- `Host` must name this server (`allowed_hosts`; default the loopback names `LOOPBACK_HOSTS`,
  `drama3 serve` adds the address it binds): a rebound name is refused (403).
- `Origin`, when a browser sends one, must be the server's own (same host and port as `Host`) or
  one of `allowed_origins` (default none; "*" any): a cross-site page is refused (403), WebSocket
  handshakes included. Clients that are not browsers send no `Origin`.
- JSON bodies need `Content-Type: application/json` (the routes check it, 415): the content types a
  page may send cross-site without asking first (`text/plain`, forms) never act.

`/health` answers whatever the Host or Origin (a load balancer probes by address; it changes
nothing). Requests framed twice (`Content-Length` and `Transfer-Encoding` both: the two could
disagree on where the body ends, and a request hidden after it would be answered) get 400, heads
over `MAX_HEAD_BYTES` or `MAX_HEADERS` 431 and targets over `MAX_TARGET_BYTES` 414, each with its
connection closed.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from .error_shapes import error_body

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
"""The names of this machine no DNS answer can rebind."""
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::", "[::]")
"""Bind addresses that are every interface, not a name a client uses."""
MAX_HEAD_BYTES = 16 * 2**10
"""Bytes of a request's head (request line and headers); h11 holds an incomplete head to the same."""
MAX_HEADERS = 100
MAX_TARGET_BYTES = 8 * 2**10
"""Bytes of a request's target (path and query)."""
OPEN_PATHS = ("/health",)


class Refusal(Exception):
    """A request refused before any route: its status, message, OpenAI error type and code, and
    whether its connection closes (a framing the server cannot trust)."""

    def __init__(self, status: int, message: str, error_type: str, code: str, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.error_type, self.code, self.close = status, message, error_type, code, close

    def body(self, path: str | None = None) -> bytes:
        """The refusal as the route at `path` answers errors (`error_shapes`)."""
        return json.dumps(error_body(path, self.status, self.message, self.error_type, None, self.code)).encode("ascii")


def host_name(value: str) -> str:
    """A `Host` value or host name -> its name without port, lowercased, an IPv6 address in brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    if value.count(":") > 1:  # a bare IPv6 address
        return f"[{value}]"
    name, _, port = value.rpartition(":")
    return (name if name and port.isdigit() else value).rstrip(".")


def allowed_hosts_for(bound: str, extra=()) -> tuple[str, ...]:
    """The host names a server bound to `bound` answers: the loopback names, `bound` unless it is
    a wildcard, and `extra` (`--allowed-hosts`; "*" lets any name through)."""
    names = list(LOOPBACK_HOSTS)
    if bound.strip().lower() not in WILDCARD_ADDRESSES:
        names.append(host_name(bound))
    names += ["*" if name.strip() == "*" else host_name(name) for name in extra]
    return tuple(dict.fromkeys(names))


def origin_of(value: str) -> str:
    """An allowed origin as a browser writes it (`scheme://host[:port]`, lowercased); ValueError
    naming `value` when it is not one."""
    if value.strip() == "*":
        return "*"
    parts = urlsplit(value.strip().lower())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"--allowed-origins {value!r}: expected an origin such as https://app.example or "
                         "http://localhost:3000 (scheme, host and port only), or *")
    return f"{parts.scheme}://{parts.netloc}"


def _headers(scope, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in scope["headers"] if key == name]


def check_head(scope) -> None:
    """Raise a Refusal (closing the connection) for a head over the limits or framed twice."""
    target = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + 1
    if target > MAX_TARGET_BYTES:
        raise Refusal(414, f"the request target is {target} bytes; at most {MAX_TARGET_BYTES}", "invalid_request_error",
                      "uri_too_long", close=True)
    headers = scope["headers"]
    if len(headers) > MAX_HEADERS:
        raise Refusal(431, f"the request has {len(headers)} headers; at most {MAX_HEADERS}", "invalid_request_error",
                      "headers_too_large", close=True)
    size = target + sum(len(key) + len(value) + 4 for key, value in headers)
    if size > MAX_HEAD_BYTES:
        raise Refusal(431, f"the request's head is {size} bytes; at most {MAX_HEAD_BYTES}", "invalid_request_error",
                      "headers_too_large", close=True)
    names = [key for key, _ in headers]
    if b"content-length" in names and b"transfer-encoding" in names:
        raise Refusal(400, "the request has both Content-Length and Transfer-Encoding; send one", "invalid_request_error",
                      "ambiguous_framing", close=True)
    if names.count(b"host") > 1:
        raise Refusal(400, "the request has more than one Host header", "invalid_request_error", "bad_request", close=True)


def check_site(scope, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...]) -> None:
    """Raise a Refusal (403) for a Host that does not name this server or an Origin of another site."""
    hosts = _headers(scope, b"host")
    host = hosts[0] if hosts else None
    if host is not None and "*" not in allowed_hosts and host_name(host) not in allowed_hosts:
        shown = host if len(host) <= 64 else host[:61] + "..."
        raise Refusal(403, f"Host {shown!r} is not a name of this server (drama3 serve --allowed-hosts)",
                      "permission_error", "forbidden_host")
    origins = _headers(scope, b"origin")
    if not origins:
        return
    origin = origins[0].strip().lower()
    if "*" in allowed_origins or origin in allowed_origins:
        return
    if host is not None and origin != "null" and urlsplit(origin).netloc == host.strip().lower():
        return  # the server's own page (e.g. /docs)
    shown = origin if len(origin) <= 64 else origin[:61] + "..."
    raise Refusal(403, f"Origin {shown!r} may not use this server (drama3 serve --allowed-origins)",
                  "permission_error", "forbidden_origin")


class RequestGuard:
    """ASGI middleware: `check_head`, then `check_site` (but on `OPEN_PATHS`), before the app."""

    def __init__(self, app, allowed_hosts=LOOPBACK_HOSTS, allowed_origins=()):
        self.app = app
        self.allowed_hosts = tuple("*" if name == "*" else host_name(name) for name in allowed_hosts)
        self.allowed_origins = tuple(origin_of(origin) for origin in allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        try:
            check_head(scope)
            if scope["path"] not in OPEN_PATHS:
                check_site(scope, self.allowed_hosts, self.allowed_origins)
        except Refusal as refusal:
            return await _refuse(scope, receive, send, refusal)
        return await self.app(scope, receive, send)


async def _refuse(scope, receive, send, refusal: Refusal) -> None:
    """Answer `refusal` as an HTTP response (a WebSocket handshake too, where the server can)."""
    body = refusal.body(scope.get("path"))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if refusal.close:
        headers.append((b"connection", b"close"))
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    await receive()  # websocket.connect
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})  # the server answers the handshake 403
