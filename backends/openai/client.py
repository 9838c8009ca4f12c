"""A small OpenAI-API client on the standard library: JSON calls, SSE streams, and the errors
mapped to what a caller can act on (refused = the request is wrong, retry elsewhere = the
endpoint is down or overloaded)."""
from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Iterator

KEY_ENV = "LOCALCTX_OPENAI_API_KEY"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0


class EndpointDown(Exception):
    """Connection refused or reset, a timeout, a 5xx, 429 or 503: worth retrying, here or elsewhere."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class RequestRefused(Exception):
    """A 4xx other than 408/429: the request itself is wrong (too long, bad key, unknown model)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


def base_url(url: str) -> str:
    """``http://host:port`` or ``.../v1`` → the ``/v1`` base."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url if url.endswith("/v1") else url + "/v1"


@dataclass
class Client:
    base: str  # ends in /v1
    api_key: str | None = None
    timeout_s: float = READ_TIMEOUT_S

    @classmethod
    def for_url(cls, url: str, timeout_s: float = READ_TIMEOUT_S) -> "Client":
        return cls(base_url(url), os.environ.get(KEY_ENV) or None, timeout_s)

    @property
    def root(self) -> str:
        return self.base[:-len("/v1")]

    def _request(self, method: str, path: str, body: dict | None, timeout: float):
        url = self.root + path  # paths are from the server's root: /v1/models, /health, ...
        headers = {"Accept": "application/json, text/event-stream"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as exc:
            raise _http_error(exc, url) from None
        except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise EndpointDown(f"{url}: {reason}") from None

    def get(self, path: str, timeout: float = CONNECT_TIMEOUT_S) -> dict:
        with self._request("GET", path, None, timeout) as resp:
            return _json(resp.read(), self.base)

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        try:
            with self._request("POST", path, body, timeout or self.timeout_s) as resp:
                return _json(resp.read(), self.base)
        except (ConnectionError, socket.timeout, TimeoutError) as exc:  # dropped while reading the answer
            raise EndpointDown(f"{self.root}{path}: {exc}") from None

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """The ``data:`` payloads of an SSE answer, until ``[DONE]``; closing the iterator closes
        the connection (the server then cancels the generation)."""
        resp = self._request("POST", path, body, self.timeout_s)
        try:
            while True:
                try:
                    line = resp.readline()
                except (ConnectionError, socket.timeout, TimeoutError) as exc:
                    raise EndpointDown(f"{self.root}{path}: the stream broke: {exc}") from None
                if not line:
                    raise EndpointDown(f"{self.root}{path}: the stream ended without [DONE]")
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                item = _json(payload, self.base)
                if "error" in item:
                    err = item["error"] if isinstance(item["error"], dict) else {"message": str(item["error"])}
                    raise EndpointDown(f"{self.base}: {err.get('message')}")
                yield item
        finally:
            resp.close()


def _json(raw: bytes, where: str) -> dict:
    try:
        data = json.loads(raw)
    except ValueError:
        raise EndpointDown(f"{where}: the answer is not JSON") from None
    if not isinstance(data, dict):
        raise EndpointDown(f"{where}: the answer is not a JSON object")
    return data


def _http_error(exc: urllib.error.HTTPError, url: str) -> Exception:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        body = {}
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message, code = str(err.get("message") or exc.reason), err.get("code")
    else:
        message, code = str(err or (body.get("detail") if isinstance(body, dict) else None) or exc.reason), None
    if exc.code in (408, 429) or exc.code >= 500:
        retry = exc.headers.get("Retry-After") if exc.headers else None
        return EndpointDown(f"{url}: HTTP {exc.code}: {message}",
                            retry_after=float(retry) if retry and retry.replace(".", "", 1).isdigit() else None)
    return RequestRefused(exc.code, f"{url}: HTTP {exc.code}: {message}", code if isinstance(code, str) else None)
