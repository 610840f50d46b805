"""``.. c-header:: ../csrc/attention.h``: a C header as a page for its callers.

Each top-level comment becomes prose (its indented lines stay preformatted),
followed by the declarations it describes as a C code block, under a rubric
that names them. The include guard and ``extern "C"`` lines are left out; the
whole header is one ``literalinclude`` away for a reader who wants it verbatim.
"""

import re

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

BOILERPLATE = re.compile(
    r'^\s*(#ifndef \w+_H|#define \w+_H|#ifdef __cplusplus|extern "C" \{|\}|#endif.*|#include .*)\s*$'
)
TYPE = re.compile(r"^(?:enum|struct)\s+(\w+)\s*\{")
MACRO = re.compile(r"^#define\s+(NPATTN_\w+)")
FUNCTION = re.compile(r"(\w+)\s*\(")


def chunks(text):
    """(comment lines, code lines) pairs, in the header's order."""
    out, comment, code, depth = [], [], [], 0
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("/*"):
            if comment or code:
                out.append((comment, code))
            comment, code = [], []
            while True:
                body = lines[i]
                end = "*/" in body
                body = body.split("*/")[0]
                body = re.sub(r"^(/\*| \*) ?", "", body)
                comment.append(body.rstrip())
                i += 1
                if end:
                    break
        elif line.strip() == "" and depth > 0:
            code.append("")  # a blank line inside a struct keeps it one block
            i += 1
        elif line.strip() == "":
            if code:
                out.append((comment, code))
                comment, code = [], []
            i += 1
        else:
            if not BOILERPLATE.match(line):
                code.append(line)
                bare = re.sub(r"/\*.*?(\*/|$)", "", line)
                depth += bare.count("{") - bare.count("}")
            i += 1
    if comment or code:
        out.append((comment, code))
    return out


def declared(code):
    """The names a chunk declares at file scope: types, macros, functions."""
    names, depth = [], 0
    for line in code:
        bare = re.sub(r"/\*.*?(\*/|$)", "", line).strip()
        if depth == 0 and bare:
            m = TYPE.match(bare) or MACRO.match(bare)
            if not m and not bare.startswith("#"):
                m = FUNCTION.search(bare.replace("NPATTN_EXPORTED ", ""))
            if m and m.group(1) not in names and m.group(1) != "NPATTN_EXPORTED":
                names.append(m.group(1))
        depth += bare.count("{") - bare.count("}")
    return names


def prose(comment):
    """Paragraphs, and preformatted blocks for the indented lines."""
    result, para, pre = [], [], []

    def flush():
        if para:
            result.append(nodes.paragraph(text=" ".join(s.strip() for s in para)))
            para.clear()
        if pre:
            text = "\n".join(pre).rstrip("\n")
            block = nodes.literal_block(text, text)
            block["language"] = "text"
            result.append(block)
            pre.clear()

    for line in comment:
        if not line.strip():
            flush()
        elif line.startswith("    "):
            if para:
                flush()
            pre.append(line[4:])
        else:
            if pre:
                flush()
            para.append(line)
    flush()
    return result


class CHeader(SphinxDirective):
    required_arguments = 1

    def run(self):
        rel, path = self.env.relfn2path(self.arguments[0])
        self.env.note_dependency(rel)
        with open(path) as f:
            text = f.read()
        result = []
        for comment, code in chunks(text):
            names = declared(code)
            if names:
                result.append(nodes.rubric(text=", ".join(names)))
            result.extend(prose(comment))
            if code:
                body = "\n".join(code)
                block = nodes.literal_block(body, body)
                block["language"] = "c"
                result.append(block)
        return result


def setup(app):
    app.add_directive("c-header", CHeader)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
