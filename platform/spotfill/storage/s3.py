"""S3 and S3-compatible object storage: the `s3://bucket/prefix` backend of storage.py.

One thread-safe boto3 client per Storage; multipart transfers through s3transfer with `chunk_mb` parts and
`concurrency` threads. Transient faults (connection errors, timeouts, 5xx, throttling) are retried by
Storage's RetryPolicy; a missing key raises FileNotFoundError; secrets never reach messages or reprs.
"""
from __future__ import annotations

import logging
import os
import uuid
from urllib.parse import urlsplit

from spotfill.config import constants
from spotfill.config.errors import ConfigError, StorageError
from spotfill.storage.base import Storage, _check_key, join_key, redact_url

_RETRYABLE_CODES = {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown",
                    "RequestTimeout", "RequestTimeoutException", "Throttling", "ThrottlingException",
                    "RequestLimitExceeded", "TooManyRequestsException", "PriorRequestNotComplete"}
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}


class S3Storage(Storage):
    """An S3 (or S3-compatible) bucket prefix, through one thread-safe boto3 client."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None,
                 region: str | None = None, credentials: dict[str, str] | None = None,
                 chunk_mb: int | None = None, request_attempts: int = 3, _client=None, **kwargs):
        super().__init__(**kwargs)
        self.bucket, self.prefix = bucket, join_key(prefix)
        self.endpoint_url, self.region = endpoint_url, region or constants.aws_region()
        self._credentials = dict(credentials or {})
        self.request_attempts = request_attempts
        self.chunk_bytes = max(5, chunk_mb or constants.STORAGE_CHUNK_MB) * 1024 * 1024
        shown = f"s3://{join_key(bucket, self.prefix)}"
        self.uri = shown + (f"?endpoint_override={redact_url(endpoint_url)}" if endpoint_url else "")
        self._client = _client or self._make_client(connect_timeout=10, read_timeout=60,
                                                    attempts=request_attempts)
        from boto3.s3.transfer import TransferConfig
        self._tconfig = TransferConfig(multipart_threshold=self.chunk_bytes,
                                       multipart_chunksize=self.chunk_bytes,
                                       max_concurrency=self.concurrency, use_threads=True)

    def _make_client(self, connect_timeout: float, read_timeout: float, attempts: int):
        import boto3
        from botocore.config import Config
        session = boto3.session.Session(
            aws_access_key_id=self._credentials.get("access_key"),
            aws_secret_access_key=self._credentials.get("secret_key"),
            aws_session_token=self._credentials.get("session_token"), region_name=self.region)
        config = Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                        retries={"mode": "standard", "total_max_attempts": max(1, attempts)},
                        max_pool_connections=self.concurrency + 4,
                        s3={"addressing_style": "path"} if self.endpoint_url else None)
        return session.client("s3", endpoint_url=self.endpoint_url, config=config)

    def _key(self, key: str) -> str:
        return join_key(self.prefix, _check_key(key))

    # -- for readers that take a pyarrow filesystem (Ray Data) --------------------------------------------
    def pyarrow_path(self, key: str) -> str:
        """`bucket/prefix/key`, the path form pyarrow.fs.S3FileSystem takes."""
        return join_key(self.bucket, self._key(key))

    def pyarrow_filesystem(self):
        """A pyarrow S3FileSystem for the same endpoint, region and credentials (none given: the standard
        AWS chain, as boto3 uses). It pickles, so Ray Data tasks on other nodes open the same bucket."""
        from pyarrow import fs

        kwargs = {"region": self.region}
        if self.endpoint_url:
            parts = urlsplit(self.endpoint_url)
            kwargs.update(endpoint_override=parts.netloc or parts.path, scheme=parts.scheme or "https")
        creds = self._credentials
        if creds.get("access_key"):
            kwargs.update(access_key=creds["access_key"], secret_key=creds.get("secret_key"),
                          session_token=creds.get("session_token"))
        return fs.S3FileSystem(**kwargs)

    def _scrub(self, text: str) -> str:
        secrets = [v for v in self._credentials.values() if v]
        secrets += [os.environ.get(n, "") for n in
                    ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")]
        for secret in secrets:
            if len(secret) >= 4:
                text = text.replace(secret, "***")
        return " ".join(text.split())

    def _classify(self, exc):
        from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError, HTTPClientError,
                                         IncompleteReadError, NoCredentialsError,
                                         ResponseStreamingError)
        from s3transfer.exceptions import RetriesExceededError
        while isinstance(exc, Exception) and type(exc).__name__ == "S3UploadFailedError" and \
                (exc.__cause__ or exc.__context__):
            exc = exc.__cause__ or exc.__context__
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
            if code in _NOT_FOUND_CODES:
                return None
            return code in _RETRYABLE_CODES, self._scrub(f"{code}: {err.get('Message', '')}".strip(": "))
        if isinstance(exc, NoCredentialsError):
            return False, "no AWS credentials found"
        transient = (ConnectionError, HTTPClientError, IncompleteReadError, ResponseStreamingError,
                     RetriesExceededError, ConnectionResetError, BrokenPipeError, TimeoutError)
        if isinstance(exc, transient):
            return True, self._scrub(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, BotoCoreError):
            return False, self._scrub(f"{type(exc).__name__}: {exc}")
        return None

    def _not_found(self, exc: Exception) -> bool:
        from botocore.exceptions import ClientError
        return isinstance(exc, ClientError) and str(exc.response.get("Error", {}).get("Code")) \
            in _NOT_FOUND_CODES

    def put_bytes(self, key, data):
        self._retrying(f"put {key}", lambda: self._client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=data))

    def get_bytes(self, key):
        def get():
            try:
                return self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
            except Exception as exc:
                if self._not_found(exc):
                    raise FileNotFoundError(f"no object {key!r} at {self.uri}") from None
                raise
        return self._retrying(f"get {key}", get)

    # -- conditional writes (S3 If-None-Match / If-Match on PutObject; AWS since 2024) --------------------
    # Endpoints differ: some ignore the headers (the write goes through), some reject them (501/400). The
    # first call probes once per endpoint and bucket: create a probe object with If-None-Match: *, again
    # (must be refused, 412), then overwrite it with a wrong If-Match (must be refused too).
    _probed: dict[tuple, str | None] = {}

    def conditional_writes(self):
        where = (self.endpoint_url, self.bucket)
        if where not in S3Storage._probed:
            S3Storage._probed[where] = self._probe_conditional()
        return S3Storage._probed[where]

    def _probe_conditional(self) -> str | None:
        key = f".spotfill-conditional-probe-{uuid.uuid4().hex}"
        try:
            if not self._put_conditional(key, b"1", IfNoneMatch="*"):
                return None
            refused = not self._put_conditional(key, b"2", IfNoneMatch="*") and \
                not self._put_conditional(key, b"3", IfMatch='"00000000000000000000000000000000"')
            return "s3: conditional writes (If-None-Match / If-Match)" if refused else None
        except StorageError as exc:
            from botocore.exceptions import ClientError
            if not isinstance(exc.__cause__, ClientError):
                raise      # unreachable, not an answer: probe again next time
            # the endpoint answered 501 NotImplemented or 400 on the header: no conditional writes
            logging.getLogger(__name__).info("%s: no conditional writes (%s)", self.uri, exc)
            return None
        finally:
            self.delete(key)

    def _put_conditional(self, key: str, data: bytes, **condition) -> bool:
        """PutObject with a condition: True when written, False on 412 PreconditionFailed (or a 404 /
        409 ConditionalRequestConflict: the object it named is gone, or a concurrent write won)."""
        from botocore.exceptions import ClientError

        def put():
            try:
                self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition)
                return True
            except ClientError as exc:
                err = exc.response.get("Error", {})
                code = str(err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
                if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409") or \
                        code in _NOT_FOUND_CODES:
                    return False
                raise
        return self._retrying(f"conditional put {key}", put)

    def put_if_absent(self, key, data):
        if not self.conditional_writes():
            return super().put_if_absent(key, data)
        return self._put_conditional(key, data, IfNoneMatch="*")

    def get_versioned(self, key):
        def get():
            try:
                out = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
                return out["Body"].read(), out["ETag"]
            except Exception as exc:
                if self._not_found(exc):
                    return None
                raise
        return self._retrying(f"get {key}", get)

    def put_if_version(self, key, data, version):
        if not self.conditional_writes():
            return super().put_if_version(key, data, version)
        if version is None:
            return self._put_conditional(key, data, IfNoneMatch="*")
        return self._put_conditional(key, data, IfMatch=version)

    def sha256(self, key):
        import hashlib

        def stream():
            try:
                body = self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            except Exception as exc:
                if self._not_found(exc):
                    raise FileNotFoundError(f"no object {key!r} at {self.uri}") from None
                raise
            h = hashlib.sha256()
            for chunk in iter(lambda: body.read(4 << 20), b""):
                h.update(chunk)
            return h.hexdigest()
        return self._retrying(f"read {key}", stream)

    def put_file(self, local_path, key):
        size = os.path.getsize(local_path)
        self._move_many([(local_path, key, size)], upload=True)
        return size

    def _size(self, key: str) -> int | None:
        """The object's size from one HEAD request; None when there is no such object."""
        def head():
            try:
                return int(self._client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
            except Exception as exc:
                if self._not_found(exc):
                    return None
                raise
        return self._retrying(f"head {key}", head)

    def get_file(self, key, local_path):
        size = self._size(key)
        if size is None:
            raise FileNotFoundError(f"no object {key!r} at {self.uri}")
        self._move_many([(local_path, key, size)], upload=False)
        return size

    def exists(self, key):
        return self._size(key) is not None

    def list(self, prefix=""):
        full = join_key(self.prefix, prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if prefix.endswith("/") and not full.endswith("/"):
            full += "/"
        cut = len(self.prefix) + 1 if self.prefix else 0

        def list_all():
            out = {}
            for page in self._client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    out[obj["Key"][cut:]] = int(obj["Size"])
            return dict(sorted(out.items()))
        return self._retrying(f"list {prefix or '/'}", list_all)

    def delete(self, keys):
        keys = [keys] if isinstance(keys, str) else list(keys)
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]

            def delete_batch(batch=batch):
                resp = self._client.delete_objects(Bucket=self.bucket,
                                                   Delete={"Objects": batch, "Quiet": True})
                if resp.get("Errors"):
                    err = resp["Errors"][0]
                    raise StorageError(f"delete at {self.uri}: {err.get('Code')} on {len(resp['Errors'])}"
                                       f" keys, e.g. {err.get('Key', '')[len(self.prefix):].lstrip('/')}")
            self._retrying(f"delete {len(batch)} keys", delete_batch)
        return len(keys)

    def _move_many(self, items, upload):
        """One TransferManager (shared part/file thread pool) for all items; retry failed files."""
        from s3transfer.manager import TransferManager
        from s3transfer.subscribers import BaseSubscriber

        class Size(BaseSubscriber):
            def __init__(self, size):
                self.size = size

            def on_queued(self, future, **kwargs):
                future.meta.provide_transfer_size(self.size)

        verb = "upload" if upload else "download"
        pending = list(items)
        if not upload:
            for path, _, _ in pending:
                os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)

        def run_once():
            failed, errors = [], []
            with TransferManager(self._client, self._tconfig) as tm:
                futures = [(item, tm.upload(item[0], self.bucket, self._key(item[1]),
                                            subscribers=[Size(item[2])]) if upload else
                            tm.download(self.bucket, self._key(item[1]), item[0],
                                        subscribers=[Size(item[2])])) for item in pending]
                for item, fut in futures:
                    try:
                        fut.result()
                    except Exception as exc:  # noqa: BLE001 - re-raised below for classification
                        failed.append(item)
                        errors.append(exc)
            pending[:] = failed  # the next attempt moves only what failed
            if errors:  # a fatal error wins over transient ones: retrying would not fix it
                raise next((e for e in errors if (self._classify(e) or (False,))[0] is False), errors[0])

        what = f"{verb} {items[0][1]}" if len(items) == 1 else f"{verb} {len(items)} files"
        self._retrying(what, run_once)

    def check(self, write=True):
        from botocore.exceptions import ClientError, ConnectionError, NoCredentialsError
        timeout = constants.STORAGE_CHECK_TIMEOUT_S
        client = self._make_client(connect_timeout=timeout, read_timeout=timeout, attempts=1)
        probe = join_key(self.prefix, f".spotfill-check-{uuid.uuid4().hex}")
        try:
            client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
            if write:
                client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok")
                client.delete_object(Bucket=self.bucket, Key=probe)
            return
        except ClientError as exc:
            err = exc.response.get("Error", {})
            code = str(err.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
            if code in ("NoSuchBucket", "404"):
                reason = f"bucket {self.bucket!r} does not exist"
            elif code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                          "AccessDenied", "403", "AuthorizationHeaderMalformed"):
                reason = f"credentials rejected ({code}; check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, " \
                         f"the profile or the instance role, and the bucket policy)"
            else:
                reason = f"{code}: {err.get('Message', '')}"
        except NoCredentialsError:
            reason = "no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, " \
                     "AWS_PROFILE, or use an instance role)"
        except ConnectionError as exc:
            where = redact_url(self.endpoint_url) if self.endpoint_url else "AWS S3"
            reason = f"endpoint {where} unreachable ({type(exc).__name__})"
        except Exception as exc:  # noqa: BLE001 - any other failure is a config problem here
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            client.close()
        raise ConfigError("storage", self.uri, reason=self._scrub(reason)) from None

    def child(self, sub):
        return S3Storage(self.bucket, join_key(self.prefix, _check_key(join_key(sub))), self.endpoint_url,
                         self.region, self._credentials, self.chunk_bytes // (1024 * 1024),
                         self.request_attempts, _client=self._client, retry=self.retry,
                         concurrency=self.concurrency)
