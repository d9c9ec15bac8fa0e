"""Draft server over real loopback gRPC, with real server processes (killed with real signals).

Covers: three replicas converge on 100k records from two publishers; SIGKILL mid-publish
and restart from the data dir loses nothing acknowledged and duplicates nothing; late and lagging
replicas catch up through snapshots; malformed, oversized and unauthenticated requests get a status
while the server keeps serving; random bytes into the decoding path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from histospec_sgl import HistoryIndex, _core, prompt_key
from histospec_sgl.procs import wait_port_free
from histospec_sgl.sync import (
    DraftServerError,
    DraftServerProcess,
    HistoryPublisher,
    HistorySubscriber,
    PublishError,
    replica,
)
from histospec_sgl.sync.client import SERVICE
from histospec_sgl.sync.replica import checksum

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tmp_path):
    with DraftServerProcess(log=tmp_path / "server.log") as s:
        yield s


def _records(n: int, seed: int, prompts: int = 50, plen: int = 8, rlen: int = 24):
    """n (prompt, response) pairs over a few prompts; responses of a prompt share most tokens."""
    rng = np.random.default_rng(seed)
    ps = [rng.integers(0, 5000, plen).astype(np.int32) for _ in range(prompts)]
    base = [rng.integers(0, 5000, rlen).astype(np.int32) for _ in range(prompts)]
    out = []
    for i in range(n):
        p = i % prompts
        r = base[p].copy()
        m = rng.random(rlen) < 0.3
        r[m] = rng.integers(0, 5000, int(m.sum()))
        out.append((ps[p], r))
    return out


def _all_records(address: str, **kw) -> list[dict]:
    """Every retained record, through a Snapshot call."""
    ch = grpc.insecure_channel(address)
    out = []
    for data in ch.unary_stream(f"/{SERVICE}/Snapshot")(b"", timeout=60, **kw):
        out.extend(_core.decode_records(data, "snapshot")["records"])
    ch.close()
    return out


def _replica_result(p: subprocess.Popen) -> dict:
    out, _ = p.communicate(timeout=180)
    res = json.loads(out.strip().splitlines()[-1])
    assert p.returncode == 0, res
    return res


# -- the core path ---------------------------------------------------------------------------------


def test_publish_subscribe_roundtrip_and_idempotent_ids(server):
    idx = HistoryIndex()
    with HistoryPublisher(server.address, batch_records=10) as pub, HistorySubscriber(server.address, idx) as sub:
        recs = _records(25, seed=1)
        ids = [pub.publish(p, r, version=3, sample_index=i % 4, reward=0.5) for i, (p, r) in enumerate(recs)]
        pub.flush()
        assert pub.published == 25 and pub.last_sequence == 25
        assert sub.poll(through_sequence=25, timeout=10) == 25
        # The index holds the records under prompt_key groups, with their version.
        got = idx.responses(prompt_key(recs[0][0]))
        assert [list(r) for _, r, _ in got] == [list(recs[0][1])]  # 50 prompts: record 0 is alone in its group
        assert {v for _, _, v in got} == {3}
        # Re-publishing the same ids (a retry) stores nothing new and returns the first sequences.
        pub2 = HistoryPublisher(server.address)
        for rid, (p, r) in zip(ids[:5], recs[:5]):
            pub2.publish(p, r, version=3, sample_index=ids.index(rid) % 4, reward=0.5, record_id=rid)
        reply = pub2.flush()
        assert reply["accepted"] == 0 and reply["duplicates"] == 5 and reply["sequences"] == [1, 2, 3, 4, 5]
        # The same id with other contents is refused.
        pub2.publish(recs[0][0], recs[1][1], record_id=ids[0])
        with pytest.raises(PublishError, match="ALREADY_EXISTS"):
            pub2.flush()
        assert pub2.discard() == 1  # drop the refused record, then close
        pub2.close()
        st_ = pub.stats()
        assert st_["records"] == 25 and st_["duplicates"] == 5 and st_["head_sequence"] == 25
        # Decoded records carry every field.
        rec = _all_records(server.address)[3]
        assert rec["sequence"] == 4 and rec["version"] == 3 and rec["sample_index"] == 3
        assert rec["reward"] == pytest.approx(0.5) and rec["group_key"] == prompt_key(recs[3][0])
        assert rec["record_id"] == ids[3] and np.array_equal(rec["response_ids"], recs[3][1])


def test_poll_applies_exactly_through_a_sequence(server):
    idx = HistoryIndex()
    with HistoryPublisher(server.address, batch_records=1000) as pub, HistorySubscriber(server.address, idx) as sub:
        for p, r in _records(100, seed=2):
            pub.publish(p, r)
        pub.flush()
        assert sub.poll(through_sequence=37, timeout=10) == 37
        assert sub.applied_sequence == 37 and idx.stats()["responses"] == 37
        assert sub.poll(through_sequence=37) == 0  # nothing more
        sub.poll(through_sequence=100, timeout=10)
        assert idx.stats()["responses"] == 100
        with pytest.raises(TimeoutError, match="sequence 101"):
            sub.poll(through_sequence=101, timeout=0.3)


def test_three_replicas_converge_on_100k_records_from_two_publishers(server):
    n_per = 50_000
    replicas = [replica.spawn(server.address, 2 * n_per, timeout=120) for _ in range(3)]
    errors: list[BaseException] = []

    def publish(seed: int) -> None:
        try:
            with HistoryPublisher(server.address, batch_records=2000) as pub:
                for p, r in _records(n_per, seed=seed, prompts=500):
                    pub.publish(p, r, version=seed)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(s,)) for s in (11, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    results = [_replica_result(p) for p in replicas]
    st_ = HistoryPublisher(server.address).stats()
    assert st_["records"] == 2 * n_per and st_["head_sequence"] == 2 * n_per
    assert all(r["applied_sequence"] == 2 * n_per for r in results)
    assert all(r["stats"] == results[0]["stats"] for r in results)
    assert results[0]["stats"]["responses"] == 2 * n_per
    assert len({r["checksum"] for r in results}) == 1
    # The replicas hold exactly the server's history: a fresh index built from a Snapshot matches.
    ref = HistoryIndex()
    ch = grpc.insecure_channel(server.address)
    for data in ch.unary_stream(f"/{SERVICE}/Snapshot")(b"", timeout=60):
        _core.apply_records(ref, data, "snapshot")
    assert checksum(ref) == results[0]["checksum"]


# -- crash safety ----------------------------------------------------------------------------------


def test_sigkill_mid_publish_loses_nothing_acknowledged_and_duplicates_nothing(tmp_path):
    data_dir = tmp_path / "data"
    srv = DraftServerProcess(data_dir=data_dir, log=tmp_path / "server.log")
    port = srv.port
    idx = HistoryIndex()
    sub = HistorySubscriber(srv.address, idx, background=True, max_backoff=0.2).start()
    recs = _records(6000, seed=5, prompts=200)
    acked: set[bytes] = set()
    sent_ids: list[bytes] = []
    stop_err: list[BaseException] = []

    def publish() -> None:
        pub = HistoryPublisher(srv.address, batch_records=100, max_attempts=200, max_backoff=0.2, timeout=5)
        try:
            for i, (p, r) in enumerate(recs):
                rid = f"trainer:{i}".encode()
                sent_ids.append(rid)
                pending = [*pub._pending]
                pub.publish(p, r, record_id=rid, version=i // 1000)
                if len(pub._pending) == 0:  # a batch went out and was acknowledged
                    acked.update(x[0] for x in pending)
                    acked.add(rid)
            pending = [*pub._pending]
            pub.flush()
            acked.update(x[0] for x in pending)
        except BaseException as e:
            stop_err.append(e)
        finally:
            pub._channel.close()

    t = threading.Thread(target=publish)
    t.start()
    while len(acked) < 1500:
        time.sleep(0.01)
        assert t.is_alive() or stop_err == [], stop_err
    srv.proc.kill()  # SIGKILL in the middle of publishing
    srv.wait(10)
    acked_before_kill = set(acked)
    time.sleep(0.5)  # the publisher retries against a dead port
    wait_port_free(port)
    srv2 = DraftServerProcess(f"127.0.0.1:{port}", data_dir=data_dir, log=tmp_path / "server2.log")
    try:
        t.join(120)
        assert not stop_err, stop_err
        stored = _all_records(srv2.address)
        ids = [r["record_id"] for r in stored]
        # Every acknowledged record is there (before and after the kill), exactly once, in order.
        assert acked_before_kill <= set(ids)
        assert set(ids) == set(sent_ids) and len(ids) == len(set(ids)) == len(recs)
        assert [r["sequence"] for r in stored] == list(range(1, len(recs) + 1))
        # A retried publish of already stored records creates no duplicates.
        with HistoryPublisher(srv2.address) as pub:
            for i in (0, 1500, 5999):
                pub.publish(recs[i][0], recs[i][1], record_id=f"trainer:{i}", version=i // 1000)
            reply = pub.flush()
        assert reply["duplicates"] == 3 and reply["accepted"] == 0 and reply["durable"]
        # The subscriber reconnected by itself and converged to the restarted server's history.
        sub.wait_applied(len(recs), 60)
        assert sub.reconnects >= 1
        ref = HistoryIndex()
        for r in stored:
            ref.add_response(r["group_key"], r["prompt_ids"], r["response_ids"], r["version"])
        assert checksum(idx) == checksum(ref)
    finally:
        sub.close()
        srv2.kill()


def test_sigterm_writes_a_snapshot_and_restart_restores_it(tmp_path):
    data_dir = tmp_path / "data"
    srv = DraftServerProcess(data_dir=data_dir, log=tmp_path / "server.log")
    with HistoryPublisher(srv.address) as pub:
        for p, r in _records(300, seed=6):
            pub.publish(p, r)
    before = _all_records(srv.address)
    assert srv.terminate() == 0
    assert (data_dir / "snapshot.bin").exists()
    logs = sorted(data_dir.glob("log-*.bin"))
    assert len(logs) == 1 and logs[0].stat().st_size == 8  # compacted: an empty log after the snapshot
    with DraftServerProcess(data_dir=data_dir, log=tmp_path / "server2.log") as srv2:
        after = _all_records(srv2.address)
        assert [(r["record_id"], r["sequence"]) for r in after] == [(r["record_id"], r["sequence"]) for r in before]
        with HistoryPublisher(srv2.address) as pub:
            pub.publish([1, 2], [3, 4])
            assert pub.flush()["sequences"] == [301]


# -- catching up -----------------------------------------------------------------------------------


def test_late_replica_catches_up_through_a_snapshot(tmp_path):
    with DraftServerProcess(max_records=500, log=tmp_path / "server.log") as srv:
        with HistoryPublisher(srv.address, batch_records=250) as pub:
            for p, r in _records(2000, seed=7):
                pub.publish(p, r)
        idx = HistoryIndex()
        with HistorySubscriber(srv.address, idx) as sub:
            assert sub.poll(through_sequence=2000, timeout=10) == 500
            assert sub.snapshots == 1
        st_ = HistoryPublisher(srv.address).stats()
        assert st_["records"] == 500 and st_["first_sequence"] == 1501 and st_["evicted_records"] == 1500
        # Asking for an evicted sequence directly is OUT_OF_RANGE.
        ch = grpc.insecure_channel(srv.address)
        with pytest.raises(grpc.RpcError) as e:
            next(iter(ch.unary_stream(f"/{SERVICE}/Subscribe")(_core.encode_subscribe(10), timeout=10)))
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_lagging_replica_is_cut_off_and_recovers_through_a_snapshot(tmp_path):
    # Retention of 300 records of ~4 KB: a subscriber that stops reading falls behind it.
    with DraftServerProcess(max_records=300, extra=["--subscriber-buffer", "1"], log=tmp_path / "s.log") as srv:
        idx = HistoryIndex()
        recs = _records(3000, seed=8, prompts=100, rlen=1000)
        # A fixed 64 KiB flow-control window (no BDP growth), so the stall reaches the server.
        small_window = [("grpc.http2.bdp_probe", 0)]
        with HistorySubscriber(srv.address, idx, max_buffered=1, channel_options=small_window) as sub, \
                HistoryPublisher(srv.address) as pub:
            for p, r in recs[:10]:
                pub.publish(p, r)
            pub.flush()
            time.sleep(0.3)  # the subscriber is now streaming, and stops reading (nobody polls)
            for p, r in recs[10:]:
                pub.publish(p, r)
            pub.flush()
            # A fast subscriber is not held up by the stalled one.
            fast_idx = HistoryIndex()
            with HistorySubscriber(srv.address, fast_idx, background=True) as fast:
                fast.wait_applied(3000, 30)
            deadline = time.monotonic() + 30
            while sub.applied_sequence < 3000 and time.monotonic() < deadline:
                sub.poll(timeout=0.2)
            assert sub.applied_sequence == 3000
            assert sub.snapshots >= 2  # the initial one, and the catch-up after the cut
            assert pub.stats()["cut_off_subscribers"] >= 1
            # It holds every retained record.
            ids = {(r["group_key"], tuple(r["response_ids"])) for r in _all_records(srv.address)}
            have = {(g, tuple(resp)) for g in idx.group_keys() for _, resp, _ in idx.responses(g)}
            assert ids <= have


# -- bad input -------------------------------------------------------------------------------------


def _raw(address: str, method: str, data: bytes, metadata=()) -> bytes:
    ch = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 256 << 20)])
    try:
        return ch.unary_unary(f"/{SERVICE}/{method}")(data, timeout=10, metadata=metadata)
    finally:
        ch.close()


def test_malformed_invalid_and_oversized_requests_get_a_status_and_the_server_keeps_serving(tmp_path):
    with DraftServerProcess(extra=["--max-message-bytes", str(1 << 20)], log=tmp_path / "s.log") as srv:
        with pytest.raises(grpc.RpcError) as e:
            _raw(srv.address, "Publish", b"\xff\xff\xff\xff\x0f garbage")
        assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
        bad = [
            ((b"a", None, [], [1], 0, 0, None, None), "prompt_ids is empty"),
            ((b"a", None, [1], [], 0, 0, None, None), "response_ids is empty"),
            ((b"", None, [1], [1], 0, 0, None, None), "record_id must be"),
            ((b"a", None, [1], [1, 2], 0, 0, [-0.5], None), "1 logprobs for 2"),
            ((b"a", None, [1], [1], 0, 0, [float("nan")], None), "NaN"),
            ((b"a", None, [1], [1], 0, 0, None, float("nan")), "reward is NaN"),
        ]
        for rec, msg in bad:
            good = (b"ok", None, [1], [2], 0, 0, None, None)
            with pytest.raises(grpc.RpcError) as e:
                _raw(srv.address, "Publish", _core.encode_publish([good, rec]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "record 1" in e.value.details() and msg in e.value.details()
        # Token ids at 2^31 and above are refused too (encoded by hand: the client refuses them first).
        with pytest.raises(ValueError, match="token"):
            _core.encode_publish([(b"x", None, [1], [2**31], 0, 0, None, None)])
        with pytest.raises(grpc.RpcError) as e:
            # Record{record_id: "x", prompt_ids: [1], response_ids: [2^31]} inside PublishRequest.records.
            record = b"\x0a\x01x" + b"\x1a\x01\x01" + b"\x22\x05\x80\x80\x80\x80\x08"
            _raw(srv.address, "Publish", b"\x0a" + bytes([len(record)]) + record)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "2^31" in e.value.details()
        big = (b"big", None, [1], np.full(400_000, 100_000, np.int32), 0, 0, None, None)
        with pytest.raises(grpc.RpcError) as e:
            _raw(srv.address, "Publish", _core.encode_publish([big]))
        # tonic answers an over-limit message with OUT_OF_RANGE ("decoded message length too large").
        assert e.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE)
        assert "too large" in e.value.details()
        with HistoryPublisher(srv.address, batch_tokens=10**9) as pub:
            pub.publish([1], np.full(400_000, 100_000, np.int32))
            with pytest.raises(PublishError, match="max-message-bytes"):
                pub.flush()
            assert pub.queued == 1 and pub.discard() == 1
        with pytest.raises(grpc.RpcError) as e:
            next(iter(grpc.insecure_channel(srv.address).unary_stream(f"/{SERVICE}/Subscribe")(
                _core.encode_subscribe(99), timeout=10)))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # Still serving.
        with HistoryPublisher(srv.address) as pub:
            pub.publish([1, 2, 3], [4, 5, 6])
            assert pub.flush()["sequences"] == [1]
        assert srv.alive()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_fuzz_publish_decoding_path(server, data):
    try:
        reply = _core.decode_publish_response(_raw(server.address, "Publish", data))
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    else:
        assert reply["accepted"] + reply["duplicates"] == len(reply["sequences"])
    assert _core.decode_stats(_raw(server.address, "Stats", b""))["head_sequence"] >= 0


def test_auth_token_is_required_except_for_health(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    with DraftServerProcess(auth_token_file=tok, log=tmp_path / "s.log") as srv:
        for md in [(), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)]:
            with pytest.raises(grpc.RpcError) as e:
                _raw(srv.address, "Stats", b"", metadata=md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(DraftServerError, match="UNAUTHENTICATED"):
            HistoryPublisher(srv.address).stats()
        with pytest.raises(PublishError, match="UNAUTHENTICATED"):
            with HistoryPublisher(srv.address) as pub:
                pub.publish([1], [2])
        idx = HistoryIndex()
        with HistoryPublisher(srv.address, auth_token="s3cret") as pub, HistorySubscriber(
            srv.address, idx, auth_token="s3cret"
        ) as sub:
            pub.publish([1], [2, 3])
            pub.flush()
            assert sub.poll(through_sequence=1, timeout=10) == 1
        with HistorySubscriber(srv.address, HistoryIndex()) as bad:
            deadline = time.monotonic() + 10
            while bad.error is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert bad.error is not None and bad.error.code == grpc.StatusCode.UNAUTHENTICATED
        # The standard health service answers without a token.
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        ch = grpc.insecure_channel(srv.address)
        stub = health_pb2_grpc.HealthStub(ch)
        r = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        ch.close()


def test_cli_refuses_bad_flags(tmp_path):
    """``histospec-sgl draft-server`` hands its arguments to the server's own parser (the binary's):
    bad flags exit 2 with the reason, a server that cannot start exits 1."""
    empty = tmp_path / "empty"
    empty.write_text("")
    run = lambda *a: subprocess.run([sys.executable, "-m", "histospec_sgl.cli", "draft-server", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    r = run("--auth-token-file", str(empty))
    assert r.returncode == 2 and "is empty" in r.stderr
    r = run("--tls-cert", "x.pem")
    assert r.returncode == 2 and "--tls-key" in r.stderr
    r = run("--max-records", "many")
    assert r.returncode == 2 and "--max-records" in r.stderr
    r = run("--help")
    assert r.returncode == 0 and "histospec-sgl draft-server" in r.stdout and "--snapshot-every-bytes" in r.stdout
    r = run("--listen", "256.1.1.1:1", "--insecure")
    assert r.returncode == 1 and "cannot listen" in r.stderr
    # Beyond loopback without a token: refused unless the user says so.
    r = run("--listen", "0.0.0.0:0")
    assert r.returncode == 2 and "--auth-token-file" in r.stderr and "--insecure" in r.stderr
    bad = tmp_path / "data"
    bad.mkdir()
    (bad / "snapshot.bin").write_bytes(b"not a snapshot at all, clearly")
    r = run("--listen", "127.0.0.1:0", "--data-dir", str(bad))
    assert r.returncode == 1 and "snapshot.bin" in r.stderr and "bad magic" in r.stderr


def test_protocol_works_with_stubs_generated_by_grpc_tools(server, tmp_path):
    """The .proto is the contract: code generated from it by the standard toolchain interoperates."""
    from grpc_tools import protoc

    out = tmp_path / "gen"
    out.mkdir()
    proto_root = ROOT / "proto"
    rc = protoc.main(["protoc", f"-I{proto_root}", f"--python_out={out}", f"--grpc_python_out={out}",
                      str(proto_root / "histospec/v1/history.proto")])
    assert rc == 0
    sys.path.insert(0, str(out))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # protobuf's gencode/runtime version notice
            from histospec.v1 import history_pb2, history_pb2_grpc
        ch = grpc.insecure_channel(server.address)
        stub = history_pb2_grpc.HistoryServiceStub(ch)
        rec = history_pb2.Record(record_id=b"gen-1", prompt_ids=[5, 6], response_ids=[7, 8, 9], version=2)
        reply = stub.Publish(history_pb2.PublishRequest(records=[rec]), timeout=10)
        assert list(reply.sequences) == [1] and reply.accepted == 1
        chunks = list(stub.Snapshot(history_pb2.SnapshotRequest(), timeout=10))
        got = chunks[-1].records[0]
        assert chunks[-1].last and got.group_key == prompt_key([5, 6]) and list(got.response_ids) == [7, 8, 9]
        assert stub.Stats(history_pb2.StatsRequest(), timeout=10).records == 1
        ch.close()
    finally:
        sys.path.remove(str(out))
        for m in [m for m in sys.modules if m.startswith("histospec.v1") or m == "histospec"]:
            del sys.modules[m]


def _self_signed(tmp_path: Path) -> tuple[Path, Path, bytes]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(pem)
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return tmp_path / "cert.pem", tmp_path / "key.pem", pem


def test_specrl_store_over_tls_with_a_token(tmp_path, monkeypatch):
    """SPEC-RL's store as a trainer adapter opens it, against a TLS server that requires a token: the
    token and the CA come from the same settings as an engine's, a record goes out and comes back as
    the slot's previous response."""
    from histospec_sgl.specrl.store import PreviousStore

    cert, key, _ = _self_signed(tmp_path)
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    with DraftServerProcess(auth_token_file=tok, extra=["--tls-cert", str(cert), "--tls-key", str(key)],
                            log=tmp_path / "s.log") as srv:
        monkeypatch.setenv("HISTOSPEC_DRAFT_SERVER_TOKEN_FILE", str(tok))
        monkeypatch.setenv("HISTOSPEC_DRAFT_SERVER_CA", str(cert))
        store = PreviousStore()
        try:
            assert store.record(srv.address, [1, 2, 3], [7, 8, 9], [-0.1, -0.2, -0.3], "stop", group=42, slot=1,
                                version=3)
            assert store.settle(srv.address, 30)
            prev = store.get(srv.address, 42, 1)
            assert prev is not None and list(prev.response_ids) == [7, 8, 9] and prev.version == 3
        finally:
            store.close()


def test_tls(tmp_path):
    cert, key, pem = _self_signed(tmp_path)
    with DraftServerProcess(extra=["--tls-cert", str(cert), "--tls-key", str(key)], log=tmp_path / "s.log") as srv:
        idx = HistoryIndex()
        with HistoryPublisher(srv.address, tls_root_certificates=pem) as pub, HistorySubscriber(
            srv.address, idx, tls_root_certificates=pem
        ) as sub:
            pub.publish([1, 2], [3, 4, 5])
            assert pub.flush()["sequences"] == [1]
            assert sub.poll(through_sequence=1, timeout=10) == 1
        # A plaintext client cannot talk to it.
        with pytest.raises(DraftServerError):
            HistoryPublisher(srv.address).stats(timeout=3)


@pytest.mark.parametrize("mode", ["on_demand", "mirror"])
def test_engine_sync_never_waits_on_a_dead_server_and_catches_up(tmp_path, mode):
    """An engine's step boundary must not stall while its draft server is down: finished responses
    queue in memory and the records it has go on being applied. Once the server is back on its port,
    the queued responses are published and records published by others meanwhile reach the index
    (on_demand: the engine asked for every group's history before the records were published)."""
    from histospec_sgl.sync.engine import EngineSync

    data_dir = tmp_path / "data"
    srv = DraftServerProcess(data_dir=data_dir, log=tmp_path / "server.log")
    port = srv.port
    idx = HistoryIndex()
    sync = EngineSync(srv.address, idx, mode=mode)
    recs = _records(40, seed=11)
    sync.want({prompt_key(p) for p, _ in recs})
    try:
        for p, r in recs[:10]:
            sync.finished(p, r, version=0)
        assert sync.drain(30)
        srv.kill()
        t0 = time.monotonic()
        for step in range(20):
            sync.finished(*recs[10 + step], version=1)
            sync.step_boundary()
        assert time.monotonic() - t0 < 2.0, "a step boundary waited on the dead server"
        assert sync.unpublished == 20
        wait_port_free(port)
        srv = DraftServerProcess(f"127.0.0.1:{port}", data_dir=data_dir, log=tmp_path / "server2.log")
        with HistoryPublisher(srv.address) as other:
            for p, r in recs[30:]:
                other.publish(p, r, version=1)
        assert sync.drain(30) and sync.unpublished == 0
        deadline = time.monotonic() + 30
        while idx.stats()["responses"] < 40 and time.monotonic() < deadline:
            sync.step_boundary()
            time.sleep(0.05)
        assert idx.stats()["responses"] == 40
        assert sync.publisher is not None and sync.publisher.stats()["records"] == 40
    finally:
        sync.close(timeout=1)
        srv.kill()


def test_a_trainers_record_never_waits_on_a_dead_server_and_nothing_acknowledged_is_lost(tmp_path, caplog):
    """A trainer adapter records finished samples through :class:`PreviousStore` (slime's ``record``,
    verl's agent loop, the OpenRLHF executor). With the draft server killed mid-rollout, recording
    returns at once and never raises; past the bounded queue, records are dropped and counted with
    one warning; ``settle`` gives up after its timeout. Once the server is back on its port (same
    data dir), the queue goes out, and the store's mirror holds what was acknowledged before the
    kill and what waited."""
    from histospec_sgl.specrl.store import PreviousStore

    data_dir = tmp_path / "data"
    srv = DraftServerProcess(data_dir=data_dir, log=tmp_path / "server.log")
    port = srv.port
    store = PreviousStore()
    pub = store.publisher(srv.address)
    pub.max_queue = 12
    recs = _records(40, seed=5)

    def record(i: int) -> bool:
        p, r = (list(map(int, x)) for x in recs[i])
        return store.record(srv.address, p, r, [-0.5] * len(r), "stop", group=i, slot=0, version=1)

    try:
        for i in range(10):
            assert record(i)
        assert store.settle(srv.address, 30)
        assert all(store.get(srv.address, i, 0) is not None for i in range(10))
        srv.kill()
        t0 = time.monotonic()
        for i in range(10, 30):
            assert record(i)  # never raises, never waits
        assert time.monotonic() - t0 < 1.0, "recording waited on the dead server"
        assert pub.dropped == 20 - 12 and pub.unpublished == 12
        assert sum("further records are dropped" in m for m in caplog.messages) == 1
        t0 = time.monotonic()
        assert not store.settle(srv.address, 1.0)
        assert time.monotonic() - t0 < 3.0
        wait_port_free(port)
        srv = DraftServerProcess(f"127.0.0.1:{port}", data_dir=data_dir, log=tmp_path / "server2.log")
        assert store.settle(srv.address, 30) and pub.unpublished == 0
        kept = [i for i in range(30) if store.get(srv.address, i, 0) is not None]
        assert kept == list(range(10 + 12)), kept  # the 10 acknowledged, the 12 queued; 8 dropped
        assert pub.publisher.stats()["records"] == 22
    finally:
        store.close(timeout=1)
        srv.kill()


def test_subscriber_close_returns_at_once_and_stops_its_thread(tmp_path):
    """close() cancels whichever stream is open, also one being opened as it is called, and wakes a
    reconnect back-off: it returns in well under a second with the thread stopped, every time."""
    with DraftServerProcess(log=tmp_path / "server.log") as srv:
        pub = HistoryPublisher(srv.address)
        for p, r in _records(2000, seed=3):
            pub.publish(p, r)
        pub.flush()
        pub.close()
        for i in range(12):
            background = i % 4 != 3
            sub = HistorySubscriber(srv.address, HistoryIndex(), background=background).start()
            if i % 4 == 1:  # idle on its Subscribe stream
                deadline = time.monotonic() + 30
                while sub.applied_sequence < 2000 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert sub.applied_sequence == 2000
            elif i % 4 == 2:  # anywhere between opening its streams
                time.sleep(0.002 * i)
            elif i % 4 == 3:  # polled through the snapshot's end, then closed
                sub.poll(through_sequence=2000, timeout=30)
                assert sub.applied_sequence == 2000
            t0 = time.monotonic()
            sub.close()
            took = time.monotonic() - t0
            assert took < 1.0 and not sub._thread.is_alive(), (i, took)
        address = srv.address
    # The server is gone: the subscriber is backing off between reconnects.
    sub = HistorySubscriber(address, HistoryIndex(), background=True, backoff=0.5, max_backoff=5.0).start()
    time.sleep(1.5)
    t0 = time.monotonic()
    sub.close()
    assert time.monotonic() - t0 < 1.0 and not sub._thread.is_alive()


def _until(poll, pred, timeout=20.0, why="the engine did not get there in time"):
    """Calls ``poll`` (a follower's poll, an engine's step boundary) until ``pred()`` holds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, why
        poll()
        time.sleep(0.02)


def test_follower_fetches_a_groups_history_follows_only_its_groups_and_resumes_after_a_kill(tmp_path):
    """``on_demand``: an engine asks for a group when its first request arrives and gets the group's
    retained history, then its new records; records of groups it never asked for are not sent (the
    server filters them, so the engine's received bytes are its groups' share). Killed (SIGKILL) and
    restarted from its data dir, the server is followed again from where the stream stopped: nothing
    is lost and nothing applied twice. A group the index has evicted is dropped from the stream."""
    from histospec_sgl.sync.follow import GroupFollower

    data_dir = tmp_path / "data"
    srv = DraftServerProcess(data_dir=data_dir, log=tmp_path / "server.log")
    port = srv.port
    recs = _records(60, seed=3, prompts=6)  # 10 responses per prompt
    keys = [prompt_key(p) for p, _ in recs]
    mine = keys[0], keys[1]
    idx = HistoryIndex()
    follower = GroupFollower(srv.address, idx, idle_seconds=0.0, sweep_every=1).start()
    try:
        with HistoryPublisher(srv.address) as pub:
            for p, r in recs[:30]:
                pub.publish(p, r, version=0)
            pub.flush()
            assert follower.want([mine[0]]) == 1 and follower.want([mine[0]]) == 0
            _until(follower.poll, lambda: follower.ready(mine[0]) and idx.group_len(mine[0]) == 5)
            assert idx.group_keys() == [mine[0]] and len(follower.fetch_seconds) == 1
            follower.want([mine[1]])
            for p, r in recs[30:]:
                pub.publish(p, r, version=1)
            pub.flush()
            _until(follower.poll, lambda: idx.group_len(mine[0]) == 10 and idx.group_len(mine[1]) == 10)
            st = pub.stats()
            assert (st["followers"], st["followed_groups"]) == (1, 2)
            assert sorted(idx.group_keys()) == sorted(mine)
        # Only the two groups' records came: about 2/6 of the history's bytes.
        whole = sum(len(p) + len(r) for p, r in recs) * 4
        assert follower.received_bytes < 0.5 * whole, (follower.received_bytes, whole)
        srv.kill()
        wait_port_free(port)
        srv = DraftServerProcess(f"127.0.0.1:{port}", data_dir=data_dir, log=tmp_path / "server2.log")
        with HistoryPublisher(srv.address) as pub:
            for i, (p, r) in enumerate(recs[:12]):
                pub.publish(p, r, version=2, record_id=f"after-restart-{i}")
            pub.flush()
        _until(follower.poll, lambda: idx.group_len(mine[0]) == 12 and idx.group_len(mine[1]) == 12)
        assert follower.reconnects >= 1
        time.sleep(0.5)
        follower.poll()
        assert [idx.group_len(g) for g in mine] == [12, 12], "a record was applied twice"
        # Evicted from the index and idle: the group leaves the stream.
        idx.remove_group(mine[0])
        follower.poll()
        assert follower.held == 1 and follower.dropped_groups == 1
        with HistoryPublisher(srv.address) as pub:
            assert pub.stats()["followed_groups"] in (1, 2)  # the drop is on its way
    finally:
        follower.close()
        srv.kill()


def test_follower_fetches_again_a_held_group_its_index_evicted(server):
    """The index evicts idle groups under its memory budget while the stream still carries them; when
    such a group's next request arrives, its whole history is fetched again (once, not doubled)."""
    from histospec_sgl.sync.follow import GroupFollower

    recs = _records(20, seed=8, prompts=2)
    g = prompt_key(recs[0][0])
    with HistoryPublisher(server.address) as pub:
        for p, r in recs:
            pub.publish(p, r, version=0)
        pub.flush()
    idx = HistoryIndex()
    follower = GroupFollower(server.address, idx, idle_seconds=3600).start()
    try:
        follower.want([g])
        _until(follower.poll, lambda: idx.group_len(g) == 10)
        follower.want([g])
        follower.poll()
        assert idx.group_len(g) == 10 and len(follower.fetch_seconds) == 1
        idx.remove_group(g)  # what the budget's LRU eviction does
        assert follower.want([g]) == 1
        _until(follower.poll, lambda: idx.group_len(g) == 10)
        time.sleep(0.3)
        follower.poll()
        assert idx.group_len(g) == 10 and len(follower.fetch_seconds) == 2
    finally:
        follower.close()


def test_announced_groups_are_fetched_by_the_engine_that_decoded_them_before(server):
    """A trainer announces its next step's groups: every follower hears it, and each asks for the
    announced groups it has decoded before (routing by group brings them back to it), so their
    history is in its index before their first request; groups it never decoded are left alone."""
    from histospec_sgl.sync.follow import GroupFollower

    recs = _records(30, seed=12, prompts=3)
    g1, g2, g3 = (prompt_key(recs[i][0]) for i in range(3))
    with HistoryPublisher(server.address) as pub:
        for p, r in recs:
            pub.publish(p, r, version=0)
        pub.flush()
    idx_a, idx_b = HistoryIndex(), HistoryIndex()
    a = GroupFollower(server.address, idx_a).start()
    b = GroupFollower(server.address, idx_b).start()
    try:
        a.want([g1])
        b.want([g2])
        _until(lambda: (a.poll(), b.poll()), lambda: idx_a.group_len(g1) == 10 and idx_b.group_len(g2) == 10)
        idx_a.remove_group(g1)  # the budget evicted it since
        with HistoryPublisher(server.address) as trainer:
            assert trainer.announce([g1, g2, g3]) == 2  # both streams told
        _until(lambda: (a.poll(), b.poll()), lambda: idx_a.group_len(g1) == 10)
        assert a.ready(g1) and a.announced == 1 and b.announced == 1
        time.sleep(0.3)
        a.poll(), b.poll()
        assert idx_a.group_len(g2) == idx_a.group_len(g3) == 0, "a group it never decoded was fetched"
        assert idx_b.group_len(g2) == 10 and idx_b.group_len(g1) == idx_b.group_len(g3) == 0
        with pytest.raises(grpc.RpcError) as e:
            _raw(server.address, "Announce", _core.encode_announce(list(range(70_000))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 65536" in e.value.details()
    finally:
        a.close()
        b.close()


def test_a_fetch_from_a_dead_server_is_given_up_at_its_bound_and_its_history_arrives_later(tmp_path):
    """A group asked of a killed server: the fetch is given up at its bound (the request drafts from
    its siblings meanwhile); the group stays held, and when the server is back from its data dir the
    history arrives and is applied, its delay counted apart."""
    from histospec_sgl.sync.follow import GroupFollower

    data_dir = tmp_path / "data"
    srv = DraftServerProcess(data_dir=data_dir, log=tmp_path / "server.log")
    port = srv.port
    recs = _records(20, seed=11, prompts=2)
    g = prompt_key(recs[0][0])
    idx = HistoryIndex()
    follower = GroupFollower(srv.address, idx, fetch_timeout=0.3).start()
    try:
        with HistoryPublisher(srv.address) as pub:
            for p, r in recs:
                pub.publish(p, r, version=0)
            pub.flush()
        time.sleep(0.3)  # the stream is open
        srv.kill()
        follower.want([g])
        t0 = time.monotonic()
        _until(follower.poll, lambda: follower.fetches_given_up == 1, timeout=5)
        assert time.monotonic() - t0 < 1.0 and idx.group_len(g) == 0
        assert len(follower.fetch_seconds) == 1 and 0.3 <= follower.fetch_seconds[0] < 1.0
        time.sleep(1.0)  # the server stays down past the bound
        wait_port_free(port)
        srv = DraftServerProcess(f"127.0.0.1:{port}", data_dir=data_dir, log=tmp_path / "server2.log")
        _until(follower.poll, lambda: idx.group_len(g) == 10)
        assert len(follower.late_seconds) == 1 and follower.late_seconds[0] >= 1.0
        assert len(follower.fetch_seconds) == 1, "a given-up fetch is counted once"
    finally:
        follower.close()
        srv.kill()


def test_sharded_server_routes_by_group_and_a_killed_shard_loses_nothing_acknowledged(tmp_path):
    """A draft server in two shards (a comma list of addresses): each record lives on the shard of its
    group key, an engine follows both and gets every group it asks for from its shard. One shard killed
    (SIGKILL) holds up only its own records: the other shard's go on being published and applied;
    restarted from its data dir, it has every record it acknowledged, and the queued ones arrive."""
    from histospec_sgl.sync.client import shard_of
    from histospec_sgl.sync.engine import EngineSync

    dirs = [tmp_path / f"shard-{i}" for i in range(2)]
    # Each shard holds 2 KiB of records in memory (a size as the docs write it) and reads the rest back from its data dir.
    held = ["--memory-bytes", "2k"]
    shards = [DraftServerProcess(data_dir=d, log=tmp_path / f"s{i}.log", extra=held) for i, d in enumerate(dirs)]
    address = ",".join(s.address for s in shards)
    recs = _records(80, seed=21, prompts=8)
    keys = sorted({prompt_key(p) for p, _ in recs})
    assert {shard_of(k, 2) for k in keys} == {0, 1}
    idx = HistoryIndex()
    sync = EngineSync(address, idx, mode="on_demand")
    try:
        with HistoryPublisher(address) as pub:
            for p, r in recs[:40]:
                pub.publish(p, r, version=0)
            pub.flush()
            per_shard = [HistoryPublisher(s.address).stats() for s in shards]
            assert [st["records"] for st in per_shard] == [
                sum(shard_of(prompt_key(p), 2) == i for p, _ in recs[:40]) for i in range(2)]
            st = pub.stats()
            assert st["records"] == 40 and st["groups"] == 8 and len(st["shards"]) == 2
        sync.want(keys)
        _until(sync.step_boundary, lambda: idx.stats()["responses"] >= 40)
        port = shards[1].port
        shards[1].kill()
        for p, r in recs[40:]:
            sync.finished(p, r, version=1)
        on_live = sum(shard_of(prompt_key(p), 2) == 0 for p, _ in recs[40:])
        _until(sync.step_boundary, lambda: idx.stats()["responses"] >= 40 + on_live,
               why="the live shard's records were held up by the dead one")
        # The live shard's acknowledgements are counted once the same flush has tried the dead shard,
        # which can be after the live shard's records reach the engine.
        _until(sync.step_boundary, lambda: sync.unpublished == 40 - on_live,
               why="the live shard's records stayed counted as unpublished")
        wait_port_free(port)
        shards[1] = DraftServerProcess(f"127.0.0.1:{port}", data_dir=dirs[1], log=tmp_path / "s1b.log", extra=held)
        assert sync.drain(30)
        _until(sync.step_boundary, lambda: idx.stats()["responses"] >= 80, timeout=30)
        assert idx.stats()["responses"] == 80
        with HistoryPublisher(address) as pub:
            st = pub.stats()
            assert st["records"] == 80 and all(s["resident_bytes"] <= 2048 + 200 for s in st["shards"])
        # A fresh engine fetches every group whole, most records read back from the shards' disks.
        idx2 = HistoryIndex()
        with EngineSync(address, idx2) as fresh:
            fresh.want(keys)
            _until(fresh.step_boundary, lambda: idx2.stats()["responses"] >= 80)
        assert checksum(idx2) != "" and sorted(idx2.group_keys()) == keys
        assert all(idx2.group_len(k) == idx.group_len(k) for k in keys)
    finally:
        sync.close(timeout=1)
        for s in shards:
            s.kill()


def test_one_backoff_doubles_to_its_largest_pause_with_jitter_and_resets():
    """Every client that retries waits by the same rule: the pause doubles from ``first`` to
    ``largest``, each wait drawn within half to one and a half times it, at most ``cap``."""
    from histospec_sgl.sync.client import Backoff

    b = Backoff(0.1, 0.8)
    waits = [b.next() for _ in range(6)]
    for w, pause in zip(waits, (0.1, 0.2, 0.4, 0.8, 0.8, 0.8)):
        assert 0.5 * pause <= w <= 1.5 * pause, waits
    assert b.next(cap=0.2) <= 0.3  # a waiting fetch caps the pause
    b.reset()
    assert b.next() <= 0.15


def test_an_announcer_never_fails_its_trainer(server, tmp_path, caplog):
    """Adapters announce through ``Announcer``: the groups reach the server's followers while it is
    up; with the server gone the call logs and returns False instead of raising."""
    from histospec_sgl.sync.client import Announcer

    a = Announcer(server.address)
    assert a.announce([]) and a.announced == 0
    assert a.announce([1, 2, 3]) and a.announced == 3
    dead = DraftServerProcess(log=tmp_path / "dead.log")
    address = dead.address
    dead.kill()
    b = Announcer(address)
    assert b.announce([4], timeout=0.5) is False and b.announced == 0
    assert "announcing 1 groups" in caplog.text
