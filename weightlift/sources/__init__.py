"""Where bytes come from besides local files: object stores (S3 and compatibles) and HTTP.

A path that is a URL (``s3://bucket/prefix/model.safetensors``, ``s3://bucket/prefix/`` holding a
checkpoint, ``https://host/model.gguf``) opens as a checkpoint whose ``source`` is an
:class:`~weightlift.sources.objects.Objects`: headers come from one or two small ranged reads
per object, tensor bytes from many parallel ranged reads (:mod:`.engine`) landing straight in
their destination, in host memory bounded by a budget. Credentials and endpoints are found the
way AWS tools find them (:mod:`.credentials`); faults are retried and resumed, and an object
replaced during a load is an error (:mod:`.store`). The client library is obstore (Rust's
``object_store``), chosen by measurement (bench/objstore.py).

Layers: :mod:`.url` (names, no I/O) -> :mod:`.credentials` -> :mod:`.store` (one client) ->
:mod:`.objects` (one checkpoint's objects) -> :mod:`.engine` (parts, budget) -> :mod:`.load`.
"""

from weightlift.sources.url import Location, is_url, parse

__all__ = ["Location", "is_url", "parse"]
