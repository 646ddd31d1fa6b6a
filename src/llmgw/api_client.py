"""The operator's client of the public JSON API (used by `llmgw ctl`)."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from llmgw.errors import LlmgwError, Unreachable

DEFAULT_SERVER = "http://127.0.0.1:8080"


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
    ) -> None:
        self.server = server.rstrip("/")
        if "://" not in self.server:
            self.server = f"http://{self.server}"
        headers = {"user-agent": "llmgw-ctl"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        verify: Any = True
        if ca:
            import ssl

            verify = ssl.create_default_context(cafile=ca)
            if cert:
                verify.load_cert_chain(cert, key)
        elif cert:
            import ssl

            verify = ssl.create_default_context()
            verify.load_cert_chain(cert, key)
        self._client = httpx.Client(base_url=self.server, headers=headers, timeout=timeout, verify=verify)

    def close(self) -> None:
        self._client.close()

    def request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            response = self._client.request(
                method, path, content=None if body is None else msgspec.json.encode(body),
                headers={"content-type": "application/json"} if body is not None else None,
            )
        except httpx.ConnectError as exc:
            raise Unreachable(
                f"cannot reach the llmgw server at {self.server}: {_reason(exc)} "
                "(is `llmgw server` running? set --server or LLMGW_SERVER)"
            ) from None
        except httpx.TimeoutException:
            raise Unreachable(f"the llmgw server at {self.server} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise Unreachable(f"request to {self.server}{path} failed: {exc}") from None
        if response.status_code >= 400:
            raise ApiError(f"{method} {path}: HTTP {response.status_code}: {_error_message(response)}", response.status_code)
        try:
            return response.json()
        except ValueError:
            raise LlmgwError(f"{method} {path}: the server answered something that is not JSON") from None

    def get(self, path: str) -> Any:
        return self.request("GET", path)


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    if "Name or service not known" in text or "nodename nor servname" in text:
        return "unknown host"
    return text or type(exc).__name__


def _error_message(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:200] or response.reason_phrase
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", data["error"]))
    return str(data)[:200]
