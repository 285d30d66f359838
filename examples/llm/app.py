"""An LLM-style endpoint behind Floodgate's WSGI middleware, on the standard library alone.

Per API key (X-API-Key): at most 10,000 tokens a minute, counted after each response from its
x-usage-tokens header, and at most 2 requests in flight, released when each response ends (the rules
are examples/llm/rules.toml, given to the agent):

    cargo run --release --bin floodgate -- agent --rules examples/llm/rules.toml
    pip install ./sdk-python && python3 examples/llm/app.py     # listens on 127.0.0.1:8081

Each request "generates" for X-Demo-Ms milliseconds (default 2,000) and reports X-Demo-Tokens tokens
(default 1,500).

POST /v1/complete streams its answer (server-sent events). Outside the middleware, it reserves its
input (X-Demo-Prompt-Tokens, default 200) and its X-Max-Tokens of output (default 1,000) before the
model runs, all or nothing with a request on the large model, and commits what the stream used when
it ends; past the key's quota of the large model (quota mode) the small one answers. It streams
X-Demo-Tokens tokens (default 600, at most X-Max-Tokens) in chunks of 100.
"""
import json
import os
import socketserver
import time
from wsgiref.simple_server import WSGIServer, make_server

from floodgate import Client, Meter
from floodgate.middleware.wsgi import FloodgateWSGIMiddleware

client = Client()


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


def complete(environ, start_response):
    key = environ.get("HTTP_X_API_KEY")
    if not key:
        start_response("401 Unauthorized", [("content-type", "text/plain")])
        return [b"x-api-key is required\n"]
    prompt = int(environ.get("HTTP_X_DEMO_PROMPT_TOKENS", "200"))
    max_tokens = int(environ.get("HTTP_X_MAX_TOKENS", "1000"))
    meters = [
        Meter(f"apikey:{key}", "llm-input-tokens", prompt),
        Meter(f"apikey:{key}", "llm-output-tokens", max_tokens),
        Meter(f"apikey:{key}", "llm-large-model", 1),
    ]
    decision, reservation = client.reserve_meters(meters)
    if not decision.allowed:
        retry = max(1, -(-(decision.retry_after_ms or 1000) // 1000))
        start_response("429 Too Many Requests", [("content-type", "text/plain"), ("retry-after", str(retry))])
        return [b"tokens exhausted\n"]
    # Quota mode: past its quota of the large model, the key is answered by the small one.
    model = "small" if decision.over_quota else "large"
    tokens = min(int(environ.get("HTTP_X_DEMO_TOKENS", "600")), max_tokens)
    start_response("200 OK", [("content-type", "text/event-stream"), ("x-model", model)])

    def stream():
        used = 0
        try:
            while used < tokens:
                n = min(100, tokens - used)
                used += n
                yield f"data: {json.dumps({'model': model, 'tokens': n}, separators=(',', ':'))}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            # The stream ended, or the client went away (the server closes the generator): commit
            # what it used; the unused output goes back.
            if reservation is not None:
                client.commit(reservation, [prompt, used, 1])

    return stream()


def routes(environ, start_response):
    # /v1/complete reserves and commits through the client itself: it is outside the middleware.
    if environ["PATH_INFO"] == "/v1/complete" and environ["REQUEST_METHOD"] == "POST":
        return complete(environ, start_response)
    return app(environ, start_response)


class ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


if __name__ == "__main__":
    port = int(os.environ.get("PORT", "8081"))
    with make_server("127.0.0.1", port, routes, server_class=ThreadingServer) as server:
        print(f"llm example listening on 127.0.0.1:{port}")
        server.serve_forever()
