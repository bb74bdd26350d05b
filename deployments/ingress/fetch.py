"""`ImageFetcher`: http(s) and file:// image URLs fetched safely: vetted by `URLPolicy`, pinned to the vetted
address, redirects checked again, a byte cap and a deadline. `MediaFetcher`: a chat request's images and videos."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from http.cookiejar import CookieJar, DefaultCookiePolicy
from urllib.parse import unquote, urljoin

import httpx

from deployments.ingress.prepare import image_params
from deployments.ingress.urls import Resolver, URLPolicy, url_error
from deployments.ingress.videos import video_urls
from schemas import ImageURLArgs, InvalidRequest
from schemas.openai import ChatCompletionRequest

logger = logging.getLogger("ray.serve")

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# NOTE: identity encoding: images are compressed already, and a gzip bomb would blow past the byte cap in one chunk.
_HEADERS = {"User-Agent": "vlm-serve", "Accept": "image/*,*/*;q=0.8", "Accept-Encoding": "identity"}


class ImageFetcher:
    def __init__(self, args: ImageURLArgs, max_bytes: int, resolver: Resolver | None = None):
        self.args, self.max_bytes, self.policy = args, max_bytes, URLPolicy(args, resolver)
        self._root = self.policy.root
        self._http: httpx.AsyncClient | None = None

    def accepts(self, url: str) -> bool:
        scheme, sep, _ = url.partition(":")
        return bool(sep) and scheme.lower() in ("http", "https", "file")

    async def aclose(self) -> None:
        if self._http is not None:
            client, self._http = self._http, None
            await client.aclose()

    async def fetch_all(self, images: list[tuple[str, str]]) -> dict[str, bytes]:
        """{JSON path: bytes} of the (JSON path, url) pairs that are ours, fetched concurrently; the first failure
        (named by its path) cancels the others."""

        async def one(param: str, url: str) -> tuple[str, bytes]:
            try:
                return param, await self.fetch(url)
            except InvalidRequest as e:
                raise InvalidRequest(f"{param}: {e.message}", param=param, code=e.code, status=e.status) from e

        tasks = [asyncio.ensure_future(one(param, url)) for param, url in images if self.accepts(url)]
        try:
            return dict(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def fetch(self, url: str) -> bytes:
        log, start = {"host": "-", "status": 0, "bytes": 0, "redirects": 0}, time.monotonic()
        try:
            async with asyncio.timeout(self.args.timeout_s):
                data = await self._fetch(url, log)
            log["bytes"] = len(data)
            return data
        except InvalidRequest as e:
            log["status"] = e.status
            raise
        except Exception as e:
            err = _failure(e, log["host"], self.args.timeout_s)
            log["status"] = err.status
            raise err from e
        finally:  # NOTE: host only, never path or query: those may carry tokens.
            logger.info(
                "image fetch host=%s status=%d bytes=%d redirects=%d ms=%.0f",
                log["host"],
                log["status"],
                log["bytes"],
                log["redirects"],
                (time.monotonic() - start) * 1000,
            )

    async def _fetch(self, url: str, log: dict) -> bytes:
        t = self.policy.parse(url, redirect=False)
        log["host"] = t.host or "file"
        if t.scheme == "file":
            log["status"] = 200
            return await asyncio.to_thread(self._read_file, t.target)
        while True:
            ip = await self.policy.vet(t)
            host = f"[{t.host}]" if ":" in t.host else t.host
            default_port = 443 if t.scheme == "https" else 80
            request = self._client().build_request(
                "GET",
                f"{t.scheme}://{f'[{ip}]' if ip.version == 6 else ip}:{t.port}{t.target}",
                headers={"Host": host if t.port == default_port else f"{host}:{t.port}"},
                # NOTE: connect to the vetted address (no second DNS lookup to rebind), yet TLS checks the name.
                extensions={"sni_hostname": t.host} if t.scheme == "https" and t.ip is None else {},
            )
            response = await self._client().send(request, stream=True)
            try:
                log["status"] = response.status_code
                location = response.headers.get("location")
                if response.status_code not in _REDIRECTS or not location:
                    return await self._body(response, t.host)
            finally:
                await response.aclose()
            log["redirects"] += 1
            if log["redirects"] > self.args.max_redirects:
                raise url_error(
                    f"image URL redirected more than image_urls.max_redirects={self.args.max_redirects} "
                    f"times (last from {t.host})",
                    "image_url_redirects",
                    422,
                )
            url = urljoin(url, location)
            t = self.policy.parse(url, redirect=True)
            log["host"] = t.host

    async def _body(self, response: httpx.Response, host: str) -> bytes:
        status = response.status_code
        if not 200 <= status < 300:
            raise url_error(
                f"image host {host} answered HTTP {status}", "image_url_fetch_failed", 502 if status >= 500 else 422
            )
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            raise url_error(f"image is {int(length)} bytes, over the limit of {self.max_bytes}", "image_too_large", 413)
        chunks, num_bytes = [], 0
        async for chunk in response.aiter_bytes():
            num_bytes += len(chunk)
            if num_bytes > self.max_bytes:  # NOTE: stop reading at once: the rest may be endless
                raise url_error(
                    f"image is over the limit of {self.max_bytes} bytes (stopped reading at {num_bytes})",
                    "image_too_large",
                    413,
                )
            chunks.append(chunk)
        if not num_bytes:
            raise url_error(
                f"image host {host} answered HTTP {status} with an empty body", "image_url_fetch_failed", 422
            )
        return b"".join(chunks)

    def _read_file(self, given: str) -> bytes:
        path = unquote(given)  # NOTE: before realpath, so %2e%2e is a '..' that realpath resolves
        real = os.path.realpath(path) if "\x00" not in path else ""
        if not real or os.path.commonpath([real, self._root]) != self._root:
            raise url_error(f"file {given[:256]} is outside image_urls.file_root", "image_url_forbidden")
        try:  # NOTE: O_NONBLOCK so that a FIFO cannot hang the thread; O_NOFOLLOW against a late-swapped symlink
            with open(os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
                info = os.fstat(f.fileno())
                data = f.read(self.max_bytes + 1) if stat.S_ISREG(info.st_mode) else None
        except OSError as e:
            why = "not found" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror})"
            raise url_error(f"file {given[:256]} {why}", "image_url_fetch_failed", 422) from e
        if not data:
            raise url_error(
                f"file {given[:256]} is {'empty' if data is not None else 'not a regular file'}",
                "image_url_fetch_failed",
                422,
            )
        if len(data) > self.max_bytes:
            raise url_error(
                f"image is {info.st_size} bytes, over the limit of {self.max_bytes}", "image_too_large", 413
            )
        return data

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                follow_redirects=False,
                trust_env=False,
                timeout=self.args.timeout_s,
                headers=_HEADERS,
                cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])),  # NOTE: keeps no cookie, sends none
                # NOTE: no pooled connections: a pool keys them by (scheme, IP, port), so a TLS connection made
                # for one name (SNI, certificate) would be reused for another name on the same address.
                limits=httpx.Limits(max_keepalive_connections=0),
            )
        return self._http


class MediaFetcher:
    """A chat request's remote images and videos (and video frames), each kind under its own byte cap."""

    def __init__(self, args: ImageURLArgs, max_image_bytes: int, max_video_bytes: int):
        self.images, self.videos = ImageFetcher(args, max_image_bytes), ImageFetcher(args, max_video_bytes)

    async def fetch_request(self, req: ChatCompletionRequest) -> dict[str, bytes]:
        """Their bytes by JSON path."""
        fetched = await self.images.fetch_all([(param, url) for _, param, url in image_params(req)])
        return fetched | await self.videos.fetch_all(video_urls(req))


def _failure(e: Exception, host: str, timeout_s: float) -> InvalidRequest:
    if isinstance(e, (TimeoutError, httpx.TimeoutException)):
        return url_error(f"fetching the image from {host} took over {timeout_s} s", "image_url_timeout", 504)
    if isinstance(e, (httpx.HTTPError, OSError)):  # refused, reset, TLS failure, malformed response
        return url_error(f"could not fetch the image from {host} ({type(e).__name__})", "image_url_fetch_failed", 502)
    # NOTE: the caller gets an InvalidRequest whatever an injected resolver raised; the details go to the log only.
    logger.warning("image fetch from %s failed", host, exc_info=e)
    return url_error(f"could not fetch the image from {host}", "image_url_fetch_failed", 502)


__all__ = ["ImageFetcher", "MediaFetcher", "Resolver"]
