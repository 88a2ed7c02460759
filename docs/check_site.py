"""Headless-browser check of the built site, as a reader sees it.

Serves `site/` on localhost, opens every page in headless Chromium at 1400 px wide, and fails if:

* a page logs a JavaScript console error (level SEVERE), a failed resource load included;
* a page that contains math has no MathJax-typeset elements;
* any page shows a MathJax error: an error node (`mjx-merror`, `[data-mjx-error]`, MathJax
  2's `.MathJax_Error`, `merror`, `.mjx-merror`) or the text "Math input error" or "Math
  Processing Error" (a formula MathJax could not parse, e.g. a LaTeX command that a Python
  string turned into a control character);
* a notebook page shows fewer loaded figures (PNG images with a non-zero natural width)
  than its notebook has PNG outputs;
* a notebook page's content is narrower than `MIN_NOTEBOOK_WIDTH` of the window, its printed
  output may break inside a word (a number), or it has no working link to its `.ipynb`;
* a page lacks its previous/next links, or they do not follow the navigation's order;
* the sidebar's course labels differ from the labels of the home page's table.

At 800 px it checks again that no page scrolls sideways. It writes screenshots of the home
page, of a notebook page and of an API page at both widths.

Usage: python docs/check_site.py [--site site] [--out out/screenshots]
Needs Debian's `chromium` and `chromium-driver` (installed by .ci/run).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parent.parent
WIDE, NARROW, HEIGHT = 1400, 800, 900
MIN_NOTEBOOK_WIDTH = 0.75  # of the window, at WIDE: the navigation takes the rest
SCREENSHOTS = {
    "": "home",
    "notebooks/04_tree_decoding_on_devices/": "notebook_04",
    "api/core/states/": "api_states",
}
WAIT_FOR_MATHJAX = """
const done = arguments[arguments.length - 1];
if (!window.MathJax || !MathJax.Hub) { done(false); return; }
MathJax.Hub.Queue(() => done(true));
"""
MATHJAX_ERRORS = "mjx-merror, [data-mjx-error], .mjx-merror, .MathJax_Error, merror"
COUNT = """
const MATHJAX_ERRORS = 'MATHJAX_ERRORS_SELECTOR';
const out = document.querySelector('.jp-OutputArea-output pre');
const style = out ? getComputedStyle(out) : null;
const link = (sel) => { const a = document.querySelector(sel); return a ? a.href : null; };
return {
  typeset: document.querySelectorAll(
    '.MathJax, .MathJax_Display, .MathJax_MathML, .MathJax_CHTML, mjx-container').length,
  errors: Array.from(document.querySelectorAll(MATHJAX_ERRORS)).map(
      e => (e.getAttribute('data-mjx-error') || e.textContent || '').trim().slice(0, 80)),
  error_text: ['Math input error', 'Math Processing Error'].filter(
      t => document.body.innerText.includes(t)),
  raw_math: document.querySelectorAll('.arithmatex, script[type^="math/tex"]').length,
  figures: Array.from(document.images).filter(
      i => i.src.startsWith('data:image/png') && i.complete && i.naturalWidth > 0).length,
  window: window.innerWidth,
  content: document.querySelector('.md-content').getBoundingClientRect().width,
  scroll_width: document.documentElement.scrollWidth,
  output_wrap: style ? [style.whiteSpace, style.wordBreak, style.overflowWrap] : null,
  prev: link('.md-footer__link--prev'),
  next: link('.md-footer__link--next'),
  download: link('.nb-download a'),
  folded: document.querySelectorAll(
    'details.solution:not([open]) > .jp-Cell.celltag_solution').length,
};
""".replace("MATHJAX_ERRORS_SELECTOR", MATHJAX_ERRORS)
NAV = """
const links = document.querySelectorAll('.md-nav--primary > .md-nav__list a.md-nav__link');
return Array.from(links).filter(a => !a.getAttribute('href').includes('#'))
    .map(a => [a.href, a.textContent.trim()]);
"""
TABLE_LABELS = """
return Array.from(document.querySelectorAll('.md-content table a'))
    .filter(a => a.getAttribute('href').startsWith('notebooks/'))
    .map(a => [a.href, a.textContent.trim()]);
"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def browser(profile: str) -> webdriver.Chrome:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--window-size={WIDE},{HEIGHT}",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    driver.set_script_timeout(60)
    return driver


def set_width(driver: webdriver.Chrome, width: int) -> None:
    """An exact viewport, whatever the window decorations."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
    )


def png_outputs(notebook: Path) -> int:
    nb = json.loads(notebook.read_text())
    return sum(
        "image/png" in o.get("data", {})
        for c in nb["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
    )


def solution_cells(notebook: Path) -> int:
    """Cells tagged "solution": exercise answers, which the site folds away."""
    nb = json.loads(notebook.read_text())
    return sum("solution" in c.get("metadata", {}).get("tags", []) for c in nb["cells"])


def is_notebook(url: str) -> bool:
    try:
        with urllib.request.urlopen(url) as r:
            return "cells" in json.loads(r.read())
    except (OSError, ValueError):
        return False


def check_page(driver, base: str, url: str, notebook: Path | None, order: list[str]) -> list:
    """Open one page at WIDE and return what is wrong with it."""
    driver.get(base + url)
    mathjax = driver.execute_async_script(WAIT_FOR_MATHJAX)
    c = driver.execute_script(COUNT)
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    want_figs = png_outputs(notebook) if notebook else 0
    status = []
    if errors:
        status.append(f"console errors: {errors}")
    if (c["raw_math"] or notebook) and (not mathjax or c["typeset"] == 0):
        status.append("math present but not typeset by MathJax")
    if c["errors"] or c["error_text"]:  # on every page, math or not
        status.append(f"MathJax errors: {c['errors']} {c['error_text']}")
    if c["figures"] < want_figs:
        status.append(f"{c['figures']} figures shown, notebook has {want_figs}")
    if notebook:
        if c["content"] < MIN_NOTEBOOK_WIDTH * c["window"]:
            status.append(f"content {c['content']:.0f} px wide in a {c['window']} px window")
        if c["output_wrap"] and c["output_wrap"] != ["pre-wrap", "normal", "normal"]:
            status.append(f"output white-space/word-break/overflow-wrap {c['output_wrap']}")
        if not c["download"] or not c["download"].endswith(f"/{notebook.name}"):
            status.append(f"no download link to {notebook.name}: {c['download']}")
        elif not is_notebook(c["download"]):
            status.append(f"download link {c['download']} is not the notebook")
        if c["folded"] != solution_cells(notebook):
            status.append(
                f"{c['folded']} folded answers, notebook has "
                f"{solution_cells(notebook)} cells tagged 'solution'"
            )
    i = order.index(base + url)
    want_prev = order[i - 1] if i > 0 else None
    want_next = order[i + 1] if i + 1 < len(order) else None
    if (c["prev"], c["next"]) != (want_prev, want_next):
        status.append(f"previous/next {c['prev']}, {c['next']}; want {want_prev}, {want_next}")
    print(
        f"{'FAIL' if status else 'ok  '} /{url:<42} math {c['typeset']:>4}, figures "
        f"{c['figures']}/{want_figs}, content {c['content']:.0f}/{c['window']} px, "
        f"MathJax errors {len(c['errors']) + len(c['error_text'])}, console errors {len(errors)}"
    )
    return [f"/{url}: {s}" for s in status]


def api_link_failures(site: Path) -> list[str]:
    """Every notebook's links into the API reference (added by hooks.py) reach an entry."""
    failures, count = [], 0
    for page in sorted(site.glob("notebooks/*/index.html")):
        links = re.findall(r'class="api-link" href="([^"]+)"', page.read_text())
        count += len(links)
        for href in links:
            path, _, anchor = href.partition("#")
            target = (page.parent / path / "index.html").resolve()
            if not target.exists() or f'id="{anchor}"' not in target.read_text():
                failures.append(f"/{page.parent.relative_to(site)}/: API link {href} has no target")
    if count == 0:
        failures.append("the notebooks link to no API entry")
    print(f"{count} links from the notebooks into the API reference")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", default=str(ROOT / "site"))
    parser.add_argument("--out", default=str(ROOT / "out" / "screenshots"))
    args = parser.parse_args(argv)
    site, out = Path(args.site), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    notebooks = {f"notebooks/{nb.stem}/": nb for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))}

    server, base = serve(site)
    failures = api_link_failures(site)
    with tempfile.TemporaryDirectory() as profile:
        driver = browser(profile)
        try:
            set_width(driver, WIDE)
            driver.get(base)
            nav = driver.execute_script(NAV)  # every page, in the navigation's order
            order = [href for href, _ in nav]
            labels = dict(nav)
            for href, label in driver.execute_script(TABLE_LABELS):
                if labels.get(href) != label:
                    failures.append(
                        f"sidebar says {labels.get(href)!r} for {href}, the home "
                        f"page's table {label!r}"
                    )
            pages = [href.removeprefix(base) for href in order]
            missing = set(notebooks) - set(pages)
            if missing or "api/" not in pages:
                failures.append(f"pages missing from the navigation: {sorted(missing)}")
            for url in pages:
                failures += check_page(driver, base, url, notebooks.get(url), order)
                if url in SCREENSHOTS:
                    driver.save_screenshot(str(out / f"{SCREENSHOTS[url]}_{WIDE}.png"))
            set_width(driver, NARROW)
            for url in pages:
                driver.get(base + url)
                c = driver.execute_script(COUNT)
                if c["scroll_width"] > c["window"]:
                    failures.append(
                        f"/{url}: scrolls sideways at {NARROW} px ({c['scroll_width']} px wide)"
                    )
                if url in SCREENSHOTS:
                    driver.execute_async_script(WAIT_FOR_MATHJAX)
                    driver.save_screenshot(str(out / f"{SCREENSHOTS[url]}_{NARROW}.png"))
            print(
                f"{len(pages)} pages at {NARROW} px: "
                f"{sum(f.endswith('px wide)') for f in failures)} scroll sideways"
            )
        finally:
            driver.quit()
            server.shutdown()
    for f in failures:
        print("FAIL", f, file=sys.stderr)
    print(f"screenshots in {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
