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
from urllib.parse import urlsplit

from edgeinfer.errors import InvalidArgumentError, shown

DEFAULT_PORTS = {"http": 80, "https": 443}
NO_ORIGIN = ("file", "data", "blob", "about", "javascript")  # pages the browser gives the Origin "null"
NO_PAGES = ("ws", "wss", "ftp")  # schemes no page is loaded from (browsers dropped ftp pages)
DNS_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")
OPAQUE_HOST = re.compile(r"[A-Za-z0-9._~!$&'()+,;=-]+")
IPV6_NETLOC = re.compile(r"\[[0-9A-Fa-f:.]+(%[^\]]*)?\](:\d*)?")  # (a zone id is refused by its name)
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
    if scheme in NO_PAGES:
        raise InvalidArgumentError(f"{bad}: no page has a {scheme}: origin; write the page's http(s) origin")
    if not scheme or scheme in NO_ORIGIN or not parts.netloc or parts.username is not None \
            or parts.password is not None or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidArgumentError(f"{bad} is not an origin: write scheme://host[:port], as a browser sends it "
                                   "(no path; file pages send the Origin null, which any page can send too)")
    port_part = f":{port}" if port is not None else ""
    if scheme not in DEFAULT_PORTS:  # an opaque host: sent as written, its port as a number
        host = parts.netloc.partition(":")[0]
        if not OPAQUE_HOST.fullmatch(host):
            raise InvalidArgumentError(f"{bad} has a host no browser sends")
        return f"{scheme}://{host}{port_part}"
    if ("[" in parts.netloc or "]" in parts.netloc) and not IPV6_NETLOC.fullmatch(parts.netloc):
        raise InvalidArgumentError(f"{bad} has a host no browser sends")  # ([v1.x] read as v1.x, [::1]x as [::1])
    return f"{scheme}://{_http_host(parts.hostname or '', bad)}" + (
        f":{port}" if port is not None and port != DEFAULT_PORTS[scheme] else "")


def _http_host(host: str, bad: str) -> str:
    """An http(s) origin's host as browsers serialise it (urlsplit has lowered its case)."""
    if ":" in host:  # IPv6 (urlsplit took it out of its brackets)
        if "%" in host:
            raise InvalidArgumentError(f"{bad} has an IPv6 zone id, which browsers do not send")
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidArgumentError(f"{bad} has a host that is not an IPv6 address") from None
        if address.ipv4_mapped is not None:  # browsers write ::ffff:102:304; Python 3.13 writes ::ffff:1.2.3.4
            return f"[::ffff:{(int(address) >> 16) & 0xffff:x}:{int(address) & 0xffff:x}]"
        return f"[{address.compressed}]"
    if not host.isascii():
        raise InvalidArgumentError(f"{bad}: write the host in its ASCII form (punycode, xn--...), as browsers send it")
    if "*" in host:
        raise InvalidArgumentError(f"{bad}: wildcards are not supported; list each origin")
    if ENDS_IN_NUMBER.fullmatch(host):  # 127.1, 0x7f.0.0.1: browsers send 127.0.0.1
        address = _ipv4(host)
        if address is None:
            raise InvalidArgumentError(f"{bad} has a host that is not an IPv4 address")
        return str(ipaddress.IPv4Address(address))
    if not DNS_NAME.fullmatch(host):
        raise InvalidArgumentError(f"{bad} has a host no browser sends")
    return host


def _ipv4(host: str) -> int | None:
    """The WHATWG URL standard's IPv4 parser: up to four parts split on ".", one empty last part
    dropped, each decimal, octal (a leading 0) or hex (0x); all but the last below 256, the last below
    256 ** (5 - parts). None where the standard fails (the same on every C library: inet_aton's
    differ)."""
    parts = host.split(".")
    if parts[-1] == "" and len(parts) > 1:
        parts.pop()
    if not 0 < len(parts) <= 4:
        return None
    numbers = []
    for p in parts:
        if p == "":  # (only one empty part, the last, is dropped: "1..2" fails)
            return None
        if p[:2].lower() == "0x":
            digits, allowed, radix = p[2:], "0123456789abcdefABCDEF", 16
        elif len(p) > 1 and p[0] == "0":
            digits, allowed, radix = p[1:], "01234567", 8
        else:
            digits, allowed, radix = p, "0123456789", 10
        if any(c not in allowed for c in digits):  # (int() would take its own prefixes: "0x0x1f", "00o7")
            return None
        if len(digits.lstrip("0")) > 11:  # 2**32 or more in any radix (and int() kept to short strings)
            return None
        numbers.append(int(digits, radix) if digits else 0)  # "0x" alone is 0
    if any(n > 255 for n in numbers[:-1]) or numbers[-1] >= 256 ** (5 - len(numbers)):
        return None
    address = numbers[-1]
    for i, n in enumerate(numbers[:-1]):
        address += n * 256 ** (3 - i)
    return address
