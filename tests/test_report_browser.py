"""The tour's report opened in a real browser: headless Chromium loads it, every image loads,
screenshots at 1280 and 420 px wide are not blank, and at 420 px nothing widens the page
(tables scroll in their own box, figures shrink and stack).

Chromium is installed by ``make test`` when missing (Debian package ``chromium``). Without it
this test skips, except under ``CI=true``, where a missing browser is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from selfattn.tour.runner import run_tour

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

# Appended to a copy of the page: once everything has loaded, record each image's state in the DOM.
IMAGE_PROBE = """<script>
window.addEventListener("load", function () {
  var status = Array.prototype.map.call(document.images, function (img) {
    return (img.complete && img.naturalWidth > 0 ? "ok " : "broken ") + img.getAttribute("src");
  });
  document.body.setAttribute("data-image-status", JSON.stringify(status));
});
</script>"""


@pytest.fixture(scope="module")
def browser():
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    message = "headless Chromium is not installed (make test installs it: apt-get install chromium)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("browser") / "report"
    run_tour(out, quick=True, progress=False)
    return out


def run_browser(browser, tmp_path, *args):
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    done = subprocess.run(
        [browser, *FLAGS, f"--user-data-dir={profile}", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def image_status(browser, tmp_path, page):
    """``[("ok" | "broken", src), ...]`` for every <img> of ``page`` after it loaded."""
    probe = page.with_name(f"probe-{page.name}")
    probe.write_text(page.read_text().replace("</body>", IMAGE_PROBE + "</body>"))
    dom = run_browser(browser, tmp_path, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    found = re.search(r'data-image-status="([^"]*)"', dom)
    assert found, "the page never finished loading"
    entries = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    return [tuple(entry.split(" ", 1)) for entry in entries]


# Headless Chromium will not make a window narrower than 500 px, so narrow layouts are rendered
# in a 420 px iframe: its document lays out, and answers media queries, as in a 420 px window.
FRAME = """<!DOCTYPE html><html><body style="margin:0;background:#fff">
<iframe id="frame" src="{src}" style="width:{width}px;height:{height}px;border:0;display:block"></iframe>
<script>
document.getElementById("frame").addEventListener("load", function () {{
  var doc = this.contentDocument, win = this.contentWindow, widest = 0, culprit = "";
  Array.prototype.forEach.call(doc.body.querySelectorAll("*"), function (el) {{
    if (el.closest(".table-scroll") && !el.classList.contains("table-scroll")) {{ return; }}
    var right = el.getBoundingClientRect().right;
    if (right > widest) {{ widest = right; culprit = el.tagName + "." + el.className; }}
  }});
  var images = Array.prototype.map.call(doc.images, function (img) {{
    return {{src: img.currentSrc.split("/").pop(), loaded: img.complete && img.naturalWidth > 0,
      natural: [img.naturalWidth, img.naturalHeight], shown: Math.ceil(img.getBoundingClientRect().right),
      width: Math.round(img.getBoundingClientRect().width), panel: img.closest(".panel-row") !== null}};
  }});
  var scrollers = Array.prototype.map.call(doc.querySelectorAll(".table-scroll"), function (box) {{
    return {{right: Math.ceil(box.getBoundingClientRect().right), inner: box.scrollWidth, outer: box.clientWidth,
      overflow: win.getComputedStyle(box).overflowX}};
  }});
  document.body.setAttribute("data-widths", JSON.stringify({{
    scroll: doc.documentElement.scrollWidth, viewport: win.innerWidth,
    widest: Math.ceil(widest), culprit: culprit, images: images, scrollers: scrollers,
    tables: doc.querySelectorAll("table").length,
    wrapped: doc.querySelectorAll(".table-scroll > table").length}}));
}});
</script></body></html>"""


def framed(page, width, height=2000):
    """A page next to ``page`` showing it in a ``width`` px iframe."""
    wrapper = page.with_name(f"frame-{width}-{page.name}")
    wrapper.write_text(FRAME.format(src=page.name, width=width, height=height))
    return wrapper


def page_widths(browser, tmp_path, page, width):
    """``{"scroll", "viewport", "widest", "culprit", "images", "scrollers", "tables", "wrapped"}`` of ``page``
    laid out ``width`` px wide: each image's chosen file, whether it loaded, its natural size, right edge, shown
    width and whether it is one panel of a figure drawn panel by panel; each
    table box's right edge, inner and outer width and overflow style; how many tables, how many in a box."""
    dom = run_browser(
        browser,
        tmp_path,
        "--allow-file-access-from-files",
        "--window-size=1280,2000",
        "--virtual-time-budget=10000",
        "--dump-dom",
        framed(page, width).as_uri(),
    )
    found = re.search(r'data-widths="([^"]*)"', dom)
    assert found, "the page never finished loading"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def screenshot(browser, tmp_path, page, name, width=1280):
    """The page as a browser ``width`` px wide shows it: ``(height, width, rgb)`` floats in [0, 1]."""
    shot = tmp_path / name
    target = page if width >= 500 else framed(page, width)
    run_browser(
        browser,
        tmp_path,
        f"--window-size={max(width, 500)},2000",
        "--hide-scrollbars",
        f"--screenshot={shot}",
        target.as_uri(),
    )
    import matplotlib.image

    return matplotlib.image.imread(shot)[:, :width, :3]


def looks_blank(pixels: np.ndarray) -> bool:
    """Blank: (almost) one colour everywhere, or no coloured pixel at all (figures are coloured)."""
    inked = np.abs(pixels - pixels[0, 0]).max(axis=-1) > 0.1
    coloured = (pixels.max(axis=-1) - pixels.min(axis=-1)) > 0.25
    return inked.mean() < 0.02 or coloured.mean() < 0.005


def test_every_image_of_the_report_loads(browser, report, tmp_path):
    statuses = image_status(browser, tmp_path, report / "report.html")
    assert statuses, "the report has no images"
    assert [src for state, src in statuses if state != "ok"] == []
    wide_only = {f"figures/{p.name}" for p in (report / "figures").glob("*.png") if p.stem != "comparison_stacked"}
    assert {src for _, src in statuses} == wide_only  # at 1280 px the stacked comparison is not picked


def test_a_missing_image_would_be_caught(browser, report, tmp_path):
    page = report / "control.html"
    page.write_text('<html><body><img src="figures/depth-residual.png"><img src="figures/not-there.png"></body></html>')
    assert image_status(browser, tmp_path, page) == [
        ("ok", "figures/depth-residual.png"),
        ("broken", "figures/not-there.png"),
    ]


def test_screenshot_of_the_report_is_not_blank(browser, report, tmp_path):
    pixels = screenshot(browser, tmp_path, report / "report.html", "report.png")
    assert pixels.shape[0] >= 1000 and pixels.shape[1] >= 1000
    assert not looks_blank(pixels)


def test_a_blank_page_would_be_caught(browser, report, tmp_path):
    page = report / "blank.html"
    page.write_text("<html><body></body></html>")
    assert looks_blank(screenshot(browser, tmp_path, page, "blank.png"))


def test_screenshot_at_420_px_is_not_blank(browser, report, tmp_path):
    pixels = screenshot(browser, tmp_path, report / "report.html", "report-420.png", width=420)
    assert pixels.shape[1] == 420 and pixels.shape[0] >= 1000
    assert not looks_blank(pixels)


def test_nothing_overflows_at_420_px(browser, report, tmp_path):
    widths = page_widths(browser, tmp_path, report / "report.html", 420)
    assert widths["viewport"] == 420
    assert widths["scroll"] <= 420, widths
    assert widths["widest"] <= 420, widths


def shrunken_panels(widths, viewport):
    """The panels of a figure drawn panel by panel that are shown at under 3/4 of the size they were drawn at
    (or of the page's width, when that is smaller): their labels would be too small to read."""
    return [
        image
        for image in widths["images"]
        if image["panel"] and image["width"] < 0.75 * min(image["natural"][0], viewport - 40)
    ]


@pytest.fixture(scope="module")
def narrow(browser, report, tmp_path_factory):
    return page_widths(browser, tmp_path_factory.mktemp("narrow"), report / "report.html", 420)


def test_at_420_px_every_image_loads_and_fits(narrow, report):
    assert narrow["images"], "the report has no images"
    for image in narrow["images"]:
        assert image["loaded"], image
        assert image["shown"] <= 420, image
    assert len(narrow["images"]) == len(list((report / "figures").glob("*.png"))) - 1  # one comparison shown


def test_at_420_px_the_comparison_figure_is_the_stacked_one(narrow):
    comparison = [image for image in narrow["images"] if image["src"].startswith("comparison")]
    assert [image["src"] for image in comparison] == ["comparison_stacked.png"]
    width, height = comparison[0]["natural"]
    assert height > 3 * width  # six panels in one column


def test_at_420_px_wide_tables_scroll_in_their_own_box(narrow):
    assert narrow["tables"] == narrow["wrapped"] > 0  # every table sits in a scrolling box
    for box in narrow["scrollers"]:
        assert box["right"] <= 420, box
        assert box["overflow"] == "auto", box
    assert any(box["inner"] > box["outer"] for box in narrow["scrollers"])  # some do need to scroll at this width


def test_an_overflowing_table_would_be_caught(browser, report, tmp_path):
    page = report / "wide.html"
    cells = "".join(f"<td>column-{i}-with-a-long-unbreakable-name</td>" for i in range(20))
    page.write_text(f"<html><body><table><tr>{cells}</tr></table></body></html>")
    assert page_widths(browser, tmp_path, page, 420)["scroll"] > 420


def test_at_420_px_the_panels_of_the_family_and_depth_figures_stack_at_a_readable_size(narrow):
    panels = [image for image in narrow["images"] if image["panel"]]
    assert {image["src"].split("-")[0] for image in panels} >= {"depth", "family_sinusoidal", "family_rotary"}
    assert shrunken_panels(narrow, 420) == []
    assert all(image["width"] >= 300 for image in panels)  # one panel a row, not three squeezed into 400 px


def test_a_squeezed_panel_would_be_caught(browser, report, tmp_path):
    page = report / "squeezed.html"
    images = "".join(f'<img src="figures/depth-{v}.png" style="width:24%">' for v in ("residual", "no_residual"))
    page.write_text(f'<html><body><div class="panel-row">{images}</div></body></html>')
    assert len(shrunken_panels(page_widths(browser, tmp_path, page, 420), 420)) == 2


def test_at_1280_px_no_table_is_cut_inside_its_box(browser, report, tmp_path):
    widths = page_widths(browser, tmp_path, report / "report.html", 1280)
    assert widths["scrollers"]
    assert [box for box in widths["scrollers"] if box["inner"] > box["outer"]] == []  # the deep-stack table too
