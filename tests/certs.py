"""Throwaway certificate authorities and certificates for the TLS tests (the `cryptography` package).

Keys are ECDSA P-256: generated in milliseconds and accepted by gRPC's BoringSSL and by OpenSSL.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_NAMES = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


@dataclass(frozen=True)
class CA:
    """A self-signed CA whose certificate is at `cert`; `issue` signs leaf certificates."""

    name: str
    directory: Path
    cert: Path
    _key: ec.EllipticCurvePrivateKey
    _cert: x509.Certificate

    def issue(self, name: str, sans: tuple[str, ...] = LOCAL_NAMES, client: bool = False) -> CertFiles:
        """A leaf certificate for `sans` (DNS names or IP addresses), usable by a server or a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        alt_names: list[x509.GeneralName] = []
        for san in sans:
            try:
                alt_names.append(x509.IPAddress(ipaddress.ip_address(san)))
            except ValueError:
                alt_names.append(x509.DNSName(san))
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        cert = (
            _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), self._cert.subject, key)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        return _write(self.directory, f"{self.name}-{name}", cert, key)


def make_ca(directory: Path, name: str) -> CA:
    """A new CA in `directory` (its certificate at <name>-ca.crt)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"llmserve test CA {name}")])
    cert = (
        _builder(subject, subject, key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    files = _write(directory, f"{name}-ca", cert, key)
    return CA(name, directory, files.cert, key, cert)


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> CertFiles:
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return CertFiles(cert_path, key_path)
