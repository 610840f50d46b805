"""Check every internal link of the built HTML: the page it names exists, and so does its anchor.

    python docs/check_links.py docs/_build/html

Links that leave the site (http:, https:, mailto:) are counted, not fetched:
CI makes no network request for the documentation. What a page loads (a
script's or an image's src, a stylesheet) must be the site's own, so that it
reads offline: one from outside (MathJax from a CDN, say) is broken too. Exits
1 naming each broken link with the page it is on.
"""

import html.parser
import os
import sys
import urllib.parse


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.links, self.loads = set(), [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        for key in ("href", "src"):
            if attrs.get(key) and not (tag == "link" and attrs.get("rel") == "preload"):
                self.links.append(attrs[key])
        if attrs.get("src") or (tag == "link" and attrs.get("rel") == "stylesheet"):  # what the page loads
            self.loads.append(attrs.get("src") or attrs.get("href") or "")


def main(root):
    pages = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("_static", "_sources")]  # the theme's templates, the sources
        for name in files:
            if name.endswith(".html"):
                path = os.path.join(folder, name)
                page = Page()
                with open(path, encoding="utf-8") as f:
                    page.feed(f.read())
                pages[os.path.normpath(path)] = page
    broken, external, internal = [], 0, 0
    for path, page in sorted(pages.items()):
        for load in page.loads:
            if urllib.parse.urlsplit(load).netloc or load.startswith("//"):
                broken.append(f"{os.path.relpath(path, root)}: {load} (loaded from outside the site: missing offline)")
        for link in page.links:
            parts = urllib.parse.urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("//"):
                external += 1
                continue
            internal += 1
            target = os.path.normpath(os.path.join(os.path.dirname(path), urllib.parse.unquote(parts.path)))
            if not parts.path:
                target = path
            if os.path.isdir(target):
                target = os.path.join(target, "index.html")
            if not os.path.exists(target):
                broken.append(f"{os.path.relpath(path, root)}: {link} (no such file)")
            elif parts.fragment and target.endswith(".html"):
                ids = pages[os.path.normpath(target)].ids
                if urllib.parse.unquote(parts.fragment) not in ids:
                    broken.append(f"{os.path.relpath(path, root)}: {link} (no such anchor)")
    print(f"{len(pages)} pages, {internal} internal links and sources checked, {external} external not fetched")
    for line in broken:
        print(f"BROKEN {line}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
