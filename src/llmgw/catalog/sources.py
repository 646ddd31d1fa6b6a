"""Where a profile's weights come from, decided from the source text alone. Pure.

Three kinds (issue 12): a bare model id (`Qwen/Qwen2.5-7B-Instruct`) goes to the engine
untouched (vLLM and SGLang resolve those themselves; a second snapshot downloader would be
wasted work); a path (`/models/x`, `./x`, `../x`) must exist on the node; an `http://` or
`https://` URL is fetched into the node's model cache and the engine gets the local path.
The catalog checks a source when the config loads and the agent checks it again before it
touches anything (a Start may come from an older or newer server).
"""

from __future__ import annotations

import enum
import hashlib
import re


class SourceKind(enum.StrEnum):
    MODEL_ID = "model id"
    PATH = "path"
    URL = "url"


URL_SCHEMES = ("http", "https")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


class SourceError(ValueError):
    """A source that cannot be used; the message is one line naming it and what is wrong."""


def classify(source: str) -> SourceKind:
    """The kind of `source`; SourceError for text that is none of them (an `s3://` URL, a
    URL with no host or no file name)."""
    if source.startswith(("/", "./", "../")) or source in (".", ".."):
        return SourceKind.PATH
    scheme, sep, _ = source.partition("://")
    if sep:
        if scheme.lower() not in URL_SCHEMES:
            raise SourceError(f"source {source!r}: scheme {scheme!r} is not supported (http://, https://, "
                              "an absolute or ./relative path, or a model id the engine resolves)")
        parse_url(source)  # raises for a URL with no host or no file
        return SourceKind.URL
    return SourceKind.MODEL_ID


class Url:
    """The parts of an http(s) URL the fetcher needs (no decoding beyond what a name needs)."""

    __slots__ = ("authority", "host", "path", "scheme", "text")

    def __init__(self, text: str, scheme: str, host: str, authority: str, path: str) -> None:
        self.text = text
        self.scheme = scheme
        self.host = host
        self.authority = authority  # host and port, without user info
        self.path = path

    @property
    def file_name(self) -> str:
        """The last path segment, safe as a file name (what `ctl replicas` shows)."""
        name = self.path.rsplit("/", 1)[-1]
        name = _SAFE_NAME.sub("_", name).lstrip(".")
        return name or "weights"

    @property
    def display(self) -> str:
        """The URL without user info or query (a presigned URL's signature stays out of logs)."""
        return f"{self.scheme}://{self.authority}{self.path}"


def parse_url(source: str) -> Url:
    scheme, _, rest = source.partition("://")
    if any(c.isspace() or ord(c) < 32 for c in source):
        raise SourceError(f"source {source!r}: a URL may hold no spaces or control characters")
    end = len(rest)
    for mark in "/?#":
        at = rest.find(mark)
        if at >= 0:
            end = min(end, at)
    netloc, tail = rest[:end], rest[end:]
    hostport = netloc.rpartition("@")[2]
    if hostport.startswith("["):
        host = hostport[: hostport.find("]") + 1] if "]" in hostport else ""
    else:
        host = hostport.partition(":")[0]
    if not host or host == "[]":
        raise SourceError(f"source {source!r}: the URL has no host")
    path = tail
    for mark in "?#":
        path = path.partition(mark)[0]
    if not path or path.endswith("/"):
        raise SourceError(f"source {source!r}: the URL names no file (it ends in /); give the weights file itself")
    return Url(source, scheme.lower(), host, hostport, path)


def shown(source: str) -> str:
    """`source` as the API, `ctl` and the admin pages show it to viewers: a URL without its user info
    or query (a password or a presigned signature stays with the nodes that fetch it); a model id or
    a path as it is."""
    try:
        return parse_url(source).display if classify(source) is SourceKind.URL else source
    except SourceError:  # the catalog refuses these; never echo one whole
        return source.partition("://")[0][:20] + "://…" if "://" in source else source


def cache_name(source: str) -> str:
    """Where a URL's file lives under the model cache: one directory per URL (the digest of the
    whole URL, so two files named model.safetensors never meet) and the file's own name."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return f"{digest}/{parse_url(source).file_name}"


def sha256_problem(value: str) -> str | None:
    """Why `value` is not a sha256 hex digest, or None (empty means "not given")."""
    if not value or _SHA256.fullmatch(value):
        return None
    return f"sha256 {value!r} is not 64 hex digits"
