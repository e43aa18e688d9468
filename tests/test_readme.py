"""The README quotes no measured ratio that would go stale: its performance sentence links to the
rows of docs/PERFORMANCE.md that the commands beside them regenerate, and the link resolves."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_quotes_no_measured_ratio_and_links_to_the_current_rows():
    readme = (ROOT / "README.md").read_text()
    # a ratio such as "1.15×" or "7.3x plain" is a number copied from a table
    assert not re.findall(r"\d(?:\.\d+)?\s?[×x]\b", readme)
    links = re.findall(r"\(docs/PERFORMANCE\.md#([\w-]+)\)", readme)
    assert "against-the-targets" in links
    headings = re.findall(r"^#+ (.+)$", (ROOT / "docs" / "PERFORMANCE.md").read_text(), flags=re.M)
    anchors = {_anchor(h) for h in headings}
    assert set(links) <= anchors, set(links) - anchors


def test_the_readme_is_at_most_250_lines():
    """The front page stays a front page: detail lives in docs/ (issue 41's bar)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
