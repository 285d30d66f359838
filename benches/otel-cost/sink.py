"""An OTLP/HTTP sink for benches/otel-cost/run.sh: answers every POST 200 and, on SIGTERM, prints
the POSTs and body bytes it was sent as `posts bytes`."""

import http.server
import signal
import sys
import threading
import time

seen = [0, 0]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        seen[0] += 1
        seen[1] += len(body)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
signal.signal(signal.SIGTERM, lambda *_: (print(seen[0], seen[1], flush=True), sys.exit(0)))
while True:
    time.sleep(1)
