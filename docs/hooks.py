"""MkDocs hooks: serve MathJax from the site itself; notebook downloads; clean search.

The site must typeset math offline (a reader behind a firewall, CI without internet), so
MathJax 2.7 is copied from the `jupyter-server-mathjax` package into `site/assets/mathjax`.
Notebook pages load it through mkdocs-jupyter's `custom_mathjax_url`; Markdown pages that
contain math (arithmatex spans) get the same script injected here, so no page loads it twice.

This MathJax package ships no TeX web fonts: write \\mathrm{E} or \\mathbf{R}, not \\mathbb,
or `docs/check_site.py` will report the failed font load.

Each notebook page gets a link to its `.ipynb` (which mkdocs-jupyter's `include_source`
copies next to the page), and its inline code that names a public function or class of the
package (`tree_decode`, `tae.combine`, `costmodel.DGX_H100`) links to that object on its API
page: the notebooks cross-link to the reference, from one table built from the modules.

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


EXCLUDE = re.compile(
    r'<(?:div|span|a) class="(?:[^"]* )?(?:zeroclipboard-container|anchor-link|'
    r'arithmatex|jp-RenderedLatex)(?: [^"]*)?"'
)
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


API_MODULES = (
    "core.numerics",
    "core.masks",
    "core.reference",
    "core.states",
    "core.merges",
    "core.kernels",
    "core.kernels.xla",
    "core.kernels.cudnn",
    "core.kernels.flash",
    "core.decode",
    "core.devices",
    "theory.energy",
    "theory.bayes",
    "theory.symbolic",
    "theory.hopfield",
    "perf.introspect",
    "perf.costmodel",
    "perf.formulas",
    "perf.links",
    "perf.patterns",
    "perf.predict",
    "perf.paper",
    "perf.crossover",
    "perf.microbench",
    "perf.calibrate",
    "perf.benchmark",
    "llama.model",
    "llama.checkpoint",
    "llama.gguf_checkpoint",
    "llama.fetch",
    "llama.config",
    "llama.layers",
    "llama.cache",
    "llama.forward",
    "llama.generator",
    "llama.hf_config",
    "llama.gguf_scan",
    "llama.paths",
    "cluster.launch",
    "cluster.processes",
    "cluster.netns",
    "cluster.run",
    "cluster.context",
    "cluster.levels",
    "cluster.methods",
    "cluster.worker",
    "plots",
    "cli",
)
"""Modules documented by the API pages; `core.kernels.xla` and its siblings share the page of
`core.kernels` (`_page`)."""
MEMBERS = re.compile(r"members:\s*\[([^\]]*)\]")
INLINE_CODE = re.compile(r"<code>([A-Za-z_][\w.]*)(\(\))?</code>")


def _page(mod: str) -> str:
    """The API page (under api/) that documents module `mod`."""
    if mod.startswith("core.kernels"):
        return "core/kernels"
    llama_pages = {
        "llama.config": "llama/model",
        "llama.layers": "llama/model",
        "llama.cache": "llama/model",
        "llama.forward": "llama/model",
        "llama.generator": "llama/model",
        "llama.hf_config": "llama/checkpoint",
        "llama.gguf_scan": "llama/gguf_checkpoint",
        "llama.paths": "llama/fetch",
    }
    if mod in llama_pages:
        return llama_pages[mod]
    if mod == "cluster.processes":
        return "cluster/launch"
    if mod.startswith("cluster.") and mod != "cluster.launch":
        return "cluster/cluster"
    return mod.replace(".", "/")


def _api_objects() -> dict[str, tuple[str, str]]:
    """`name` (and `tae.name`, `module.name` with the module's full or last dotted name)
    -> (module, name) for every public object that an API page documents; a name that two
    modules define is linked by its module only."""
    import importlib
    import inspect

    table: dict[str, tuple[str, str]] = {}
    ambiguous: set[str] = set()
    for mod in API_MODULES:
        module = importlib.import_module(f"tree_attention_edu.{mod}")
        text = (Path(__file__).parent / "api" / f"{_page(mod)}.md").read_text()
        block = text.split(f"::: tree_attention_edu.{mod}\n", 1)[1].split(":::", 1)[0]
        listed = MEMBERS.search(block)
        documented = {m.strip() for m in listed.group(1).split(",")} if listed else None
        parent = mod.rsplit(".", 1)[0] if mod.startswith("core.kernels.") else None
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if documented is not None and name not in documented:
                continue  # the API page lists its members: link only what it shows
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or not obj.__doc__:
                continue  # mkdocstrings shows documented functions and classes only
            aliases = {f"{mod}.{name}", f"{mod.rsplit('.', 1)[-1]}.{name}"}
            if parent:  # `kernels.xla_state`: re-exported by the kernels package
                aliases.add(f"{parent.rsplit('.', 1)[-1]}.{name}")
            for alias in aliases:
                table[alias] = (mod, name)
            if name in table and table[name] != (mod, name):
                ambiguous.add(name)
            table.setdefault(name, (mod, name))
    for name in ambiguous:
        table.pop(name)
    package = importlib.import_module("tree_attention_edu")
    for name in getattr(package, "__all__", ()):
        if name in table:
            table[f"tae.{name}"] = table[name]
    return table


_API: dict[str, tuple[str, str]] | None = None


def _link_api(html: str, page) -> str:
    """Wrap `<code>name</code>` in a link to the object's API entry (outside code cells)."""
    global _API
    if _API is None:
        _API = _api_objects()
    up = "../" * PurePosixPath(page.url).as_posix().rstrip("/").count("/") + "../"

    def link(match: re.Match) -> str:
        target = _API.get(match.group(1))
        if target is None:
            return match.group()
        mod, name = target
        return (
            f'<a class="api-link" href="{up}api/{_page(mod)}/#tree_attention_edu.{mod}.{name}">'
            f"{match.group()}</a>"
        )

    return MARKDOWN_CELL.sub(lambda cell: INLINE_CODE.sub(link, cell.group()), html)


def on_page_content(html, page, config, files):
    html = EXCLUDE.sub(lambda m: m.group() + " data-search-exclude", html)
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    html = MARKDOWN_CELL.sub(_exclude_tex, html)
    html = _link_api(html, page)
    name = PurePosixPath(page.file.src_uri).name  # copied next to the page's index.html
    link = (
        f'<p class="nb-download" data-search-exclude><a class="md-button" href="{name}" '
        f'download title="Download this notebook">Download {name}</a></p>\n'
    )
    return link + html
