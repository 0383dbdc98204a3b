"""A real S3 HTTP endpoint on loopback, for tests, benchmarks and the demo.

`LocalS3` runs moto's S3 server (the same WSGI app as `moto_server`) in a thread of this process, bound to
127.0.0.1 on a free port, creates a bucket, and can stop and start again on the SAME port with the SAME
objects, which is how callers simulate a storage outage::

    with LocalS3(bucket="ckpt") as s3:          # starts, creates the bucket
        storage = open_storage(s3.uri("run-1"))  # s3://ckpt/run-1?endpoint_override=http://127.0.0.1:PORT
        with s3.outage():                       # connections refused (open keep-alive ones are cut)
            ...
        s3.outage_for(20)                       # the same, in the background, for 20 s

moto (5.2) honours PutObject's `If-None-Match: *` and `If-Match: <etag>` (412 PreconditionFailed), as AWS
does; `LocalS3(conditional_writes=False)` drops those headers, like an S3-compatible store that ignores them.

The instance creates an IAM user with an allow-all policy and exposes its keys (`access_key`,
`secret_key`, `env()`). Inside `with s3.strict_auth():` the server checks access keys and SigV4 signatures
(moto's IAM emulation) and answers 403 InvalidAccessKeyId / SignatureDoesNotMatch like AWS would. It is off
otherwise because moto 5.2 miscomputes the signature of query values holding '/' (any ListObjectsV2 with a
'dir/' prefix fails). moto keeps its state in process-wide backends, so every LocalS3 of a process sees the
same buckets, and the auth switch is process-wide too.
Nothing here patches boto3: clients talk HTTP to the server.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import uuid
from typing import Iterator
from urllib.parse import quote

from spotfill.testing.ports import free_port

log = logging.getLogger(__name__)

_AUTH_LOCK = threading.Lock()


class _QuietHandlerMixin:
    """Request handler that does not log every request (werkzeug logs each one at INFO)."""

    def log_request(self, *args, **kwargs):  # noqa: D102 - werkzeug API
        pass

    def log(self, type, message, *args):  # noqa: A002 - werkzeug API
        if type == "error":
            log.debug("local s3: " + message, *args)


def _make_server(host: str, port: int, conditional_writes: bool = True):
    """A threaded werkzeug server for moto's app that tracks open connections so stop() can cut them.
    conditional_writes=False drops If-None-Match / If-Match from requests, as an S3-compatible store without
    conditional writes does (the write goes through)."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

    class Handler(_QuietHandlerMixin, WSGIRequestHandler):
        pass

    class Server(ThreadedWSGIServer):
        def __init__(self, *args, **kwargs):
            self.open_conns: set[socket.socket] = set()
            self.conns_lock = threading.Lock()
            super().__init__(*args, **kwargs)

        def process_request(self, request, client_address):
            with self.conns_lock:
                self.open_conns.add(request)
            super().process_request(request, client_address)

        def shutdown_request(self, request):
            with self.conns_lock:
                self.open_conns.discard(request)
            super().shutdown_request(request)

        def handle_error(self, request, client_address):
            log.debug("local s3: connection error from %s", client_address, exc_info=True)

        def cut_connections(self):
            with self.conns_lock:
                conns, self.open_conns = list(self.open_conns), set()
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    conn.close()

    app = DomainDispatcherApplication(create_backend_app)
    if not conditional_writes:
        moto_app = app

        def app(environ, start_response):
            environ.pop("HTTP_IF_NONE_MATCH", None)
            environ.pop("HTTP_IF_MATCH", None)
            return moto_app(environ, start_response)
    try:
        return Server(host, port, app, handler=Handler)
    except SystemExit as exc:  # werkzeug exits on bind failure; make it an exception
        raise OSError(f"local s3: cannot bind {host}:{port}") from exc


class LocalS3:
    """moto's S3 server on loopback with one bucket; stop()/start() keep the port and the objects."""

    def __init__(self, bucket: str = "spotfill", host: str = "127.0.0.1", port: int = 0,
                 region: str = "us-east-1", conditional_writes: bool = True):
        self.bucket, self.host, self.port, self.region = bucket, host, port, region
        self.conditional_writes = conditional_writes    # False: ignore If-None-Match / If-Match
        self.access_key = "testing"
        self.secret_key = "testing"
        self._server = None
        self._thread: threading.Thread | None = None
        self._ready = False
        self._lock = threading.RLock()

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether the endpoint accepts connections now."""
        return self._server is not None

    @property
    def endpoint_url(self) -> str:
        """http://127.0.0.1:PORT (the port stays the same across stop/start)."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> "LocalS3":
        """Start serving (binding the same port as before); the first start creates the bucket."""
        with self._lock:
            if self._server is not None:
                return self
            if not self.port:
                self.port = free_port(self.host)
            deadline = time.monotonic() + 10.0
            while True:  # the port may linger a moment after a stop
                try:
                    server = _make_server(self.host, self.port, self.conditional_writes)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            self._server = server
            self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                            name=f"local-s3-{self.port}", daemon=True)
            self._thread.start()
            if not self._ready:
                self._setup()
                self._ready = True
            log.info("local s3 up at %s (bucket %s)", self.endpoint_url, self.bucket)
            return self

    def stop(self) -> None:
        """Stop serving: new connections are refused and open ones are cut. Objects are kept."""
        with self._lock:
            server, self._server = self._server, None
            if server is None:
                return
            server.shutdown()          # serve_forever returns and closes the listening socket
            server.cut_connections()   # keep-alive connections would otherwise keep being served
            if self._thread is not None:
                self._thread.join(timeout=5)
            log.info("local s3 at %s stopped", self.endpoint_url)

    def close(self) -> None:
        """Stop for good (moto's objects stay in this process's memory)."""
        self.stop()

    def __enter__(self) -> "LocalS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """Within the block the endpoint is down (connection refused); it comes back on exit."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def outage_for(self, seconds: float) -> threading.Thread:
        """Take the endpoint down now and bring it back after `seconds`, without blocking the caller."""
        self.stop()

        def restore():
            time.sleep(seconds)
            self.start()

        thread = threading.Thread(target=restore, name="local-s3-outage", daemon=True)
        thread.start()
        return thread

    @contextlib.contextmanager
    def strict_auth(self) -> Iterator[None]:
        """Within the block, requests need valid keys and signatures (process-wide moto switch)."""
        from moto import settings
        from moto.core.authorization import ActionAuthenticatorMixin
        with _AUTH_LOCK:
            previous = settings.INITIAL_NO_AUTH_ACTION_COUNT
            settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
            ActionAuthenticatorMixin.request_count = 0
        try:
            yield
        finally:
            with _AUTH_LOCK:
                settings.INITIAL_NO_AUTH_ACTION_COUNT = previous

    # -- addresses ---------------------------------------------------------------------------------
    def uri(self, prefix: str = "") -> str:
        """s3://bucket/prefix?endpoint_override=http://127.0.0.1:PORT (no secrets in it)."""
        path = f"{self.bucket}/{prefix.strip('/')}" if prefix.strip("/") else self.bucket
        return f"s3://{path}?endpoint_override={quote(self.endpoint_url, safe=':/')}"

    def env(self) -> dict[str, str]:
        """AWS environment variables that point boto3 at this server with its valid keys."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_REGION": self.region, "AWS_DEFAULT_REGION": self.region,
                "AWS_ENDPOINT_URL_S3": self.endpoint_url}

    def client(self, **config_kwargs):
        """A fresh boto3 S3 client for this server (valid keys, path-style addressing)."""
        import boto3
        from botocore.config import Config
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, **config_kwargs))

    # -- setup -------------------------------------------------------------------------------------
    def _setup(self) -> None:
        import boto3
        iam = boto3.session.Session().client(
            "iam", endpoint_url=self.endpoint_url, region_name=self.region,
            aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap")
        user = f"spotfill-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=(
            '{"Version": "2012-10-17", "Statement": '
            '[{"Effect": "Allow", "Action": "*", "Resource": "*"}]}'))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        iam.close()
        client = self.client()
        try:
            client.create_bucket(Bucket=self.bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        client.close()

    def __repr__(self) -> str:
        state = "up" if self.running else "down"
        return f"LocalS3({self.endpoint_url}, bucket={self.bucket!r}, {state})"


def main(argv: list[str] | None = None) -> int:
    """`python -m spotfill.testing.s3local [--port P] [--bucket B]`: serve until interrupted.

    Prints one JSON line (endpoint_url, bucket, uri, env). SIGUSR1 takes the endpoint down (an outage),
    SIGUSR2 brings it back on the same port with the same objects.
    """
    import argparse
    import json
    import signal
    parser = argparse.ArgumentParser(prog="python -m spotfill.testing.s3local", description=main.__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bucket", default="spotfill")
    args = parser.parse_args(argv)
    with LocalS3(bucket=args.bucket, port=args.port) as s3:
        # Handlers only flip state from a helper thread: stop()/start() block, signal handlers must not.
        signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=s3.stop, daemon=True).start())
        signal.signal(signal.SIGUSR2, lambda *_: threading.Thread(target=s3.start, daemon=True).start())
        # The keys are moto's fake ones; printing them lets a second process use this server.
        print(json.dumps({"endpoint_url": s3.endpoint_url, "bucket": s3.bucket, "uri": s3.uri(),
                          "env": s3.env()}), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
