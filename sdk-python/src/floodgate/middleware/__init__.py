"""HTTP middleware that asks the agent once per request, as the Rust SDK's tower Layer does.

- :class:`FloodgateMiddleware` (:mod:`.asgi`): Starlette, FastAPI, any ASGI app.
- :class:`FloodgateWSGIMiddleware` (:mod:`.wsgi`): any WSGI app.
- ``floodgate.middleware.django.FloodgateDjangoMiddleware`` (:mod:`.django`, imports Django).

The helpers they share (headers, ``Retry-After``, trusted proxies, wire-safe values, quota mode's
over-quota rules) are here too.
"""

from ._common import (
    OVER_QUOTA_HEADER,
    OVER_QUOTA_KEY,
    Cidr,
    binding_rule,
    build_attributes,
    client_ip,
    format_ip,
    header_text,
    over_quota_header,
    over_quota_rules,
    parse_cidrs,
    rate_limit_headers,
    rejection_body,
    retry_after_seconds,
    route_name,
    server_took_forwarded_for,
)
from .asgi import FloodgateMiddleware
from .wsgi import FloodgateWSGIMiddleware

__all__ = [
    "FloodgateMiddleware",
    "FloodgateWSGIMiddleware",
    "OVER_QUOTA_HEADER",
    "OVER_QUOTA_KEY",
    "Cidr",
    "binding_rule",
    "build_attributes",
    "client_ip",
    "format_ip",
    "header_text",
    "over_quota_header",
    "over_quota_rules",
    "parse_cidrs",
    "rate_limit_headers",
    "rejection_body",
    "retry_after_seconds",
    "route_name",
    "server_took_forwarded_for",
]
