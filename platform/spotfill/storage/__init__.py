"""Object storage (local, S3) and the checkpoint store (commit protocol, async upload)."""
