"""An LLM-style endpoint behind Floodgate's WSGI middleware, on the standard library alone.

Per API key (X-API-Key): at most 10,000 tokens a minute, counted after each response from its
x-usage-tokens header, and at most 2 requests in flight, released when each response ends (the rules
are examples/llm/rules.toml, given to the agent):

    cargo run --release --bin floodgate -- agent --rules examples/llm/rules.toml
    pip install ./sdk-python && python3 examples/llm/app.py     # listens on 127.0.0.1:8081

Each request "generates" for X-Demo-Ms milliseconds (default 2,000) and reports X-Demo-Tokens tokens
(default 1,500).
"""
import json
import os
import socketserver
import time
from wsgiref.simple_server import WSGIServer, make_server

from floodgate.middleware.wsgi import FloodgateWSGIMiddleware


def chat(environ, start_response):
    if environ["PATH_INFO"] != "/v1/chat" or environ["REQUEST_METHOD"] != "POST":
        start_response("404 Not Found", [("content-type", "text/plain")])
        return [b"not found\n"]
    time.sleep(int(environ.get("HTTP_X_DEMO_MS", "2000")) / 1000)
    tokens = int(environ.get("HTTP_X_DEMO_TOKENS", "1500"))
    body = json.dumps({"answer": "...", "usage": {"total_tokens": tokens}}).encode()
    start_response("200 OK", [("content-type", "application/json"), ("x-usage-tokens", str(tokens))])
    return [body]


app = FloodgateWSGIMiddleware(
    chat,
    # Only for this demo: in production an authenticating hop sets the key.
    api_key_header="x-api-key",
    # Let in unless the key is past its tokens; the response's count is charged afterwards. The
    # concurrency rule holds a slot until the response is closed.
    charge_headers={"/v1/chat": "x-usage-tokens"},
)


class ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


if __name__ == "__main__":
    port = int(os.environ.get("PORT", "8081"))
    with make_server("127.0.0.1", port, app, server_class=ThreadingServer) as server:
        print(f"llm example listening on 127.0.0.1:{port}")
        server.serve_forever()
