"""Screenshots of the four explore views for the docs, in headless Chromium at a laptop's size.

    python tools/explore_screenshots.py docs/   # writes explore-buckets.png, explore-bias.png, explore-attention.png, explore-image.png

Needs Playwright (the dev extra) and a Chromium on the PATH (Debian's `chromium`; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

from playwright.sync_api import sync_playwright

from relpos.tools.explore import serve

ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def main(out: str) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("needs a chromium on the PATH (apt-get install chromium)")
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    server = serve(port=0, block=False)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=ARGS)
            page = browser.new_page(viewport={"width": 1366, "height": 768})
            page.goto(base + "#buckets")
            page.wait_for_selector("#buckets-chart .step", state="attached")
            page.hover("#buckets-table tbody tr:nth-child(26)")  # bucket 26 (16 .. 22): a log-region range, highlighted
            page.screenshot(path=str(out_dir / "explore-buckets.png"))
            page.goto(base + "#bias")
            page.select_option("#bias-kind", "t5")
            page.fill("#bias-length", "32")
            page.check("#bias-causal")
            page.wait_for_function("document.querySelector('#bias-canvas').dataset.n === '32'")
            box = page.locator("#bias-canvas").bounding_box()
            page.mouse.move(box["x"] + box["width"] * (46 + 440 * 3.5 / 32) / 620, box["y"] + box["height"] * (16 + 440 * 20.5 / 32) / 520)
            page.wait_for_function("document.querySelector('#bias-hover').textContent.includes('bucket')")
            page.screenshot(path=str(out_dir / "explore-bias.png"))
            page.goto(base + "#attention")
            page.wait_for_selector("#difference-table tr:nth-child(2) td")
            page.select_option("#attention-query", "2")
            page.screenshot(path=str(out_dir / "explore-attention.png"))
            page.set_viewport_size({"width": 1366, "height": 1200})
            page.goto(base + "#image")
            page.wait_for_selector("#image-grid-svg rect.patch", state="attached")
            page.fill("#image-shift", "2")  # shifted windows: patch 0 shares its window with the far borders
            page.wait_for_function("document.querySelectorAll('#image-grid-svg .window-line.plain').length > 0")
            page.click("#image-grid-svg rect[data-q='0']")
            page.hover("#image-grid-svg rect[data-q='7']")
            page.wait_for_selector("#example-maps table")
            page.screenshot(path=str(out_dir / "explore-image.png"))
            browser.close()
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="docs", help="folder the four PNGs are written to (default: docs)")
    main(parser.parse_args().out)
