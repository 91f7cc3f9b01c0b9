"""Digests: BLAKE3 hashing (blake), the per-file sidecar cache of digests (sidecar), the manifest a
user publishes (published), hashing what a load landed (landed), and one digest over a set of
named tensors (setdigest)."""
