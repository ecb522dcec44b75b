"""relpos explore: the JSON endpoints are relpos's numbers; bad values get a 400 and a message;
the page, driven in a real headless Chromium, shows those numbers and the messages."""

import json
import shutil
import urllib.error
import urllib.request

import pytest
import torch

import relpos
from relpos.tools.patch_scores import patch_scores
from relpos.tools import plots
from relpos.tools.explore import serve


@pytest.fixture(scope="module")
def base_url():
    server = serve(port=0, block=False)
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.loads(response.read()) if "/api/" in url else response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_bucket_endpoint_is_relpos(base_url):
    status, data = get(base_url + "/api/buckets?num_buckets=16&max_distance=40&causal=1&strategy=quadratic")
    assert status == 200
    assert data == relpos.bucket_table(16, 40, bidirectional=False, strategy="quadratic")


def test_bias_and_attention_endpoints_are_relpos(base_url):
    status, data = get(base_url + "/api/bias?kind=alibi&length=8&causal=1")
    assert status == 200 and torch.equal(torch.tensor(data["matrix"]), plots.bias_matrix("alibi", 8, causal=True))
    assert data["details"] == {"slope": 0.25} and data["causal"] is True
    status, data = get(base_url + "/api/bias?kind=t5&length=12")  # the hover readout's parts: bucket, table value
    table, buckets = data["details"]["table"], data["details"]["buckets"]
    assert buckets == relpos.relative_position_bucket(relpos.relative_positions(12, 12)).tolist()
    assert all(abs(data["matrix"][i][j] - table[buckets[i][j]]) < 1e-6 for i in range(12) for j in range(12))
    status, data = get(base_url + "/api/bias?kind=window2d&length=9")
    index, table = data["details"]["index"], data["details"]["table"]
    assert all(abs(data["matrix"][p][r] - table[index[p][r]]) < 1e-6 for p in range(9) for r in range(9))
    status, data = get(base_url + "/api/attention?scale=0.5&decay=linear")
    standard, linear = plots.worked_example_weights(0.5, "linear")
    assert status == 200 and torch.allclose(torch.tensor(data["biased"], dtype=torch.float64), linear)
    assert torch.allclose(torch.tensor(data["bias"]), -0.5 * relpos.relative_positions(5, 5).abs().float())
    assert torch.allclose(torch.tensor(data["difference"], dtype=torch.float64), linear - standard)
    status, data = get(base_url + "/api/attention?scale=0.5")
    standard, biased = plots.worked_example_weights(0.5)
    assert status == 200 and torch.allclose(torch.tensor(data["biased"], dtype=torch.float64), biased)


@pytest.mark.parametrize(
    "query, words",
    [
        ("/api/buckets?num_buckets=31", ["num_buckets must be even", "31"]),
        ("/api/buckets?num_buckets=abc", ["num_buckets must be an integer", "abc"]),
        ("/api/buckets?max_distance=4", ["max_distance must be >"]),
        ("/api/buckets?strategy=cubic", ["strategy must be one of"]),
        ("/api/bias?kind=fourier", ["kind must be one of"]),
        ("/api/bias?length=100000", ["length must be between 1 and 128"]),
        ("/api/bias?kind=window2d&length=10", ["square number"]),
        ("/api/attention?scale=-1", ["scale must be a finite number > 0"]),
        ("/api/attention?decay=cubic", ["decay must be one of log, linear"]),
        ("/api/bias?causal=maybe", ["causal must be true or false"]),
    ],
)
def test_bad_values_get_400_and_a_message(base_url, query, words):
    status, data = get(base_url + query)
    assert status == 400
    for w in words:
        assert w in data["error"]
    assert get(base_url + "/api/buckets")[0] == 200  # the server is still up


def test_static_files_and_404(base_url):
    status, page = get(base_url + "/")
    assert status == 200 and "relpos explore" in page and "/app.js" in page
    for asset in ("/app.js", "/style.css"):
        assert get(base_url + asset)[0] == 200
    assert "https://" not in page and "https://" not in get(base_url + "/app.js")[1]  # nothing from outside
    assert get(base_url + "/nope")[0] == 404
    assert get(base_url + "/../pyproject.toml")[0] == 404


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_page_in_a_real_browser(base_url):
    """Each view driven as a user would: the numbers shown are relpos's, controls update them, a bad
    value shows relpos's message and hides the stale result, the hover readout explains a cell."""
    if CHROMIUM is None:
        from ci_env import in_ci

        if in_ci():
            pytest.fail("chromium is missing but CI=true: .ci/run installs Debian's chromium; the browser test must run in CI")
        pytest.skip("needs Debian's chromium (.ci/run installs it); under CI=true this fails instead")
    from playwright.sync_api import sync_playwright

    args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        page = browser.new_page(viewport={"width": 1366, "height": 768})
        page.goto(base_url + "/")
        page.wait_for_selector("#buckets-table tbody tr")
        _check_buckets_view(page)
        page.click("#tab-bias")
        assert page.is_hidden("#buckets-view") and page.is_visible("#bias-view")
        _check_bias_view(page)
        page.click("#tab-attention")
        _check_attention_view(page)
        page.goto(base_url + "/#bias")  # a view can be linked to
        assert page.is_visible("#bias-view") and page.is_hidden("#attention-view")
        browser.close()


def _rows(page, selector):
    return page.eval_on_selector_all(selector, "rs => rs.map(r => [...r.cells].map(c => c.textContent))")


def _check_buckets_view(page):
    rows = _rows(page, "#buckets-table tbody tr")  # default T5: exactly relpos's ranges
    expected = relpos.bucket_table(32, 128)["buckets"]
    assert [int(r[0]) for r in rows] == [b["bucket"] for b in expected]
    assert ["24", "8 .. 11", "range"] in rows and ["15", "-inf .. -91", "range"] in rows
    assert page.text_content("#max-exact") == "8" and page.text_content("#unused") == "16"
    assert page.eval_on_selector_all("#buckets-chart .step", "s => s.length") == 31  # one step per used bucket
    assert page.eval_on_selector_all("#buckets-chart .exact-band", "s => s.length") == 1
    page.hover("#buckets-table tbody tr:nth-child(26)")  # bucket 26 (16 is unused: no row) lights up in the chart
    assert page.eval_on_selector_all("#buckets-chart .step.hot", "s => s.map(x => x.dataset.bucket)") == ["26"]
    page.fill("#num-buckets", "16")
    page.check("#causal")
    page.wait_for_function("document.querySelectorAll('#buckets-table tbody tr').length === 16")
    causal = relpos.bucket_table(16, 128, bidirectional=False)["buckets"]
    assert [int(r[0]) for r in _rows(page, "#buckets-table tbody tr")] == [b["bucket"] for b in causal]
    page.uncheck("#causal")
    page.fill("#num-buckets", "31")  # a bad value: relpos's message, and no stale table under it
    page.wait_for_function("document.querySelector('#buckets-error').textContent.length > 0")
    assert "num_buckets must be even" in page.text_content("#buckets-error")
    assert page.is_hidden("#buckets-table")
    page.fill("#num-buckets", "32")
    page.wait_for_function("document.querySelector('#buckets-error').textContent === ''")
    assert page.is_visible("#buckets-table")


def _check_bias_view(page):
    page.fill("#bias-length", "24")
    page.wait_for_function("document.querySelector('#bias-canvas').dataset.n === '24'")
    drawn = page.evaluate("""() => { const c = document.querySelector('#bias-canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const seen = new Set(); for (let i = 0; i < d.length; i += 4 * 97) seen.add(d[i] + ',' + d[i+1] + ',' + d[i+2]);
        return seen.size; }""")
    assert drawn > 20  # cells, axes, labels and the colour bar
    box = page.locator("#bias-canvas").bounding_box()
    i, j = 20, 3  # hover the middle of cell (query 20, key 3); the heatmap is 440 px at (46, 16) of 620 x 520
    page.mouse.move(box["x"] + box["width"] * (46 + 440 * (j + 0.5) / 24) / 620,
                    box["y"] + box["height"] * (16 + 440 * (i + 0.5) / 24) / 520)
    page.wait_for_function("document.querySelector('#bias-hover').textContent.startsWith('query 20, key 3')")
    matrix = plots.bias_matrix("t5", 24)
    bucket = int(relpos.relative_position_bucket(torch.tensor(j - i), num_buckets=32, max_distance=128))
    assert page.text_content("#bias-hover") == (
        f"query 20, key 3: j \u2212 i = -17 \u2192 bucket {bucket} \u2192 table[{bucket}] = {matrix[i, j].item():.4f}")
    page.fill("#bias-max-distance", "20")  # T5's own options: a short max_distance saturates early
    page.wait_for_function("document.querySelector('#bias-hover').textContent.startsWith('Hover')")
    page.mouse.move(box["x"] + box["width"] * (46 + 440 * (j + 0.5) / 24) / 620,
                    box["y"] + box["height"] * (16 + 440 * (i + 0.5) / 24) / 520)
    page.wait_for_function("document.querySelector('#bias-hover').textContent.startsWith('query 20, key 3')")
    bucket = int(relpos.relative_position_bucket(torch.tensor(j - i), num_buckets=32, max_distance=20))
    assert f"bucket {bucket} " in page.text_content("#bias-hover")
    page.select_option("#bias-kind", "alibi")  # options it does not take are hidden
    assert page.is_hidden("#bias-num-buckets") and page.is_hidden("#bias-max-distance")
    page.select_option("#bias-kind", "t5")
    page.check("#bias-causal")
    page.wait_for_function("document.querySelector('#bias-legend').textContent.includes('Grey cells')")
    page.fill("#bias-length", "500")
    page.wait_for_function("document.querySelector('#bias-error').textContent.length > 0")
    assert "length must be between 1 and 128" in page.text_content("#bias-error") and page.is_hidden("#bias-canvas")
    page.fill("#bias-length", "16")
    page.wait_for_function("document.querySelector('#bias-canvas').dataset.n === '16' && document.querySelector('#bias-error').textContent === ''")


def _check_attention_view(page):
    page.wait_for_selector("#difference-table tr:nth-child(2) td")
    numbers = "rs => rs.slice(1).map(r => [...r.querySelectorAll('td')].map(c => Number(c.textContent)))"
    standard, biased = plots.worked_example_weights(0.3)
    shown = torch.tensor(page.eval_on_selector_all("#biased-table tr", numbers), dtype=torch.float64)
    assert torch.allclose(shown, biased, atol=5e-5)
    difference = torch.tensor(page.eval_on_selector_all("#difference-table tr", numbers), dtype=torch.float64)
    assert torch.allclose(difference, biased - standard, atol=5e-5)
    page.select_option("#attention-query", "2")  # the query selector marks the row and redraws its bars
    assert page.eval_on_selector_all("#biased-table tr.selected th", "t => t.map(x => x.textContent)") == ["sat"]
    assert page.eval_on_selector_all("#attention-row rect.bar", "b => b.length") == 10 + 2  # 5 keys x 2, legend
    assert 'Query "sat"' in page.text_content("#attention-caption")
    page.select_option("#attention-decay", "linear")  # the worked example's exercise: linear decay
    _, linear = plots.worked_example_weights(0.3, "linear")
    page.wait_for_function("document.querySelector('#attention-caption').textContent.includes('|j \u2212 i|)') === false")
    shown = torch.tensor(page.eval_on_selector_all("#biased-table tr", numbers), dtype=torch.float64)
    assert torch.allclose(shown, linear, atol=5e-5)
    page.fill("#attention-scale", "0")
    page.wait_for_function("document.querySelector('#attention-error').textContent.length > 0")
    assert "scale must be a finite number > 0" in page.text_content("#attention-error")
    assert page.is_hidden("#biased-table")


def raw_get(base_url, path, host=None):
    """A GET with a chosen Host header (urllib always sends the real one)."""
    import http.client
    from urllib.parse import urlparse

    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.putrequest("GET", path, skip_host=host is not None)
    if host is not None:
        conn.putheader("Host", host)
    conn.endheaders()
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, body


def test_only_requests_addressed_to_the_server_are_answered(base_url):
    port = base_url.rsplit(":", 1)[1]
    assert raw_get(base_url, "/api/buckets", host=f"localhost:{port}")[0] == 200
    assert raw_get(base_url, "/api/buckets", host=f"127.0.0.1:{port}")[0] == 200
    for host in ("evil.example:80", f"evil.example:{port}", "127.0.0.1", ""):
        status, body = raw_get(base_url, "/api/buckets", host=host)
        assert status == 403 and b"host name" in body, host


@pytest.mark.parametrize(
    "query, status",
    [
        ("/api/buckets?num_buckets=100000&max_distance=100001", 413),
        ("/api/bias?kind=t5&num_buckets=1000000000&max_distance=2000000000", 413),
        ("/api/buckets?num_buckets=4&max_distance=100000000", 200),  # O(num_buckets log max_distance): fast
        ("/api/buckets?max_distance=" + "9" * 40, 413),
        ("/api/buckets?max_distance=" + "9" * 100, 413),
        ("/" + "a" * 300, 404),
        ("/api/attention?scale=1e400", 400),
    ],
)
def test_hostile_requests_are_refused_before_any_work(base_url, query, status):
    got, body = raw_get(base_url, query, host=base_url.split("//", 1)[1])
    assert got == status, body[:200]
    assert json.loads(body)  # always a JSON answer, never a dropped connection
    assert get(base_url + "/api/buckets")[0] == 200


def test_remote_binding_needs_an_explicit_flag(capsys):
    from relpos.tools.explore import make_server

    with pytest.raises(ValueError, match="not a loopback address.*allow_remote=True"):
        make_server("0.0.0.0", 0)
    server = make_server("0.0.0.0", 0, allow_remote=True)
    server.server_close()
    from relpos.tools.cli import main

    assert main(["explore", "--host", "0.0.0.0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_many_concurrent_clients_are_all_answered(base_url):
    """40 clients at once on loopback (bounded: 40 requests, then it stops)."""
    from concurrent.futures import ThreadPoolExecutor

    from relpos.tools.explore import make_server

    assert make_server.__globals__["_Server"].request_queue_size >= 64
    with ThreadPoolExecutor(max_workers=40) as pool:
        statuses = list(pool.map(lambda i: get(base_url + f"/api/buckets?num_buckets={2 * (i % 16) + 4}")[0], range(40)))
    assert statuses == [200] * 40


def test_nothing_is_computed_for_a_client_that_has_gone(monkeypatch):
    """The handler waits until the client has sent its request and closed; then it must not compute."""
    import socket
    import threading
    import time

    from relpos.tools import explore

    calls, closed = [], threading.Event()
    monkeypatch.setitem(explore.ROUTES, "/api/buckets", lambda query: calls.append(query) or {"ok": True})
    real_parse = explore._Handler.parse_request

    def parse_after_the_client_left(self):
        closed.wait(5)
        return real_parse(self)

    monkeypatch.setattr(explore._Handler, "parse_request", parse_after_the_client_left)
    server = serve(port=0, block=False)
    try:
        port = server.server_address[1]
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(f"GET /api/buckets?num_buckets=8 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        client.close()
        closed.set()
        time.sleep(0.5)
        assert calls == []  # gone before the work started: no work
        closed.clear()
        threading.Timer(0.2, closed.set).start()  # a client that stays gets its answer
        status, payload = get(f"http://127.0.0.1:{port}/api/buckets?num_buckets=8")
        assert status == 200 and payload == {"ok": True} and len(calls) == 1
    finally:
        server.shutdown()
        server.server_close()


# --- the image view (relpos.tools.explore_image) ---------------------------------------------------------


def test_image_endpoint_is_relpos(base_url):
    from relpos.tools.explore_image import IMAGE_KINDS

    status, data = get(base_url + "/api/image?kind=table&grid=8&window=4&shift=2&seed=3")
    assert status == 200 and set(data["kinds"]) == set(IMAGE_KINDS)
    local = IMAGE_KINDS["table"](4, 4, 3, {})  # (16, 16): the window's bias, query rows
    # patch (3, 3) sits at (1, 1) of its window after the roll by -2; patch (4, 5) at (2, 3): same window
    assert abs(data["matrix"][3 * 8 + 3][4 * 8 + 5] - float(local[1 * 4 + 1, 2 * 4 + 3])) < 1e-5
    assert data["matrix"][3 * 8 + 3][7 * 8 + 7] is None  # (7, 7) rolls into another window
    # patch (0, 0) rolls to (6, 6): its window also holds (7, 7) (rolled (5, 5)) but from the other border
    assert data["window_of"][0] == data["window_of"][63] and data["masked"][0][63] is True
    assert data["masked"][0][1] is False and data["masked"][63][54] is False  # same region: not masked
    table = relpos.RelativePositionBias(1, (4, 4))  # seed 3, N(0, 1): the same values the kind draws
    with torch.no_grad():
        table.relative_position_bias_table.copy_(torch.randn(49, 1, generator=torch.Generator().manual_seed(3)))
    assert torch.allclose(local, table()[0])
    status, data = get(base_url + "/api/image?kind=continuous&grid=6&window=3&pretrained_window=2")
    assert status == 200 and all(0.0 <= v <= 16.0 for row in data["matrix"] for v in row if v is not None)
    status, data = get(base_url + "/api/image?kind=factorized&grid=4&window=0")  # global: one window
    assert status == 200 and all(v is not None for row in data["matrix"] for v in row)
    for kind in ("decomposed", "rope2d_axial", "rope2d_mixed", "rope2d_dinov3"):  # global attention's 2D terms
        status, data = get(base_url + f"/api/image?kind={kind}&grid=6&window=0&seed=2")
        assert status == 200 and kind in data["kinds"]
        assert torch.allclose(torch.tensor(data["matrix"], dtype=torch.float64), patch_scores(kind, 6, 6, seed=2).double(), atol=1e-5)


def test_image_worked_example_numbers(base_url):
    """The 2x2 grid of the relative-vs-absolute tutorial, recomputed by hand here."""
    status, ex = get(base_url + "/api/image-example")
    assert status == 200
    r = 2**-0.5
    assert ex["no_position"] == [[round(v * r, 3) for v in row] for row in [[1, 0, 1, 0], [0, 1, 1, 0], [1, 1, 2, 0], [0, 0, 0, 0]]]
    # x + p = [1, 0], [0, 1.5], [1.5, 1], [0.5, 0.5]
    dots = [[1, 0, 1.5, 0.5], [0, 2.25, 1.5, 0.75], [1.5, 1.5, 3.25, 1.25], [0.5, 0.75, 1.25, 0.5]]
    assert ex["absolute"] == [[round(v * r, 3) for v in row] for row in dots]
    assert ex["relative"] == [[0.707, 0.2, 0.807, 0.3], [-0.2, 0.707, 0.707, 0.1],
                              [0.607, 0.707, 1.414, 0.2], [-0.3, -0.1, -0.2, 0.0]]
    assert max(range(4), key=lambda j: ex["relative"][0][j]) == 2  # patch 0's largest logit: patch 2, below it
    assert max(range(4), key=lambda j: ex["bias"][0][j]) == 3  # the bias alone favours the diagonal


@pytest.mark.parametrize(
    "query, words",
    [
        ("/api/image?kind=sam", ["kind must be one of"]),
        ("/api/image?grid=17", ["grid must be between 1 and 16"]),
        ("/api/image?grid=8&window=3", ["window must divide grid=8"]),
        ("/api/image?window=4&shift=4", ["shift must be between 0 and window - 1 = 3"]),
        ("/api/image?kind=continuous&pretrained_window=-1", ["pretrained_window must be between 0"]),
    ],
)
def test_image_bad_values_get_400(base_url, query, words):
    status, data = get(base_url + query)
    assert status == 400
    for w in words:
        assert w in data["error"]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_image_view_in_a_real_browser(base_url):
    """The grid shows relpos's numbers for the chosen patch, windows and the shift are drawn, the
    hover readout explains a pair, a bad value shows the message, the worked example shows its numbers."""
    from playwright.sync_api import sync_playwright

    args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        page = browser.new_page(viewport={"width": 1366, "height": 900})
        page.goto(base_url + "/#image")
        assert page.is_visible("#image-view") and page.is_hidden("#buckets-view")
        page.wait_for_selector("#image-grid-svg rect.patch", state="attached")
        kinds = page.eval_on_selector_all("#image-kind option", "os => os.map(o => o.value)")
        assert kinds == ["table", "factorized", "continuous", "decomposed", "rope2d_axial", "rope2d_mixed", "rope2d_dinov3"]
        _, data = get(base_url + "/api/image?kind=table&grid=8&window=4&shift=0&seed=0")
        page.click("#image-grid-svg rect[data-q='9']")  # query patch (1, 1)
        shown = page.eval_on_selector_all("#image-grid-svg text.cell-value", "ts => ts.map(t => t.textContent)")
        assert shown == [f"{v:.2f}" for v in data["matrix"][9] if v is not None]  # its window's 16 patches
        assert page.eval_on_selector_all("#image-grid-svg .patch.other", "r => r.length") == 48
        assert page.eval_on_selector_all("#image-grid-svg .window-line", "l => l.length") == 2  # one inner line per axis
        page.hover("#image-grid-svg rect[data-q='18']")
        hover = page.text_content("#image-hover")
        assert "(-1, -1)" in hover and f"{data['matrix'][9][18]:.4f}" in hover
        page.fill("#image-shift", "2")  # shifted windows: patch 0 now shares a window with the far corner
        page.wait_for_function("document.querySelectorAll('#image-grid-svg .window-line.plain').length > 0")
        page.click("#image-grid-svg rect[data-q='0']")
        assert page.eval_on_selector_all("#image-grid-svg .patch.masked", "r => r.length") == 12
        page.hover("#image-grid-svg rect[data-q='63']")
        assert "shift mask -100" in page.text_content("#image-hover")
        page.fill("#image-window", "3")
        page.wait_for_function("document.querySelector('#image-error').textContent.includes('window must divide')")
        assert page.is_hidden("#image-result")
        page.fill("#image-window", "4")
        page.wait_for_function("!document.querySelector('#image-result').hidden")
        page.wait_for_selector("#example-maps table")
        cells = page.eval_on_selector_all("#example-maps > div:last-child tr td", "cs => cs.map(c => c.textContent)")
        assert cells[:4] == ["0.707", "0.200", "0.807", "0.300"]
        assert "prefers looking below itself" in page.text_content("#example-text")
        browser.close()
