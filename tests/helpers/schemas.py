"""JSON schemas of the kinds clients send for extraction and classification (nested
objects, arrays, enums, required and optional fields, string patterns, bounded numbers),
and a prompt for each: tests/data/schemas.json."""

from __future__ import annotations

import json
from pathlib import Path

_DATA = json.loads((Path(__file__).resolve().parents[1] / "data" / "schemas.json").read_text())
SCHEMAS: list[dict] = _DATA["schemas"]
PROMPTS: list[str] = _DATA["prompts"]
