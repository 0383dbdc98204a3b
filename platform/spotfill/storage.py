"""Where bytes live: one thin adapter over a local directory or an S3 bucket prefix.

`open_storage(uri)` accepts a local path, `file:///path`, or `s3://bucket/prefix`. For S3 the endpoint is
`?endpoint_override=http://host:port`, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS itself;
credentials come from boto3's standard chain (pyarrow-style `access_key`/`secret_key`/`session_token` query
parameters are accepted too); the region is `?region=`, AWS_REGION, AWS_DEFAULT_REGION or us-east-1.

Keys are '/'-separated and relative to the URI's prefix. Every method retries transient faults (connection
refused/reset, timeouts, 5xx, throttling) with bounded exponential backoff (`RetryPolicy`, defaults in
constants.py) and then raises StorageError; a missing key raises FileNotFoundError; `check()` raises
ConfigError. Messages, logs and reprs carry `Storage.uri`, which never holds secrets.
"""
from __future__ import annotations

import abc
import contextlib
import logging
import os
import random
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar
from urllib.parse import parse_qsl, urlsplit

from spotfill import constants
from spotfill.errors import ConfigError, StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")
TMP_MARK = ".spotfill-tmp-"          # local temp files carry this in their name and are never listed
S3_QUERY_KEYS = ("endpoint_override", "region", "scheme", "access_key", "secret_key", "session_token")
_SECRET_QUERY_KEYS = ("access_key", "secret_key", "session_token")
_RETRYABLE_CODES = {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown",
                    "RequestTimeout", "RequestTimeoutException", "Throttling", "ThrottlingException",
                    "RequestLimitExceeded", "TooManyRequestsException", "PriorRequestNotComplete"}
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter for transient storage faults."""

    attempts: int = field(default_factory=lambda: constants.STORAGE_RETRIES)
    base_s: float = field(default_factory=lambda: constants.STORAGE_RETRY_BASE_S)
    max_s: float = field(default_factory=lambda: constants.STORAGE_RETRY_MAX_S)
    deadline_s: float = field(default_factory=lambda: constants.STORAGE_RETRY_DEADLINE_S)

    def delay(self, attempt: int) -> float:
        """Seconds to sleep after failed attempt number `attempt` (1-based)."""
        return min(self.max_s, self.base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


@dataclass
class TransferStats:
    """What upload_dir/download_dir moved: key (relative to the dir) -> size, total bytes, seconds."""

    files: dict[str, int]
    bytes: int
    seconds: float

    @property
    def mb_s(self) -> float:
        """Throughput in MB/s (1e6 bytes)."""
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def join_key(*parts: str) -> str:
    """Join key parts with '/', dropping empty ones and stray slashes."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"bad storage key {key!r}: want a relative 'a/b/c' path")
    return key


def local_files(local_dir: str) -> dict[str, int]:
    """Files under `local_dir` (recursive, symlinks followed) as '/'-separated relpath -> size."""
    out = {}
    for root, dirs, files in os.walk(local_dir, followlinks=True):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            out[os.path.relpath(path, local_dir).replace(os.sep, "/")] = os.path.getsize(path)
    return out


class Storage(abc.ABC):
    """Bytes under a root (a directory, or an S3 bucket prefix). `uri` is safe to print."""

    uri: str

    def __init__(self, retry: RetryPolicy | None = None, concurrency: int | None = None):
        self.retry = retry or RetryPolicy()
        self.concurrency = max(1, concurrency or constants.STORAGE_CONCURRENCY)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    def _retrying(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying transient faults per self.retry; then StorageError naming `what`."""
        start, attempt = time.monotonic(), 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                reason = self._classify(exc)
                if reason is None:
                    raise
                transient, text = reason
                elapsed = time.monotonic() - start
                delay = self.retry.delay(attempt)
                if not transient or attempt >= self.retry.attempts or \
                        elapsed + delay > self.retry.deadline_s:
                    tail = f" (gave up after {attempt} attempts, {elapsed:.1f}s)" if transient else ""
                    raise StorageError(f"{what} at {self.uri}: {text}{tail}") from exc
                log.warning("storage: %s at %s failed (%s); retry %d/%d in %.2fs", what, self.uri, text,
                            attempt, self.retry.attempts - 1, delay)
                time.sleep(delay)

    def _classify(self, exc: BaseException) -> tuple[bool, str] | None:
        """(transient?, one-line reason) for a storage fault; None to re-raise `exc` unchanged."""
        return None

    # -- the interface ------------------------------------------------------------------------------
    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` at `key` (readers see the old or the new object, never a torn one)."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The bytes at `key`; FileNotFoundError if there is none."""

    @abc.abstractmethod
    def put_file(self, local_path: str, key: str) -> int:
        """Upload a local file to `key` (multipart when large); returns its size."""

    @abc.abstractmethod
    def get_file(self, key: str, local_path: str) -> int:
        """Download `key` to `local_path` atomically (parents created); returns its size."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object exists at `key`."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> dict[str, int]:
        """Keys starting with `prefix` (plain string prefix, as S3 does) -> size, sorted by key."""

    @abc.abstractmethod
    def delete(self, keys: str | Iterable[str]) -> int:
        """Delete these keys (missing ones are fine); returns how many were asked for."""

    @abc.abstractmethod
    def _move_many(self, items: list[tuple[str, str, int]], upload: bool) -> None:
        """Transfer (local_path, key, size) items in parallel, in the given direction."""

    def upload_dir(self, local_dir: str, key_prefix: str) -> TransferStats:
        """Upload every file under `local_dir` to `key_prefix/<relpath>`, in parallel."""
        t0 = time.monotonic()
        files = local_files(local_dir)
        if files:
            self._move_many([(os.path.join(local_dir, rel), join_key(key_prefix, rel), size)
                             for rel, size in files.items()], upload=True)
        return TransferStats(files, sum(files.values()), time.monotonic() - t0)

    def download_dir(self, key_prefix: str, local_dir: str) -> TransferStats:
        """Download every key under `key_prefix/` to `local_dir/<relpath>`, in parallel."""
        t0 = time.monotonic()
        base = join_key(key_prefix)
        keys = self.list(base + "/" if base else "")
        files = {k[len(base):].lstrip("/"): size for k, size in keys.items()}
        if files:
            self._move_many([(os.path.join(local_dir, *rel.split("/")), join_key(base, rel), size)
                             for rel, size in files.items()], upload=False)
        return TransferStats(files, sum(files.values()), time.monotonic() - t0)

    @abc.abstractmethod
    def check(self, write: bool = True) -> None:
        """Fast reachability/credentials check (one try, short timeouts): ConfigError('storage', ...)."""

    @abc.abstractmethod
    def child(self, sub: str) -> "Storage":
        """A Storage rooted at `sub` under this one (same client, same settings)."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix/` (a directory-like prefix); returns how many."""
        keys = list(self.list(join_key(prefix) + "/" if prefix.strip("/") else ""))
        return self.delete(keys) if keys else 0


# ----------------------------------------------------------------------------------------------------
class LocalStorage(Storage):
    """A directory. Writes go to a temp file in the target directory, then os.replace."""

    def __init__(self, root: str, **kwargs):
        super().__init__(**kwargs)
        self.root = os.path.abspath(root)
        self.uri = self.root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *_check_key(key).split("/"))

    def _classify(self, exc):
        if isinstance(exc, FileNotFoundError):
            return None
        if isinstance(exc, OSError):  # a full disk or a permission error is not transient
            return False, f"{type(exc).__name__}: {exc.strerror or exc}"
        return None

    @staticmethod
    def _atomic_write(path: str, writer: Callable[[str], None], tries: int = 20) -> None:
        """Write via a temp file in the target folder, then os.replace. delete() prunes folders that it
        leaves empty, so a concurrent delete (another rank clearing its marker in the same checkpoint
        folder) can remove a folder between our makedirs and our first file in it: make it again."""
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f"{TMP_MARK}{uuid.uuid4().hex}-{os.path.basename(path)}")
        try:
            for attempt in range(tries):
                try:
                    os.makedirs(folder, exist_ok=True)
                    writer(tmp)
                    break
                except FileNotFoundError:
                    if os.path.isdir(folder) or attempt == tries - 1:
                        raise  # something else is missing (e.g. the source file)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)  # the folder holds tmp, so no prune can remove it now
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def put_bytes(self, key, data):
        def write(tmp):
            with open(tmp, "wb") as f:
                f.write(data)
        self._retrying(f"put {key}", lambda: self._atomic_write(self._path(key), write))

    def get_bytes(self, key):
        def read():
            with open(self._path(key), "rb") as f:
                return f.read()
        return self._retrying(f"get {key}", read)

    def put_file(self, local_path, key):
        self._retrying(f"put {key}", lambda: self._atomic_write(
            self._path(key), lambda tmp: shutil.copyfile(local_path, tmp)))
        return os.path.getsize(local_path)

    def get_file(self, key, local_path):
        src = self._path(key)
        if not os.path.isfile(src):
            raise FileNotFoundError(f"no object {key!r} at {self.uri}")
        self._retrying(f"get {key}", lambda: self._atomic_write(
            os.path.abspath(local_path), lambda tmp: shutil.copyfile(src, tmp)))
        return os.path.getsize(local_path)

    def exists(self, key):
        return os.path.isfile(self._path(key))

    def list(self, prefix=""):
        base = self.root
        if "/" in prefix:  # walk only the deepest directory the prefix names
            base = os.path.join(self.root, *prefix.rsplit("/", 1)[0].split("/"))
        if not os.path.isdir(base):
            return {}
        out = {}
        for rel, size in local_files(base).items():
            if TMP_MARK in rel:
                continue
            key = join_key(os.path.relpath(base, self.root).replace(os.sep, "/")
                           if base != self.root else "", rel)
            if key.startswith(prefix):
                out[key] = size
        return dict(sorted(out.items()))

    def delete(self, keys):
        keys = [keys] if isinstance(keys, str) else list(keys)
        for key in keys:
            path = self._path(key)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            parent = os.path.dirname(path)
            while parent != self.root and parent.startswith(self.root):
                try:
                    os.rmdir(parent)  # only succeeds when empty
                except OSError:
                    break
                parent = os.path.dirname(parent)
        return len(keys)

    def _move_many(self, items, upload):
        def copy(item):
            local, key, _ = item
            src, dst = (local, self._path(key)) if upload else (self._path(key), os.path.abspath(local))
            self._retrying(f"{'upload' if upload else 'download'} {key}", lambda: self._atomic_write(
                dst, lambda tmp: shutil.copyfile(src, tmp)))
        with ThreadPoolExecutor(min(self.concurrency, len(items))) as pool:
            list(pool.map(copy, items))

    def check(self, write=True):
        try:
            os.makedirs(self.root, exist_ok=True)
            if write:
                probe = os.path.join(self.root, f"{TMP_MARK}check-{uuid.uuid4().hex}")
                with open(probe, "wb") as f:
                    f.write(b"ok")
                os.unlink(probe)
            elif not os.access(self.root, os.R_OK):
                raise PermissionError(13, "not readable")
        except OSError as exc:
            raise ConfigError("storage", self.uri, reason=f"local path not usable: "
                              f"{exc.strerror or exc}") from None

    def child(self, sub):
        return LocalStorage(os.path.join(self.root, *_check_key(join_key(sub)).split("/")),
                            retry=self.retry, concurrency=self.concurrency)


# ----------------------------------------------------------------------------------------------------
def redact_url(url: str) -> str:
    """A URL without user:password@ and without query values that look like credentials."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = "&".join(f"{k}=***" if k.lower() in _SECRET_QUERY_KEYS or "secret" in k.lower()
                     or "token" in k.lower() or "signature" in k.lower() else f"{k}={v}"
                     for k, v in parse_qsl(parts.query, keep_blank_values=True))
    return parts._replace(netloc=netloc, query=query).geturl()


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

    def put_file(self, local_path, key):
        size = os.path.getsize(local_path)
        self._move_many([(local_path, key, size)], upload=True)
        return size

    def get_file(self, key, local_path):
        size = self.list(key).get(key)
        if size is None:
            raise FileNotFoundError(f"no object {key!r} at {self.uri}")
        self._move_many([(local_path, key, size)], upload=False)
        return size

    def exists(self, key):
        def head():
            try:
                self._client.head_object(Bucket=self.bucket, Key=self._key(key))
                return True
            except Exception as exc:
                if self._not_found(exc):
                    return False
                raise
        return self._retrying(f"head {key}", head)

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


def open_storage(uri: str, *, retry: RetryPolicy | None = None, concurrency: int | None = None,
                 chunk_mb: int | None = None, request_attempts: int = 3) -> Storage:
    """Storage for a local path, file:///path or s3://bucket/prefix[?endpoint_override=...]."""
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError("storage", uri, accepted="a local path, file:///path, s3://bucket/prefix")
    uri = uri.strip()
    parts = urlsplit(uri)
    kwargs = {"retry": retry, "concurrency": concurrency}
    if parts.scheme in ("", "file") or (len(parts.scheme) == 1 and os.name == "nt"):
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise ConfigError("storage", uri, reason="file:// URIs must name a local path",
                                  accepted="file:///absolute/path")
            return LocalStorage(parts.path, **kwargs)
        return LocalStorage(os.path.expanduser(uri), **kwargs)
    if parts.scheme != "s3":
        raise ConfigError("storage", redact_url(uri), reason=f"unknown scheme {parts.scheme!r}",
                          accepted="a local path, file:///path, s3://bucket/prefix")
    bucket = parts.netloc.rsplit("@", 1)[-1]
    shown = f"s3://{join_key(bucket, parts.path)}"
    if "@" in parts.netloc:
        raise ConfigError("storage", shown, reason="credentials in the URI host are not accepted; "
                          "use the AWS credential chain")
    if not bucket:
        raise ConfigError("storage", shown, reason="no bucket", accepted="s3://bucket/prefix")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - set(S3_QUERY_KEYS))
    if unknown:
        raise ConfigError("storage", shown, reason=f"unknown query parameter(s) {', '.join(unknown)}",
                          accepted=S3_QUERY_KEYS)
    endpoint = query.get("endpoint_override") or constants.aws_endpoint_url()
    if endpoint and "://" not in endpoint:
        endpoint = f"{query.get('scheme', 'https')}://{endpoint}"
    creds = {k: query[k] for k in _SECRET_QUERY_KEYS if query.get(k)}
    return S3Storage(bucket, parts.path, endpoint_url=endpoint, region=query.get("region"),
                     credentials=creds, chunk_mb=chunk_mb, request_attempts=request_attempts, **kwargs)
