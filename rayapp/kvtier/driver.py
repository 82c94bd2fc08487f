"""Which Python driver reaches the catalog's database: psycopg 3, or Huawei's `gaussdb` for openGauss.

openGauss's default password authentication (`sha256`, and `md5_sha256`) answers the login with
authentication request codes 10 and 11, which PostgreSQL's libpq (and so psycopg) reads as SASL and
refuses. `gaussdb` (a fork of psycopg 3 with the same API, PyPI `gaussdb` + `gaussdb-pool`) speaks it
through GaussDB's own libpq. A DSN written `opengauss://...` (or `gaussdb://...`) selects it; any
other DSN is psycopg's.

`gaussdb` 1.0.4 reads libpq's structures with GaussDB's layout: loaded over PostgreSQL's libpq it
crashes the process on its first connection (its `PQconninfoOption` carries a field PostgreSQL's does
not). So the driver is taken only once the libpq it would load is known not to be PostgreSQL's: every
openGauss and GaussDB libpq reports PostgreSQL 9.2's version, every PostgreSQL libpq since 10 its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any

OPENGAUSS_SCHEMES = ("opengauss://", "gaussdb://")
# PQlibVersion() of the first PostgreSQL release whose libpq no openGauss or GaussDB client reports.
_POSTGRESQL_10 = 100_000

_INSTALL = "pip install 'rayapp[opengauss]'"
# libpq's words for an authentication request it does not speak: openGauss's sha256 (code 10, PostgreSQL's SASL)
# and md5_sha256 (code 11, PostgreSQL's SASL continuation), across libpq releases.
_OPENGAUSS_AUTH_REFUSED = (
    "none of the server's SASL authentication mechanisms are supported",
    "AUTH_REQ_SASL_CONT without AUTH_REQ_SASL",
    "authentication method 10 not supported",
    "authentication method 11 not supported",
)


@dataclass(frozen=True)
class Driver:
    """A DB-API module with psycopg 3's interface, its connection pool class, and the DSN as libpq takes it."""

    name: str
    module: ModuleType
    pool_class: type
    conninfo: str

    @property
    def unreachable(self) -> tuple[type[Exception], ...]:
        """Failures of the database rather than of rayapp's SQL. A missing table (the server was
        re-initialized under us) is one: the reconnect creates it again."""
        return (self.module.OperationalError, self.module.InterfaceError, self.module.errors.UndefinedTable)

    def conninfo_parts(self) -> dict[str, Any]:
        """The DSN's keywords; a `ProgrammingError` of the module when it does not parse."""
        return self.module.conninfo.conninfo_to_dict(self.conninfo)

    def explain(self, error: Exception) -> str:
        """The first line of a connection error, with what to change when the cause is known."""
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
        if self.name == "psycopg" and any(words in text for words in _OPENGAUSS_AUTH_REFUSED):
            return (
                f"{first}. If the catalog is openGauss, the server asked for its sha256 or md5_sha256 password "
                f"authentication, which PostgreSQL's libpq does not speak: write the DSN as opengauss://... with "
                f"`{_INSTALL}` and GaussDB's libpq first on the library path, or on the server set "
                "password_encryption_type to 0 or 1, allow the client with md5 in pg_hba.conf and set the role's "
                "password again"
            )
        return first


def driver_for(dsn: str) -> Driver:
    """The driver a DSN selects; a `ValueError` saying what to install when it cannot be loaded here."""
    scheme = next((s for s in OPENGAUSS_SCHEMES if dsn.lower().startswith(s)), None)
    if scheme is None:
        import psycopg
        from psycopg_pool import ConnectionPool

        return Driver("psycopg", psycopg, ConnectionPool, dsn)
    if importlib.util.find_spec("gaussdb") is None or importlib.util.find_spec("gaussdb_pool") is None:
        raise ValueError(f"kvtier.dsn {scheme}... connects with the gaussdb driver, which is not installed: {_INSTALL}")
    _check_gaussdb_libpq()
    import gaussdb
    from gaussdb_pool import ConnectionPool as GaussDBPool

    return Driver("gaussdb", gaussdb, GaussDBPool, "postgresql://" + dsn[len(scheme) :])


def _check_gaussdb_libpq() -> None:
    # The same lookup gaussdb makes on Linux, done first so that a PostgreSQL libpq is refused, not loaded.
    path = ctypes.util.find_library("pq")
    if path is None:
        raise ValueError(
            "the gaussdb driver (opengauss:// DSN) needs GaussDB's libpq, and no libpq is on the library path: "
            "install GaussDB's client driver and put its lib/ first (ldconfig or LD_LIBRARY_PATH)"
        )
    version = ctypes.CDLL(path).PQlibVersion()
    if version >= _POSTGRESQL_10:
        raise ValueError(
            f"the gaussdb driver (opengauss:// DSN) needs GaussDB's libpq, but the library path's libpq ({path}) is "
            f"PostgreSQL {version // 10_000}'s, over which gaussdb crashes: put the lib/ of GaussDB's client driver "
            "first (ldconfig or LD_LIBRARY_PATH), or connect with a postgresql:// DSN after setting the server's "
            "password_encryption_type to 0 or 1 (md5)"
        )
