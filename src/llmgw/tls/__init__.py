"""The cluster's internal CA, certificate issuing, SSL contexts and peer identity.

    ca.py        the CA directory: init, issue server/node/operator certificates, records
    build.py     pure construction of keys, names and certificates (time passed in)
    info.py      what a certificate says: SANs, usages, expiry
    context.py   SSL contexts for servers and clients, with one-line loading errors
    identity.py  the verified peer's CN, and whether it is an operator
    explain.py   a TLS failure as one line that names the `llmgw ctl cert` fix
    net.py       trio helpers: handshakes that send their alert, fetching a server's certificate
    files.py     atomic writes that never replace a file unless asked
"""

from llmgw.tls.context import client_context, server_context
from llmgw.tls.explain import explain_tls_error
from llmgw.tls.identity import peer_common_name, peer_is_operator
from llmgw.tls.info import cert_not_after, days_left

__all__ = [
    "cert_not_after",
    "client_context",
    "days_left",
    "explain_tls_error",
    "peer_common_name",
    "peer_is_operator",
    "server_context",
]
