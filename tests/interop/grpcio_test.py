"""The agent's own HTTP/2 gRPC server (agent/src/envoy/h2/) called from grpcio: gRPC C-core's chttp2
stack, an HTTP/2 implementation independent of the hyper/h2 one the Rust tests' tonic client uses.

Most tests share one agent (embedded store, the rules below) with its gRPC listener on a port it
picks itself (`--grpc 127.0.0.1:0`, read back from its log) and one grpcio channel to it, each test
on keys of its own; the SIGTERM tests start agents of their own. Messages are raw protobuf bytes, encoded and decoded by hand below (no
codegen, no protobuf package): RateLimitRequest and RateLimitResponse of envoy.service.ratelimit.v3.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import grpc
import pytest

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
# The server's cap on a request message (agent/src/envoy/h2/grpc.rs, MAX_MESSAGE).
MAX_MESSAGE = 16 * 1024

# RateLimitResponse.Code and RateLimitResponse.RateLimit.Unit.
UNKNOWN, OK, OVER_LIMIT = 0, 1, 2
MINUTE = 2

RULES = {
    "rules": [
        {
            "id": "edge-ip",
            "dimension": "descriptor",
            "limit": 3,
            "windowSeconds": 60,
            "envoy": {"domain": "edge", "descriptors": [{"key": "remote_address"}]},
        },
        {
            "id": "edge-tenant",
            "dimension": "descriptor",
            "limit": 1000,
            "windowSeconds": 60,
            "envoy": {"domain": "edge", "descriptors": [{"key": "tenant"}]},
        },
        {
            "id": "edge-blob",
            "dimension": "descriptor",
            "limit": 1000,
            "windowSeconds": 60,
            "envoy": {"domain": "edge", "descriptors": [{"key": "blob"}]},
        },
    ]
}


# --- protobuf, by hand -------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    assert n >= 0
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _varint_field(num: int, value: int) -> bytes:
    return _varint(num << 3) + _varint(value)


Descriptor = Sequence[Tuple[str, str]]


def encode_request(domain: str, descriptors: Sequence[Descriptor], hits_addend: int = 0) -> bytes:
    """RateLimitRequest{1 domain, 2 repeated RateLimitDescriptor{1 repeated Entry{1 key, 2 value}},
    3 hits_addend}; proto3: empty strings and zeros are left out."""
    out = bytearray()
    if domain:
        out += _len_field(1, domain.encode())
    for d in descriptors:
        entries = b"".join(_len_field(1, _len_field(1, k.encode()) + _len_field(2, v.encode())) for k, v in d)
        out += _len_field(2, entries)
    if hits_addend:
        out += _varint_field(3, hits_addend)
    return bytes(out)


def _read_varint(buf: bytes, pos: int) -> Tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, pos
        if shift > 63:
            raise ValueError("varint too long")


def read_fields(buf: bytes) -> Dict[int, list]:
    """Every field of a message: number -> values in order (ints for varints and fixed, bytes for
    length-delimited). Fails on anything malformed."""
    fields: Dict[int, list] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            if pos + n > len(buf):
                raise ValueError("truncated length-delimited field")
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise ValueError(f"wire type {wire}")
        if num == 0:
            raise ValueError("field number 0")
        fields.setdefault(num, []).append(value)
    if pos != len(buf):
        raise ValueError("a field runs past the message")
    return fields


def _one(fields: Dict[int, list], num: int, default=0):
    values = fields.get(num)
    return values[-1] if values else default


def decode_response(buf: bytes) -> dict:
    """RateLimitResponse{1 overall_code, 2 repeated DescriptorStatus{1 code, 2 current_limit
    RateLimit{1 requests_per_unit, 2 unit, 3 name}, 3 limit_remaining, 4 duration_until_reset
    Duration{1 seconds, 2 nanos}}, 3 repeated HeaderValue{1 key, 2 value}}."""
    f = read_fields(buf)
    statuses = []
    for raw in f.get(2, []):
        s = read_fields(raw)
        limit = None
        if 2 in s:
            lf = read_fields(_one(s, 2))
            limit = {"requests_per_unit": _one(lf, 1), "unit": _one(lf, 2), "name": _one(lf, 3, b"").decode()}
        reset = None
        if 4 in s:
            df = read_fields(_one(s, 4))
            reset = _one(df, 1) + _one(df, 2) / 1e9
        statuses.append({"code": _one(s, 1), "limit": limit, "remaining": _one(s, 3), "reset": reset})
    headers = []
    for raw in f.get(3, []):
        h = read_fields(raw)
        headers.append((_one(h, 1, b"").decode(), _one(h, 2, b"").decode()))
    return {"overall": _one(f, 1), "statuses": statuses, "headers": headers}


def header(r: dict, name: str) -> Optional[str]:
    found = [v for k, v in r["headers"] if k.lower() == name]
    assert len(found) <= 1, f"{name} twice: {r['headers']}"
    return found[0] if found else None


def test_the_hand_encoding_reads_back():
    # The reader against the encoder, and a response built by hand (so a failure below is the
    # server's, not this file's protobuf).
    req = encode_request("edge", [[("remote_address", "1.2.3.4")], [("a", "b"), ("c", "")]], hits_addend=300)
    f = read_fields(req)
    assert f[1] == [b"edge"] and f[3] == [300] and len(f[2]) == 2
    entries = read_fields(f[2][1])[1]
    assert [read_fields(e).get(2, [b""])[0] for e in entries] == [b"b", b""]
    limit = _len_field(2, _varint_field(1, 3) + _varint_field(2, MINUTE) + _len_field(3, b"edge-ip"))
    status = _varint_field(1, OK) + limit + _varint_field(3, 2) + _len_field(4, _varint_field(1, 59) + _varint_field(2, 5 * 10**8))
    resp = _varint_field(1, OK) + _len_field(2, status) + _len_field(3, _len_field(1, b"x-a") + _len_field(2, b"1"))
    assert decode_response(resp) == {
        "overall": OK,
        "statuses": [{"code": OK, "limit": {"requests_per_unit": 3, "unit": MINUTE, "name": "edge-ip"}, "remaining": 2, "reset": 59.5}],
        "headers": [("x-a", "1")],
    }


# --- the agent --------------------------------------------------------------------------------


def floodgate_bin() -> str:
    path = os.environ.get("FLOODGATE_BIN")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"FLOODGATE_BIN must name the floodgate binary (got {path!r})", pytrace=False)
    return path


def poll(what: str, fn, timeout: float = 10.0):
    """Calls ``fn`` until it returns something other than None/False; fails after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v is not None and v is not False:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


class Agent:
    """`floodgate agent` on the embedded store, its gRPC listener on a port of its choosing."""

    def __init__(self, rules: dict, grpc_socket: bool = False):
        self.dir = tempfile.mkdtemp(prefix="fg-interop-")
        # Also on a Unix socket (`--grpc-socket`, for an Envoy on the same host), when asked.
        self.grpc_socket = os.path.join(self.dir, "grpc.sock") if grpc_socket else None
        self.log_path = os.path.join(self.dir, "agent.log")
        rules_path = os.path.join(self.dir, "rules.json")
        with open(rules_path, "w") as f:
            json.dump(rules, f)
        cmd = [
            floodgate_bin(), "agent",
            "--socket", os.path.join(self.dir, "agent.sock"),
            "--rules", rules_path,
            "--grpc", "127.0.0.1:0",
            "--admin", "off",
        ]  # fmt: skip
        if self.grpc_socket:
            cmd += ["--grpc-socket", self.grpc_socket]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLOODGATE_")}
        env.update(STATE_DIRECTORY=self.dir, NO_COLOR="1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            self.addr = poll("the agent to log its gRPC address", self._logged_addr)
        except BaseException:
            self.close()
            raise

    def log(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()
        except OSError:
            return ""

    def _logged_addr(self) -> Optional[str]:
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}; log:\n{self.log()}")
        log = self.log()
        if "rules loaded" not in log:
            return None
        if self.grpc_socket and "RateLimitService (gRPC) on a Unix socket" not in log:
            return None
        for line in log.splitlines():
            if "RateLimitService (gRPC) listening" in line and "addr=" in line:
                return line.split("addr=", 1)[1].split()[0]
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def open_channel(addr: str) -> grpc.Channel:
    channel = grpc.insecure_channel(addr)
    # The HTTP/2 handshake (both prefaces, SETTINGS both ways) done before any call.
    grpc.channel_ready_future(channel).result(timeout=10)
    return channel


@pytest.fixture(scope="module")
def agent() -> Iterator[Agent]:
    a = Agent(RULES, grpc_socket=True)
    yield a
    a.close()


@pytest.fixture(scope="module")
def channel(agent: Agent) -> Iterator[grpc.Channel]:
    ch = open_channel(agent.addr)
    yield ch
    ch.close()


def method(channel: grpc.Channel, path: str = METHOD):
    # Raw bytes both ways: no serializer, no deserializer.
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)


def check(channel: grpc.Channel, domain: str, descriptors: Sequence[Descriptor], **kw) -> dict:
    return decode_response(method(channel)(encode_request(domain, descriptors), timeout=10, **kw))


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value


# --- the tests --------------------------------------------------------------------------------


def test_three_allowed_then_over_limit_with_statuses_and_headers(channel):
    ip = [[("remote_address", "203.0.113.5")]]
    for expected in (2, 1, 0):
        r = check(channel, "edge", ip)
        assert r["overall"] == OK, r
        (s,) = r["statuses"]
        assert s["code"] == OK
        assert s["limit"] == {"requests_per_unit": 3, "unit": MINUTE, "name": "edge-ip"}, s
        assert s["remaining"] == expected, r
        assert s["reset"] is not None and 0 < s["reset"] <= 120, s
        assert header(r, "x-ratelimit-limit") == "3", r
        assert header(r, "x-ratelimit-remaining") == str(expected), r
        # Epoch seconds, rounded up (docs/gateway.md): when the key is full again.
        reset_at = header(r, "x-ratelimit-reset")
        assert reset_at is not None and time.time() <= int(reset_at) <= time.time() + 121, r
        assert header(r, "retry-after") is None, r
    r = check(channel, "edge", ip)
    assert r["overall"] == OVER_LIMIT, r
    assert r["statuses"][0]["code"] == OVER_LIMIT
    assert r["statuses"][0]["remaining"] == 0
    retry = header(r, "retry-after")
    assert retry is not None, f"Retry-After on an over-limit answer: {r}"
    assert 1 <= int(retry) <= 120, retry
    # Another address counts on its own.
    other = check(channel, "edge", [[("remote_address", "203.0.113.6")]])
    assert other["overall"] == OK and other["statuses"][0]["remaining"] == 2, other


def test_64_concurrent_calls_on_one_channel_are_all_answered_and_counted_exactly(channel):
    call = method(channel)
    req = encode_request("edge", [[("tenant", "concurrent")]])
    futures = [call.future(req, timeout=20) for _ in range(64)]
    answers = [decode_response(f.result()) for f in futures]
    assert all(a["overall"] == OK for a in answers), [a for a in answers if a["overall"] != OK][:3]
    # Each call took exactly one unit: the remainders are 999..936, each once, in some order.
    assert sorted(a["statuses"][0]["remaining"] for a in answers) == list(range(936, 1000))
    assert check(channel, "edge", [[("tenant", "concurrent")]])["statuses"][0]["remaining"] == 935


def test_unknown_method_is_unimplemented_and_bad_requests_are_refused(channel):
    req = encode_request("edge", [[("remote_address", "198.51.100.1")]])
    for path in ("/envoy.service.ratelimit.v3.RateLimitService/Nope", "/grpc.health.v1.Health/Watch"):
        e = rpc_error(lambda: method(channel, path)(req, timeout=10))
        assert e.code() == grpc.StatusCode.UNIMPLEMENTED, (path, e.code(), e.details())
    e = rpc_error(lambda: method(channel)(encode_request("", [[("remote_address", "198.51.100.1")]]), timeout=10))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    assert "domain" in (e.details() or ""), e.details()
    # Bytes that are not a RateLimitRequest.
    e = rpc_error(lambda: method(channel)(b"\x0a\xff\xff\xff\xff\x0f", timeout=10))
    assert e.code() == grpc.StatusCode.INTERNAL, (e.code(), e.details())
    # None of these refusals harmed the connection: the next call is answered.
    assert check(channel, "edge", [[("remote_address", "198.51.100.1")]])["overall"] == OK


def test_grpc_health_check_answers_serving(channel):
    # grpc.health.v1.HealthCheckRequest{service} and HealthCheckResponse{status}: SERVING is 1.
    check_health = method(channel, "/grpc.health.v1.Health/Check")
    for service in (b"", b"envoy.service.ratelimit.v3.RateLimitService"):
        req = b"\x0a" + bytes([len(service)]) + service if service else b""
        assert check_health(req, timeout=10) == b"\x08\x01", service
    e = rpc_error(lambda: check_health(b"\x0a\x03abc", timeout=10))
    assert e.code() == grpc.StatusCode.NOT_FOUND, (e.code(), e.details())


def test_metadata_is_accepted(channel):
    metadata = (
        ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        ("x-request-id", "interop-1"),
        ("x-blob-bin", bytes(range(256))),  # base64 on the wire
        ("x-long", "v" * 4000),
    )
    # Twice: the second time grpcio's HPACK encoder refers to its dynamic table for these.
    for expected in (2, 1):
        r = check(channel, "edge", [[("remote_address", "198.51.100.7")]], metadata=metadata)
        assert r["overall"] == OK and r["statuses"][0]["remaining"] == expected, r


def test_hpack_dynamic_table_churn(channel):
    # 300 calls, each with header values of its own: grpcio's HPACK encoder keeps inserting into
    # (and evicting from) its 4 KiB dynamic table, which the server's decoder must mirror exactly
    # (a slip is a COMPRESSION_ERROR GOAWAY, or a header read under the wrong name).
    call = method(channel)
    for i in range(300):
        md = (("x-request-id", f"churn-{i:04d}-".ljust(100, "r")), ("traceparent", f"00-{i:032x}-{i:016x}-01"))
        r = decode_response(call(encode_request("edge", [[("tenant", f"churn-{i % 3}")]]), timeout=10, metadata=md))
        assert r["overall"] == OK and r["statuses"][0]["remaining"] == 999 - i // 3, (i, r)


def blobs(count: int, size: int, tag: str) -> List[Descriptor]:
    return [[("blob", f"{tag}-{i}-".ljust(size, "x"))] for i in range(count)]


def test_a_10_kib_request_is_answered(channel):
    descriptors = blobs(8, 1280, "ten")
    req = encode_request("edge", descriptors)
    assert 10_000 < len(req) <= MAX_MESSAGE
    r = decode_response(method(channel)(req, timeout=10))
    assert r["overall"] == OK, r
    assert [s["remaining"] for s in r["statuses"]] == [999] * 8, r


def request_of_size(size: int, tag: str) -> bytes:
    """A RateLimitRequest of exactly ``size`` bytes: 12 blob descriptors, the last one's value padded."""
    descriptors = blobs(12, 1000, tag)
    base = len(encode_request("edge", descriptors))
    pad = size - base
    for _ in range(3):  # the value's length varint may grow by a byte
        last = [("blob", descriptors[-1][0][1] + "y" * pad)]
        req = encode_request("edge", descriptors[:-1] + [last])
        if len(req) == size:
            return req
        pad -= len(req) - size
    raise AssertionError(f"no request of {size} bytes")


def test_the_largest_request_is_answered_and_one_byte_more_is_resource_exhausted(channel):
    # 16,384 bytes and the 5-byte gRPC prefix: more than one 16 KiB DATA frame, so the server
    # gathers the body from two.
    r = decode_response(method(channel)(request_of_size(MAX_MESSAGE, "max"), timeout=10))
    assert r["overall"] == OK and len(r["statuses"]) == 12, r
    e = rpc_error(lambda: method(channel)(request_of_size(MAX_MESSAGE + 1, "over"), timeout=10))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
    assert str(MAX_MESSAGE) in (e.details() or ""), e.details()
    e = rpc_error(lambda: method(channel)(encode_request("edge", blobs(12, 1500, "big")), timeout=10))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
    # The refused request counted nothing, and the connection goes on.
    r = decode_response(method(channel)(encode_request("edge", blobs(1, 1500, "big")), timeout=10))
    assert r["overall"] == OK and r["statuses"][0]["remaining"] == 999, r


def test_request_bodies_past_the_connection_window_are_all_answered(channel):
    # 128 concurrent 10 KiB requests: 1.3 MB of DATA, more than the server's 1 MiB connection
    # window, so they pass only if the server credits the window back (WINDOW_UPDATE) as it goes.
    call = method(channel)
    value = "w" * 10_240
    req = encode_request("edge", [[("blob", value)]])
    futures = [call.future(req, timeout=20) for _ in range(128)]
    answers = [decode_response(f.result()) for f in futures]
    assert all(a["overall"] == OK for a in answers), [a for a in answers if a["overall"] != OK][:3]
    assert sorted(a["statuses"][0]["remaining"] for a in answers) == list(range(872, 1000))


def test_gzip_from_the_client(channel):
    # The server supports no grpc-encoding and does not advertise grpc-accept-encoding; grpcio does
    # not wait to be told: asked for gzip on a call it sends `grpc-encoding: gzip` and compresses the
    # message whenever gzip makes it smaller. What was observed (grpcio 1.76, GRPC_TRACE=compression):
    # - a small message (35 bytes): "Algorithm 'gzip' enabled but decided not to compress", sent
    #   with the compressed flag 0 (and the grpc-encoding header): the server answers it normally;
    # - a compressible 4 KiB message: sent gzipped (66 bytes, flag 1): the server answers
    #   Trailers-Only UNIMPLEMENTED, "compressed messages are not accepted", and counts nothing.
    call = method(channel)
    small = encode_request("edge", [[("remote_address", "198.51.100.9")]])
    assert len(gzip.compress(small)) > len(small)  # gzip would only grow it
    r = decode_response(call(small, timeout=10, compression=grpc.Compression.Gzip))
    assert r["overall"] == OK and r["statuses"][0]["remaining"] == 2, r
    big = encode_request("edge", [[("blob", "z" * 4000)]])
    assert len(gzip.compress(big)) < len(big) // 10  # compresses well: grpcio sends it compressed
    e = rpc_error(lambda: call(big, timeout=10, compression=grpc.Compression.Gzip))
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED, (e.code(), e.details())
    assert "compressed" in (e.details() or ""), e.details()
    # Nothing was counted for the refused call; uncompressed, the same request is the key's first.
    r = decode_response(call(big, timeout=10))
    assert r["overall"] == OK and r["statuses"][0]["remaining"] == 999, r


def test_the_unix_socket_listener_answers_too(agent):
    # grpcio's `unix:` target: the same server over `--grpc-socket` (:authority is "localhost").
    ch = open_channel(f"unix:{agent.grpc_socket}")
    try:
        for expected in (2, 1, 0):
            r = check(ch, "edge", [[("remote_address", "198.51.100.20")]])
            assert r["overall"] == OK and r["statuses"][0]["remaining"] == expected, r
        assert check(ch, "edge", [[("remote_address", "198.51.100.20")]])["overall"] == OVER_LIMIT
    finally:
        ch.close()


def test_sigterm_with_the_channel_open_exits_0_promptly():
    a = Agent(RULES)
    try:
        ch = open_channel(a.addr)
        assert check(ch, "edge", [[("remote_address", "192.0.2.1")]])["overall"] == OK
        started = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        try:
            code = a.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent did not exit within 5 s of SIGTERM; log:\n{a.log()}")
        assert code == 0, f"exit {code}; log:\n{a.log()}"
        assert time.monotonic() - started < 5
        # The channel learns the server is gone: a call fails (UNAVAILABLE), it does not hang.
        e = rpc_error(lambda: check(ch, "edge", [[("remote_address", "192.0.2.1")]]))
        assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
        ch.close()
    finally:
        a.close()


# A stopping agent closes each gRPC connection gracefully: GOAWAY, the streams it took answered, its
# FIN, then what the client still sends read and dropped (a lingering close) until the client closes
# or a second passes. Closing with the client's frames unread would make the kernel reset the
# connection, and grpcio fail calls the agent answered (UNAVAILABLE "Broken pipe"): before the
# lingering close, one SIGTERM under load in about ten lost one. This tries 300 times (about 35 ms
# each) and fails at the first lost call.
class CallLost(AssertionError):
    """A call that died on the stopping connection."""


def test_sigterm_under_load_fails_no_call_with_a_connection_reset():
    req = encode_request("edge", [[("blob", "s" * 10_000)]])
    for attempt in range(300):
        a = Agent(RULES)
        try:
            ch = open_channel(a.addr)
            call = method(ch)
            futures = [call.future(req, timeout=10) for _ in range(8)]
            futures[0].result()
            futures += [call.future(req, timeout=10) for _ in range(64)]
            a.proc.send_signal(signal.SIGTERM)
            futures += [call.future(req, timeout=10) for _ in range(64)]
            lost = []
            for i, f in enumerate(futures):
                try:
                    f.result()
                except grpc.RpcError as e:
                    # A call refused by the shutdown (past the GOAWAY's last stream id, or sent after
                    # it) is retried by grpcio on a new connection, which the stopping agent refuses
                    # or resets: "failed to connect to all addresses; ...". Expected. Any other
                    # failure is a call that died on the original connection.
                    details = e.details() or ""
                    if not details.startswith("failed to connect to all addresses"):
                        lost.append((i, e.code().name, details))
            assert a.proc.wait(timeout=5) == 0, a.log()
            ch.close()
            if lost:
                raise CallLost(f"try {attempt + 1}: calls that died on the stopping connection: {lost[:5]}")
        finally:
            a.close()
