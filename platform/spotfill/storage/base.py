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
import hashlib
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

from spotfill.config import constants
from spotfill.config.errors import ConditionalWritesUnsupported, ConfigError, StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")
TMP_MARK = ".spotfill-tmp-"          # local temp files carry this in their name and are never listed
S3_QUERY_KEYS = ("endpoint_override", "region", "scheme", "access_key", "secret_key", "session_token")
_SECRET_QUERY_KEYS = ("access_key", "secret_key", "session_token")


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


def sha256_file(path: str, bufsize: int = 4 << 20) -> str:
    """Hex sha256 of a file (hashlib releases the GIL on large buffers, so threads help)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def local_files(local_dir: str, live: bool = False) -> dict[str, int]:
    """Files under `local_dir` (recursive, symlinks followed) as '/'-separated relpath -> size.

    live=True is for a directory other threads write and delete in (LocalStorage's objects): temp files
    are left out before they are looked at, and a file removed between the walk and its stat (a temp
    file renamed into place, an object deleted) is not listed, as S3's listing would not; otherwise
    (a snapshot to upload) a vanished file raises."""
    out = {}
    for root, dirs, files in os.walk(local_dir, followlinks=True):
        dirs.sort()
        for name in sorted(files):
            if live and TMP_MARK in name:
                continue
            path = os.path.join(root, name)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                if not live:
                    raise
                continue
            out[os.path.relpath(path, local_dir).replace(os.sep, "/")] = size
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

    # -- conditional writes: what the writer fence (storage/fence.py) builds on ---------------------
    def conditional_writes(self) -> str | None:
        """How this backend makes a write conditional on the object's state (a short description), or
        None where it cannot: then put_if_absent / put_if_version raise ConditionalWritesUnsupported."""
        return None

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create `key` with `data` only where no object exists: True when created, False when one did."""
        raise ConditionalWritesUnsupported(f"{self.uri} has no conditional writes")

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, version) of `key`, or None without an object. put_if_version takes the version."""
        try:
            data = self.get_bytes(key)
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def put_if_version(self, key: str, data: bytes, version: str | None) -> bool:
        """Replace `key` only while its version is still `version` (None: only while there is no object);
        False when another write came first."""
        raise ConditionalWritesUnsupported(f"{self.uri} has no conditional writes")

    def sha256(self, key: str) -> str:
        """Hex sha256 of the object at `key` as storage holds it, read from storage (no local copy)."""
        return hashlib.sha256(self.get_bytes(key)).hexdigest()

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
        for rel, size in local_files(base, live=True).items():
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

    # A local directory: exclusive create through a hard link (link(2) fails on an existing name), and
    # compare-and-swap as read, compare, replace under an flock on a lock file beside the object (the
    # processes of one machine; on NFS only where the server honours POSIX locks). The version is the
    # content's sha256.
    def conditional_writes(self):
        return "local: exclusive create (link) + compare-and-swap under flock"

    def put_if_absent(self, key, data):
        path = self._path(key)
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{TMP_MARK}{uuid.uuid4().hex}-{os.path.basename(path)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def put_if_version(self, key, data, version):
        import fcntl

        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = os.path.join(os.path.dirname(path), f"{TMP_MARK}lock-{os.path.basename(path)}")
        with open(lock, "a+b") as held:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
            try:
                current = self.get_versioned(key)
                if (current[1] if current else None) != version:
                    return False
                if version is None:
                    return self.put_if_absent(key, data)
                self.put_bytes(key, data)
                return True
            finally:
                fcntl.flock(held.fileno(), fcntl.LOCK_UN)

    def sha256(self, key):
        path = self._path(key)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no object {key!r} at {self.uri}")
        return sha256_file(path)

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
    from spotfill.storage.s3 import S3Storage
    return S3Storage(bucket, parts.path, endpoint_url=endpoint, region=query.get("region"),
                     credentials=creds, chunk_mb=chunk_mb, request_attempts=request_attempts, **kwargs)


def __getattr__(name: str):
    """`spotfill.storage.base.S3Storage` without importing boto3 for local storage (PEP 562)."""
    if name == "S3Storage":
        from spotfill.storage.s3 import S3Storage
        return S3Storage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
