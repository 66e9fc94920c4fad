"""The HTTP server behind every `/metrics` endpoint, bounded: at most MAX_CONNECTIONS connections are
served at once (one thread each; any more is closed at once, never queued on a thread), and a connection
that sends nothing for TIMEOUT_S is closed. Idle connections, however many, cost no more than the cap.
"""

from __future__ import annotations

import socket
import sys
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

MAX_CONNECTIONS = 16
"""Connections a /metrics endpoint serves at once (a scrape is one, briefly)."""
TIMEOUT_S = 10.0
"""A connection idle this long (no request, or a request not finished) is closed."""


class _QuietHandler(WSGIRequestHandler):
    timeout = TIMEOUT_S  # (socketserver sets it on the connection: every read and write is bounded)

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing (a scrape every few seconds would fill the worker's log)."""


class BoundedServer(ThreadingMixIn, WSGIServer):
    """A WSGI server with one daemon thread per connection, at most `max_connections` of them."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    request_queue_size = 128  # (socketserver's 5 leaves a burst of connects waiting on SYN retries)

    def server_activate(self) -> None:
        self.slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # full: close it now rather than start a thread
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or went away is no error of the server's; anything else is
        printed as socketserver does."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def start(app: Any, host: str, port: int, timeout_s: float = TIMEOUT_S) -> BoundedServer:
    """Serve WSGI `app` on `host:port` (IPv4 or IPv6, by the address) from a daemon thread; `shutdown`
    and `server_close` stop it. Raises OSError when the address cannot be bound."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server_class = type("Server", (BoundedServer,), {"address_family": family})
    handler = type("Handler", (_QuietHandler,), {"timeout": timeout_s})
    server = make_server(sockaddr[0], port, app, server_class, handler_class=handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
