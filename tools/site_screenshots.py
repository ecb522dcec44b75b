"""Screenshots of the docs site, built from this checkout, in headless Chromium at a laptop's size.

    python tools/site_screenshots.py docs/site       # writes home.png, api.png, encoding.png, benchmarks.png

Builds the site with ``mkdocs build --strict`` into a temporary folder, serves it on 127.0.0.1 and shows
the home page (the README), an API reference page (the layers), an encoding page (T5's bias) and the
benchmarks overview. Needs the docs and dev extras and a Chromium on the PATH (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

from playwright.sync_api import sync_playwright

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
#: file name -> the page's path on the site, and what must be on it before the picture is taken
PAGES = {
    "home.png": ("", "h1#relpos"),
    "api.png": ("reference/layers/", "[id='relpos.WindowAttention']"),
    "encoding.png": ("encodings/t5/", "article img"),
    "benchmarks.png": ("benchmarks/", "article table"),
}


def build(site: pathlib.Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT, env=env, check=True)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line per request would bury the printed file names
        pass


def serve(site: pathlib.Path) -> http.server.ThreadingHTTPServer:
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for the PNG files (created if missing)")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs a chromium on the PATH (apt-get install chromium)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = pathlib.Path(tmp) / "site"
        build(site)
        server = serve(site)
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=ARGS)
                page = browser.new_page(viewport={"width": 1366, "height": 900})
                for name, (path, ready) in PAGES.items():
                    page.goto(base + path)
                    page.wait_for_selector(ready, state="attached")
                    page.screenshot(path=str(out / name))
                    print(out / name)
                browser.close()
        finally:
            server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
