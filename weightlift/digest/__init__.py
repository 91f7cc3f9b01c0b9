"""Digests: BLAKE3 hashing (blake), the per-file sidecar cache of digests (sidecar), the manifest a
user publishes (published), and hashing what a load landed (landed)."""
