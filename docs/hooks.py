"""MkDocs hooks: serve MathJax from the site itself; notebook downloads; clean search.

The site must typeset math offline (a reader behind a firewall, CI without internet), so
MathJax 2.7 is copied from the `jupyter-server-mathjax` package into `site/assets/mathjax`.
Notebook pages load it through mkdocs-jupyter's `custom_mathjax_url`; Markdown pages that
contain math (arithmatex spans) get the same script injected here, so no page loads it twice.

This MathJax package ships no TeX web fonts: write \\mathrm{E} or \\mathbf{R}, not \\mathbb,
or `docs/check_site.py` will report the failed font load.

Each notebook page gets a link to its `.ipynb` (which mkdocs-jupyter's `include_source`
copies next to the page).

The search index is built from each page's HTML (material's search plugin), and it skips
elements marked `data-search-exclude`. Marked here, so that results read as prose: the
notebooks' copy buttons ("Copied!") and heading anchors (¶), and the math (Markdown math,
notebook math and sympy's LaTeX outputs), which the index would otherwise hold as raw LaTeX.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path, PurePosixPath

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


EXCLUDE = re.compile(r'<(?:div|span|a) class="(?:[^"]* )?(?:zeroclipboard-container|anchor-link|'
                     r'arithmatex|jp-RenderedLatex)(?: [^"]*)?"')
MARKDOWN_CELL = re.compile(r'(<div class="[^"]*\bjp-RenderedMarkdown\b[^>]*>)(.*?)(</div>)', re.S)
CODE = re.compile(r"(<code>.*?</code>|<pre>.*?</pre>)", re.S)
# Math as it stands in a rendered notebook cell, before MathJax: $$...$$ and $...$ (a tag
# never sits inside; "<" in math arrives as &lt;).
TEX = re.compile(r"\$\$[^<]+?\$\$|\$[^$<]+?\$")


def _exclude_tex(match: re.Match) -> str:
    start, body, end = match.groups()
    parts = CODE.split(body)  # odd items are code: a `$` there is not math
    for i in range(0, len(parts), 2):
        parts[i] = TEX.sub(lambda m: f"<span data-search-exclude>{m.group()}</span>", parts[i])
    return start + "".join(parts) + end


def on_page_content(html, page, config, files):
    html = EXCLUDE.sub(lambda m: m.group() + " data-search-exclude", html)
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    html = MARKDOWN_CELL.sub(_exclude_tex, html)
    name = PurePosixPath(page.file.src_uri).name  # copied next to the page's index.html
    link = (f'<p class="nb-download" data-search-exclude><a class="md-button" href="{name}" '
            f'download title="Download this notebook">Download {name}</a></p>\n')
    return link + html
