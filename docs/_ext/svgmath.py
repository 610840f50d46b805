"""Maths drawn as SVG when the documentation is built: no script, nothing fetched.

Sphinx's default renderer, MathJax, is a script loaded from a CDN, so a build
read offline shows raw LaTeX. Here each math node (``$...$`` and ``$$...$$``
in a page or a notebook's Markdown, the ``math`` role and directive) is set by
ziamath, in pure Python, into an inline SVG: the glyphs are paths in the
text's colour (``currentColor``, so a dark theme shows them too), and the
LaTeX is the SVG's accessible label. LaTeX that ziamath cannot set is a
warning naming the page, which ``-W`` makes an error.
"""

import html

import ziamath
from docutils import nodes
from sphinx.util import logging

logger = logging.getLogger(__name__)

ziamath.config.svg2 = False  # glyphs as paths: no <symbol> ids, which would repeat on a page
SIZE = 20  # the font size ziamath sets at: its glyphs then match the theme's 16 px body text


def _drawn(self, node, latex: str, inline: bool) -> "ziamath.Latex | None":
    try:
        return ziamath.Latex(latex, size=SIZE, color="currentColor", inline=inline)
    except Exception as e:  # ziamath raises what its parsers raise
        logger.warning(f"svgmath: cannot set {latex!r} as maths: {e}", location=node)
        return None


def _svg(math: "ziamath.Latex", latex: str, style: str = "") -> str:
    """The SVG, labelled with its LaTeX for screen readers and search."""
    label = html.escape(latex, quote=True)
    style = f' style="{style}"' if style else ""
    return math.svg().replace("<svg ", f'<svg role="img" aria-label="{label}"{style} ', 1)


def visit_inline(self, node) -> None:
    latex = node.astext()
    math = _drawn(self, node, latex, inline=True)
    if math is None:
        self.body.append(f'<span class="math">{html.escape(latex)}</span>')
    else:  # the SVG's bottom lies getyofst() px below the text's baseline
        svg = _svg(math, latex, f"vertical-align: {math.getyofst():.2f}px")
        self.body.append(f'<span class="math notranslate svgmath">{svg}</span>')
    raise nodes.SkipNode


def visit_block(self, node) -> None:
    latex = node.astext()
    math = _drawn(self, node, latex, inline=False)
    self.body.append(self.starttag(node, "div", CLASS="math notranslate svgmath"))
    if node.get("number"):
        number = self.builder.env.toc_fignumbers.get(self.builder.current_docname, {}).get(node["ids"][0])
        self.body.append(f'<span class="eqno">({node["number"] if number is None else number})</span>')
    self.body.append(html.escape(latex) if math is None else _svg(math, latex))
    self.body.append("</div>\n")
    raise nodes.SkipNode


def setup(app):
    app.add_html_math_renderer("svgmath", (visit_inline, None), (visit_block, None))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
