"""The ```python blocks of a doc page, as a user copies them (tests run them as written, changing only hosts)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(page: str) -> list[str]:
    """Every ```python block of ``docs/<page>``, in order."""
    text = (ROOT / "docs" / page).read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
