"""The layers of DESIGN.md section 2 import only the layers before them (ir is the common base)."""

from __future__ import annotations

import ast
from pathlib import Path

ORDER = ["ir", "lang", "analysis", "algebra", "transform", "schedule", "tile", "codegen", "runtime", "integrations"]
ROOT = Path(__file__).resolve().parents[1] / "src" / "neptune_fusion"


def _imported_layers(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "neptune_fusion" and len(parts) > 1 and parts[1] in ORDER:
                out.add(parts[1])
    return out


def test_data_flows_one_way():
    problems = []
    for rank, layer in enumerate(ORDER):
        allowed = set(ORDER[: rank + 1])
        for path in sorted((ROOT / layer).glob("*.py")):
            bad = _imported_layers(path) - allowed
            if bad:
                problems.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not problems, "\n".join(problems)
