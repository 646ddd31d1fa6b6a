"""One attempt at downloading one weights file: blocking, run in a worker thread (llmgw.agent.weights).

The file is written to `<target>.partial` beside the target, with `<target>.partial.json`
recording the URL and the validator the server gave (ETag, or Last-Modified), and renamed to
the target only when every byte is there, fsynced and (when a sha256 is given) verified: a
partial file is never found under the model's name. A later attempt, by this agent or the
next, resumes the partial file with `Range: bytes=N-` and `If-Range: <validator>`; a server
that answers 200 instead (no Range support, or the file changed) restarts it from byte 0.

Why httpx's blocking client in a thread: the agent's event loop must stay free (heartbeats,
the engines' health checks), a disk write can block for a long time, and the read size
decides the speed. `make bench-fetch` (2 GB sparse file over loopback into /dev/shm, same run,
best of 3): httpx in its default 64 KiB reads reached 478 MB/s against curl's 1126 MB/s
(ratio 0.42); with 1 MiB reads (`READ_SIZE` below) 1270 against 1227 (ratio 1.04), peak RSS
growth 6 MB. web/client.py speaks plain http only (no https for a weights store) and reads on
the event loop.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import httpcore
import httpx
import msgspec

from llmgw.fsutil import publish

READ_SIZE = 1 << 20  # bytes per socket read and file write (see the module docstring)
HASH_READ = 4 << 20  # bytes per read when hashing what a resumed file already has
DISK_MARGIN = 64 << 20  # bytes left free beyond the download, for logs and state files

# httpcore reads a response in 64 KiB pieces by default, a class attribute with no option to
# set it per client. Only the fetcher uses httpx's blocking client in the agent (the
# supervisor's health checks use the async one, which has its own attribute).
httpcore._sync.http11.HTTP11Connection.READ_NUM_BYTES = READ_SIZE


class Reason(enum.StrEnum):
    """Why a download failed: the `reason` label of llmgw_weights_fetch_failures_total."""

    HTTP = "http"  # the server answered an error status
    NETWORK = "network"  # no connection, a reset, a timeout, a body cut short
    CHECKSUM = "checksum"  # the sha256 differs
    LENGTH = "length"  # the server's lengths contradict what it sent
    DISK = "disk"  # no room, or the cache cannot be written
    TIMEOUT = "timeout"  # still downloading at start_timeout
    SOURCE = "source"  # a source the agent refuses (no host, no file)


class FetchError(Exception):
    """A failed attempt: `reason` for the metric, `retry` when another attempt may succeed."""

    def __init__(self, reason: Reason, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry = retry


class Partial(msgspec.Struct, kw_only=True):
    """What `<target>.partial.json` records about the partial file beside it."""

    url: str
    etag: str = ""
    last_modified: str = ""
    total: int | None = None

    @property
    def validator(self) -> str:
        return self.etag or self.last_modified


class Transfer:
    """Shared by the worker thread (which writes) and the trio task that reports (which reads
    once a second): plain attributes, each a whole value; `stop` asks the worker to give up."""

    def __init__(self) -> None:
        self.done = 0  # bytes of the file on disk so far
        self.total: int | None = None
        self.fetched = 0  # bytes received over the network (all attempts)
        self.answered = False  # a response head came: `total` says what the server announced
        self.stop = threading.Event()


class Stopped(Exception):
    """The worker saw `Transfer.stop` (the download was cancelled); the partial file is kept."""


def partial_paths(target: Path) -> tuple[Path, Path]:
    return target.with_name(target.name + ".partial"), target.with_name(target.name + ".partial.json")


def _read_partial(meta: Path, url: str) -> Partial | None:
    try:
        record = msgspec.json.decode(meta.read_bytes(), type=Partial)
    except (OSError, msgspec.DecodeError):
        return None
    return record if record.url == url else None


def _strong_etag(value: str | None) -> str:
    """An ETag usable in If-Range: a weak one (W/"…") may not be (RFC 9110 §13.1.5)."""
    return value if value and not value.startswith("W/") else ""


def _content_range(value: str | None) -> tuple[int, int | None] | None:
    """(first byte, total or None) from `bytes first-last/total`; None when unreadable."""
    if not value or not value.startswith("bytes "):
        return None
    span, _, total = value[6:].partition("/")
    first, dash, _ = span.partition("-")
    if not dash or not first.isdigit():
        return None
    return int(first), int(total) if total.isdigit() else None


def download(client: httpx.Client, url: str, display: str, target: Path, sha256: str, transfer: Transfer,
             *, disk_free: Callable[[Path], int] | None = None) -> None:
    """Make `target` exist with the whole file: resume or start the partial file, then rename.
    Raises FetchError (or Stopped). Never leaves a partial file under the target's name."""
    if target.is_dir():
        raise FetchError(Reason.DISK, f"{target} is a directory; the model cache needs a file there")
    partial, meta = partial_paths(target)
    record = _read_partial(meta, url)
    offset = 0
    if record is not None and record.validator and partial.is_file():
        offset = partial.stat().st_size
    headers = {"accept-encoding": "identity"}  # bytes as stored: a gzip body would not resume by offset
    if offset > 0 and record is not None:
        headers["range"] = f"bytes={offset}-"
        headers["if-range"] = record.validator
    try:
        with client.stream("GET", url, headers=headers) as response:
            _receive(response, url, display, target, partial, meta, offset, sha256, transfer, disk_free or _disk_free)
    except httpx.TimeoutException as exc:
        raise FetchError(Reason.NETWORK, f"{display}: timed out ({type(exc).__name__})", retry=True) from None
    except httpx.TransportError as exc:
        raise FetchError(Reason.NETWORK, f"{display}: {_transport_text(exc)}", retry=True) from None


def _transport_text(exc: httpx.TransportError) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.RemoteProtocolError) and "complete message body" in text:
        return f"the connection closed mid-body ({text})"
    return text


def _receive(response: httpx.Response, url: str, display: str, target: Path, partial: Path, meta: Path, offset: int,
             sha256: str, transfer: Transfer, disk_free: Callable[[Path], int]) -> None:
    status = response.status_code
    if status == 416 and offset > 0:
        raise FetchError(Reason.LENGTH, f"{display}: the server has no byte {offset} (416), yet the download is "
                         "incomplete: the file is shorter than the server announced")
    if status >= 400:
        phrase = response.reason_phrase or ""
        retry = status >= 500 or status in (408, 429)
        raise FetchError(Reason.HTTP, f"{display}: HTTP {status} {phrase}".rstrip(), retry=retry)
    if status not in (200, 206):
        raise FetchError(Reason.HTTP, f"{display}: unexpected HTTP {status} {response.reason_phrase}".rstrip())
    length = response.headers.get("content-length")
    announced = int(length) if length is not None and length.isdigit() else None
    if status == 206:
        found = _content_range(response.headers.get("content-range"))
        if found is None or found[0] != offset:
            # Not the bytes asked for: start over (without Range) on the next attempt.
            with contextlib.suppress(FileNotFoundError):
                meta.unlink()
            raise FetchError(Reason.LENGTH, f"{display}: asked for bytes from {offset}, the server sent "
                             f"{response.headers.get('content-range')!r}; starting over", retry=True)
        total = found[1] if found[1] is not None else (offset + announced if announced is not None else None)
        if total is not None and announced is not None and offset + announced != total:
            raise FetchError(Reason.LENGTH, f"{display}: Content-Length {announced} from byte {offset} "
                             f"contradicts the total of {total} in Content-Range (the server's lengths lie)")
    else:
        offset = 0  # the whole file: the server ignored Range, or the file changed (If-Range)
        total = announced
    record = Partial(url=url, etag=_strong_etag(response.headers.get("etag")),
                     last_modified=response.headers.get("last-modified", ""), total=total)
    transfer.total = total
    transfer.done = offset
    transfer.answered = True
    target.parent.mkdir(parents=True, exist_ok=True)
    if total is not None:
        need = total - offset + DISK_MARGIN
        free = disk_free(target.parent)
        if free < need:
            raise FetchError(Reason.DISK, f"{display}: {total - offset} bytes to fetch, {free} free in "
                             f"{target.parent} (keeping {DISK_MARGIN >> 20} MiB spare); nothing written")
    digest = hashlib.sha256() if sha256 else None
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if offset else os.O_TRUNC)
    try:
        fd = os.open(partial, flags, 0o600)
    except OSError as exc:
        raise FetchError(Reason.DISK, f"cannot write {partial}: {exc.strerror or exc}") from None
    try:
        meta.write_bytes(msgspec.json.encode(record))
        if digest is not None and offset:
            _hash_prefix(partial, offset, digest, transfer)
        try:
            for piece in response.iter_raw():
                if transfer.stop.is_set():
                    raise Stopped
                _write_all(fd, piece)
                transfer.fetched += len(piece)
                transfer.done += len(piece)
                if digest is not None:
                    digest.update(piece)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                os.close(fd)
                fd = -1
                _discard(partial, meta)
                raise FetchError(Reason.DISK, f"{display}: {exc.strerror} writing {partial} after {transfer.done} "
                                 "bytes; removed the partial file") from None
            raise FetchError(Reason.DISK, f"{display}: cannot write {partial}: {exc.strerror or exc}") from None
        if total is not None and transfer.done != total:
            raise FetchError(Reason.LENGTH, f"{display}: got {transfer.done} of the {total} bytes announced",
                             retry=transfer.done < total)
        os.fsync(fd)
    finally:
        if fd >= 0:
            os.close(fd)
    if digest is not None and digest.hexdigest() != sha256.lower():
        _discard(partial, meta)
        raise FetchError(Reason.CHECKSUM, f"{display}: sha256 is {digest.hexdigest()}, the profile says {sha256.lower()}; "
                         "removed the download")
    publish(partial, target)
    with contextlib.suppress(FileNotFoundError):
        meta.unlink()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _hash_prefix(partial: Path, size: int, digest: hashlib._Hash, transfer: Transfer) -> None:
    with open(partial, "rb") as fh:
        left = size
        while left > 0:
            if transfer.stop.is_set():
                raise Stopped
            block = fh.read(min(HASH_READ, left))
            if not block:
                break
            digest.update(block)
            left -= len(block)


def _discard(partial: Path, meta: Path) -> None:
    for path in (partial, meta):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _disk_free(directory: Path) -> int:
    return shutil.disk_usage(directory).free
