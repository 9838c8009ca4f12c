"""Who may talk to ``localctx serve``: one ASGI layer in front of every route.

With an API key (``--api-key``, better ``$LOCALCTX_API_KEY``: a key on the command line shows in
``ps``) every route but /health needs ``Authorization: Bearer KEY``. Without one the server is a
desktop's: it answers only requests addressed to this machine by name — a Host header that is
``localhost`` (or ``*.localhost``), a loopback address, or a name given with ``--allow-host`` — so
that a web page cannot reach it through DNS rebinding; a request that carries a browser's
``Origin`` must come from such a host too; and a POST body must be ``application/json``, which a
page on another origin cannot send without a CORS preflight, which this server does not grant.
CORS headers are sent only to the origins named with ``--cors ORIGIN``. Each refusal is an
OpenAI-shaped error: 401, 403 (host, origin), 415 (media type).

The same layer counts every answer by path and status for /metrics (``on_status``)."""
from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

KEY_FREE_PATHS = ("/health",)
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"


@dataclass(frozen=True)
class Access:
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # --allow-host: names (or addresses) served without a key, lower case
    cors_origins: tuple[str, ...] = ()  # --cors: origins sent CORS headers ("*": any, with a key only)


def is_loopback(host: str) -> bool:
    """A name or address that only ever means this machine."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host of a Host header, without its port ("[::1]:8080" → "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _error(status: int, message: str, type: str, code: str, headers: list | None = None) -> tuple:
    body = json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    return status, body, [(b"content-type", b"application/json"), *(headers or [])]


class AccessLayer:
    """ASGI middleware: the checks above, then the app; CORS headers added where they apply."""

    def __init__(self, app, access: Access, on_status: Callable[[str, int], None] | None = None):
        self.app, self.access, self.on_status = app, access, on_status

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        origin = headers.get("origin")
        cors = self._cors_headers(origin)

        async def counted_send(message):
            if message["type"] == "http.response.start":
                if cors:
                    message = {**message, "headers": [*message.get("headers", []), *cors]}
                if self.on_status is not None:
                    self.on_status(path, message["status"])
            await send(message)

        refusal = self.refusal(scope["method"], path, headers)
        if refusal is None and scope["method"] == "OPTIONS":
            refusal = (204, b"", [(b"access-control-allow-methods", CORS_METHODS.encode()),
                                  (b"access-control-allow-headers", CORS_HEADERS.encode()),
                                  (b"access-control-max-age", b"600")]) if cors else \
                _error(405, "OPTIONS is answered only to the origins named with --cors", "invalid_request_error",
                       "method_not_allowed")
        if refusal is None:
            return await self.app(scope, receive, counted_send)
        status, body, extra = refusal
        await counted_send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-length", str(len(body)).encode()), *extra]})
        await counted_send({"type": "http.response.body", "body": body})

    def _cors_headers(self, origin: str | None) -> list:
        allowed = self.access.cors_origins
        if origin is None or not (origin in allowed or "*" in allowed):
            return []
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    def _host_allowed(self, host: str) -> bool:
        return is_loopback(host) or host in self.access.allowed_hosts

    def refusal(self, method: str, path: str, headers: dict[str, str]) -> tuple | None:
        """(status, body, headers) of the answer that refuses this request, or None."""
        key = self.access.api_key
        if key is not None:
            if path in KEY_FREE_PATHS or method == "OPTIONS":
                return None
            auth = headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                return _error(401, "Incorrect API key provided: send Authorization: Bearer <the key the server was "
                                   "started with>", "authentication_error", "invalid_api_key",
                              [(b"www-authenticate", b"Bearer")])
            return None
        host = host_name(headers.get("host", ""))
        if not self._host_allowed(host):
            return _error(403, f"the request is addressed to host {host or '(none)'!r}, not to this machine: without "
                               "an API key localctx serve answers only localhost, loopback addresses and the names "
                               f"given with --allow-host; add --allow-host {host or 'NAME'}, or set "
                               "$LOCALCTX_API_KEY", "invalid_request_error", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and origin not in self.access.cors_origins:
            origin_host = urlsplit(origin).hostname or ""
            if not self._host_allowed(origin_host):
                return _error(403, f"requests from web pages at {origin} are refused: without an API key only pages "
                                   "on this machine may call localctx serve; start it with --cors "
                                   f"{origin} to allow that origin", "invalid_request_error", "origin_not_allowed")
        if method == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return _error(415, f"the body's Content-Type is {media or 'missing'}: send application/json "
                                   "(curl: -H 'Content-Type: application/json')", "invalid_request_error",
                              "unsupported_media_type")
        return None
