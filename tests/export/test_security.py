"""stabmon.export.security: HTTPS and basic-auth settings, and reading the files they
name, on real files in tmp_path (a FIFO and a symlink among them) and a real certificate
made by openssl (the ``certificate`` fixture; skipped without openssl)."""

from __future__ import annotations

import base64
import os
import ssl
from pathlib import Path

import pytest

from stabmon.config import load_config
from stabmon.export.security import Security


def _credentials(tmp_path: Path, text: str) -> str:
    path = tmp_path / "auth"
    path.write_text(text)
    return str(path)


def test_default_security_serves_plain_open_http() -> None:
    security = Security()
    assert security.ssl_context() is None
    assert security.expected_authorization() is None
    assert security.problem() is None


def test_from_config_reads_the_three_keys_of_a_config(tmp_path: Path) -> None:
    auth = _credentials(tmp_path, "u:p\n")
    config = load_config({}, overrides={"basic_auth_file": auth}, env={})
    assert Security.from_config(config) == Security(basic_auth_file=auth)


def test_expected_authorization_is_the_basic_header_of_the_first_line(tmp_path: Path) -> None:
    security = Security(basic_auth_file=_credentials(tmp_path, "prom:s3cr:et\nignored\n"))
    assert security.expected_authorization() == b"Basic " + base64.b64encode(b"prom:s3cr:et")


@pytest.mark.parametrize("text", ["", "\n", "no-colon\n", ":password\n", "user:\n"])
def test_a_credentials_file_that_is_not_username_colon_password_is_refused(
    tmp_path: Path, text: str
) -> None:
    security = Security(basic_auth_file=_credentials(tmp_path, text))
    with pytest.raises(ValueError, match="expected one line username:password"):
        security.expected_authorization()
    assert (security.problem() or "").startswith("basic_auth_file cannot be used:")


def test_a_credentials_file_larger_than_a_line_is_refused(tmp_path: Path) -> None:
    security = Security(basic_auth_file=_credentials(tmp_path, "u:" + "p" * 5000))
    with pytest.raises(ValueError, match="longer than one username:password line"):
        security.expected_authorization()


def test_a_fifo_as_credentials_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "auth"
    os.mkfifo(fifo)
    security = Security(basic_auth_file=str(fifo))
    assert security.problem() == f"basic_auth_file {str(fifo)!r} is not a readable file"
    with pytest.raises(OSError, match="not a regular file"):
        security.expected_authorization()


def test_a_symlinked_credentials_file_is_not_followed(tmp_path: Path) -> None:
    real = Path(_credentials(tmp_path, "u:p\n"))
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OSError, match="symbolic link"):
        Security(basic_auth_file=str(link)).expected_authorization()


def test_problem_names_a_missing_file_by_its_setting(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    assert Security(tls_certfile=missing).problem() == (
        f"tls_certfile {missing!r} is not a readable file"
    )


def test_a_key_without_a_certificate_is_refused() -> None:
    with pytest.raises(ValueError, match="tls_keyfile is set but tls_certfile is not"):
        Security(tls_keyfile="/etc/hostname").ssl_context()


def test_a_file_that_is_not_pem_cannot_serve_https(tmp_path: Path) -> None:
    junk = tmp_path / "cert.pem"
    junk.write_text("not a certificate\n")
    problem = Security(tls_certfile=str(junk)).problem()
    assert problem is not None and problem.startswith("tls_certfile/tls_keyfile cannot be used:")


def test_a_real_certificate_and_key_give_a_tls12_server_context(
    certificate: tuple[Path, Path],
) -> None:
    cert, key = certificate
    security = Security(tls_certfile=str(cert), tls_keyfile=str(key))
    context = security.ssl_context()
    assert isinstance(context, ssl.SSLContext)
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert security.problem() is None
