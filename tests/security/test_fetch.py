"""`ImageFetcher` against SSRF: allow-list, non-public addresses, URL tricks, redirects, byte cap, file:// root."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import threading
import time

import pytest

from demo.local import free_port
from deployments.ingress.fetch import ImageFetcher
from schemas import ImageURLArgs, InvalidRequest
from tests.helpers import self_signed_certificate
from tests.security.image_server import CAP, PNG, Handler, image_server

LOOPBACK = {"allowed_networks": ["127.0.0.1/32"]}  # the test server's exemption


@pytest.fixture(scope="module")
def server():
    with image_server() as s:
        yield s


def _resolver(table: dict[str, list[str]]):
    async def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]

    return resolve


def _fetch(url: str, resolver=None, max_bytes: int = CAP, **args) -> bytes:
    async def go():
        fetcher = ImageFetcher(
            ImageURLArgs(**{"allow_http": True, "allowed_domains": ["*"], **args}), max_bytes, resolver
        )
        try:
            return await fetcher.fetch(url)
        finally:
            await fetcher.aclose()

    return asyncio.run(go())


def _fails(url: str, status: int, code: str, **kw) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        _fetch(url, **kw)
    assert (e.value.status, e.value.code) == (status, code), e.value.message
    return e.value


def test_accepts_http_https_file_only():
    fetcher = ImageFetcher(ImageURLArgs(), CAP)
    assert all(fetcher.accepts(u) for u in ("http://a/x.png", "HTTPS://a/x.png", "File:///x.png"))
    assert not any(fetcher.accepts(u) for u in ("data:image/png;base64,AA==", "ftp://a/x", "x.png", ""))


def test_http_off_says_how_to_turn_it_on():
    e = _fails("http://example.com/x.png", 400, "image_url_not_allowed", allow_http=False, allowed_domains=[])
    assert "data:" in e.message and "image_urls.allow_http" in e.message


def test_file_off_by_default():
    e = _fails("file:///etc/passwd", 400, "image_url_not_allowed")
    assert "image_urls.file_root" in e.message


@pytest.mark.parametrize(
    "url", ["ftp://example.com/x.png", "gopher://example.com/_x", "javascript:alert(1)", "dict://127.0.0.1:11211/stat"]
)
def test_other_schemes_named(url):
    e = _fails(url, 400, "image_url_not_allowed")
    assert repr(url.split(":")[0]) in e.message


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:80\\@evil.com/x.png",  # backslash: parsers disagree on which host this is
        "http://evil.com@127.0.0.1/x.png",  # userinfo
        "http://user:pass@images.test/x.png",
        "http://images.test/x .png",
        "http://images.test/x\t.png",
        "http://images.test\n/x.png",
        "http:///x.png",  # no host
        "http://images.test:99999/x.png",  # port out of range
        "http://images.test:0/x.png",
        "http://[::1/x.png",
        "http://[fe80::1%25eth0]/x.png",  # zone id
        "http://ex%61mple.com/x.png",
        "http://1.2.3.4.5/x.png",  # a numeric last label makes it an IPv4 address, and this is not one
        "http://256.1.1.1/x.png",
    ],
)
def test_malformed_urls(url):
    _fails(url, 400, "invalid_image_url", resolver=_resolver({"images.test": ["93.184.216.34"]}))


def test_domain_not_in_allow_list():
    e = _fails("http://evil.test/x.png", 400, "image_url_not_allowed", allowed_domains=["images.test"])
    assert "evil.test" in e.message


@pytest.mark.parametrize(
    "host,allowed",
    [
        ("a.example.com", True),
        ("a.b.example.com", True),
        ("A.Example.COM.", True),
        ("example.com", False),
        ("badexample.com", False),
        ("example.com.evil.test", False),
        ("10.0.0.1", False),
    ],
)
def test_wildcard_domain_rules(host, allowed):
    # NOTE: every name resolves to 10.0.0.1, so a host past the allow-list is stopped by the address check instead.
    resolver = _resolver(
        {
            h: ["10.0.0.1"]
            for h in ("a.example.com", "a.b.example.com", "example.com", "badexample.com", "example.com.evil.test")
        }
    )
    _fails(
        f"http://{host}/x.png",
        400,
        "image_url_forbidden" if allowed else "image_url_not_allowed",
        allowed_domains=["*.example.com"],
        resolver=resolver,
    )


def test_ip_literal_matches_only_itself_in_allow_list():
    _fails("http://10.0.0.1/x.png", 400, "image_url_forbidden", allowed_domains=["10.0.0.1"])
    _fails("http://10.0.0.2/x.png", 400, "image_url_not_allowed", allowed_domains=["10.0.0.1"])


@pytest.mark.parametrize(
    "address",
    [
        "10.1.2.3",
        "192.168.1.1",
        "172.16.0.1",
        "100.64.0.1",
        "169.254.169.254",
        "127.0.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "fec0::1",
        "ff02::1",
        "::ffff:127.0.0.1",
        "2002:a00:1::1",
        "64:ff9b::a00:1",
    ],
)
def test_name_resolving_to_non_public_address(address):
    e = _fails("http://evil.test/x.png", 400, "image_url_forbidden", resolver=_resolver({"evil.test": [address]}))
    assert "evil.test" in e.message and address not in e.message


def test_rebinding_one_private_address_blocks():
    _fails(
        "http://rebind.test/x.png",
        400,
        "image_url_forbidden",
        resolver=_resolver({"rebind.test": ["93.184.216.34", "127.0.0.1"]}),
    )


def test_loopback_blocked_without_exemption(server):
    base, _ = server
    _fails(f"{base}/img.png", 400, "image_url_forbidden")


@pytest.mark.parametrize(
    "host",
    [
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "127.1",
        "127.0.0.1.",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "localhost",
    ],
)
def test_loopback_spellings_blocked(server, host):
    _, port = server  # NOTE: the default resolver: numeric forms must not reach the (real) DNS either
    _fails(f"http://{host}:{port}/img.png", 400, "image_url_forbidden")


def test_numeric_form_is_the_address_it_spells(server):
    _, port = server
    assert _fetch(f"http://2130706433:{port}/img.png", allowed_domains=["127.0.0.1"], **LOOPBACK) == PNG


def test_fetch_ok_and_log_has_no_query(server, caplog):
    base, _ = server
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        assert _fetch(f"{base}/img.png?token=s3cret", allowed_domains=["127.0.0.1"], **LOOPBACK) == PNG
    line = next(r.getMessage() for r in caplog.records if "image fetch" in r.getMessage())
    assert "host=127.0.0.1" in line and "status=200" in line and f"bytes={len(PNG)}" in line
    assert "s3cret" not in caplog.text and "img.png" not in caplog.text


def test_connects_to_vetted_ip_with_original_host_and_no_cookies(server):
    _, port = server
    resolver = _resolver({"images.test": ["127.0.0.1"]})

    async def go():
        fetcher = ImageFetcher(
            ImageURLArgs(allow_http=True, allowed_domains=["images.test"], **LOOPBACK), CAP, resolver
        )
        try:
            return [await fetcher.fetch(f"http://images.test:{port}/img.png?n={n}") for n in range(2)]
        finally:
            await fetcher.aclose()

    Handler.seen.clear()
    assert asyncio.run(go()) == [PNG, PNG]
    assert [s["host"] for s in Handler.seen] == [f"images.test:{port}"] * 2
    assert [s["cookie"] for s in Handler.seen] == [None, None]  # the first answer's Set-Cookie is not sent back
    assert Handler.seen[0]["user_agent"] == "vlm-serve"


def test_https_connects_to_the_ip_with_sni_name_and_verifies_it(tmp_path):
    cert, key = self_signed_certificate("images.test", tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    names = []
    context.sni_callback = lambda sock, name, ctx: names.append(name)

    def serve(listener):
        try:
            conn, _ = listener.accept()
            with context.wrap_socket(conn, server_side=True):
                pass
        except OSError:  # the client refuses the self-signed certificate, as it must
            pass

    with socket.create_server(("127.0.0.1", 0)) as listener:
        thread = threading.Thread(target=serve, args=(listener,), daemon=True)
        thread.start()
        _fails(
            f"https://images.test:{listener.getsockname()[1]}/x.png",
            502,
            "image_url_fetch_failed",
            resolver=_resolver({"images.test": ["127.0.0.1"]}),
            **LOOPBACK,
        )
        thread.join(2)
    assert names == ["images.test"]


@pytest.mark.parametrize("path,status", [("/404", 422), ("/500", 502), ("/empty", 422)])
def test_remote_errors(server, path, status):
    base, _ = server
    e = _fails(f"{base}{path}", status, "image_url_fetch_failed", **LOOPBACK)
    assert ("empty body" if path == "/empty" else f"HTTP {path[1:]}") in e.message


def test_connection_refused_is_502():
    _fails(f"http://127.0.0.1:{free_port()}/x.png", 502, "image_url_fetch_failed", **LOOPBACK)


def test_dns_failures():
    _fails("http://nxdomain.test/x.png", 422, "image_url_fetch_failed", resolver=_resolver({}))

    async def flaky(host, port):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    _fails("http://flaky.test/x.png", 502, "image_url_fetch_failed", resolver=flaky)

    async def broken(host, port):
        raise RuntimeError("resolver bug")

    e = _fails("http://broken.test/x.png", 502, "image_url_fetch_failed", resolver=broken)
    assert "resolver bug" not in e.message


def test_slow_server_and_slow_dns_time_out(server):
    base, _ = server
    start = time.monotonic()
    _fails(f"{base}/slow", 504, "image_url_timeout", timeout_s=0.4, **LOOPBACK)

    async def slow(host, port):
        await asyncio.sleep(5)

    _fails("http://slow.test/x.png", 504, "image_url_timeout", timeout_s=0.2, resolver=slow)
    assert time.monotonic() - start < 20  # a generous cap: the server would take SLOW_S (60 s), the DNS 5 s


def test_cancel_is_not_turned_into_an_error(server):
    base, _ = server

    async def go():
        fetcher = ImageFetcher(ImageURLArgs(allow_http=True, allowed_domains=["*"], **LOOPBACK), CAP)
        Handler.seen.clear()
        task = asyncio.create_task(fetcher.fetch(f"{base}/slow"))
        while not Handler.seen:  # the server has the request: the fetch is waiting for its answer
            assert not task.done(), task
            await asyncio.sleep(0.01)
        task.cancel()
        try:
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await fetcher.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("path", ["/big", "/big-chunked"])
def test_byte_cap(server, path):
    base, _ = server
    e = _fails(f"{base}{path}", 413, "image_too_large", **LOOPBACK)
    assert str(CAP) in e.message


def test_redirect_followed(server):
    base, _ = server
    assert _fetch(f"{base}/redirect?to=/img.png", **LOOPBACK) == PNG


@pytest.mark.parametrize(
    "to,code",
    [
        ("http://169.254.169.254/latest/meta-data", "image_url_forbidden"),
        ("http://127.0.0.2:{port}/img.png", "image_url_forbidden"),  # loopback, but not the exempt address
        ("file:///etc/passwd", "image_url_not_allowed"),
        ("gopher://127.0.0.1:{port}/_x", "image_url_not_allowed"),
    ],
)
def test_redirect_target_checked_again(server, tmp_path, to, code):
    base, port = server
    _fails(f"{base}/redirect?to={to.format(port=port)}", 400, code, file_root=str(tmp_path), **LOOPBACK)


def test_redirect_leaving_allow_list(server):
    base, port = server
    _fails(
        f"{base}/redirect?to=http://localhost:{port}/img.png",
        400,
        "image_url_not_allowed",
        allowed_domains=["127.0.0.1"],
        **LOOPBACK,
    )


def test_too_many_redirects(server):
    base, _ = server
    e = _fails(f"{base}/loop", 422, "image_url_redirects", max_redirects=3, **LOOPBACK)
    assert "3" in e.message
    _fails(f"{base}/redirect?to=/img.png", 422, "image_url_redirects", max_redirects=0, **LOOPBACK)


@pytest.fixture
def root(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "cat.png").write_bytes(PNG)
    (tmp_path / "images" / "big.png").write_bytes(b"x" * (CAP + 1))
    (tmp_path / "images" / "empty.png").write_bytes(b"")
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", tmp_path / "images" / "escape.png")
    os.symlink(tmp_path / "images" / "cat.png", tmp_path / "images" / "alias.png")
    return tmp_path / "images"


def test_file_inside_root(root):
    assert _fetch(f"file://{root}/cat.png", file_root=str(root)) == PNG
    assert _fetch(f"file://localhost{root}/alias.png", file_root=str(root)) == PNG  # a link that stays inside


@pytest.mark.parametrize(
    "path",
    [
        "{root}/../secret.png",
        "{root}/escape.png",
        "{root}/%2e%2e/secret.png",
        "{root}/%2E%2E%2Fsecret.png",
        "/etc/passwd",
        "{root}/cat.png%00.txt",
    ],
)
def test_file_outside_root(root, path):
    _fails("file://" + path.format(root=root), 400, "image_url_forbidden", file_root=str(root))


def test_file_errors(root):
    e = _fails(f"file://{root}/missing.png", 422, "image_url_fetch_failed", file_root=str(root))
    assert "not found" in e.message
    _fails(f"file://{root}/", 422, "image_url_fetch_failed", file_root=str(root))  # a directory
    _fails(f"file://{root}/empty.png", 422, "image_url_fetch_failed", file_root=str(root))
    _fails(f"file://{root}/big.png", 413, "image_too_large", file_root=str(root))
    _fails(f"file://otherhost{root}/cat.png", 400, "invalid_image_url", file_root=str(root))


def test_aclose_twice_is_fine(server):
    base, _ = server

    async def go():
        fetcher = ImageFetcher(ImageURLArgs(allow_http=True, allowed_domains=["*"], **LOOPBACK), CAP)
        assert await fetcher.fetch(f"{base}/img.png") == PNG
        await fetcher.aclose()
        await fetcher.aclose()

    asyncio.run(go())
