"""TLS settings of a collector client (the shim's agent, ``rankscope.control``), from arguments
or the environment.

Each setting is the argument when given, else its environment variable:

==================  ========================  ===============================================
argument            environment variable      meaning
==================  ========================  ===============================================
``tls_ca``          ``RANKSCOPE_TLS_CA``      PEM CA that signs the collector's certificate
``tls_cert``        ``RANKSCOPE_TLS_CERT``    PEM client certificate (mutual TLS)
``tls_key``         ``RANKSCOPE_TLS_KEY``     its PEM private key
``tls_target_name`` ``RANKSCOPE_TLS_TARGET_NAME``  name to verify in the collector's certificate
==================  ========================  ===============================================

TLS is on when a CA, a certificate or a key is set; the agent reads and checks the files when it
is created (a missing file or a key that does not match its certificate raises ValueError).
"""

import os

ENV = {
    "tls_ca_file": "RANKSCOPE_TLS_CA",
    "tls_cert_file": "RANKSCOPE_TLS_CERT",
    "tls_key_file": "RANKSCOPE_TLS_KEY",
    "tls_target_name": "RANKSCOPE_TLS_TARGET_NAME",
}


def resolve(
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_target_name: str | None = None,
) -> dict:
    """Returns the keyword arguments of ``_native.Agent`` / ``_native.set_control`` for TLS:
    each given argument, else its environment variable, else ""."""
    given = {
        "tls_ca_file": tls_ca,
        "tls_cert_file": tls_cert,
        "tls_key_file": tls_key,
        "tls_target_name": tls_target_name,
    }
    return {
        k: os.fspath(v) if v is not None else os.environ.get(ENV[k], "") for k, v in given.items()
    }
