"""Static files served under content-hashed names (the admin pages' scripts and styles).

`admin.js` is served as `/admin/static/admin.<12 hex of its sha256>.js` with
`Cache-Control: public, max-age=31536000, immutable`: a browser keeps it a year and never asks
again, and an upgrade that changes the file changes its name, so no page ever runs a stale
script (the pattern of Rails' and Django's asset pipelines, without their build step: the hash is
taken when the server starts). A name whose hash is not the current one is a 404, never the
current file under an old name. The files ship inside the package (clusters are often
air-gapped: no CDN); nothing here is fetched from anywhere.

`Assets` is pure (file names and bytes in, names and bytes out); the admin pages read their files
once, when the server starts (`llmgw.server.admin.pages.package_assets`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import msgspec

PREFIX = "/admin/static/"
HASH_CHARS = 12  # 48 bits of sha256: a collision between two versions of one file is not a worry
# A year, and never revalidated: the name changes with the content.
IMMUTABLE = b"public, max-age=31536000, immutable"
TYPES = {
    "js": b"text/javascript; charset=utf-8",
    "css": b"text/css; charset=utf-8",
    "svg": b"image/svg+xml",
    "txt": b"text/plain; charset=utf-8",
}


class Asset(msgspec.Struct, frozen=True):
    name: str  # "fabric.js"
    hashed: str  # "fabric.1a2b3c4d5e6f.js"
    body: bytes
    content_type: bytes

    @property
    def url(self) -> str:
        return PREFIX + self.hashed


def hashed_name(name: str, body: bytes) -> str:
    """`fabric.js` + its bytes → `fabric.<sha256[:12]>.js`."""
    stem, dot, ext = name.rpartition(".")
    digest = hashlib.sha256(body).hexdigest()[:HASH_CHARS]
    return f"{stem}.{digest}.{ext}" if dot else f"{name}.{digest}"


class Assets:
    """Every static file by plain name (for the pages' links) and by hashed name (for serving)."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        self.by_name: dict[str, Asset] = {}
        self.by_hashed: dict[str, Asset] = {}
        for name, body in sorted(files.items()):
            ext = name.rpartition(".")[2]
            asset = Asset(name=name, hashed=hashed_name(name, body), body=body,
                          content_type=TYPES.get(ext, b"application/octet-stream"))
            self.by_name[name] = asset
            self.by_hashed[asset.hashed] = asset

    def url(self, name: str) -> str:
        return self.by_name[name].url

    def lookup(self, path: str) -> Asset | None:
        """The asset a request path names (`/admin/static/<hashed>`), None for any other."""
        if not path.startswith(PREFIX):
            return None
        return self.by_hashed.get(path[len(PREFIX):])
