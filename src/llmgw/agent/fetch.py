"""One attempt at downloading one weights file: blocking, run in a worker thread (llmgw.agent.weights).

The file is written to `<target>.partial` beside the target, with `<target>.partial.json`
recording the URL and the validator the server gave (ETag, or Last-Modified), and renamed to
the target only when every byte is there, fsynced and (when a sha256 is given) verified: a
partial file is never found under the model's name. A later attempt, by this agent or the
next, resumes the partial file with `Range: bytes=N-` and `If-Range: <validator>`; a server
that answers 200 instead (no Range support, or the file changed) restarts it from byte 0.

The cache may be shared, so nothing in it is trusted to be what its name says (issue 40,
finding 8): the entry's directory is opened with O_NOFOLLOW and every file in it is opened,
renamed and removed relative to that directory's fd with O_NOFOLLOW, so a symbolic link
planted at any of the names is refused, never written through. Directories are created 0700
and files 0600, and `.partial.json` holds the URL as logs show it (no user info, no query)
with the sha256 of the whole URL to match a resume, never the credentials.

Redirects are followed here, one hop at a time, by llmgw.catalog.redirects' rules (the
source's host or the catalog's allow_redirect_hosts, no loopback, link-local or metadata
address unless the source was there, at most MAX_REDIRECTS hops; issue 40, finding 4): the
client never follows one on its own.

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
import socket
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import httpcore
import httpx
import msgspec

from llmgw.catalog.redirects import (
    MAX_REDIRECTS,
    REDIRECT_STATUSES,
    address_problem,
    host_problem,
    port_of,
)
from llmgw.catalog.sources import SourceError, Url, parse_url

READ_SIZE = 1 << 20  # bytes per socket read and file write (see the module docstring)
HASH_READ = 4 << 20  # bytes per read when hashing what a resumed file already has
DISK_MARGIN = 64 << 20  # bytes left free beyond the download, for logs and state files
# Without a Content-Length the free space is checked again every SPACE_STEP bytes written (64
# reads: one statvfs per 64 MiB, not one per read), and the download stops when less than
# DISK_MARGIN + SPACE_STEP is free (issue 40, finding 9).
SPACE_STEP = 64 << 20

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
    REDIRECT = "redirect"  # a redirect the agent refuses (another host, an internal address, too many hops)


class FetchError(Exception):
    """A failed attempt: `reason` for the metric, `retry` when another attempt may succeed."""

    def __init__(self, reason: Reason, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry = retry


class Partial(msgspec.Struct, kw_only=True):
    """What `<target>.partial.json` records about the partial file beside it: the source as
    logs show it (for people) and the sha256 of the whole URL (to match a resume), never the
    URL itself, whose user info or presigned query is a credential."""

    source: str = ""
    url_sha256: str = ""
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


def url_digest(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


Resolve = Callable[[str, int], list[str]]


def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (blocking: called in the worker thread)."""
    name = host[1:-1] if host.startswith("[") else host
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)})


class _Entry:
    """The directory of one cache entry, opened without following a link; every name in it is
    used relative to its fd and never followed (see the module docstring)."""

    def __init__(self, directory: Path, display: str) -> None:
        self.path = directory
        self.display = display
        _make_dirs(directory, display)
        try:
            self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _link_refused(display, directory) from None
            raise FetchError(Reason.DISK, f"cannot open {directory}: {exc.strerror or exc}") from None
        try:
            st = os.fstat(self.fd)
            if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
                os.fchmod(self.fd, 0o700)  # an entry made 0755 by an older agent
        except OSError:
            os.close(self.fd)
            raise

    def close(self) -> None:
        os.close(self.fd)

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry `name` itself (a link is not followed); None when absent."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def regular(self, name: str) -> os.stat_result | None:
        """`name` when it is a plain file; None when absent; a link or anything else is refused."""
        st = self.lstat(name)
        if st is None or stat.S_ISREG(st.st_mode):
            return st
        if stat.S_ISLNK(st.st_mode):
            raise _link_refused(self.display, self.path / name)
        raise FetchError(Reason.DISK, f"{self.path / name} is not a plain file; the model cache needs a file there")

    def open(self, name: str, flags: int) -> int:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _link_refused(self.display, self.path / name) from None
            raise FetchError(Reason.DISK, f"cannot open {self.path / name}: {exc.strerror or exc}") from None
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
                os.fchmod(fd, 0o600)  # a partial file left 0644 by an older agent
        except OSError:
            os.close(fd)
            raise
        return fd

    def read(self, name: str) -> bytes | None:
        """The file's bytes; None when absent or unreadable; a link is refused."""
        if self.regular(name) is None:
            return None
        fd = self.open(name, os.O_RDONLY)
        try:
            with os.fdopen(fd, "rb", closefd=False) as fh:
                return fh.read()
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes) -> None:
        fd = self.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def publish(self, tmp: str, name: str) -> None:
        """Rename a finished file (written and fsynced) to its final name, durably; rename
        replaces a link at `name` rather than writing through it."""
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        with contextlib.suppress(OSError):
            os.fsync(self.fd)


def _link_refused(display: str, path: Path) -> FetchError:
    return FetchError(Reason.DISK, f"{display}: {path} in the model cache is a symbolic link; the fetcher "
                      "follows none (remove it)")


def cache_problem(target: Path) -> str | None:
    """Why `target` (a cache file) cannot be used, by lstat, or None: its entry directory, the
    file or its partial files are a symbolic link, or the file's name is taken by a directory."""
    for path in (target.parent, target, *partial_paths(target)):
        try:
            st = path.lstat()
        except OSError:
            if path == target.parent:
                return None
            continue
        if stat.S_ISLNK(st.st_mode):
            return f"{path} in the model cache is a symbolic link; the fetcher follows none (remove it)"
        if path == target and stat.S_ISDIR(st.st_mode):
            return f"{target} in the model cache is a directory, not the file"
    return None


def _make_dirs(directory: Path, display: str) -> None:
    """Create `directory` and any missing parent, each 0700 (a parent that exists is left as is)."""
    missing: list[Path] = []
    at = directory
    while not os.path.lexists(at):
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise FetchError(Reason.DISK, f"cannot create {path}: {exc.strerror or exc}") from None


def _read_partial(entry: _Entry, name: str, url: str) -> Partial | None:
    data = entry.read(name)
    if data is None:
        return None
    try:
        record = msgspec.json.decode(data, type=Partial)
    except msgspec.DecodeError:
        return None
    return record if record.url_sha256 == url_digest(url) else None


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
             *, disk_free: Callable[[Path], int] | None = None, allow_redirect_hosts: Sequence[str] = (),
             resolve: Resolve = resolve_host, space_step: int = SPACE_STEP) -> None:
    """Make `target` exist with the whole file: resume or start the partial file, then rename.
    Raises FetchError (or Stopped). Never leaves a partial file under the target's name."""
    entry = _Entry(target.parent, display)
    try:
        _download(client, url, display, target, sha256, transfer, entry, disk_free or _disk_free,
                  allow_redirect_hosts, resolve, space_step)
    finally:
        entry.close()


def _download(client: httpx.Client, url: str, display: str, target: Path, sha256: str, transfer: Transfer,
              entry: _Entry, disk_free: Callable[[Path], int], allowed: Sequence[str], resolve: Resolve,
              space_step: int) -> None:
    found = entry.lstat(target.name)
    if found is not None and stat.S_ISDIR(found.st_mode):
        raise FetchError(Reason.DISK, f"{target} is a directory; the model cache needs a file there")
    entry.regular(target.name)  # a link at the final name is refused before anything is fetched
    partial, meta = partial_paths(target)
    record = _read_partial(entry, meta.name, url)
    offset = 0
    if record is not None and record.validator:
        st = entry.regular(partial.name)
        offset = st.st_size if st is not None else 0
    headers = {"accept-encoding": "identity"}  # bytes as stored: a gzip body would not resume by offset
    if offset > 0 and record is not None:
        headers["range"] = f"bytes={offset}-"
        headers["if-range"] = record.validator
    source = parse_url(url)
    source_url = httpx.URL(url)
    source_auth = httpx.BasicAuth(source_url.username, source_url.password) if source_url.userinfo else None
    source_addresses: list[str] | None = None
    current = source_url
    try:
        for hop in range(MAX_REDIRECTS + 1):
            # User info goes with a hop to the source's own origin only (as httpx and curl do).
            auth = (source_auth
                    if hop and current.netloc == source_url.netloc and current.scheme == source_url.scheme
                    else None)
            with client.stream("GET", current, headers=headers, follow_redirects=False,
                               auth=auth if auth is not None else httpx.USE_CLIENT_DEFAULT) as response:
                location = response.headers.get("location")
                if response.status_code not in REDIRECT_STATUSES or not location:
                    _receive(response, url, display, target, partial, meta, offset, sha256, transfer, disk_free,
                             entry, space_step)
                    return
            nxt = current.join(location)
            try:
                hop_url = parse_url(str(nxt.copy_with(username=None, password=None)))
            except SourceError:
                raise FetchError(Reason.REDIRECT, f"{display}: redirect to {location[:200]!r} refused: not a URL "
                                 "of a file") from None
            if hop == MAX_REDIRECTS:
                raise FetchError(Reason.REDIRECT, f"{display}: refused to follow more than {MAX_REDIRECTS} redirects "
                                 f"(the last to {hop_url.display})")
            problem = host_problem(source, hop_url, allowed)
            if problem is None:
                if source_addresses is None:
                    source_addresses = _resolve(resolve, source, display)
                problem = address_problem(hop_url, _resolve(resolve, hop_url, display), source_addresses)
            if problem is not None:
                raise FetchError(Reason.REDIRECT, f"{display}: redirect to {hop_url.display} refused: {problem}")
            current = nxt.copy_with(username=None, password=None)
    except httpx.TimeoutException as exc:
        raise FetchError(Reason.NETWORK, f"{display}: timed out ({type(exc).__name__})", retry=True) from None
    except httpx.TransportError as exc:
        raise FetchError(Reason.NETWORK, f"{display}: {_transport_text(exc)}", retry=True) from None


def _resolve(resolve: Resolve, url: Url, display: str) -> list[str]:
    try:
        return resolve(url.host, port_of(url))
    except OSError as exc:
        raise FetchError(Reason.NETWORK, f"{display}: cannot resolve {url.host} to check a redirect: "
                         f"{exc.strerror or exc}", retry=True) from None


def _transport_text(exc: httpx.TransportError) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.RemoteProtocolError) and "complete message body" in text:
        return f"the connection closed mid-body ({text})"
    return text


def _receive(response: httpx.Response, url: str, display: str, target: Path, partial: Path, meta: Path, offset: int,
             sha256: str, transfer: Transfer, disk_free: Callable[[Path], int], entry: _Entry, space_step: int) -> None:
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
            entry.unlink(meta.name)
            raise FetchError(Reason.LENGTH, f"{display}: asked for bytes from {offset}, the server sent "
                             f"{response.headers.get('content-range')!r}; starting over", retry=True)
        total = found[1] if found[1] is not None else (offset + announced if announced is not None else None)
        if total is not None and announced is not None and offset + announced != total:
            raise FetchError(Reason.LENGTH, f"{display}: Content-Length {announced} from byte {offset} "
                             f"contradicts the total of {total} in Content-Range (the server's lengths lie)")
    else:
        offset = 0  # the whole file: the server ignored Range, or the file changed (If-Range)
        total = announced
    record = Partial(source=display, url_sha256=url_digest(url), etag=_strong_etag(response.headers.get("etag")),
                     last_modified=response.headers.get("last-modified", ""), total=total)
    transfer.total = total
    transfer.done = offset
    transfer.answered = True
    directory = target.parent
    # What must stay free: the rest of the file, or (no length) the next SPACE_STEP bytes.
    need = (total - offset if total is not None else space_step) + DISK_MARGIN
    free = disk_free(directory)
    if free < need:
        what = f"{total - offset} bytes to fetch" if total is not None else \
            f"no Content-Length, {space_step} bytes at a time"
        raise FetchError(Reason.DISK, f"{display}: {what}, {free} free in {directory} "
                         f"(keeping {DISK_MARGIN >> 20} MiB spare); nothing written")
    digest = hashlib.sha256() if sha256 else None
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if offset else os.O_TRUNC)
    fd = entry.open(partial.name, flags)
    try:
        entry.write(meta.name, msgspec.json.encode(record))
        if digest is not None and offset:
            _hash_prefix(entry, partial.name, offset, digest, transfer)
        next_check = transfer.done + space_step
        try:
            for piece in response.iter_raw():
                if transfer.stop.is_set():
                    raise Stopped
                _write_all(fd, piece)
                transfer.fetched += len(piece)
                transfer.done += len(piece)
                if digest is not None:
                    digest.update(piece)
                if total is None and transfer.done >= next_check:
                    next_check = transfer.done + space_step
                    free = disk_free(directory)
                    if free < need:
                        os.close(fd)
                        fd = -1
                        _discard(entry, partial, meta)
                        raise FetchError(Reason.DISK, f"{display}: the server sent no Content-Length and the disk is "
                                         f"filling: {free} free in {directory} after {transfer.done} bytes (keeping "
                                         f"{DISK_MARGIN >> 20} MiB spare); stopped and removed the partial file")
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                os.close(fd)
                fd = -1
                _discard(entry, partial, meta)
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
        _discard(entry, partial, meta)
        raise FetchError(Reason.CHECKSUM,
                         f"{display}: sha256 is {digest.hexdigest()}, the profile says {sha256.lower()}; "
                         "removed the download")
    entry.publish(partial.name, target.name)
    entry.unlink(meta.name)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _hash_prefix(entry: _Entry, name: str, size: int, digest: hashlib._Hash, transfer: Transfer) -> None:
    fd = entry.open(name, os.O_RDONLY)
    with os.fdopen(fd, "rb") as fh:
        left = size
        while left > 0:
            if transfer.stop.is_set():
                raise Stopped
            block = fh.read(min(HASH_READ, left))
            if not block:
                break
            digest.update(block)
            left -= len(block)


def _discard(entry: _Entry, partial: Path, meta: Path) -> None:
    for path in (partial, meta):
        entry.unlink(path.name)


def _disk_free(directory: Path) -> int:
    return shutil.disk_usage(directory).free
