"""Test stand-ins (loopback S3, IMDS, a spot market, a tiny engine step): used by tests, the demo, benchmarks
and CI's smoke test; not product logic."""
