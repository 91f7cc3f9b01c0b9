"""The store fixtures (moto behind a fault proxy, nginx) for the group loads from a store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sources.conftest import aws_env, moto_server, proxy, s3  # noqa: F401 - fixtures used here
from tests.sources.servers import Nginx


@pytest.fixture(scope="session")
def nginx_counted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Nginx, object]]:
    """nginx logging the body bytes of every response: a store's egress as the server counts it."""
    pytest.importorskip("obstore", reason="store URLs need obstore (the s3 extra)")
    root = tmp_path_factory.mktemp("www")
    n = Nginx(root, tmp_path_factory.mktemp("nginx"), log_bytes=True)
    why = n.start()
    if why is not None:
        pytest.skip(f"no web server to test against: {why}")
    yield n, root
    n.stop()
