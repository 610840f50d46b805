"""The pictures a reader sees, read without drawing them: every figure stored in a
notebook and every PNG the documentation shows is at least 600 pixels wide; the
code that draws them sets no text below 9 points; the prose counts the notebooks
right. (Heatmap labels pick black or white by the cell's luminance; that, the
notebooks' own ink(), is looked at by eye, as every figure is before a release.)"""

import base64
import json
import pathlib
import re
import struct

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MIN_WIDTH = 600  # pixels
MIN_POINTS = 9
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9}


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def notebook_figures():
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            for output in cell.get("outputs", []):
                if "image/png" in output.get("data", {}):
                    yield pytest.param(base64.b64decode(output["data"]["image/png"]), id=f"{path.name}:cell {i}")


def shown_pngs():
    """The PNGs the documentation's pages embed, and those beside the notebooks."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", page.read_text()):
            yield pytest.param(page.parent / target, id=f"{page.name}: {target}")
    for path in sorted((ROOT / "notebooks").glob("*.png")):
        yield pytest.param(path, id=str(path.relative_to(ROOT)))


@pytest.mark.skipif(not NOTEBOOKS, reason="the notebooks are not in the sdist")
@pytest.mark.parametrize("png", list(notebook_figures()))
def test_notebook_figures_are_wide_enough(png):
    width, _ = png_size(png)
    assert width >= MIN_WIDTH, f"{width} px wide"


@pytest.mark.parametrize("path", list(shown_pngs()))
def test_shown_pngs_are_wide_enough(path):
    if not path.exists():
        pytest.skip(f"{path.name} is not in this tree")
    width, _ = png_size(path.read_bytes())
    assert width >= MIN_WIDTH, f"{width} px wide"


def shown_svgs():
    """The SVG pictures the documentation's pages embed."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.svg)\)", page.read_text()):
            yield pytest.param(page.parent / target, id=f"{page.name}: {target}")


@pytest.mark.parametrize("path", list(shown_svgs()))
def test_shown_svgs_are_wide_enough_and_set_no_small_text(path):
    """At least 600 wide (in points, as matplotlib writes it: 800 CSS pixels), and no text
    below 9 points (its user unit is a point) inside."""
    if not path.exists():
        pytest.skip(f"{path.name} is not in this tree")
    svg = path.read_text()
    width = re.search(r'<svg[^>]*\bwidth="([0-9.]+)(pt|px)?"', svg)
    assert width and float(width.group(1)) >= MIN_WIDTH, width and width.group(0)
    small = [size for size in re.findall(r"font-size:\s*([0-9.]+)", svg) if float(size) < MIN_POINTS]
    assert not small, f"text of {small} points"


def drawing_code():
    """(where, source) of each notebook's code cells and of the benchmark plots."""
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                yield f"{path.name}:cell {i}", "".join(cell["source"])
    for plot in (ROOT / "benchmarks" / "plot.py", ROOT / "docs" / "quant_error.py"):
        if plot.exists():
            yield str(plot.relative_to(ROOT)), plot.read_text()


SIZE = re.compile(r"(?:fontsize|labelsize)[\"']?\s*[=:]\s*(?:([0-9.]+)|[\"']([a-z-]+)[\"'])")


def test_no_text_is_set_below_9_points():
    """No font or tick-label size below 9 points, as a number or as a word below "medium"
    (matplotlib's "small" is 10/12 of the 10-point default: 8.3 points); rcParams' too."""
    small = []
    for where, source in drawing_code():
        for m in SIZE.finditer(source):
            points, word = m.groups()
            if (points and float(points) < MIN_POINTS) or word in ("xx-small", "x-small", "small"):
                small.append(f"{where}: {m.group(0)}")
    assert not small, small


@pytest.mark.skipif(not NOTEBOOKS, reason="the notebooks are not in the sdist")
def test_the_prose_counts_the_notebooks_right():
    """Wherever README.md or docs/ says "<n> notebooks", n is how many there are."""
    wrong = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"\b(\w+) notebooks\b", page.read_text()):
            n = NUMBERS.get(m.group(1).lower(), int(m.group(1)) if m.group(1).isdigit() else None)
            if n is not None and n != len(NOTEBOOKS):
                wrong.append(f"{page.name}: {m.group(0)!r}, where there are {len(NOTEBOOKS)}")
    assert not wrong, wrong
