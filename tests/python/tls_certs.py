"""Test certificates made with the ``openssl`` command at test time (nothing checked in).

``make_pki(dir)`` writes, as PEM files in ``dir``:

- ``ca.pem`` / ``ca.key``: the test CA (signs the collector's and the agents' certificates);
- ``server.pem`` / ``server.key``: the collector, SAN ``IP:127.0.0.1`` and
  ``DNS:rankscope-collector``;
- ``client.pem`` / ``client.key``: an agent (client certificate signed by the CA);
- ``rogue-ca.pem`` / ``rogue-client.pem`` / ``rogue-client.key``: a second, untrusted CA and a
  client certificate it signed;
- ``ca2.pem`` / ``server2.*`` / ``client2.*``: the PKI a rotation moves to, a new CA with a
  collector and an agent certificate like the first ones.

EC P-256 keys (fast to make); certificates valid for one day.
"""

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {out.stderr}")


def _make_ca(d: Path, name: str, cn: str) -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "1",
        "-subj",
        f"/CN={cn}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )


def _make_leaf(d: Path, name: str, ca: str, cn: str, extensions: str) -> None:
    _openssl(
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={cn}",
        cwd=d,
    )
    (d / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-out",
        f"{name}.pem",
        "-days",
        "1",
        "-extfile",
        f"{name}.ext",
        cwd=d,
    )


def make_pki(d: Path) -> Path:
    """Writes the files listed in the module docstring into ``d``; returns ``d``."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (./run setup installs it)")
    d.mkdir(parents=True, exist_ok=True)
    _make_ca(d, "ca", "rankscope test CA")
    _make_leaf(
        d,
        "server",
        "ca",
        "rankscope-collector",
        "subjectAltName=IP:127.0.0.1,DNS:rankscope-collector\n"
        "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n",
    )
    _make_leaf(
        d,
        "client",
        "ca",
        "rank-0",
        "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n",
    )
    _make_ca(d, "rogue-ca", "some other CA")
    _make_leaf(
        d,
        "rogue-client",
        "rogue-ca",
        "rank-0",
        "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n",
    )
    _make_ca(d, "ca2", "rankscope test CA, renewed")
    _make_leaf(
        d,
        "server2",
        "ca2",
        "rankscope-collector",
        "subjectAltName=IP:127.0.0.1,DNS:rankscope-collector\n"
        "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n",
    )
    _make_leaf(
        d,
        "client2",
        "ca2",
        "rank-0",
        "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n",
    )
    return d
