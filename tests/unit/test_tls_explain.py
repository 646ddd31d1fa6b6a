"""explain_tls_error on its own: unwrapping, and the cases a loopback handshake cannot stage.

The common failures are tested on real handshakes in test_tls_handshake.py.
"""

from __future__ import annotations

import ssl

import trio

from llmgw.tls import explain_tls_error


def _alert(reason: str) -> ssl.SSLError:
    err = ssl.SSLError(1, f"[SSL: {reason}] alert")
    err.reason = reason
    err.library = "SSL"
    return err


def _verify(code: int, message: str) -> ssl.SSLCertVerificationError:
    err = ssl.SSLCertVerificationError(1, f"certificate verify failed: {message}")
    err.reason = "CERTIFICATE_VERIFY_FAILED"
    err.verify_code = code
    err.verify_message = message
    return err


def _wrapped(err: BaseException) -> BaseException:
    """As trio raises it: BrokenResourceError from the SSLError, inside an exception group."""
    try:
        try:
            raise err
        except BaseException as inner:
            raise trio.BrokenResourceError from inner
    except trio.BrokenResourceError as broken:
        return ExceptionGroup("nursery", [broken])


def test_unwraps_groups_and_causes() -> None:
    line = explain_tls_error(_wrapped(_verify(9, "certificate is not yet valid")), "ctrl")
    assert line.startswith("the server certificate of ctrl is not valid yet; check the clocks")


def test_server_side_alerts_from_clients() -> None:
    assert "does not trust our server certificate" in explain_tls_error(_alert("TLSV1_ALERT_UNKNOWN_CA"), "10.0.0.7",
                                                                        side="server")
    assert "name or IP it dials is not among its SANs" in explain_tls_error(
        _alert("SSLV3_ALERT_CERTIFICATE_UNKNOWN"), "10.0.0.7", side="server"
    )
    assert "refused our server certificate as expired" in explain_tls_error(
        _alert("SSLV3_ALERT_CERTIFICATE_EXPIRED"), "10.0.0.7", side="server"
    )


def test_alpn_and_unknown_errors() -> None:
    assert "no application protocol (ALPN)" in explain_tls_error(_alert("TLSV1_ALERT_NO_APPLICATION_PROTOCOL"), "ctrl")
    assert explain_tls_error(RuntimeError("odd"), "ctrl") == "TLS with ctrl failed: odd"
    assert explain_tls_error(_alert("SOMETHING_NEW"), "ctrl") == "TLS with ctrl failed: [SSL: SOMETHING_NEW] alert"


def test_every_line_is_one_line() -> None:
    cases = [
        _verify(64, "IP address mismatch"),
        _verify(62, "Hostname mismatch"),
        _verify(10, "certificate has expired"),
        _verify(20, "unable to get local issuer certificate"),
        _verify(26, "unsuitable certificate purpose"),
        _alert("TLSV13_ALERT_CERTIFICATE_REQUIRED"),
        _alert("SSLV3_ALERT_BAD_CERTIFICATE"),
        ssl.SSLEOFError(8, "EOF occurred in violation of protocol"),
        ConnectionResetError(),
    ]
    for err in cases:
        for side in ("client", "server"):
            line = explain_tls_error(err, "ctrl", side=side)
            assert line and "\n" not in line
            assert "ctrl" in line
