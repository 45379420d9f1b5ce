"""A real S3 server on 127.0.0.1 for the S3 checkpoint tests (moto's server mode, in a thread of the test process),
and a fault proxy in front of it: an HTTP relay that corrupts, truncates or delays requests as a bad network would.

boto3 talks to them over TCP exactly as to AWS; the endpoint and credentials reach it through the environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), as they reach a training run.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ACCESS_KEY = "AKIAFORGETESTKEY0001"
SECRET_KEY = "neox-forge-test-secret-d8a1f0c3b7e94a52"


def s3_env(endpoint: str, tmp: Path, secret: str = SECRET_KEY) -> dict[str, str]:
    """The environment a run needs to reach ``endpoint`` with test credentials (no AWS config file is read)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3 server on a free port of 127.0.0.1; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def make_bucket(endpoint: str, bucket: str) -> Any:
    """Create ``bucket`` on the server and return a plain boto3 client of it (for the tests' own reads)."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)
    return client


def objects(client: Any, bucket: str, prefix: str = "") -> dict[str, bytes]:
    """Every object under ``prefix``: key → bytes."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            out[item["Key"]] = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
    return out


Tamper = Callable[[str, str, bytes], bytes]


class FaultProxy:
    """An HTTP relay on 127.0.0.1 in front of ``upstream``. ``tamper(method, path, body)`` may change a request's
    body before it is relayed (the request's headers, its Content-MD5 included, stay the client's); ``delay``
    seconds pass before each request is relayed."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.tamper: Tamper | None = None
        self.delay = 0.0
        self.requests: list[tuple[str, str]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                proxy.requests.append((self.command, self.path))
                if proxy.tamper is not None:
                    body = proxy.tamper(self.command, self.path, body)
                if proxy.delay:
                    time.sleep(proxy.delay)
                skip = {"content-length", "expect", "connection", "transfer-encoding"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                finally:
                    conn.close()
                self.send_response(reply.status)
                for k, v in reply.getheaders():
                    if k.lower() not in {"content-length", "transfer-encoding", "connection", "server", "date"}:
                        self.send_header(k, v)
                # a HEAD reply carries the object's length, not its own body's
                size = reply.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", size or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def corrupt_puts(times: int | None, *, truncate: bool = False, min_size: int = 1) -> Tamper:
    """A tamper that flips one byte (or, with ``truncate``, drops the second half) of the body of the first
    ``times`` PUT requests with a body of at least ``min_size`` bytes (every one with None)."""
    seen = [0]

    def tamper(method: str, path: str, body: bytes) -> bytes:
        if method != "PUT" or len(body) < min_size or (times is not None and seen[0] >= times):
            return body
        seen[0] += 1
        if truncate:
            return body[: len(body) // 2]
        return body[:-1] + bytes([body[-1] ^ 0xFF])

    return tamper
