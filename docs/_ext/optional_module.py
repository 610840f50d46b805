"""``.. optional-automodule:: npattn.torch``: the module's reference where it exists.

The directive renders ``automodule`` with its members when the module can be
found, and a note saying that this build does not have it otherwise, so that
the documentation builds with and without modules that are still being
written. A module that is found but fails to import is an error, as in
``automodule`` itself.
"""

import importlib.util

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


class OptionalAutomodule(SphinxDirective):
    required_arguments = 1
    has_content = False

    def run(self):
        name = self.arguments[0]
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            note = nodes.note()
            note += nodes.paragraph(text=f"{name} is not part of this build of npattn.")
            return [note]
        lines = StringList([f".. automodule:: {name}", "   :members:", ""], source=self.get_source_info()[0])
        node = nodes.section()
        node.document = self.state.document
        self.state.nested_parse(lines, self.content_offset, node)
        return node.children


def setup(app):
    app.add_directive("optional-automodule", OptionalAutomodule)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
