"""A loopback HTTP server of test images and of the tricks an image URL can play (errors, slowness, size, redirects)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from demo.inputs import image_bytes, make_image

PNG = image_bytes(make_image(8, 8))
CAP = 10_000  # /big is one byte over it
SLOW_S = 60.0


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict] = []  # one entry per request: path, Host, Cookie, User-Agent

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes = b"", **headers: str):
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        url = urlsplit(self.path)
        self.seen.append(
            {
                "path": self.path,
                "host": self.headers["Host"],
                "cookie": self.headers["Cookie"],
                "user_agent": self.headers["User-Agent"],
            }
        )
        try:
            if url.path == "/img.png":
                self._send(200, PNG, Content_Type="image/png", Set_Cookie="sid=secret; Path=/")
            elif url.path in ("/404", "/500"):
                self._send(int(url.path[1:]), b"nope")
            elif url.path == "/empty":
                self._send(200)
            elif url.path == "/slow":  # longer than any client here waits: the client's timeout always fires first
                time.sleep(SLOW_S)
                self._send(200, PNG)
            elif url.path == "/big":  # NOTE: says the size up front; the client must not wait for the body
                self._send(200, b"x" * (CAP + 1))
            elif url.path == "/big-chunked":
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for _ in range(200):
                    self.wfile.write(b"1000\r\n" + b"x" * 4096 + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
            elif url.path == "/redirect":
                self._send(302, Location=parse_qs(url.query)["to"][0])
            elif url.path == "/loop":
                self._send(302, Location="/loop")
            else:
                self._send(404)
        except OSError:  # the client hung up on purpose (byte cap, timeout)
            pass


@contextmanager
def image_server() -> Iterator[tuple[str, int]]:
    """(base URL, port) of a server on 127.0.0.1 for as long as the block runs."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}", httpd.server_port
    finally:
        httpd.shutdown()
        httpd.server_close()


__all__ = ["CAP", "PNG", "Handler", "image_server"]
