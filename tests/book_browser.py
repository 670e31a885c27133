"""Checks of a built course book in headless Chromium (Playwright driving the system's Chromium).

The book is served over loopback HTTP, as a web server would serve it (Sphinx's search fetches the result
pages for their summaries, which a browser refuses from ``file://``). Used by tests/test_site.py (the student
book) and tests/test_lab_runs.py (the book of a course run).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import threading
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.image as mpimg
import pytest

# As the project's machines start Chromium headless: no sandbox as root, no GPU, no background connections
# (the network is closed; Chromium's own requests would only add noise).
CHROMIUM_FLAGS = [
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

LESSONS = [
    "00_setup",
    "01_grad",
    "02_jit",
    "03_vmap",
    "04_pmap",
    "05_sharding",
    "06_shard_map",
    "07_debugging",
    "08_lab",
    "09_multihost",
    "10_transformers",
    "11_pipeline_experts",
    "12_transformer_lab",
]


def chromium() -> str:
    """The Chromium executable; skips the test without one (CI, which installs it, fails instead)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail(
            "Chromium is needed for the site test: apt-get install chromium (.ci/run installs it)"
        )
    pytest.skip("Chromium not installed (apt-get install chromium); CI runs this test")


@contextmanager
def serve(folder: Path):
    """Serve ``folder`` on 127.0.0.1 (a free port); yields the base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Visit:
    """What one page showed: the console errors, failed requests and uncaught exceptions; the DOM facts."""

    url: str
    errors: list[str] = field(default_factory=list)
    images: list[dict] = field(
        default_factory=list
    )  # {"src", "ok"}: ok = loaded with a non-zero size
    links: list[str] = field(default_factory=list)  # absolute hrefs of every <a>
    sidebar: list[str] = field(default_factory=list)  # hrefs of the primary sidebar's navigation
    prev_next: list[str] = field(default_factory=list)
    page_toc: list[str] = field(
        default_factory=list
    )  # the per-page contents ("Contents" on the right)
    text: str = ""
    screenshot: Path | None = None


class Browser:
    """One headless Chromium for a test; :meth:`visit` loads a page and records what it showed."""

    def __init__(self, shots: Path):
        from playwright.sync_api import sync_playwright

        self.shots = shots
        # skip before Playwright starts: one started and left behind keeps its event loop running in this
        # thread, and the next browser test of the process fails instead of skipping
        executable = chromium()
        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(
            executable_path=executable, chromium_sandbox=False, args=CHROMIUM_FLAGS
        )
        self._page = self._browser.new_page(viewport={"width": 1280, "height": 1400})

    def close(self):
        self._browser.close()
        self._pw.stop()

    def visit(self, url: str, screenshot: bool = True) -> Visit:
        v = Visit(url)
        page = self._page
        handlers = {
            "console": lambda m: (
                v.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None
            ),
            "pageerror": lambda e: v.errors.append(f"uncaught: {e}"),
            "requestfailed": lambda r: v.errors.append(f"request failed: {r.url} ({r.failure})"),
            "response": lambda r: (
                v.errors.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None
            ),
        }
        for event, fn in handlers.items():
            page.on(event, fn)
        try:
            page.goto(url, wait_until="load")
            page.wait_for_load_state("networkidle")
            facts = page.evaluate("""() => ({
                images: [...document.images].map(i => ({src: i.currentSrc || i.src,
                                                        ok: i.complete && i.naturalWidth > 0 && i.naturalHeight > 0})),
                links: [...document.querySelectorAll('a[href]')].map(a => a.href),
                sidebar: [...document.querySelectorAll('nav.bd-docs-nav a[href]')].map(a => a.href),
                prev_next: [...document.querySelectorAll('.prev-next-area a')].map(a => a.href),
                page_toc: [...document.querySelectorAll('nav.page-toc a')].map(a => a.textContent.trim()),
                text: document.body.innerText,
            })""")
            for k, val in facts.items():
                setattr(v, k, val)
            if screenshot:
                name = re.sub(
                    r"[^A-Za-z0-9_.-]", "_", urllib.parse.urlsplit(url).path.strip("/") or "index"
                )
                v.screenshot = self.shots / f"{name}.png"
                page.screenshot(path=str(v.screenshot))
        finally:
            for event, fn in handlers.items():
                page.remove_listener(event, fn)
        return v

    def search(self, base: str, query: str) -> list[str]:
        """The result pages (file names, in rank order) of the book's own search for ``query``."""
        page = self._page
        page.goto(f"{base}search.html?q={urllib.parse.quote(query)}")
        page.wait_for_function(
            "() => { const s = document.querySelector('#search-results p.search-summary');"
            " return s && /found/.test(s.textContent); }",
            timeout=60_000,
        )
        hrefs = page.eval_on_selector_all(
            "#search-results ul.search li a", "els => els.map(a => a.href)"
        )
        return [urllib.parse.urlsplit(h).path.rsplit("/", 1)[-1] for h in hrefs]


def check_page(v: Visit, book: Path, base: str) -> None:
    """Asserts for every page: no console errors, every image loaded, every internal link (and its
    #anchor) resolves to a file of the book, the screenshot is a rendered page."""
    assert not v.errors, f"{v.url}: {v.errors}"
    assert all(i["ok"] for i in v.images), (
        f"{v.url}: images not shown: {[i['src'] for i in v.images if not i['ok']]}"
    )
    for href in v.links:
        if not href.startswith(base):
            continue  # the official JAX docs and other external pages: not fetched (no network here)
        parts = urllib.parse.urlsplit(href)
        target = book / urllib.parse.unquote(parts.path[len(urllib.parse.urlsplit(base).path) :])
        if target.is_dir():
            target = target / "index.html"
        assert target.is_file(), f"{v.url}: broken link {href}"
        if parts.fragment and target.suffix == ".html":
            frag = urllib.parse.unquote(parts.fragment)
            assert f'id="{frag}"' in target.read_text(encoding="utf-8"), (
                f"{v.url}: no #{frag} in {target.name}"
            )
    if v.screenshot is not None:
        img = mpimg.imread(v.screenshot)
        assert img.shape[0] >= 1000 and img.shape[1] >= 1000
        assert img[..., :3].std() > 0.02, f"{v.url} rendered blank"


def sidebar_lessons(v: Visit) -> list[str]:
    """The lesson pages the sidebar links to, in order."""
    names = [urllib.parse.urlsplit(h).path.rsplit("/", 1)[-1] for h in v.sidebar]
    return [n.removesuffix(".html") for n in names if n.removesuffix(".html") in LESSONS]
