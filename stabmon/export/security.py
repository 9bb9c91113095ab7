"""HTTPS and basic-auth settings of an endpoint, and reading the files they name.

The exporter serves with them and ``stabmon status`` authenticates with them; both
import this module, so reading a credentials file never loads the HTTP server. It
takes a :class:`~stabmon.config.Config` structurally (:class:`SecuritySettings`):
export does not import config.
"""

from __future__ import annotations

import base64
import os
import ssl
import stat
from dataclasses import dataclass
from typing import Protocol

from stabmon.shared.safefs import read_regular

__all__ = ["Security", "SecuritySettings"]

#: Credentials files are one line; anything larger is not one.
_MAX_CREDENTIALS_BYTES = 4096
#: A certificate chain or key is a few KB; this bounds a wrong path's read.
_MAX_PEM_BYTES = 2**20


class SecuritySettings(Protocol):
    """The three settings :meth:`Security.from_config` reads (a ``Config`` has them)."""

    @property
    def tls_certfile(self) -> str | None: ...
    @property
    def tls_keyfile(self) -> str | None: ...
    @property
    def basic_auth_file(self) -> str | None: ...


@dataclass(frozen=True, kw_only=True)
class Security:
    """HTTPS and basic auth of an exporter; the defaults serve plain, open HTTP."""

    tls_certfile: str | None = None
    """PEM certificate (chain); set, the exporter serves HTTPS only."""
    tls_keyfile: str | None = None
    """PEM private key of ``tls_certfile``; None when the certificate file holds it."""
    basic_auth_file: str | None = None
    """File whose first line is ``username:password``; set, every request must carry them."""

    @classmethod
    def from_config(cls, config: SecuritySettings) -> Security:
        """The three keys of the same names from a :class:`~stabmon.config.Config`."""
        return cls(
            tls_certfile=config.tls_certfile,
            tls_keyfile=config.tls_keyfile,
            basic_auth_file=config.basic_auth_file,
        )

    def problem(self) -> str | None:
        """Why these settings cannot serve, naming the setting; None when they can.

        The daemon checks this before it starts, so a wrong path is a one-line error rather
        than a daemon that serves nothing (a training process only logs it: training goes on).
        """
        for key in ("tls_certfile", "tls_keyfile", "basic_auth_file"):
            path = getattr(self, key)
            if path is not None and not (_is_regular(path) and os.access(path, os.R_OK)):
                return f"{key} {path!r} is not a readable file"
        try:
            self.ssl_context()
        except (OSError, ValueError, ssl.SSLError) as error:
            return f"tls_certfile/tls_keyfile cannot be used: {error}"
        try:
            self.expected_authorization()
        except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
            return f"basic_auth_file cannot be used: {error}"
        return None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server context, or None for plain HTTP; raises OSError/ValueError when unusable."""
        if self.tls_certfile is None:
            if self.tls_keyfile is not None:
                raise ValueError("tls_keyfile is set but tls_certfile is not")
            return None
        for path in (self.tls_certfile, self.tls_keyfile):
            if path is not None:
                read_regular(path, _MAX_PEM_BYTES)  # never load_cert_chain on a FIFO: it blocks
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.tls_certfile, self.tls_keyfile)
        return context

    def expected_authorization(self) -> bytes | None:
        """The ``Authorization`` header value every request must send, or None for no auth."""
        if self.basic_auth_file is None:
            return None
        try:  # a regular file only, never waited on (a FIFO would block attach() for ever)
            text = read_regular(self.basic_auth_file, _MAX_CREDENTIALS_BYTES)
        except ValueError:
            raise ValueError(
                f"{self.basic_auth_file}: longer than one username:password line"
            ) from None
        line = text.decode("utf-8").splitlines()[0] if text.strip() else ""
        username, colon, password = line.partition(":")
        if not colon or not username or not password:
            raise ValueError(f"{self.basic_auth_file}: expected one line username:password")
        return b"Basic " + base64.b64encode(line.encode("utf-8"))


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return False
