"""``relpos explore``: a local page with three interactive views, numbers served by relpos itself.

* ``/``: the page (``explore_static/``: HTML, JS and CSS shipped with the package, nothing fetched
  from outside);
* ``/api/buckets``: :func:`relpos.bucket_table` (the T5 bucket explorer);
* ``/api/bias``: :func:`relpos.plots.bias_matrix` (the bias heatmap);
* ``/api/attention``: :func:`relpos.plots.seed004_weights` (standard vs biased attention).

Every parameter is validated on the server: a bad value gets HTTP 400 with a readable message
(shown on the page), never a traceback, and the server stays up.
"""

from __future__ import annotations

import json
import pathlib
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from .buckets import STRATEGIES, bucket_table
from .plots import BIAS_KINDS, SEED004_TOKENS, bias_matrix, seed004_weights

__all__ = ["make_server", "serve", "MAX_LENGTH"]

STATIC = pathlib.Path(__file__).parent / "explore_static"
MAX_LENGTH = 128  # the heatmap's side: larger matrices are slow to draw and say nothing new
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}


class BadRequest(ValueError):
    pass


def _param(query: dict, name: str, kind, default):
    raw = query.get(name, [None])[0]
    if raw is None or raw == "":
        return default
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise BadRequest(f"{name} must be true or false, got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        raise BadRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None


def _api_buckets(query: dict) -> dict:
    strategy = _param(query, "strategy", str, "log")
    if strategy not in STRATEGIES:
        raise BadRequest(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    return bucket_table(
        _param(query, "num_buckets", int, 32),
        _param(query, "max_distance", int, 128),
        bidirectional=not _param(query, "causal", bool, False),
        strategy=strategy,
    )


def _api_bias(query: dict) -> dict:
    kind = _param(query, "kind", str, "t5")
    if kind not in BIAS_KINDS:
        raise BadRequest(f"kind must be one of {', '.join(BIAS_KINDS)}, got {kind!r}")
    length = _param(query, "length", int, 16)
    if not 1 <= length <= MAX_LENGTH:
        raise BadRequest(f"length must be between 1 and {MAX_LENGTH}, got {length}")
    options = {}
    if kind == "t5":
        options = {"num_buckets": _param(query, "num_buckets", int, 32), "max_distance": _param(query, "max_distance", int, 128)}
    elif kind == "log_decay":
        options = {"scale": _param(query, "scale", float, 0.3)}
    causal = _param(query, "causal", bool, False)
    matrix = bias_matrix(kind, length, causal=causal, seed=_param(query, "seed", int, 0), **options)
    return {"kind": kind, "length": length, "causal": causal, "options": options, "matrix": matrix.tolist()}


def _api_attention(query: dict) -> dict:
    scale = _param(query, "scale", float, 0.3)
    standard, biased = seed004_weights(scale)
    return {"tokens": list(SEED004_TOKENS), "scale": scale, "standard": standard.tolist(), "biased": biased.tolist()}


ROUTES = {"/api/buckets": _api_buckets, "/api/bias": _api_bias, "/api/attention": _api_attention}


class _Handler(BaseHTTPRequestHandler):
    server_version = "relpos-explore"

    def log_message(self, format, *args):  # keep the terminal for the URL
        pass

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        url = urlparse(self.path)
        if url.path in ROUTES:
            try:
                self._json(HTTPStatus.OK, ROUTES[url.path](parse_qs(url.query)))
            except (ValueError, TypeError) as exc:  # relpos's own validation messages, or ours
                self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            except Exception as exc:  # never a traceback on the page, never a dead server
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {type(exc).__name__}"})
            return
        name = "index.html" if url.path in ("/", "/index.html") else url.path.lstrip("/")
        path = STATIC / name
        if "/" in name or not path.is_file():
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {url.path}"})
            return
        self._send(HTTPStatus.OK, path.read_bytes(), _TYPES.get(path.suffix, "application/octet-stream"))


def make_server(host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A server bound to ``host:port`` (port 0: a free one); call ``serve_forever()`` on it."""
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    return server


def serve(host: str = "127.0.0.1", port: int = 0, *, block: bool = True) -> ThreadingHTTPServer:
    server = make_server(host, port)
    print(f"relpos explore: http://{host}:{server.server_address[1]}/  (Ctrl-C to stop)", flush=True)
    if block:
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    else:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
