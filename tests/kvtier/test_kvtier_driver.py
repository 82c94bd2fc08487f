"""The catalog's driver against openGauss's login: psycopg's refusal names the fix, and the gaussdb driver is
taken only over a libpq it can run on."""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading

import pytest

from rayapp.kvtier.catalog import Catalog

# The codes openGauss's server sends in its AuthenticationRequest for its own password methods.
SHA256, MD5_SHA256 = 10, 11
# Frontend requests a libpq sends before its startup message, each answered with one byte ('N': not here).
_SSL_REQUEST, _GSSENC_REQUEST = 80877103, 80877104


def _opengauss_auth_request(code: int) -> bytes:
    """The message openGauss sends for a login by `code`: its stored-password method (2: sha256), a 64-hex-digit
    salt, then a token and an iteration count (sha256) or an md5 salt (md5_sha256)."""
    salt = os.urandom(32).hex().encode()
    payload = struct.pack("!ii", code, 2) + salt
    payload += b"\0" * 8 + struct.pack("!i", 10_000) if code == SHA256 else os.urandom(4)
    return b"R" + struct.pack("!i", 4 + len(payload)) + payload


def _read_message(conn: socket.socket) -> bytes:
    (length,) = struct.unpack("!i", conn.recv(4, socket.MSG_WAITALL))
    return conn.recv(length - 4, socket.MSG_WAITALL)


@pytest.fixture
def opengauss_login(request):
    """A server that greets every connection as openGauss does under `password_encryption_type` 2 (sha256) or
    with md5_sha256: the authentication request, then whatever the client answers is dropped."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed at the end of the test
            with conn:
                body = _read_message(conn)
                while struct.unpack("!i", body[:4])[0] in (_SSL_REQUEST, _GSSENC_REQUEST):
                    conn.sendall(b"N")
                    body = _read_message(conn)
                conn.sendall(_opengauss_auth_request(request.param))
                conn.recv(1024)

    threading.Thread(target=serve, daemon=True).start()
    yield f"host=127.0.0.1 port={server.getsockname()[1]} dbname=rayapp user=rayapp password=secret"
    server.close()


@pytest.mark.parametrize("opengauss_login", [SHA256, MD5_SHA256], indirect=True, ids=["sha256", "md5_sha256"])
def test_psycopg_refused_by_opengauss_password_methods_says_what_to_change(opengauss_login, caplog):
    with caplog.at_level(logging.WARNING, logger="rayapp.kvtier"):
        catalog = Catalog(opengauss_login, 8, retry_after_s=3600.0)
    assert not catalog.available
    (warning,) = [r.getMessage() for r in caplog.records if "cluster KV tier disabled" in r.getMessage()]
    assert "opengauss://" in warning and "rayapp[opengauss]" in warning
    assert "password_encryption_type" in warning
    assert "secret" not in warning  # the DSN's password stays out of the log
    catalog.close()


def test_an_opengauss_dsn_refuses_a_libpq_the_gaussdb_driver_would_crash_on():
    pytest.importorskip("gaussdb", reason="the gaussdb driver (rayapp[opengauss]) is not installed")
    # This machine's libpq is PostgreSQL's (or there is none): gaussdb 1.0.4 would end the process on connect.
    with pytest.raises(ValueError, match="needs GaussDB's libpq"):
        Catalog("opengauss://rayapp:secret@127.0.0.1:5432/rayapp", 8)
