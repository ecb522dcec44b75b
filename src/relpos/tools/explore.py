"""``relpos explore``: a local page with three interactive views, numbers served by relpos itself.

* ``/``: the page (``explore_static/``: HTML, JS and CSS shipped with the package, nothing fetched
  from outside);
* ``/api/buckets``: :func:`relpos.bucket_table` (the T5 bucket explorer);
* ``/api/bias``: :func:`relpos.tools.plots.bias_matrix` (the bias heatmap) of any drawable encoding of
  :mod:`relpos.registry`;
* ``/api/kinds``: every encoding of the registry (name, label, paper, kind, summary, options);
* ``/api/attention``: :func:`relpos.tools.plots.worked_example_weights` (standard vs biased attention);
* ``/api/image`` and ``/api/image-example``: :mod:`relpos.tools.explore_image` (2D biases on a patch grid).

Every parameter is validated on the server: a bad value gets HTTP 400 with a readable message
(shown on the page), a size past the page's limits HTTP 413, never a traceback, and the server
stays up. Every request's work is bounded (bucket tables cost O(num_buckets log max_distance) and
``num_buckets`` is capped), so an answer comes within a second or two.

Exposure: the server binds the loopback address unless told otherwise (``allow_remote=True``,
``relpos explore --host ADDR --allow-remote``, with a warning), and answers only requests whose
``Host`` header names the address it serves (403 otherwise), so a web page on another origin cannot
read it through DNS rebinding.
"""

from __future__ import annotations

import html
import ipaddress
import json
import pathlib
import select
import socket
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from .. import registry
from ..encodings.buckets import STRATEGIES, bucket_table
from .explore_image import api_image, worked_example
from .plots import BIAS_KINDS, DECAYS, EXAMPLE_TOKENS, bias_details, bias_matrix, example_bias, worked_example_weights

__all__ = ["make_server", "serve", "MAX_BUCKETS", "MAX_LENGTH"]

STATIC = pathlib.Path(__file__).parent / "explore_static"
MAX_LENGTH = 128  # the heatmap's side: larger matrices are slow to draw and say nothing new
MAX_BUCKETS = 4096  # bucket tables and T5 bias tables the page asks for (T5 uses 32)
MAX_INT = 10**12  # any integer parameter; a larger one is not a position the page can mean
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}


class BadRequest(ValueError):
    pass


class TooLarge(ValueError):
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
    if len(raw) > 64:
        raise TooLarge(f"{name} is {len(raw)} characters long; values are at most 64")
    try:
        value = kind(raw)
    except ValueError:
        raise BadRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    if kind is int and abs(value) > MAX_INT:
        raise TooLarge(f"{name}={value} is past the page's limit of {MAX_INT}")
    return value


def _buckets(query: dict) -> int:
    num_buckets = _param(query, "num_buckets", int, 32)
    if num_buckets > MAX_BUCKETS:
        raise TooLarge(f"num_buckets={num_buckets} is past the page's limit of {MAX_BUCKETS}")
    return num_buckets


def _api_buckets(query: dict) -> dict:
    strategy = _param(query, "strategy", str, "log")
    if strategy not in STRATEGIES:
        raise BadRequest(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    return bucket_table(
        _buckets(query),
        _param(query, "max_distance", int, 128),
        bidirectional=not _param(query, "causal", bool, False),
        strategy=strategy,
    )


def _bias_options(kind: str, query: dict) -> dict:
    """The options ``kind`` takes on the page (relpos.registry's ``page=True`` options), from the query."""
    options = {}
    for option in registry.get(kind).options:
        if not option.page:
            continue
        if option.name == "num_buckets":
            options["num_buckets"] = _buckets(query)
        elif option.default is None and option.name not in query:
            continue  # derived from the head count and width unless given
        else:
            options[option.name] = _param(query, option.name, option.type, option.default)
    return options


def _api_bias(query: dict) -> dict:
    kind = _param(query, "kind", str, "t5")
    if kind not in BIAS_KINDS:
        raise BadRequest(f"kind must be one of {', '.join(BIAS_KINDS)}, got {kind!r}")
    length = _param(query, "length", int, 16)
    if not 1 <= length <= MAX_LENGTH:
        raise BadRequest(f"length must be between 1 and {MAX_LENGTH}, got {length}")
    options = _bias_options(kind, query)
    causal = _param(query, "causal", bool, False)
    seed = _param(query, "seed", int, 0)
    matrix = bias_matrix(kind, length, causal=causal, seed=seed, **options)
    details = bias_details(kind, length, causal=causal, seed=seed, **options)
    encoding = registry.get(kind)
    return {"kind": kind, "length": length, "causal": causal and kind != "window2d", "options": options,
            "matrix": matrix.tolist(), "details": details, "legend": encoding.summary, "formula": encoding.formula}


def _api_kinds(query: dict) -> dict:
    """Every encoding of relpos.registry: what it is and whether the bias view can draw it."""
    return {"kinds": [
        {"name": e.name, "label": e.label, "paper": e.paper, "kind": e.kind, "summary": e.summary, "formula": e.formula,
         "paths": e.paths, "plot": e.plot, "options": [{"name": o.name, "default": o.default, "help": o.help} for o in e.options]}
        for e in registry.ENCODINGS.values()
    ]}


def _kind_options() -> str:
    """The bias view's <option> list, from relpos.registry (the page is served with it filled in)."""
    def label(name: str) -> str:
        e = registry.get(name)
        seeded = " (seeded init)" if "init_std" in e.option_names() else ""
        return html.escape(f"{e.label}{seeded} \u2014 {e.paper}")
    return "".join(f'<option value="{name}">{label(name)}</option>' for name in BIAS_KINDS)


def _api_attention(query: dict) -> dict:
    scale = _param(query, "scale", float, 0.3)
    decay = _param(query, "decay", str, "log")
    if decay not in DECAYS:
        raise BadRequest(f"decay must be one of {', '.join(DECAYS)}, got {decay!r}")
    standard, biased = worked_example_weights(scale, decay)
    bias = example_bias(scale, decay).materialize(len(EXAMPLE_TOKENS), len(EXAMPLE_TOKENS))[0, 0]
    return {"tokens": list(EXAMPLE_TOKENS), "scale": scale, "decay": decay, "bias": bias.tolist(),
            "standard": standard.tolist(), "biased": biased.tolist(), "difference": (biased - standard).tolist()}


ROUTES = {"/api/buckets": _api_buckets, "/api/bias": _api_bias, "/api/attention": _api_attention, "/api/kinds": _api_kinds,
          "/api/image": lambda query: api_image(query, _param), "/api/image-example": lambda query: worked_example()}
KINDS_MARK = b"<!-- bias kinds: filled in by relpos.tools.explore from relpos.registry -->"


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

    def _client_gone(self) -> bool:
        """True when the client has closed its side: its socket reads as end-of-file right now."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        try:
            self._get()
        except (BrokenPipeError, ConnectionResetError):  # the client left: nothing to answer
            pass
        except Exception as exc:  # never a traceback on the server's terminal, never a dead server
            try:
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {type(exc).__name__}"})
            except OSError:
                pass

    def _get(self) -> None:
        if self.headers.get("Host", "").lower() not in self.server.allowed_hosts:
            self._json(HTTPStatus.FORBIDDEN, {"error": "this server answers only requests addressed to it by its own host name"})
            return
        url = urlparse(self.path)
        if url.path in ROUTES:
            if self._client_gone():  # nobody would read the answer: compute nothing
                self.close_connection = True
                return
            try:
                self._json(HTTPStatus.OK, ROUTES[url.path](parse_qs(url.query)))
            except TooLarge as exc:
                self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": str(exc)})
            except (ValueError, TypeError, OverflowError) as exc:  # relpos's own validation messages, or ours
                self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        name = "index.html" if url.path in ("/", "/index.html") else url.path.lstrip("/")
        if "/" in name or len(name) > 64 or not (STATIC / name).is_file():
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {url.path[:80]}"})
            return
        path = STATIC / name
        body = path.read_bytes()
        if name == "index.html":
            body = body.replace(KINDS_MARK, _kind_options().encode())
        self._send(HTTPStatus.OK, body, _TYPES.get(path.suffix, "application/octet-stream"))


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # the default backlog of 5 stalls 20 concurrent clients for a second
    daemon_threads = True
    allowed_hosts: frozenset = frozenset()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_server(host: str = "127.0.0.1", port: int = 0, *, allow_remote: bool = False) -> ThreadingHTTPServer:
    """A server bound to ``host:port`` (port 0: a free one); call ``serve_forever()`` on it.

    ``host`` must be a loopback address unless ``allow_remote=True``: the page has no
    authentication, and anything that can reach the port can use it.
    """
    if not isinstance(allow_remote, bool):
        raise TypeError(f"allow_remote must be a bool, got {allow_remote!r}")
    if not _is_loopback(host) and not allow_remote:
        raise ValueError(
            f"host={host!r} is not a loopback address: the explorer would be reachable from other machines; "
            "pass allow_remote=True (relpos explore --allow-remote) if that is what you want"
        )
    server = _Server((host, port), _Handler)
    bound = server.server_address[1]
    names = {host, "localhost", "127.0.0.1", "[::1]"} if _is_loopback(host) else {host}
    server.allowed_hosts = frozenset(f"{name}:{bound}".lower() for name in names)
    return server


def serve(host: str = "127.0.0.1", port: int = 0, *, block: bool = True, allow_remote: bool = False) -> ThreadingHTTPServer:
    server = make_server(host, port, allow_remote=allow_remote)
    if not _is_loopback(host):
        print(f"relpos explore: WARNING: serving on {host}, reachable from other machines, without authentication",
              file=sys.stderr, flush=True)
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
