"""Image URLs, checked before anything is fetched: scheme, host allow-list, and public addresses only (SSRF)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import socket
from collections.abc import Awaitable, Callable
from typing import NamedTuple
from urllib.parse import urlsplit

from schemas import ImageURLArgs, InvalidRequest

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> IP address strings
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
# NOTE: a host whose last label is a number is an IPv4 address to browsers (WHATWG URL), in any of inet_aton's forms
# (2130706433, 0x7f000001, 0177.0.0.1, 127.1): canonicalised here so the allow-list and the address checks see it.
_NUMERIC_LABEL = re.compile(r"0x[0-9a-f]*|[0-9]+")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class Target(NamedTuple):
    scheme: str
    host: str  # lower-cased, no trailing dot, IPv4 canonical, IPv6 without brackets; "" for file:
    port: int
    target: str  # path (and ?query) as given
    ip: IPAddress | None  # the host, when it is an IP literal


def url_error(message: str, code: str = "invalid_image_url", status: int = 400) -> InvalidRequest:
    return InvalidRequest(message, code=code, status=status)


def is_public(ip: IPAddress) -> bool:
    if ip.version == 6:
        embedded = (
            ip.ipv4_mapped or ip.sixtofour or (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None)
        )
        if (embedded is not None and not is_public(embedded)) or ip.is_site_local:
            return False
    # NOTE: is_global alone lets multicast (224/4, ff00::/8) through, hence the explicit checks.
    return ip.is_global and not (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved or ip.is_unspecified
    )


async def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class URLPolicy:
    """What `image_urls` allows: parses a URL once, strictly, and vets the addresses its host resolves to."""

    def __init__(self, args: ImageURLArgs, resolver: Resolver | None = None):
        self.args, self._resolve = args, resolver or _getaddrinfo
        domains = [d.lower().removesuffix(".") for d in args.allowed_domains]
        self._any_host = "*" in domains
        self._domain_ips = {ip for d in domains if (ip := as_ip(d.strip("[]"))) is not None}
        self._names = {d for d in domains if not d.startswith("*.")}
        self._suffixes = tuple(d[1:] for d in domains if d.startswith("*."))  # ".example.com"
        self._networks = [ipaddress.ip_network(n, strict=False) for n in args.allowed_networks]
        self.root = os.path.realpath(args.file_root) if args.file_root is not None else None

    def parse(self, url: str, redirect: bool) -> Target:
        where = "redirect target" if redirect else "image URL"
        if len(url) > 8192 or any(not "!" <= c <= "~" or c == "\\" for c in url):
            raise url_error(
                f"{where} must be at most 8192 characters of printable ASCII without spaces or backslashes "
                "(percent-encode the rest)"
            )
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise url_error(f"{where} is malformed: {e}") from e
        if parts.scheme in ("http", "https"):
            if not self.args.allow_http:
                raise url_error(
                    "only data: URLs are accepted for images; set image_urls.allow_http (and "
                    "image_urls.allowed_domains) to fetch http(s) URLs",
                    "image_url_not_allowed",
                )
        elif parts.scheme == "file" and not redirect:
            if self.root is None:
                raise url_error(
                    "only data: URLs are accepted for images; set image_urls.file_root to read file:// URLs",
                    "image_url_not_allowed",
                )
            if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
                raise url_error("file URLs must be file:///absolute/path (no host)")
            return Target("file", "", 0, parts.path, None)
        else:
            raise url_error(
                f"{where} scheme {(parts.scheme or '(none)')[:16]!r} is not supported: data:, http: and "
                f"https:{'' if redirect else ' (and file:)'} are",
                "image_url_not_allowed",
            )
        if "@" in parts.netloc:
            raise url_error(f"{where} must not carry credentials (user:password@host)")
        host = parts.hostname or ""
        if parts.netloc.startswith("["):
            ip = as_ip(host) if "%" not in host else None  # NOTE: no IPv6 zone ids: they pick an interface
            if ip is None or ip.version != 6:
                raise url_error(f"{where} host [{host[:64]}] is not an IPv6 address")
        else:
            host = host.removesuffix(".")
            if not _NAME.fullmatch(host):
                raise url_error(f"{where} has no host, or a host {host[:64]!r} that is not a DNS name or IP address")
            ip = None
            if _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]):
                try:
                    ip = ipaddress.IPv4Address(socket.inet_aton(host))
                except OSError as e:
                    raise url_error(f"{where} host {host[:64]!r} is not a valid IPv4 address") from e
                host = str(ip)
        if port == 0:
            raise url_error(f"{where} port 0 is not a port")
        # NOTE: an IP literal matches only itself: "*.example.com" must not match 10.0.0.1 by a suffix accident.
        if not (
            self._any_host
            or (ip in self._domain_ips if ip is not None else host in self._names or host.endswith(self._suffixes))
        ):
            raise url_error(f"image host {host} is not in image_urls.allowed_domains", "image_url_not_allowed")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return Target(parts.scheme, host, port or (443 if parts.scheme == "https" else 80), target, ip)

    async def vet(self, t: Target) -> IPAddress:
        """Every address of the host must be public (or in allowed_networks); returns the one to connect to."""
        if t.ip is not None:
            found = [str(t.ip)]
        else:
            try:
                found = await self._resolve(t.host, t.port)
            except socket.gaierror as e:
                # NOTE: a name that does not exist is the client's error (422, retrying won't help); a failing DNS
                # server is ours to report (502).
                if e.errno in (socket.EAI_NONAME, socket.EAI_NODATA):
                    raise url_error(f"image host {t.host} does not resolve", "image_url_fetch_failed", 422) from e
                raise url_error(f"image host {t.host} could not be resolved now", "image_url_fetch_failed", 502) from e
        ips = [
            (ip.ipv4_mapped or ip) if ip.version == 6 else ip
            for ip in (ipaddress.ip_address(a.split("%", 1)[0]) for a in found)
        ]
        if not ips:
            raise url_error(f"image host {t.host} does not resolve", "image_url_fetch_failed", 422)
        for ip in ips:
            if not is_public(ip) and not any(ip.version == n.version and ip in n for n in self._networks):
                # NOTE: the address is not named: it would map the internal network for the caller.
                raise url_error(f"image host {t.host} resolves to a non-public address", "image_url_forbidden")
        return ips[0]


def as_ip(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


__all__ = ["IPAddress", "Resolver", "Target", "URLPolicy", "as_ip", "is_public", "url_error"]
