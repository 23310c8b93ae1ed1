"""Great Expectations' Data Docs made to work offline: every asset local, nothing fetched.

GE renders its Data Docs pages with their CSS, scripts, fonts and logos loaded from public CDNs
and an S3 bucket (about a dozen outside hosts): opened offline they render unstyled with an empty
validation list, and opened online they tell those hosts who looked. `localize(docs)` copies the
files they need from `stages/datadocs_assets/` (the same versions, taken from the npm registry's
packages, each with its licence) into `<docs>/static/vendor/` and points every page and style
sheet at those copies by a relative path; GE's two logos on S3 become its own local one. A page
that still names an outside asset after that fails the validate stage, naming the URL: a new GE
version that adds one must not phone home quietly.

`ASSETS` maps each outside URL (as GE writes it, without its query) to the local file. To refresh
the copies for a new GE version: download the packages from the npm registry
(`https://registry.npmjs.org/<name>/-/<name>-<version>.tgz`) and copy the files named below.

    python -m stages.datadocs data/docs     # localize a folder of Data Docs (validate does it)
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "datadocs_assets"
VENDOR = "static/vendor"  # inside the docs folder

# outside URL -> file under ASSETS_DIR (and under <docs>/static/vendor/)
ASSETS = {
    "https://code.jquery.com/jquery-3.7.1.min.js": "jquery@3.7.1/jquery.min.js",
    "https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/css/bootstrap.min.css":
        "bootstrap@4.3.1/bootstrap.min.css",
    "https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/bootstrap.min.js":
        "bootstrap@4.3.1/bootstrap.min.js",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.js":
        "bootstrap-table@1.19.1/bootstrap-table.min.js",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.css":
        "bootstrap-table@1.19.1/bootstrap-table.min.css",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/extensions/filter-control/"
    "bootstrap-table-filter-control.min.js":
        "bootstrap-table@1.19.1/bootstrap-table-filter-control.min.js",
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/"
    "bootstrap-table-filter-control.css":
        "bootstrap-table@1.19.0/bootstrap-table-filter-control.css",
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/"
    "bootstrap-table-filter-control.min.css":
        "bootstrap-table@1.19.0/bootstrap-table-filter-control.min.css",
    "https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/umd/popper.min.js":
        "popper.js@1.12.9/popper.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/css/all.min.css":
        # its fonts inlined as data: URIs (woff2): a page opened from file:// may not load a font
        # file (browsers give file:// pages an opaque origin, and fonts need CORS)
        "fontawesome-free@6.6.0/css/all.min.css",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/js/"
    "bootstrap-datepicker.min.js": "bootstrap-datepicker@1.9.0/bootstrap-datepicker.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/css/"
    "bootstrap-datepicker.min.css": "bootstrap-datepicker@1.9.0/bootstrap-datepicker.min.css",
    "https://cdn.jsdelivr.net/npm/vega@5": "vega@5.33.1/vega.min.js",
    "https://cdn.jsdelivr.net/npm/vega-lite@5": "vega-lite@5.23.0/vega-lite.min.js",
    "https://cdn.jsdelivr.net/npm/vega-embed@6": "vega-embed@6.29.0/vega-embed.min.js",
    "https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/dist/css/"
    "bootstrap-prefers-dark.css": "bootstrap-dark@1.1.0/bootstrap-prefers-dark.min.css",
}
# GE's logos on S3: its own local logo (static/images, which GE writes beside the pages)
LOGOS = ("https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/full_logo_dark.png",
         "https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/logo-long.png")
LOCAL_LOGO = "static/images/logo-long.png"

# an outside URL a page would load: src=, href= of a style sheet or icon, url(...) in CSS
_LOADED = re.compile(r"""(?:src\s*=\s*["']|<link\b[^>]*?href\s*=\s*["']|url\(\s*['"]?)"""
                     r"""(https?://[^"')\s>]+)""", re.IGNORECASE)


class OutsideAsset(RuntimeError):
    """A Data Docs page still loads something from outside the machine."""


def outside_assets(text: str) -> list[str]:
    """The outside URLs a page or style sheet would load (links a person clicks do not count)."""
    return [m.group(1) for m in _LOADED.finditer(text)]


def localize(docs: Path) -> None:
    """Copy the assets into `docs` and point every page and style sheet at them; raises
    OutsideAsset naming the file and URL of anything still loaded from outside.
    """
    docs = Path(docs)
    vendor = docs / VENDOR
    shutil.rmtree(vendor, ignore_errors=True)
    shutil.copytree(ASSETS_DIR, vendor, ignore=shutil.ignore_patterns("__pycache__"))
    pages = sorted(docs.rglob("*.html")) + sorted((docs / "static").rglob("*.css"))
    for page in pages:
        if vendor in page.parents:
            continue
        up = "../" * (len(page.relative_to(docs).parts) - 1)  # from the page to the docs root
        text = page.read_text()
        for url, local in ASSETS.items():
            text = re.sub(re.escape(url) + r"(?=[\"')\s?#])", up + f"{VENDOR}/{local}", text)
        for url in LOGOS:
            text = re.sub(re.escape(url) + r"(\?[^\"')\s]*)?", up + LOCAL_LOGO, text)
        # GE's template climbs one folder short to the favicon on a validation result's page
        text = re.sub(r'href="(?:\.\./)*static/images/favicon\.ico"',
                      f'href="{up}static/images/favicon.ico"', text)
        left = outside_assets(text)
        if left:
            raise OutsideAsset(
                f"{page}: Data Docs would load {left[0]} from outside the machine; add it to "
                f"stages/datadocs.py ASSETS (and its file to stages/datadocs_assets/)")
        page.write_text(text)


def main(argv: list[str] | None = None) -> None:
    """Localize a Data Docs folder (the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("docs", type=Path, help="a Data Docs folder, e.g. data/docs")
    args = parser.parse_args(argv)
    localize(args.docs)
    print(f"{args.docs}: every asset is local ({args.docs / VENDOR})")


if __name__ == "__main__":
    main()
