"""cors-origins entries, kept as a browser sends a page's `Origin` header.

Requests are compared with the entries as strings (the server's 403 check, `app.foreign_page`, and
Starlette's CORSMiddleware alike), so an entry must be written as the Origin a browser serialises
(the WHATWG URL standard): an http(s) origin is scheme://host[:port] in lower case, without the
scheme's default port or a slash, an IPv6 host compressed in brackets, an IPv4 host as four decimal
numbers, a name in its ASCII (punycode) form. `origin` puts an entry in that form, or refuses one that
no Origin can equal, naming it: entries that matched nothing were kept ("http://example.com/", the
slash), and "*" without an API key let the preflight say yes to every page, whose requests were then
403. Other schemes (a browser extension's chrome-extension://ID, a webview app's tauri://localhost)
are scheme://host, kept as written but for the scheme's case.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

from edgeinfer.errors import InvalidArgumentError, shown

DEFAULT_PORTS = {"http": 80, "https": 443}
NO_ORIGIN = ("file", "data", "blob", "about", "javascript")  # pages the browser gives the Origin "null"
DNS_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")
OPAQUE_HOST = re.compile(r"[A-Za-z0-9._~!$&'()+,;=-]+")
ENDS_IN_NUMBER = re.compile(r"(.*\.)?(\d+|0[xX][0-9a-fA-F]*)\.?")  # WHATWG: such a host is parsed as IPv4


def origin(value: str, api_key_set: bool) -> str:
    """`value` as a browser would send it in `Origin`, or InvalidArgumentError naming the entry. "*" is
    kept only with an API key (the key then guards every request; without one it would let any page
    on this device drive the model)."""
    bad = f"cors-origins entry {shown(value)}"
    text = value.strip()
    if text == "*":
        if api_key_set:
            return text
        raise InvalidArgumentError(f"{bad}: without an API key a wildcard would let any web page drive the model; "
                                   "list each origin (scheme://host[:port]) or set an API key")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise InvalidArgumentError(f"{bad} is not an origin (a bad host or port): write scheme://host[:port], "
                                   "as a browser sends it") from None
    scheme = parts.scheme.lower()
    if not scheme or scheme in NO_ORIGIN or not parts.netloc or parts.username is not None \
            or parts.password is not None or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidArgumentError(f"{bad} is not an origin: write scheme://host[:port], as a browser sends it "
                                   "(no path; file pages send the Origin null, which any page can send too)")
    if scheme not in DEFAULT_PORTS:  # an opaque host: sent as written
        host = parts.netloc.rpartition(":")[0] if port is not None else parts.netloc
        if not OPAQUE_HOST.fullmatch(host):
            raise InvalidArgumentError(f"{bad} has a host no browser sends")
        return f"{scheme}://{parts.netloc}"
    return f"{scheme}://{_http_host(parts.hostname or '', bad)}" + (
        f":{port}" if port is not None and port != DEFAULT_PORTS[scheme] else "")


def _http_host(host: str, bad: str) -> str:
    """An http(s) origin's host as browsers serialise it (urlsplit has lowered its case)."""
    if ":" in host:  # IPv6 (urlsplit took it out of its brackets)
        if "%" in host:
            raise InvalidArgumentError(f"{bad} has an IPv6 zone id, which browsers do not send")
        try:
            return f"[{ipaddress.IPv6Address(host).compressed}]"
        except ValueError:
            raise InvalidArgumentError(f"{bad} has a host that is not an IPv6 address") from None
    if not host.isascii():
        raise InvalidArgumentError(f"{bad}: write the host in its ASCII form (punycode, xn--...), as browsers send it")
    if "*" in host:
        raise InvalidArgumentError(f"{bad}: wildcards are not supported; list each origin")
    if ENDS_IN_NUMBER.fullmatch(host):  # 127.1, 0x7f.0.0.1: browsers send 127.0.0.1
        try:
            return socket.inet_ntoa(socket.inet_aton(host.rstrip(".")))
        except OSError:
            raise InvalidArgumentError(f"{bad} has a host that is not an IPv4 address") from None
    if not DNS_NAME.fullmatch(host):
        raise InvalidArgumentError(f"{bad} has a host no browser sends")
    return host
