"""Credentials and endpoints, found the way AWS tools find them; the obstore client built from them.

For ``s3://`` botocore resolves everything an AWS tool would: the environment
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``), ``AWS_PROFILE`` and the
shared files (``AWS_CONFIG_FILE``, ``AWS_SHARED_CREDENTIALS_FILE``), SSO, container and instance
roles, the region, and the endpoint (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, a profile's
``endpoint_url``; none of them where ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` or the profile's
``ignore_configured_endpoint_urls`` is true), and the profile's ``s3 = addressing_style``.
obstore's client is given every one of these explicitly, AWS's own endpoint included: left
without one, it reads ``AWS_ENDPOINT_URL`` from the environment itself, past what botocore
decided. Bytes then move through obstore (Rust's ``object_store``), which signs each
request with credentials botocore refreshes (see :class:`_Credentials`). Where botocore finds
no credentials, or ``AWS_NO_SIGN_REQUEST``/``AWS_SKIP_SIGNATURE`` is true, requests go unsigned:
a public bucket needs nothing more.

Nothing secret leaves this module: the credential provider hands keys to obstore and nothing
else; :func:`describe` (used in errors and reports) names the endpoint, region, profile and
whether requests are signed, never a key.
"""

from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from weightlift.errors import OptionError, install_hint
from weightlift.sources.url import Location

__all__ = ["Retry", "StoreConfig", "resolve", "make_store", "describe"]

_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Retry:
    """How requests and interrupted bodies are retried: exponential backoff with jitter.

    obstore retries a request that fails before its body (5xx such as S3's ``503 SlowDown``,
    reset or refused connections, timeouts); a body cut short is resumed from the byte it stopped
    at by :mod:`weightlift.sources.store`, with the same backoff and the same limit.
    """

    max_retries: int = 10
    init_backoff_s: float = 0.1
    max_backoff_s: float = 15.0
    retry_timeout_s: float = 180.0
    #: the most one request may take, its body included (a longer one is cut and retried or resumed)
    timeout_s: float = 30.0

    def obstore(self) -> Any:
        td = datetime.timedelta
        return {
            "max_retries": self.max_retries,
            "retry_timeout": td(seconds=self.retry_timeout_s),
            "backoff": {"init_backoff": td(seconds=self.init_backoff_s), "max_backoff": td(seconds=self.max_backoff_s)},
        }

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (1-based): full jitter under the exponential."""
        import random

        return random.uniform(0, min(self.max_backoff_s, self.init_backoff_s * 2 ** (attempt - 1)))


@dataclass(frozen=True)
class StoreConfig:
    """What a store client was built from; safe to show (no secret in it)."""

    scheme: str
    root: str
    endpoint: str | None
    region: str | None
    profile: str | None
    signed: bool
    #: virtual-hosted addressing (``bucket.endpoint/key``), as a profile's ``s3 = addressing_style
    #: = virtual`` asks; else path-style (``endpoint/bucket/key``)
    virtual: bool = False

    @property
    def endpoint_key(self) -> str:
        """What remembered tuning is keyed by: the endpoint (or the bucket's AWS region)."""
        if self.scheme != "s3":
            return self.root
        return self.endpoint or f"s3.{self.region or 'us-east-1'}.amazonaws.com"


class _Credentials:
    """obstore's credential provider over botocore's (refreshing) credentials; holds no copy."""

    def __init__(self, creds: Any):
        self._creds = creds
        self._lock = threading.Lock()

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            f = self._creds.get_frozen_credentials()
        expiry = getattr(self._creds, "_expiry_time", None)
        return {
            "access_key_id": f.access_key,
            "secret_access_key": f.secret_key,
            "token": f.token,
            # refreshable credentials are asked again a little before they expire
            "expires_at": expiry - datetime.timedelta(minutes=5) if expiry is not None else None,
        }

    def __repr__(self) -> str:
        return "<botocore credentials>"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def resolve(loc: Location) -> tuple[StoreConfig, Any]:
    """The configuration of the client for ``loc``'s store, and its credential provider (or None)."""
    if loc.scheme != "s3":
        return StoreConfig(loc.scheme, loc.root, loc.root, None, None, False), None
    try:
        import botocore.session
        from botocore.exceptions import BotoCoreError
    except ImportError:
        raise OptionError(f"s3:// needs botocore and obstore: {install_hint('s3')}") from None
    try:
        session = botocore.session.get_session()
        region, endpoint = _region_and_endpoint(session)
        creds = None if _flag("AWS_NO_SIGN_REQUEST") or _flag("AWS_SKIP_SIGNATURE") else session.get_credentials()
        s3 = session.get_scoped_config().get("s3")
    except BotoCoreError as e:  # a broken profile or config file: botocore's message names the file
        raise OptionError(f"AWS configuration: {type(e).__name__}: {e}") from None
    profile = session.get_config_variable("profile")
    provider = _Credentials(creds) if creds is not None else None
    virtual = isinstance(s3, dict) and str(s3.get("addressing_style", "")).strip().lower() == "virtual"
    return StoreConfig("s3", loc.root, endpoint, region, profile, provider is not None, virtual), provider


def _region_and_endpoint(session: Any) -> tuple[str | None, str | None]:
    """The region, and the endpoint a user configured (None: AWS itself), in botocore's order:
    ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, then the profile. The common cases are read
    directly; a profile with a ``services`` section (or endpoints turned off) asks botocore's
    own client resolution, which costs tens of milliseconds more."""
    region = session.get_config_variable("region")
    scoped = session.get_scoped_config()
    ignore = os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "") or scoped.get("ignore_configured_endpoint_urls")
    if "services" not in scoped and not ignore:
        for v in (
            os.environ.get("AWS_ENDPOINT_URL_S3"),
            os.environ.get("AWS_ENDPOINT_URL"),
            scoped.get("endpoint_url"),
        ):
            if v:
                return region, v.rstrip("/")
        return region, None
    client = session.create_client("s3")
    url = str(client.meta.endpoint_url)
    if url.endswith(".amazonaws.com") or ".amazonaws.com/" in url:
        return client.meta.region_name, None
    return client.meta.region_name, url.rstrip("/")


def make_store(cfg: StoreConfig, provider: Any, retry: Retry, *, connections: int) -> Any:
    """The obstore client for ``cfg``: an ``S3Store`` for a bucket, an ``HTTPStore`` for a host."""
    try:
        from obstore.store import HTTPStore, S3Store
    except ImportError:
        raise OptionError(f"{cfg.scheme}:// needs obstore: {install_hint('s3')}") from None
    client: Any = {
        "allow_http": True,
        "pool_max_idle_per_host": str(max(1, connections)),
        "connect_timeout": "10s",
        "timeout": datetime.timedelta(seconds=retry.timeout_s),
    }
    if cfg.scheme != "s3":
        return HTTPStore(cfg.root, client_options=client, retry_config=retry.obstore())
    region = cfg.region or "us-east-1"
    # always an endpoint and a style: obstore would otherwise take AWS_ENDPOINT_URL (and
    # AWS_VIRTUAL_HOSTED_STYLE_REQUEST) from the environment, where botocore was told to ignore it
    endpoint = cfg.endpoint or f"https://s3.{region}.amazonaws.com"
    if cfg.virtual:  # the bucket in the host name: obstore expects it in the endpoint given
        u = urlsplit(endpoint)
        endpoint = f"{u.scheme}://{cfg.root}.{u.netloc}{u.path}"
    kw: dict[str, Any] = {"region": region, "endpoint": endpoint, "virtual_hosted_style_request": cfg.virtual}
    if provider is not None:
        kw["credential_provider"] = provider
    else:
        kw["skip_signature"] = True
    return S3Store(cfg.root, client_options=client, retry_config=retry.obstore(), **kw)


def describe(cfg: StoreConfig) -> str:
    """The client's configuration in words, for errors and reports (never a secret)."""
    if cfg.scheme != "s3":
        return cfg.root
    where = cfg.endpoint or "AWS"
    prof = f", profile {cfg.profile!r}" if cfg.profile else ""
    style = ", virtual-hosted" if cfg.virtual else ""
    return (
        f"endpoint {where}{style}, region {cfg.region or 'us-east-1'}{prof}, {'signed' if cfg.signed else 'anonymous'}"
    )
