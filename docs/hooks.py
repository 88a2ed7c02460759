"""MkDocs hooks: serve MathJax from the site itself.

The site must typeset math offline (a reader behind a firewall, CI without internet), so
MathJax 2.7 is copied from the `jupyter-server-mathjax` package into `site/assets/mathjax`.
Notebook pages load it through mkdocs-jupyter's `custom_mathjax_url`; Markdown pages that
contain math (arithmatex spans) get the same script injected here, so no page loads it twice.

This MathJax package ships no TeX web fonts: write \\mathrm{E} or \\mathbf{R}, not \\mathbb,
or `docs/check_site.py` will report the failed font load.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jupyter_server_mathjax

MATHJAX = Path(jupyter_server_mathjax.__file__).parent / "static"
# Browsers render MathML natively now (Chromium since 109, Firefox, Safari), so MathJax emits
# MathML and needs no web fonts. Where it falls back to HTML-CSS, it must use STIX-Web, the
# only fonts this MathJax package ships.
CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe,local/site"
LOCAL = """MathJax.Hub.Config({
  MMLorHTML: {prefer: {MSIE: "MML", Firefox: "MML", Opera: "MML", Safari: "MML", Chrome: "MML",
                       other: "MML"}},
  "HTML-CSS": {availableFonts: ["STIX-Web"], preferredFont: "STIX-Web", webFont: "STIX-Web",
               imageFont: null,
               // MathJax's probe font points at about:blank, which Chromium reports as a
               // failed load; a local() source makes no request at all.
               styles: {"@font-face": {"font-family": "MathJax_Blank",
                                       src: "local('MathJax_Blank')"}}}
});
MathJax.Ajax.loadComplete("[MathJax]/config/local/site.js");
"""


def on_post_build(config, **kwargs):
    target = Path(config["site_dir"]) / "assets" / "mathjax"
    shutil.copytree(MATHJAX, target, dirs_exist_ok=True)
    (target / "config" / "local").mkdir(parents=True, exist_ok=True)
    (target / "config" / "local" / "site.js").write_text(LOCAL)


def on_post_page(output, page, config, **kwargs):
    if "arithmatex" not in output or "MathJax.js" in output:
        return output
    prefix = "../" * page.url.count("/")
    script = (
        '<script type="text/x-mathjax-config">MathJax.Hub.Config({messageStyle: "none", '
        'tex2jax: {inlineMath: [["\\\\(", "\\\\)"]], displayMath: [["\\\\[", "\\\\]"]]}});'
        "</script>\n"
        f'<script src="{prefix}assets/mathjax/MathJax.js?config={CONFIG}"></script>\n'
    )
    return output.replace("</body>", script + "</body>")
