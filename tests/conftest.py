"""Shared fixtures.

`s3_server` (session): a REAL S3 HTTP endpoint on loopback -- spotfill.testing.s3local.LocalS3, i.e. moto's S3
server in a thread of the test process on 127.0.0.1:<free port>, with a bucket and valid fake keys exported
as AWS_* environment variables (the standard boto3 chain finds them). Nothing patches boto3. Use
`s3_server.uri(prefix)` for an `s3://bucket/prefix?endpoint_override=...` URI, `with s3_server.outage():`
or `s3_server.outage_for(seconds)` to take the endpoint down on the same port (objects survive), and
`with s3_server.strict_auth():` to make it reject bad keys/signatures.

`s3_uri` (function): a fresh unique prefix on that server, so tests never see each other's objects.
"""
from __future__ import annotations

import re
import uuid

import pytest


@pytest.fixture(scope="session")
def s3_server():
    from spotfill.testing.s3local import LocalS3

    mp = pytest.MonkeyPatch()
    # Keep the developer's own AWS setup (profiles, IMDS) out of the tests.
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    mp.setenv("AWS_CONFIG_FILE", "/dev/null")
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        mp.delenv(name, raising=False)
    server = LocalS3(bucket="spotfill-test").start()
    for name, value in server.env().items():
        if not name.startswith("AWS_ENDPOINT_URL"):   # URIs carry ?endpoint_override= instead
            mp.setenv(name, value)
    try:
        yield server
    finally:
        server.close()
        mp.undo()


@pytest.fixture
def s3_uri(s3_server, request) -> str:
    """s3://spotfill-test/<unique prefix>?endpoint_override=http://127.0.0.1:PORT"""
    s3_server.start()  # a test that died mid-outage must not break the next one
    name = re.sub(r"[^a-zA-Z0-9-]+", "-", request.node.name)[:40].strip("-")
    return s3_server.uri(f"t/{name}-{uuid.uuid4().hex[:8]}")


@pytest.fixture(autouse=True, scope="module")
def no_ray_connection_left_behind():
    """A module that connected to Ray and did not disconnect (a job's validate, a test that failed before its
    own shutdown) would make the next module's ray.init fail ("called ray.init twice"): disconnect after
    each module."""
    yield
    import sys
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        ray.shutdown()
