"""Headless-browser check of the built site, as a reader sees it.

Serves `site/` on localhost, opens every page in headless Chromium, and fails if:

* a page logs a JavaScript console error (level SEVERE), a failed resource load included;
* a page that contains math has no MathJax-typeset elements, or has MathJax errors;
* a notebook page shows fewer loaded figures (PNG images with a non-zero natural width)
  than its notebook has PNG outputs.

It writes screenshots of the home page and of one notebook page.

Usage: python docs/check_site.py [--site site] [--out out/screenshots]
Needs Debian's `chromium` and `chromium-driver` (installed by .ci/run).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import sys
import tempfile
import threading
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parent.parent
WAIT_FOR_MATHJAX = """
const done = arguments[arguments.length - 1];
if (!window.MathJax || !MathJax.Hub) { done(false); return; }
MathJax.Hub.Queue(() => done(true));
"""
COUNT = """
return {
  typeset: document.querySelectorAll(
    '.MathJax, .MathJax_Display, .MathJax_MathML, .MathJax_CHTML, mjx-container').length,
  errors: document.querySelectorAll('.MathJax_Error, merror').length,
  raw_math: document.querySelectorAll('.arithmatex, script[type^="math/tex"]').length,
  figures: Array.from(document.images).filter(
      i => i.src.startsWith('data:image/png') && i.complete && i.naturalWidth > 0).length,
};
"""


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def browser(profile: str) -> webdriver.Chrome:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                 f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    driver.set_script_timeout(60)
    return driver


def png_outputs(notebook: Path) -> int:
    nb = json.loads(notebook.read_text())
    return sum("image/png" in o.get("data", {}) for c in nb["cells"] if c["cell_type"] == "code"
               for o in c.get("outputs", []))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", default=str(ROOT / "site"))
    parser.add_argument("--out", default=str(ROOT / "out" / "screenshots"))
    args = parser.parse_args(argv)
    site, out = Path(args.site), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    pages = {"": None, "api/": None}
    pages.update({f"notebooks/{nb.stem}/": nb for nb in notebooks})

    server, base = serve(site)
    failures = []
    with tempfile.TemporaryDirectory() as profile:
        driver = browser(profile)
        try:
            for url, notebook in pages.items():
                driver.get(base + url)
                mathjax = driver.execute_async_script(WAIT_FOR_MATHJAX)
                counts = driver.execute_script(COUNT)
                errors = [e["message"] for e in driver.get_log("browser")
                          if e["level"] == "SEVERE"]
                want_figs = png_outputs(notebook) if notebook else 0
                status = []
                if errors:
                    status.append(f"console errors: {errors}")
                if counts["raw_math"] or notebook:
                    if not mathjax or counts["typeset"] == 0:
                        status.append("math present but not typeset by MathJax")
                    if counts["errors"]:
                        status.append(f"{counts['errors']} MathJax errors")
                if counts["figures"] < want_figs:
                    status.append(f"{counts['figures']} figures shown, notebook has {want_figs}")
                print(f"{'FAIL' if status else 'ok  '} /{url:<45} math elements "
                      f"{counts['typeset']:>4}, figures {counts['figures']}/{want_figs}, "
                      f"console errors {len(errors)}")
                failures += [f"/{url}: {s}" for s in status]
                if url == "":
                    driver.save_screenshot(str(out / "home.png"))
                if notebook is not None and notebook.stem.startswith("04_"):
                    driver.save_screenshot(str(out / "notebook_04.png"))
        finally:
            driver.quit()
            server.shutdown()
    for f in failures:
        print("FAIL", f, file=sys.stderr)
    print(f"screenshots in {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
