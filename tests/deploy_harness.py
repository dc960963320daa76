"""Helpers of the deployment tests: certificates and SuperNode keys made with ``cryptography`` (no openssl, no
ssh-keygen), a SuperLink with TLS and SuperNode authentication and its SuperNodes on 127.0.0.1, and Flower's
default local simulation (``flwr run APP``) in a network and PID namespace of its own.

Run as a script inside such a namespace, it is the namespace's first process (everything Flower starts there,
the SuperLink ``flwr`` leaves running included, ends when it ends)::

    python tests/deploy_harness.py local-run SECONDS APP [flwr run options...]

brings the loopback interface up, submits ``flwr run APP --format json ...`` to Flower's default connection
(``local``: the simulation runtime that ``flwr`` starts on 127.0.0.1) and waits until the run finishes; it prints
one JSON line: the run's status, its details, the run id and ``flwr log --show``'s output.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from flower_harness import _wait_port, flower_env, free_port, scripts_dir, start, stop_group

# -- certificates and keys ------------------------------------------------------------------------------


def _write_key(path: Path, key, fmt) -> Path:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def make_certificates(folder: Path, days: int = 2) -> dict[str, Path]:
    """A certificate authority and a SuperLink certificate it signs for 127.0.0.1 and localhost (ECDSA P-384,
    SHA-384), as ``ca.crt``, ``server.pem`` and ``server.key`` in ``folder``; returns their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, server_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedshuffle test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_key(paths["key"], server_key, serialization.PrivateFormat.TraditionalOpenSSL)
    return paths


def make_node_keys(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's key pair as Flower 1.41 reads it: an ECDSA P-384 private key in OpenSSH format
    (``flower-supernode --auth-supernode-private-key``) and its OpenSSH public key (``flwr supernode register``)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private = _write_key(folder / name, key, serialization.PrivateFormat.OpenSSH)
    public = folder / f"{name}.pub"
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n"
    )
    return private, public


# -- a SuperLink with TLS and SuperNode authentication ------------------------------------------------------


class SecureFederation:
    """A ``flower-superlink`` with TLS (``certificates``) and ``--enable-supernode-auth`` on a free 127.0.0.1 port,
    the ``flwr`` connection ``secure`` (its ``root-certificates``), and SuperNodes added with :meth:`node`; every
    process in its own process group."""

    def __init__(self, work: Path, certificates: dict[str, Path], env: dict[str, str], port: int) -> None:
        self.work, self.certificates, self.env, self.port = work, certificates, env, port
        self.processes: list[subprocess.Popen] = []
        self.connection = "secure"

    def flwr(self, args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(scripts_dir() / "flwr"), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            start_new_session=True,
        )

    def register(self, public_key: Path) -> subprocess.CompletedProcess:
        """``flwr supernode register PUBLIC_KEY secure``: the SuperLink accepts the node holding its private key."""
        return self.flwr(["supernode", "register", str(public_key), self.connection, "--format", "json"])

    def node(
        self,
        name: str,
        node_config: str,
        private_key: Path | None,
        root_certificates: Path | None,
        retries: int | None = None,
    ) -> subprocess.Popen:
        """A ``flower-supernode`` connecting over TLS (trusting ``root_certificates``; None: the system's CAs)
        and signing its requests with ``private_key`` (None: no key)."""
        command = [
            str(scripts_dir() / "flower-supernode"),
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--node-config",
            node_config,
        ]
        if root_certificates is not None:
            command += ["--root-certificates", str(root_certificates)]
        if private_key is not None:
            command += ["--auth-supernode-private-key", str(private_key)]
        if retries is not None:
            command += ["--max-retries", str(retries)]
        process = start(command, self.work / f"supernode-{name}.log", self.env)
        self.processes.append(process)
        return process


@contextmanager
def secure_federation(work: Path, deadline: float):
    """Certificates made in ``work``, a SuperLink serving them with SuperNode authentication on, and the ``flwr``
    connection to it; yields a :class:`SecureFederation`, whose processes are all stopped on exit."""
    home = work / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    certificates = make_certificates(work / "certificates")
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "secure"\n\n[superlink.secure]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{certificates["ca"]}"\n'
    )
    federation = SecureFederation(work, certificates, flower_env(home), port)
    try:
        link = start(
            [
                str(scripts_dir() / "flower-superlink"),
                "--ssl-ca-certfile",
                str(certificates["ca"]),
                "--ssl-certfile",
                str(certificates["cert"]),
                "--ssl-keyfile",
                str(certificates["key"]),
                "--enable-supernode-auth",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--disable-runtime-dependency-installation",
                "--database",
                str(work / "state.db"),
            ],
            work / "superlink.log",
            federation.env,
        )
        federation.processes.append(link)
        _wait_port(port, deadline, link, work / "superlink.log")
        yield federation
    finally:
        for process in reversed(federation.processes):
            stop_group(process)


# -- Flower's default local simulation, inside a namespace ------------------------------------------------


def local_run(seconds: float, app: str, options: list[str]) -> dict:
    """``flwr run APP OPTIONS`` on the default connection, waited for (at most ``seconds``); see the module
    docstring."""
    deadline = time.monotonic() + seconds
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(scripts_dir()), os.environ.get("PATH", "")]),
    }  # flwr starts flower-superlink by name

    def call(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["flwr", *args], capture_output=True, text=True, env=env, timeout=max(1.0, deadline - time.monotonic())
        )

    submitted = call("run", app, *options, "--format", "json")
    if submitted.returncode != 0 or '"run-id"' not in submitted.stdout:
        return {"status": "not submitted", "details": submitted.stdout + submitted.stderr}
    run_id = str(json.loads(submitted.stdout)["run-id"])
    while time.monotonic() < deadline:
        listed = call("ls", "--run-id", run_id, "--format", "json")
        run = json.loads(listed.stdout)["runs"][0] if listed.returncode == 0 else {}
        if str(run.get("status", "")).startswith("finished"):
            log = call("log", run_id, "--show")
            return {
                "status": run["status"],
                "details": run.get("status-details", ""),
                "run-id": run_id,
                "log": log.stdout + log.stderr,
            }
        time.sleep(0.5)
    return {"status": "timeout", "details": f"run {run_id} did not finish in {seconds:g} s"}


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "local-run":
        print(json.dumps(local_run(float(sys.argv[2]), sys.argv[3], sys.argv[4:])))
    else:
        sys.exit(__doc__)
