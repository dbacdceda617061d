"""Beyond loopback: real TLS and mTLS (certificates made here with cryptography), bearer
tokens with tenants, tenant-private sequences on every RPC that takes a handle
or an id, per-tenant prefix sharing, sequence caps and KV quotas, and the
refusal to serve a non-loopback address unprotected."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ferrum_rpc.client import CacheNotFound, ClientTls, ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import ExecutorError, SequenceLimitExceeded, TenantQuotaExceeded, Unauthenticated
from ferrum_rpc.server.rpc.auth import TokenTable
from ferrum_rpc.server.config import ServerConfig, is_loopback
from tests.conftest import running_server

ALICE, BOB = "alice-" + "a" * 26, "bob-" + "b" * 28
ARGMAX = LogitsPolicy.argmax()


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(d, name: str, key, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                      serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, server: bool = False):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                      content_commitment=False, key_encipherment=False,
                                                      data_encipherment=False, key_agreement=False,
                                                      encipher_only=False, decipher_only=False), critical=True)
    elif server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a server certificate (localhost, 127.0.0.1) and a client one, and
    a rogue CA with its own client certificate (cryptography, made here)."""
    d = tmp_path_factory.mktemp("pki")
    cas = {}
    for ca in ("ca", "rogue-ca"):
        key = _key()
        cas[ca] = key
        _write(d, ca, key, _cert(ca, key, ca, key, ca=True))
    for name, ca, server in (("server", "ca", True), ("client", "ca", False), ("rogue-client", "rogue-ca", False)):
        key = _key()
        _write(d, name, key, _cert(name, key, ca, cas[ca], server=server))
    return d


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# tenants\nalice {ALICE}\nbob   {BOB}  # the other one\n\n")
    return str(path)


# -- TLS and mTLS ----------------------------------------------------------------------
def test_tls_serves_verified_clients_only(tiny_llama_dir, pki):
    server_kwargs = dict(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))
    with running_server(tiny_llama_dir, server_kwargs=server_kwargs) as server:
        port = server.target.rsplit(":", 1)[1]
        for target in (server.target, f"localhost:{port}"):
            with ExecutorClient(target, timeout=10, tls=ClientTls(ca=str(pki / "ca.pem"))) as ex:
                assert ex.prefill([1, 2, 3], logits=ARGMAX).kv_cache.sequence_length == 3
        with ExecutorClient(server.target, timeout=5) as plain, pytest.raises(ExecutorError) as plain_err:
            plain.prefill([1, 2, 3])  # plaintext to a TLS port: no connection
        assert plain_err.value.code == grpc.StatusCode.UNAVAILABLE
        with ExecutorClient(server.target, timeout=5, tls=ClientTls(ca=str(pki / "rogue-ca.pem"))) as wrong, \
                pytest.raises(ExecutorError) as wrong_err:
            wrong.prefill([1, 2, 3])  # the server's chain does not verify against this CA
        assert wrong_err.value.code == grpc.StatusCode.UNAVAILABLE
        # server name override: connect by IP, verify the certificate's DNS name
        with ExecutorClient(server.target, timeout=10,
                            tls=ClientTls(ca=str(pki / "ca.pem"), server_name="localhost")) as ex:
            assert ex.info().name == "tiny"


def test_mtls_requires_a_client_certificate_from_the_given_ca(tiny_llama_dir, pki):
    server_kwargs = dict(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                         tls_client_ca=str(pki / "ca.pem"))
    ca = str(pki / "ca.pem")
    with running_server(tiny_llama_dir, server_kwargs=server_kwargs) as server:
        good = ClientTls(ca=ca, cert=str(pki / "client.pem"), key=str(pki / "client.key"))
        with ExecutorClient(server.target, timeout=10, tls=good) as ex:
            assert ex.prefill([4, 5], logits=ARGMAX).kv_cache.sequence_length == 2
        for refused in (ClientTls(ca=ca),
                        ClientTls(ca=ca, cert=str(pki / "rogue-client.pem"), key=str(pki / "rogue-client.key"))):
            with ExecutorClient(server.target, timeout=5, tls=refused) as ex, pytest.raises(ExecutorError) as err:
                ex.info()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE


# -- tokens and tenants ----------------------------------------------------------------
@pytest.fixture(scope="module")
def authed(tiny_llama_dir, tokens_file):
    with running_server(tiny_llama_dir, server_kwargs=dict(auth_tokens=tokens_file), tenant_max_sequences=40,
                        max_sequences=200) as server:
        yield server


def test_calls_need_a_known_token_but_health_checks_do_not(authed):
    for token in (None, "nobody-" + "x" * 20, ALICE[:-1] + "?"):
        with ExecutorClient(authed.target, timeout=10, token=token) as ex:
            with pytest.raises(Unauthenticated, match="Bearer") as err:
                ex.prefill([1, 2])
            assert token is None or token not in str(err.value)
    with grpc.insecure_channel(authed.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as err:  # reflection follows the service's rule
            list(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = list(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                   timeout=10, metadata=[("authorization", f"Bearer {BOB}")]))
        assert any("ModelExecutor" in s.name for s in listed[0].list_services_response.service)
    with ExecutorClient(authed.target, timeout=10, token=ALICE) as ex:
        assert ex.prefill([1, 2], logits=ARGMAX).kv_cache.sequence_length == 2


def test_another_tenants_sequence_behaves_exactly_like_an_unknown_one(authed):
    with ExecutorClient(authed.target, timeout=10, token=ALICE) as alice, \
            ExecutorClient(authed.target, timeout=10, token=BOB) as bob:
        handle = alice.prefill([5, 6, 7, 8, 9], logits=ARGMAX).kv_cache
        unknown = handle.__class__(**{**handle.__dict__, "cache_id": "f" * 32})
        attempts = {
            "decode": lambda h: bob.decode(1, h),
            "batch_decode": lambda h: bob.batch_decode([(1, h)]),
            "forward_verify": lambda h: bob.forward_verify([1, 2], h),
            "continue prefill": lambda h: bob.prefill([3], kv_cache=h),
            "truncate_kv": lambda h: bob.truncate_kv(h, 1),
            "fork_cache": lambda h: bob.fork_cache(h, 2),
            "release_cache": lambda h: bob.release_cache(h.cache_id),
            "session": lambda h: _session_step(bob, h),
        }
        for name, call in attempts.items():
            with pytest.raises(CacheNotFound) as theirs:
                call(handle)
            with pytest.raises(CacheNotFound) as nobodys:
                call(unknown)
            assert str(theirs.value).replace(handle.cache_id, "ID") == \
                str(nobodys.value).replace(unknown.cache_id, "ID"), name
        out = alice.decode(10, handle)  # untouched by all of that
        assert out.kv_cache.sequence_length == 6
        alice.release_cache(out.kv_cache)


def _session_step(client, handle):
    with client.decode_session() as session:
        return session.step([(1, handle)])


def test_prefix_sharing_stays_within_a_tenant(authed):
    prompt = list(range(100, 140))  # 10 full blocks of 4
    with ExecutorClient(authed.target, timeout=10, token=ALICE) as alice, \
            ExecutorClient(authed.target, timeout=10, token=BOB) as bob:
        first = alice.prefill(prompt, logits=ARGMAX)
        assert bob.prefill(prompt, logits=ARGMAX).cached_tokens == 0  # nothing learned about alice's prompt
        assert alice.prefill(prompt, logits=ARGMAX).cached_tokens == 36
        alice.release_cache(first.kv_cache)


def test_sequence_caps_per_tenant_refuse_before_any_work(authed):
    with ExecutorClient(authed.target, timeout=10, token=ALICE) as alice, \
            ExecutorClient(authed.target, timeout=10, token=BOB) as bob:
        handles = []
        with pytest.raises(SequenceLimitExceeded, match="your tenant holds 40 live sequences, its cap is 40"):
            for i in range(41):  # alice may hold a few from earlier tests: refused at her 41st
                handles.append(alice.prefill([i + 1], logits=ARGMAX).kv_cache)
        held = alice.status().active_sequences
        with pytest.raises(SequenceLimitExceeded):
            alice.fork_cache(handles[0], 2)
        assert alice.status().active_sequences == held  # refused before any work
        out = bob.prefill([1, 2], logits=ARGMAX)  # the other tenant is still served
        for h in handles:
            alice.release_cache(h)
        bob.release_cache(out.kv_cache)
        alice.release_cache(alice.fork_cache(alice.prefill([9], logits=ARGMAX).kv_cache, 1)[0])


def test_tenant_kv_quota_refuses_with_its_own_reason_and_others_keep_going(tiny_llama_dir, tokens_file):
    with running_server(tiny_llama_dir, server_kwargs=dict(auth_tokens=tokens_file), tenant_kv_tokens=32) as srv, \
            ExecutorClient(srv.target, timeout=10, token=ALICE) as alice, \
            ExecutorClient(srv.target, timeout=10, token=BOB) as bob:
        handle = alice.prefill(list(range(1, 29)), logits=ARGMAX).kv_cache  # 7 of 8 blocks
        before = alice.status()
        with pytest.raises(TenantQuotaExceeded, match="quota of 32"):
            alice.prefill(list(range(100, 108)), logits=ARGMAX)  # 2 more blocks (no prefix shared)
        with pytest.raises(TenantQuotaExceeded):
            alice.forward_verify(list(range(5)), handle)  # would need an 8th and 9th block
        after = alice.status()
        assert (after.kv_blocks_used, after.active_sequences) == (before.kv_blocks_used, before.active_sequences)
        assert bob.prefill(list(range(1, 29)), logits=ARGMAX).kv_cache.sequence_length == 28
        alice.release_cache(handle)
        assert alice.prefill(list(range(1, 9)), logits=ARGMAX).kv_cache.sequence_length == 8


def test_server_wide_sequence_cap(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_sequences=3) as srv, ExecutorClient(srv.target, timeout=10) as ex:
        a = ex.prefill([1], logits=ARGMAX).kv_cache
        ex.fork_cache(a, 2)
        with pytest.raises(SequenceLimitExceeded, match="server holds 3"):
            ex.prefill([2], logits=ARGMAX)


# -- configuration ---------------------------------------------------------------------
def test_token_file_rules(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("alice short\n")
    with pytest.raises(ValueError, match="shorter than") as err:
        TokenTable.load(path)
    assert "short" not in str(err.value).replace("shorter", "")
    path.write_text(f"alice {ALICE}\nbob {ALICE}\n")
    with pytest.raises(ValueError, match="reuses") as err:
        TokenTable.load(path)
    assert ALICE not in str(err.value)
    path.write_text(f"alice {ALICE} extra\n")
    with pytest.raises(ValueError, match="expected"):
        TokenTable.load(path)
    path.write_text(f"alice {ALICE}\nbob {BOB}\n")
    table = TokenTable.load(path)
    assert table.tenant_for([("authorization", f"Bearer {BOB}")]) == "bob"
    assert table.tenant_for([("authorization", BOB)]) is None  # the scheme is required
    assert table.tenant_for([]) is None


def test_non_loopback_needs_tls_and_tokens_or_insecure(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
    with pytest.raises(ValueError, match="without TLS and tokens"):
        ServerConfig(models=(), host="0.0.0.0")
    with pytest.raises(ValueError, match="without TLS and tokens"):  # TLS alone is not enough
        ServerConfig(models=(), host="0.0.0.0", tls_cert="c", tls_key="k")
    ServerConfig(models=(), host="0.0.0.0", insecure=True)
    ServerConfig(models=(), host="0.0.0.0", tls_cert="c", tls_key="k", auth_tokens="t")
    proc = subprocess.run([sys.executable, "-m", "ferrum_rpc.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--insecure" in proc.stderr and "Traceback" not in proc.stderr


# -- metrics ---------------------------------------------------------------------------
def _scrape(port: int) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_a_known_workload_exactly(tiny_llama_dir, tokens_file):
    kwargs = dict(auth_tokens=tokens_file, metrics_port=0)
    with running_server(tiny_llama_dir, server_kwargs=kwargs, prefix_caching=True) as srv, \
            ExecutorClient(srv.target, timeout=10, token=ALICE) as alice, \
            ExecutorClient(srv.target, timeout=10, token=BOB) as bob:
        port = srv.app.metrics_port
        base = _scrape(port)
        prompt = list(range(1, 13))  # 3 full blocks of 4
        a = alice.prefill(prompt, logits=ARGMAX).kv_cache
        a = alice.decode(5, a).kv_cache
        a = alice.decode(6, a).kv_cache
        again = alice.prefill(prompt, logits=ARGMAX)  # 8 tokens from alice's prefix cache
        b = bob.prefill([7, 8, 9], logits=ARGMAX).kv_cache
        outs = bob.batch_decode([(1, b)])
        with pytest.raises(CacheNotFound):
            bob.decode(1, a)  # alice's: answered as unknown, counted as NOT_FOUND for bob
        m = _scrape(port)
        status = alice.status()

    def requests(method, code, tenant):
        key = ("ferrum_requests_total", (("code", code), ("method", method), ("tenant", tenant)))
        return m.get(key, 0) - base.get(key, 0)

    assert requests("Prefill", "OK", "alice") == 2 and requests("Decode", "OK", "alice") == 2
    assert requests("Prefill", "OK", "bob") == 1 and requests("BatchDecode", "OK", "bob") == 1
    assert requests("Decode", "NOT_FOUND", "bob") == 1 and requests("Decode", "OK", "bob") == 0
    assert m[("ferrum_request_seconds_count", (("method", "Prefill"),))] == 3
    assert m[("ferrum_forward_seconds_count", (("method", "Decode"),))] == 2
    model = (("model", "tiny"),)
    assert m[("ferrum_sequences_alive", (("model", "tiny"), ("tenant", "alice")))] == 2
    assert m[("ferrum_sequences_alive", (("model", "tiny"), ("tenant", "bob")))] == 1
    assert m[("ferrum_kv_blocks_used", model)] == status.kv_blocks_used
    assert m[("ferrum_prefix_cache_hit_tokens_total", model)] - base.get(
        ("ferrum_prefix_cache_hit_tokens_total", model), 0) == 8
    # tokens: 12 + 1 + 1 + (12 - 8) + 3 + 1; forwards of one sequence each (the warm-up's too)
    assert m[("ferrum_tokens_processed_total", model)] - base[("ferrum_tokens_processed_total", model)] == 22
    forwards = m[("ferrum_forward_batch_size_count", model)] - base[("ferrum_forward_batch_size_count", model)]
    assert forwards == 6 and m[("ferrum_forward_batch_size_bucket", (("le", "1"), ("model", "tiny")))] == \
        m[("ferrum_forward_batch_size_count", model)]
    assert outs[0].kv_cache.sequence_length == 4


@pytest.mark.cpu_only  # bursts run on the CPU
def test_metrics_count_the_forwards_of_a_greedy_run_in_bursts(tiny_llama_dir):
    from ferrum_rpc.types import TokenChoice

    key = ("ferrum_burst_forwards_total", (("model", "tiny"),))
    with running_server(tiny_llama_dir, server_kwargs=dict(metrics_port=0)) as srv, \
            ExecutorClient(srv.target, timeout=10) as client:
        base = _scrape(srv.app.metrics_port).get(key, 0)
        out = client.prefill([5, 6, 7], logits=ARGMAX)  # the run starts at position 3, a block's last (of 4)
        run = client.decode_ahead(out.logits.argmax()[0], out.kv_cache, TokenChoice.greedy(), 24)
        bursts = _scrape(srv.app.metrics_port)[key] - base
        assert run.kv_cache.sequence_length == 3 + 24
        # of the 24 forwards, a block's last position runs as a plain step, as does a forward
        # with room for one more in the run's queue; most burst, 23 at most
        assert 12 <= bursts <= 23
