"""The weight-sync credential: header check, the no-token rule, the pod's reload route and gRPC interceptor."""

from __future__ import annotations

import grpc
import pytest
from fastapi.testclient import TestClient
from test_rollout_routes import FakeEngine

from molt._proto import weightsync_pb2 as pb
from molt.weightsync.auth import bearer_matches, check_exposure, is_loopback, token_from_env
from molt.weightsync.client import GrpcPodClient, PodError
from molt.weightsync.server import start_weightsync_server
from services.rollout.app import build_app
from services.rollout.config import RolloutSettings


def test_bearer_header_and_token_env():
    assert bearer_matches("Bearer t0k", "t0k") and bearer_matches(b"Bearer t0k", "t0k")
    for bad in (None, "", "t0k", "Bearer t0", "Bearer t0k ", "bearer t0k", "Bearer t0ké"):
        assert not bearer_matches(bad, "t0k")
    assert token_from_env({}) is None and token_from_env({"MOLT_WEIGHTS_TOKEN": " "}) is None
    assert token_from_env({"MOLT_WEIGHTS_TOKEN": "abc"}) == "abc"


def test_no_token_is_accepted_only_on_loopback_or_when_allowed():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "pod-0"))
    check_exposure(None, "127.0.0.1", False)
    check_exposure("t", "0.0.0.0", False)
    check_exposure(None, "0.0.0.0", True)
    with pytest.raises(ValueError, match="set MOLT_WEIGHTS_TOKEN.*--weights.allow_unauthenticated"):
        check_exposure(None, "0.0.0.0", False)


def _settings(host: str, **weights) -> RolloutSettings:
    return RolloutSettings.model_validate({"model": {"path": "/fake"}, "server": {"host": host}, "weights": weights})


def test_pod_app_refuses_a_public_address_without_a_token(monkeypatch):
    monkeypatch.delenv("MOLT_WEIGHTS_TOKEN", raising=False)
    with pytest.raises(ValueError, match="MOLT_WEIGHTS_TOKEN"):
        build_app(_settings("0.0.0.0"), engine=FakeEngine())
    build_app(_settings("0.0.0.0", allow_unauthenticated=True), engine=FakeEngine())


def _reloading_engine() -> tuple[FakeEngine, list]:
    """A fake engine whose reloads are recorded as (path, version)."""
    engine, calls = FakeEngine(), []

    async def reload_from_path(path, version):
        calls.append((path, version))
        return {"policy_version": version}

    engine.reload_from_path = reload_from_path
    return engine, calls


def test_reload_route_needs_the_token(monkeypatch):
    monkeypatch.setenv("MOLT_WEIGHTS_TOKEN", "t0k")
    engine, calls = _reloading_engine()
    with TestClient(build_app(_settings("0.0.0.0"), engine=engine)) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "t0k"}):
            r = client.post("/v1/weights/reload", json={"path": "/m", "version": 4}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_weights_token"
        assert calls == []
        r = client.post(
            "/v1/weights/reload", json={"path": "/m", "version": 4}, headers={"Authorization": "Bearer t0k"}
        )
        assert r.status_code == 200 and calls == [("/m", 4)]


def test_without_a_weights_token_the_reload_needs_the_service_token(monkeypatch):
    """--weights.allow_unauthenticated opens weight changes to the trainer's path without a token; the reload
    (any model dir the caller names) still needs MOLT_INTERNAL_TOKEN where the pod has one."""
    monkeypatch.delenv("MOLT_WEIGHTS_TOKEN", raising=False)
    monkeypatch.setenv("MOLT_INTERNAL_TOKEN", "svc-t0k")
    engine, calls = _reloading_engine()
    with TestClient(build_app(_settings("0.0.0.0", allow_unauthenticated=True), engine=engine)) as client:
        r = client.post("/v1/weights/reload", json={"path": "/m", "version": 4})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_internal_token"
        r = client.post(
            "/v1/weights/reload", json={"path": "/m", "version": 4}, headers={"Authorization": "Bearer svc-t0k"}
        )
        assert r.status_code == 200 and calls == [("/m", 4)]


async def test_grpc_calls_without_the_token_are_unauthenticated(monkeypatch):
    monkeypatch.delenv("MOLT_WEIGHTS_TOKEN", raising=False)
    server, port = await start_weightsync_server(FakeEngine(), "127.0.0.1", 0, token="t0k")
    target = f"127.0.0.1:{port}"
    try:
        for token in ("", "nope"):
            client = GrpcPodClient(target, token=token)
            with pytest.raises(PodError) as err:
                await client.status()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED.name
            with pytest.raises(PodError) as err:
                await client.abort(pb.AbortRequest(sync_id="x"))
            assert err.value.code == "UNAUTHENTICATED"
            await client.close()
        monkeypatch.setenv("MOLT_WEIGHTS_TOKEN", "t0k")  # the client's default: the same env as the pod
        client = GrpcPodClient(target)
        assert (await client.status()).version == 3
        await client.close()
    finally:
        await server.stop(0)
    with pytest.raises(ValueError, match="MOLT_WEIGHTS_TOKEN"):
        await start_weightsync_server(FakeEngine(), "0.0.0.0", 0)


def _pki(tmp_path):
    """A CA, a pod certificate for 127.0.0.1 and a trainer client certificate, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(name, key, issuer=None, issuer_key=None, ca=False, san=None):
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key or key, hashes.SHA256())

    def write(name, cert, key):
        (tmp_path / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (tmp_path / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("molt-test-ca", ca_key, ca=True)
    write("ca", ca, ca_key)
    for name, san in (("pod", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), ("trainer", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        write(name, issue(name, key, ca.subject, ca_key, san=san), key)
    return {k: str(tmp_path / k) for k in ("ca.pem", "pod.pem", "pod.key", "trainer.pem", "trainer.key")}


async def test_mutual_tls_on_the_weight_port(tmp_path, monkeypatch):
    from molt.weightsync.auth import server_credentials

    pki = _pki(tmp_path)
    monkeypatch.delenv("MOLT_WEIGHTS_TOKEN", raising=False)
    creds = server_credentials(pki["pod.pem"], pki["pod.key"], pki["ca.pem"])
    server, port = await start_weightsync_server(FakeEngine(), "127.0.0.1", 0, token="t0k", credentials=creds)
    target = f"127.0.0.1:{port}"
    try:
        monkeypatch.setenv("MOLT_WEIGHTS_TLS_CA", pki["ca.pem"])
        monkeypatch.setenv("MOLT_WEIGHTS_TLS_CERT", pki["trainer.pem"])
        monkeypatch.setenv("MOLT_WEIGHTS_TLS_KEY", pki["trainer.key"])
        client = GrpcPodClient(target, token="t0k", timeout_s=10)
        assert (await client.status()).version == 3
        await client.close()
        client = GrpcPodClient(target, token="nope", timeout_s=10)  # TLS does not replace the token
        with pytest.raises(PodError, match="UNAUTHENTICATED"):
            await client.status()
        await client.close()
        monkeypatch.delenv("MOLT_WEIGHTS_TLS_CERT")
        monkeypatch.delenv("MOLT_WEIGHTS_TLS_KEY")
        client = GrpcPodClient(target, token="t0k", timeout_s=5)  # verifies the pod but shows no certificate
        with pytest.raises(PodError, match="UNAVAILABLE"):
            await client.status()
        await client.close()
        monkeypatch.delenv("MOLT_WEIGHTS_TLS_CA")
        client = GrpcPodClient(target, token="t0k", timeout_s=5)  # plaintext against a TLS port
        with pytest.raises(PodError, match="UNAVAILABLE"):
            await client.status()
        await client.close()
    finally:
        await server.stop(0)
    with pytest.raises(ValueError, match="--grpc.tls_key"):
        server_credentials(pki["pod.pem"], None, None)
