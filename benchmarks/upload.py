"""Checkpoint upload throughput: Storage.upload_dir versus raw boto3 multipart, same bytes, same endpoint.

    python benchmarks/upload.py --size-mb 200 [--uri s3://bucket/prefix?endpoint_override=...] [--json PATH]

Without --uri it starts its own LocalS3 (moto's S3 server on loopback). The directory is checkpoint-like:
one big file (~80% of the bytes, like a ZeRO optimizer shard) and several small ones. The baseline is one
`client.upload_file` with boto3's default TransferConfig (8 MB parts, 10 threads) of a single file holding
the same number of bytes -- the best case for raw boto3. Runs alternate between the two to share any
drift of a busy machine, and each side reports its best of `repeats`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

try:
    from spotfill.storage.base import S3Storage, open_storage
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))
    from spotfill.storage.base import S3Storage, open_storage


def make_checkpoint_dir(root: str, size_mb: float) -> int:
    """Write one big file plus small ones (nested), `size_mb` MB in all; returns the byte count."""
    total = int(size_mb * 1e6)
    big = int(total * 0.8)
    rest = total - big
    smalls = [rest // 4] * 3 + [rest - 3 * (rest // 4)]
    sizes = {"zero/optim_states.pt": big}
    sizes.update({f"model/part-{i}.pt": s for i, s in enumerate(smalls)})
    sizes["meta/client_state.json"] = 0
    block = os.urandom(1 << 20)
    for rel, size in sizes.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            left = size
            while left > 0:
                f.write(block[:min(left, len(block))])
                left -= min(left, len(block))
    return sum(sizes.values())


def raw_client(storage: S3Storage):
    """A plain boto3 S3 client for the same endpoint and region (default settings, path-style)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=storage.endpoint_url, region_name=storage.region,
        config=Config(s3={"addressing_style": "path"}) if storage.endpoint_url else None)


def flatten(src: str, flat: str) -> int:
    """Concatenate every file under `src` into one file `flat`; returns its size."""
    with open(flat, "wb") as out:
        for root, dirs, files in os.walk(src):
            dirs.sort()
            for name in sorted(files):
                with open(os.path.join(root, name), "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
    return os.path.getsize(flat)


def raw_upload(raw, storage: S3Storage, flat: str, key: str) -> float:
    """Seconds for one raw boto3 `upload_file` (default TransferConfig: 8 MB parts, 10 threads) of `flat`
    to `key` under the storage's prefix."""
    from boto3.s3.transfer import TransferConfig

    t0 = time.perf_counter()
    raw.upload_file(flat, storage.bucket, f"{storage.prefix}/{key}".lstrip("/"), Config=TransferConfig())
    return time.perf_counter() - t0


def compare_upload(storage: S3Storage, src: str, repeats: int = 2, ours=None, stat: str = "best",
                   work_dir: str | None = None) -> dict:
    """Upload MB/s of spotfill's upload of directory `src` vs raw boto3 `upload_file` of one file holding
    the same bytes (default TransferConfig), alternating the two `repeats` times.

    `ours(i) -> None` uploads `src` the spotfill way (default: `storage.upload_dir(src, f"ours-{i}")`) and
    leaves its objects under `ours-{i}/`; they are deleted after each try. `stat`: "best" (min time) or
    "median" of the tries.
    """
    if ours is None:
        def ours(i):
            storage.upload_dir(src, f"ours-{i}")
    raw = raw_client(storage)
    work = tempfile.mkdtemp(prefix="spotfill-bench-flat-", dir=work_dir)
    try:
        flat = os.path.join(work, "flat.bin")
        nbytes = flatten(src, flat)
        mine, theirs = [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            ours(i)
            mine.append(time.perf_counter() - t0)
            theirs.append(raw_upload(raw, storage, flat, f"raw-{i}/flat.bin"))
            storage.delete_prefix(f"ours-{i}")
            storage.delete_prefix(f"raw-{i}")
        pick = min if stat == "best" else statistics.median
        upload_mb_s = nbytes / 1e6 / pick(mine)
        raw_mb_s = nbytes / 1e6 / pick(theirs)
        return {"upload_mb_s": round(upload_mb_s, 1), "raw_boto3_mb_s": round(raw_mb_s, 1),
                "upload_ratio": round(upload_mb_s / raw_mb_s, 3), "bytes": nbytes,
                "seconds": {"spotfill": [round(s, 3) for s in mine],
                            "raw_boto3": [round(s, 3) for s in theirs]}, "stat": stat,
                "chunk_mb": storage.chunk_bytes // (1024 * 1024), "concurrency": storage.concurrency}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        raw.close()


def bench_upload(uri_or_server, size_mb: float = 200, repeats: int = 2) -> dict:
    """Upload MB/s of Storage.upload_dir vs raw boto3 upload_file (default TransferConfig), same run."""
    uri = uri_or_server.uri(f"bench-{uuid.uuid4().hex[:8]}") if hasattr(uri_or_server, "uri") \
        else uri_or_server
    storage = open_storage(uri)
    if not isinstance(storage, S3Storage):
        raise SystemExit("bench_upload wants an s3:// URI or a LocalS3")
    work = tempfile.mkdtemp(prefix="spotfill-bench-")
    try:
        src = os.path.join(work, "ckpt")
        make_checkpoint_dir(src, size_mb)
        result = compare_upload(storage, src, repeats, stat="best")
        result["seconds"]["upload_dir"] = result["seconds"].pop("spotfill")
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_upload_section(quick: bool = True, progress=None) -> dict:
    """`spotfill bench --only upload`: bench_upload against a loopback S3 endpoint in a child process."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._common import s3_endpoint, scoped_env

    with s3_endpoint() as (server, env), scoped_env(**env):
        return bench_upload(server, size_mb=100 if quick else 400, repeats=2 if quick else 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/upload.py", description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--uri", help="s3:// URI to measure against (default: start a LocalS3)")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    if args.uri:
        result = bench_upload(args.uri, args.size_mb, args.repeats)
    else:
        from spotfill.testing.s3local import LocalS3
        with LocalS3(bucket="spotfill-bench") as s3:
            os.environ.update(s3.env())
            result = bench_upload(s3, args.size_mb, args.repeats)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
