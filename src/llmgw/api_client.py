"""The operator's client of the public JSON API (used by `llmgw ctl`)."""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec

from llmgw.errors import LlmgwError, Unreachable, UsageError
from llmgw.safetext import terminal_text
from llmgw.server.forgery import SAFE_METHODS, WRITE_HEADERS
from llmgw.tls.context import check_key_pair, client_context

DEFAULT_SERVER = "http://127.0.0.1:8080"  # also in llmgw.cli.ctl (kept light to import)


def segment(value: str) -> str:
    """What the operator typed as one path segment (a node or replica id): a '/', '?' or '#' in it
    cannot reach another route (`ctl drain 'gpu-01/cordon?'` cordoned gpu-01), nor a control
    character the URL (a traceback); the server answers 'no node ...' instead."""
    from urllib.parse import quote

    if value in ("", ".", ".."):
        raise UsageError(f"{value!r} is not a node or replica id")
    return quote(value, safe="")


class ApiError(LlmgwError):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ApiClient:
    def __init__(
        self,
        server: str = DEFAULT_SERVER,
        *,
        token: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        ca: str | None = None,
        timeout: float = 10.0,
        insecure: bool = False,
        warn: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.server = server.rstrip("/")
        if "://" not in self.server:
            self.server = f"http://{self.server}"
        check_cleartext(self.server, token=bool(token), cert=bool(cert or key), insecure=insecure, warn=warn)
        self.ca = ca
        self.cert = cert
        headers = {"user-agent": "llmgw-ctl"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        verify: Any = True
        if ca:
            # Files are checked first: a wrong path or a mismatched key is one line, not a traceback.
            verify = client_context(ca, cert or None, key or None, alpn=("http/1.1",))
        elif cert or key:
            if not (cert and key):
                raise UsageError("an operator certificate needs both --cert and --key")
            check_key_pair(cert, key)
            verify = ssl.create_default_context()
            verify.load_cert_chain(cert, key)
        self._client = httpx.Client(base_url=self.server, headers=headers, timeout=timeout, verify=verify)

    def close(self) -> None:
        self._client.close()

    def request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            content = None if body is None else msgspec.json.encode(body)
            response = self._client.request(method, path, content=content, headers=_headers(method))
        except httpx.TimeoutException:
            raise Unreachable(f"the llmgw server at {self.server} did not answer in time") from None
        except httpx.HTTPError as exc:
            tls = self._tls_problem(exc)
            if tls:
                raise LlmgwError(tls) from None
            if isinstance(exc, httpx.ConnectError):
                raise Unreachable(
                    f"cannot reach the llmgw server at {self.server}: {_reason(exc)} "
                    "(is `llmgw server` running? set --server or LLMGW_SERVER)"
                ) from None
            if isinstance(exc, httpx.RemoteProtocolError) and self.server.startswith("http://"):
                raise Unreachable(
                    f"the llmgw server at {self.server} closed the connection without an answer; if its public "
                    "port speaks TLS (public_tls in its config), use an https:// URL with --ca"
                ) from None
            if (isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError) and self.cert
                    and self.server.startswith("https://")):
                raise LlmgwError(
                    f"the llmgw server at {self.server} closed the connection without an answer: it most likely "
                    f"refused the client certificate {self.cert} (not from the CA in its public_tls.ca, or expired); "
                    "see the server's log"
                ) from None
            raise Unreachable(f"request to {self.server}{path} failed: {exc}") from None
        if response.status_code >= 400:
            message = _error_message(response)
            if response.status_code == 400 and "on a TLS port" in message and self.server.startswith("http://"):
                raise Unreachable(  # the server's plain-text answer on its TLS port (web.server._plain_on_tls)
                    f"the llmgw server at {self.server} speaks TLS on that port (public_tls in its config): "
                    "use an https:// URL with --ca"
                )
            raise ApiError(f"{method} {path}: HTTP {response.status_code}: {message}", response.status_code)
        try:
            return response.json()
        except ValueError:
            raise LlmgwError(f"{method} {path}: the server answered something that is not JSON") from None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def stream_lines(self, path: str, *, method: str = "GET", body: Any = None) -> Iterator[str]:
        """The lines of a streamed answer as they come (`ctl logs -f`, `ctl fabric-test`): no read
        timeout, since a quiet engine writes nothing for minutes; a slow reader simply reads
        slower, and the server and the node wait for it (their buffers are bounded)."""
        content = None if body is None else msgspec.json.encode(body)
        try:
            with self._client.stream(method, path, content=content, headers=_headers(method),
                                     timeout=httpx.Timeout(self._client.timeout.connect, read=None)) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ApiError(f"{method} {path}: HTTP {response.status_code}: {_error_message(response)}",
                                   response.status_code)
                yield from response.iter_lines()
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.ConnectError):
                raise Unreachable(f"cannot reach the llmgw server at {self.server}: {_reason(exc)} "
                                  "(is `llmgw server` running? set --server or LLMGW_SERVER)") from None
            raise Unreachable(f"the stream from {self.server}{path} broke: {exc}") from None

    def _tls_problem(self, exc: BaseException) -> str:
        """One line for a failed TLS handshake with the server ("" when it was not one)."""
        err = _ssl_error(exc)
        if err is None:
            return ""
        from llmgw.tls import explain_tls_error

        host = httpx.URL(self.server).host
        if isinstance(err, ssl.SSLCertVerificationError) and not self.ca:
            detail = err.verify_message or "certificate verify failed"
            return (
                f"certificate verify failed for the llmgw server at {self.server} ({detail}): pass the cluster's "
                "CA certificate with --ca ca.crt (or LLMGW_CA), the ca.crt of the `llmgw ctl cert` directory"
            )
        if getattr(err, "reason", "") in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
            return (f"the llmgw server at {self.server} does not speak TLS on that port; use an http:// URL "
                    "(its public port has no public_tls)")
        line = explain_tls_error(exc, host).replace("point tls.ca at", "pass --ca with")
        return f"TLS with the llmgw server at {self.server} failed: {line}"


def _headers(method: str) -> dict[str, str] | None:
    """What every change sends: what a browser cannot send from another site (server/forgery.py)."""
    return None if method in SAFE_METHODS else WRITE_HEADERS


def is_loopback(host: str) -> bool:
    """localhost or a loopback literal; a name is never resolved (nothing is sent before the check)."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_cleartext(server: str, *, token: bool, cert: bool, insecure: bool, warn: Callable[[str], None]) -> None:
    """Refuse to send a credential over plain http:// to another machine (a token would cross
    the network in cleartext on every call, GETs included); --insecure sends it with a warning."""
    url = httpx.URL(server)
    if url.scheme != "http" or not (token or cert) or is_loopback(url.host):
        return
    what = "the token" if token else "a client certificate"
    if not insecure:
        raise UsageError(
            f"refusing to send {what} over plain http:// to {url.host}: use an https:// URL (public_tls on the "
            "server, with --ca) or reach the server on loopback; --insecure sends it anyway"
        )
    warn(f"sending {what} over plain http:// to {url.host} (--insecure): anyone on the path can read it")


def _ssl_error(exc: BaseException) -> ssl.SSLError | None:
    seen: set[int] = set()
    cur: BaseException | None = exc
    todo = [exc]
    while todo:
        cur = todo.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, ssl.SSLError):
            return cur
        todo.extend(e for e in (cur.__cause__, cur.__context__) if e is not None)
    return None


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    if "Name or service not known" in text or "nodename nor servname" in text:
        return "unknown host"
    return text or type(exc).__name__


def _error_message(response: httpx.Response) -> str:
    """The server's explanation of a refusal, as one line of plain text (it reaches a terminal)."""
    return terminal_text(_raw_error_message(response))


def _raw_error_message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:200] or response.reason_phrase
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", data["error"]))
    if isinstance(data, dict) and isinstance(data.get("message"), str):
        return data["message"]  # e.g. a refused reload: {"ok": false, "message": "file:line ..."}
    return str(data)[:200]
