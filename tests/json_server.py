"""A local JSON-over-HTTP server for tests (127.0.0.1 only): each POST is answered by a
function of the request, on its own thread, as real servers answer concurrent requests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# (path, headers, JSON body) -> (status, JSON answer, seconds to wait before answering)
Answer = Callable[[str, Mapping[str, str], dict[str, Any]], tuple[int, Any, float]]


@contextmanager
def json_server(answer: Answer) -> Iterator[str]:
    """Serve ``answer`` until the block ends; yields ``http://127.0.0.1:<port>``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the http.server API)
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            status, payload, delay_s = answer(self.path, dict(self.headers), body)
            time.sleep(delay_s)
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (the deadline tests)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
