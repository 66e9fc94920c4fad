"""The bus over TLS: a redis-server listening only on a TLS port, which also asks for a client certificate
(certificates made here with the openssl CLI); a rediss:// URL with `redis.tls_*` settings publishes and
reads, and a client without the CA or its certificate is turned away."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
from redis.exceptions import ConnectionError

from astraflow import redis_server
from astraflow.streams import Bus, Out
from astraflow.streams.keys import GROUP_RAAS
from astraflow.streams.settings import RedisSettings, StreamsSettings
from tests.redis7 import system_redis

pytestmark = pytest.mark.integration


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d) -> None:
    """ca.{crt,key}; server.{crt,key} for 127.0.0.1; client.{crt,key}; all signed by the CA."""
    openssl("req", "-x509", "-new", "-nodes", "-newkey", "rsa:2048", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "2", "-subj", "/CN=astraflow-test-ca", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl("req", "-new", "-nodes", "-newkey", "rsa:2048", "-keyout", f"{name}.key", "-out",
                f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", "san.ext", cwd=d)  # fmt: skip


@pytest.fixture
def tls_server(tmp_path):
    binary = system_redis()
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    make_certs(tmp_path)
    port = redis_server.free_port()
    tls = "--tls-cert-file server.crt --tls-key-file server.key --tls-ca-cert-file ca.crt".split()
    args = [binary, "--port", "0", "--tls-port", str(port), *tls, "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not _listening(port):
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                if "tls" in out.lower() and ("not compiled" in out.lower() or "support" in out.lower()):
                    pytest.skip(f"this redis-server was built without TLS: {out[-300:]}")
                raise RuntimeError(f"redis-server exited: {out[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the TLS redis-server did not start")
            time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_bus_over_tls_with_client_certificates(tls_server, tmp_path):
    url = f"rediss://127.0.0.1:{tls_server}/0"
    tls = RedisSettings(
        tls_ca_file=tmp_path / "ca.crt",
        tls_cert_file=tmp_path / "client.crt",
        tls_key_file=tmp_path / "client.key",
        reconnect_max_s=1,
    )
    bus = Bus.connect(url, "tls", tls, StreamsSettings(block_ms=100))
    try:
        await bus.ensure_group(bus.keys.prompts, GROUP_RAAS)
        await bus.publish(Out(bus.keys.prompts, {"kind": "prompt", "uid": "g1"}))
        [entry] = await bus.read(bus.keys.prompts, GROUP_RAAS, "c", 10, None)
        assert entry.fields["uid"] == b"g1"
    finally:
        await bus.close()

    no_cert = tls.model_copy(update={"tls_cert_file": None, "tls_key_file": None})
    no_ca = tls.model_copy(update={"tls_ca_file": None})
    for settings in (no_cert, no_ca):
        refused = Bus.connect(url, "tls", settings, StreamsSettings())
        try:
            with pytest.raises(ConnectionError):
                await refused.redis.ping()
        finally:
            await refused.close()
