"""Test stand-ins (loopback S3, IMDS): used by tests, the demo and benchmarks; not product logic."""
