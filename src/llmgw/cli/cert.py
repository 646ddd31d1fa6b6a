"""`llmgw ctl cert`: the cluster's internal CA and certificate issuance, on local files."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from llmgw.cli import complete
from llmgw.cli.render import console, make_table, output_option, print_json, say, text
from llmgw.tls.defaults import CA_DAYS, DEFAULT_CA_NAME, DEFAULT_KEY_TYPE, KEY_TYPES, LEAF_DAYS

if TYPE_CHECKING:
    from rich.text import Text

    from llmgw.tls.ca import ClientKind, Issued
    from llmgw.tls.info import CertInfo

KEY_TYPE_HELP = (
    "Key algorithm. ed25519 works between llmgw processes (Python's ssl on OpenSSL >= 1.1.1, "
    "TLS 1.2 and 1.3) but web browsers refuse ed25519 certificates: keep ecdsa-p256 for a "
    "public-port server certificate that browsers visit."
)
_STATUS_STYLE = {
    "ok": "green",
    "expires soon": "yellow",
    "not yet valid": "yellow",
    "expired": "red",
    "other CA": "red",
    "superseded": "dim",
    "revoked": "red",
}


def _dir_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--dir",
        "ca_dir",
        required=True,
        envvar="LLMGW_CA_DIR",
        show_envvar=True,
        type=click.Path(file_okay=False),
        help="CA directory (holds ca.crt, ca.key and the issue records).",
    )(func)


def _days_option(default: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--days",
        type=click.IntRange(min=1, max=36500),
        default=default,
        show_default=True,
        help="Validity in days.",
    )


def _key_type_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--key-type",
        type=click.Choice(KEY_TYPES),
        default=DEFAULT_KEY_TYPE,
        show_default=True,
        help=KEY_TYPE_HELP,
    )(func)


def _out_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--out",
        metavar="PREFIX",
        default=None,
        help="Write PREFIX.crt and PREFIX.key (a directory: the default names inside it). "
        "Default: in the CA directory.",
    )(func)


def _force_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option("--force", is_flag=True, help=help_text)


def _status(status: str) -> Text:
    return text(status, _STATUS_STYLE.get(status, ""))


def _detail_rows(info: CertInfo) -> list[tuple[str, str | Text]]:
    rows = [
        ("file", info.path),
        ("kind", info.kind),
        ("subject", info.subject),
        ("issuer", info.issuer),
        ("SANs", ", ".join(info.sans) or "-"),
        ("usages", ", ".join(info.usages) or "-"),
        ("serial", info.serial),
        ("key type", info.key_type),
        ("not before", info.not_before),
        ("not after", info.not_after),
        ("days left", f"{info.days_left:.0f}"),
        ("sha256", info.sha256),
    ]
    if info.key:
        rows.insert(1, ("key", info.key))
    return [*rows, ("status", _status(info.status))]


def _print_detail(info: CertInfo) -> None:
    console().print(make_table(["field", "value"], _detail_rows(info)))


def _print_issued(issued: Issued, output: str, what: str) -> None:
    info = issued.info
    if issued.revoked:
        say(f"note: the certificate this one replaces (serial {issued.revoked}) is now on the deny list "
            "(revoked.json in the CA directory): give the server the updated list (tls.deny_list, then `kill -HUP` or "
            "`llmgw ctl reload`) once the new pair is in place, and the old key stops working", stderr=True)
    if issued.clamped:
        say(f"note: validity cut to the CA's own expiry ({info.not_after}); no certificate may outlive its CA",
            stderr=True)
    if output == "json":
        print_json(info)
        return
    if info.key:
        say(f"wrote {what} {info.path} and its key {info.key} (mode 0600)")
    _print_detail(info)


@click.group()
def cert() -> None:
    """Issue and inspect certificates from the cluster's own CA (local files; no server needed).

    \b
    llmgw ctl cert init --dir ./ca
    llmgw ctl cert server --dir ./ca --host ctrl.example.com --ip 10.0.0.5
    llmgw ctl cert node gpu-01 --dir ./ca
    llmgw ctl cert operator alice --dir ./ca
    llmgw ctl cert viewer grafana --dir ./ca
    llmgw ctl cert list --dir ./ca
    llmgw ctl cert revoke gpu-01 --dir ./ca
    """


@cert.command()
@_dir_option
@click.option("--name", default=DEFAULT_CA_NAME, show_default=True, help="The CA's common name.")
@_days_option(CA_DAYS)
@_key_type_option
@_force_option("Replace an existing CA; every certificate the old one issued stops being trusted.")
@output_option
def init(ca_dir: str, name: str, days: int, key_type: str, force: bool, output: str) -> None:
    """Create the CA: DIR/ca.key (mode 0600) and the self-signed DIR/ca.crt.

    Refuses to replace an existing CA unless --force. Give ca.crt to the server (tls.ca) and
    to every agent (tls.ca); keep ca.key on the machine that issues certificates only.
    """
    from llmgw.tls import ca as ca_store

    info = ca_store.init_ca(ca_dir, now=time.time(), name=name, days=days, key_type=key_type, force=force)
    _print_issued(ca_store.Issued(info=info), output, "CA certificate")


@cert.command()
@_dir_option
@click.option("--host", "hosts", multiple=True, metavar="NAME",
              help="DNS name agents and clients dial (repeatable). An IP given here is stored as an IP entry.")
@click.option("--ip", "ips", multiple=True, metavar="ADDR", help="IP address agents and clients dial (repeatable).")
@click.option("--name", default=None, metavar="CN",
              help="Common name (default: the first --host or --ip). Clients ignore it: they check the SANs.")
@_out_option
@_days_option(LEAF_DAYS)
@_key_type_option
@_force_option("Replace existing certificate and key files at the output prefix.")
@output_option
def server(
    ca_dir: str,
    hosts: Sequence[str],
    ips: Sequence[str],
    name: str | None,
    out: str | None,
    days: int,
    key_type: str,
    force: bool,
    output: str,
) -> None:
    """Issue the server certificate (serverAuth) for the fleet and public ports.

    Its subjectAltName holds every --host (DNS) and --ip (IP address): list every name and
    address an agent or client may dial. Default files: DIR/server.crt, DIR/server.key.
    """
    from llmgw.tls import ca as ca_store

    issued = ca_store.issue_server(
        ca_dir, hosts=hosts, ips=ips, now=time.time(), days=days, name=name, out=out, key_type=key_type, force=force
    )
    _print_issued(issued, output, "server certificate")


# The client kinds (tls.ca.issue_client): one command each, one shape; the help is each one's own.
_CLIENT_COMMANDS: list[tuple[ClientKind, str, str]] = [
    ("node", "NODE_ID", """Issue a node certificate (clientAuth, CN = NODE_ID) for `llmgw agent`.

    NODE_ID must be the id the agent registers as (its node_id, by default the host name):
    with require_identity the server refuses a stream whose certificate says otherwise.
    Default files: DIR/node-NODE_ID.crt, DIR/node-NODE_ID.key.
    """),
    ("operator", "NAME", """Issue an operator certificate (clientAuth, OU=operators) for `llmgw ctl`.

    The server tells it from a node certificate by OU=operators; a node certificate never
    grants operator rights. Default files: DIR/operator-NAME.crt, DIR/operator-NAME.key.
    """),
    ("viewer", "NAME", """Issue a viewer certificate (clientAuth, OU=viewers) for dashboards and scripts.

    A viewer may read /api/v1, /admin and /metrics but never mutate; it is neither an operator
    nor a node. Default files: DIR/viewer-NAME.crt, DIR/viewer-NAME.key.
    """),
    ("gateway", "NAME", """Issue a gateway certificate (clientAuth, OU=gateways) for `llmgw gateway` on another machine.

    It may follow the control plane's gateway feed on the fleet port (the endpoint set and the
    engines' per-shard keys) and nothing more: it is not a node, an operator or a viewer.
    Default files: DIR/gateway-NAME.crt, DIR/gateway-NAME.key.
    """),
]


def _cert_names(kind: ClientKind) -> complete.CertNames:
    """Renewing is issuing again under the same name: the CA directory's names of that kind, and
    for a gateway the names of those following the server (a remote gateway is its certificate's name)."""
    also = " and the gateways following the server (with --server or LLMGW_SERVER)" if kind == "gateway" else ""
    return complete.CertNames(kind, f"the names of the {kind} certificates in the CA directory (--dir){also}",
                              server=complete.GATEWAYS if kind == "gateway" else None)


def _client_command(kind: ClientKind, metavar: str, help_text: str) -> None:
    @cert.command(name=kind, help=help_text)
    @click.argument("name", metavar=metavar, shell_complete=_cert_names(kind))
    @_dir_option
    @_out_option
    @_days_option(LEAF_DAYS)
    @_key_type_option
    @_force_option("Replace existing certificate and key files at the output prefix.")
    @output_option
    def issue(ca_dir: str, name: str, out: str | None, days: int, key_type: str, force: bool, output: str) -> None:
        from llmgw.tls import ca as ca_store

        issued = ca_store.issue_client(ca_dir, kind, name, now=time.time(), days=days, out=out, key_type=key_type,
                                       force=force)
        _print_issued(issued, output, f"{kind} certificate")


for _kind, _metavar, _help in _CLIENT_COMMANDS:
    _client_command(_kind, _metavar, _help)


@cert.command()
@click.argument("target", metavar="NAME|SERIAL",
                shell_complete=complete.CertNames(None, "the names the CA directory (--dir) issued certificates to"))
@_dir_option
@click.option("--reason", default="", help="Why, kept in the deny list.")
@output_option
def revoke(ca_dir: str, target: str, reason: str, output: str) -> None:
    """Put certificates on the deny list DIR/revoked.json: by SERIAL (hex, as `cert list` shows it;
    8 or more leading digits will do) or every certificate whose name is NAME.

    The server refuses them once it has the list: point tls.deny_list at a copy of the file,
    then `kill -HUP` the server or run `llmgw ctl reload`; live fleet streams of revoked node
    certificates end then.
    """
    from llmgw.tls import ca as ca_store

    result = ca_store.revoke(ca_dir, target, now=time.time(), reason=reason)
    if output == "json":
        print_json(result)
        return
    for r in result.revoked:
        say(f"revoked {r.kind} {r.common_name} (serial {r.serial})")
    for serial in result.already:
        say(f"serial {serial} was already revoked")
    if result.revoked:
        say(f"deny list: {result.deny_list}; give the server the updated list (tls.deny_list), then `kill -HUP` "
            "it or run `llmgw ctl reload`")


@cert.command(name="list")
@_dir_option
@output_option
def list_(ca_dir: str, output: str) -> None:
    """The CA and every certificate it issued: subject, SANs, usages, serial, expiry, status."""
    from llmgw.tls import ca as ca_store

    infos = ca_store.list_certificates(ca_dir, now=time.time())
    if output == "json":
        print_json(infos)
        return
    rows = [
        (
            i.kind,
            i.common_name or i.subject,
            ", ".join(i.sans) or "-",
            ", ".join(u for u in i.usages if u in ("serverAuth", "clientAuth", "keyCertSign")) or "-",
            i.serial[:16],
            i.not_after[:10],
            f"{i.days_left:.0f}",
            _status(i.status),
            i.path,
        )
        for i in infos
    ]
    columns = ["KIND", "NAME", "SANS", "USAGE", "SERIAL", "NOT AFTER", "DAYS", "STATUS", "FILE"]
    console().print(make_table(columns, rows))


@cert.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dir", "ca_dir", envvar="LLMGW_CA_DIR", show_envvar=True, type=click.Path(file_okay=False),
              help="CA directory to check the status against (revoked, superseded, other CA), as `cert list` "
              "does. Default: the file's own directory when it holds the CA; else the status is from the dates alone.")
@output_option
def show(file: str, ca_dir: str | None, output: str) -> None:
    """One certificate file: subject, SANs, usages, serial, expiry, days left, status."""
    from llmgw.tls import ca as ca_store
    from llmgw.tls.info import describe, load_certificate

    certificate = load_certificate(file)
    info = describe(certificate, file, time.time())
    if ca_dir is None and (Path(file).parent / ca_store.CA_CERT).exists():
        ca_dir = str(Path(file).parent)
    if ca_dir is not None:
        info.status = ca_store.status_in_ca(ca_dir, certificate, info.status)
    if output == "json":
        print_json(info)
        return
    rows = _detail_rows(info)
    rows.append(("checked against", f"the CA in {ca_dir}" if ca_dir else "its dates only (no CA directory: --dir)"))
    console().print(make_table(["field", "value"], rows))
