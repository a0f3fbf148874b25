"""The split stream's security: how a call authenticates its node, and the round's TLS.

A node's secret is 256 random bits per node and session. A client presents it in the **call
metadata** (:data:`NODE_HEADER`, :data:`TOKEN_HEADER`), and the server's interceptor
(:mod:`split_layer.stream_server`) checks it -- as bytes, in constant time, also for unknown
nodes -- before any handler runs or any frame is read. TLS (``split-stream-tls``): the server
makes a fresh self-signed certificate (:func:`ephemeral_certificate`) and ships it in the
Flower start message; the client trusts exactly that certificate (named :data:`TLS_NAME`).
``auto`` encrypts unless both the bound host and the address the clients dial are loopback
addresses (:func:`_is_loopback`; ``split_layer.stream_options.StreamOptions.use_tls``).
"""
from __future__ import annotations

import datetime as _dt
import ipaddress

__all__ = ["NODE_HEADER", "TOKEN_HEADER", "TLS_NAME", "ephemeral_certificate"]

TLS_NAME = "flower-ssl-split-stream"   # the certificate's name; the client pins the certificate itself
# call metadata that authenticates a client (checked before any frame is read)
NODE_HEADER = "x-flowerssl-node"
TOKEN_HEADER = "x-flowerssl-token-bin"   # "-bin": raw bytes, so any token value arrives and is compared as bytes


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ephemeral_certificate(valid_for: float = 86_400.0) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM): a fresh self-signed P-256 certificate (one per round),
    valid from 5 minutes ago for ``valid_for`` seconds."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)])
    now = _dt.datetime.now(_dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - _dt.timedelta(minutes=5))
            .not_valid_after(now + _dt.timedelta(seconds=float(valid_for)))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()),
            cert.public_bytes(serialization.Encoding.PEM))

