"""The cluster's internal CA, certificate issuing, SSL contexts and peer identity.

    ca.py        the CA directory: init, issue server/node/operator certificates, records
    build.py     pure construction of keys, names and certificates (time passed in)
    info.py      what a certificate says: SANs, usages, expiry
    context.py   SSL contexts for servers and clients, with one-line loading errors
    identity.py  the verified peer's CN, and whether it is an operator
    explain.py   a TLS failure as one line that names the `llmgw ctl cert` fix
    net.py       trio helpers: handshakes that send their alert, fetching a server's certificate
    defaults.py  key types and lifetimes (no cryptography import: the CLI reads them at start)

The names below load on first use, so that `import llmgw.tls.defaults` (the CLI's option
defaults) does not pay for importing cryptography on every `llmgw` invocation and shell
completion.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmgw.tls.context import client_context, server_context
    from llmgw.tls.explain import explain_tls_error
    from llmgw.tls.identity import peer_common_name, peer_is_operator
    from llmgw.tls.info import cert_not_after, days_left

_WHERE = {
    "client_context": "llmgw.tls.context",
    "server_context": "llmgw.tls.context",
    "explain_tls_error": "llmgw.tls.explain",
    "peer_common_name": "llmgw.tls.identity",
    "peer_is_operator": "llmgw.tls.identity",
    "cert_not_after": "llmgw.tls.info",
    "days_left": "llmgw.tls.info",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'llmgw.tls' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

__all__ = [
    "cert_not_after",
    "client_context",
    "days_left",
    "explain_tls_error",
    "peer_common_name",
    "peer_is_operator",
    "server_context",
]
