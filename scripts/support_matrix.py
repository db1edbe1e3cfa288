"""Tries every feature on every architecture's tiny checkpoint (kvserve.testing.support) and writes
what worked: docs/support_matrix.json, and the table of docs/models.md between its markers.

    python scripts/support_matrix.py                  # every architecture (a few minutes)
    python scripts/support_matrix.py --arch Phi3ForCausalLM --arch GptOssForCausalLM
    python scripts/support_matrix.py --render         # only rewrite the table from the JSON
    python scripts/support_matrix.py --check          # exit 1 when the table is not the JSON's

tests/models/test_support_matrix.py tries the cells again and compares them with the JSON. The
rendering uses only the standard library, so that --check runs without kvserve built.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "support_matrix.json"
DOC = ROOT / "docs" / "models.md"
BEGIN = "<!-- support matrix: written by scripts/support_matrix.py from docs/support_matrix.json -->"
END = "<!-- end of support matrix -->"

COLUMNS = {"weights": "quantized weights (`kvserve quantize`)", "kv_cache": "quantized KV",
           "lora": "LoRA adapters on", "speculative": "speculative decoding",
           "prefix_caching": "prefix caching", "cuda_graphs": "CUDA graphs",
           "tensor_parallel": "tensor parallel"}


def cell(variants: dict[str, str]) -> str:
    """The variants that worked, or "no"; a footnote-free cell (reasons go below the table)."""
    worked = [name for name, outcome in variants.items() if outcome == "ok"]
    if worked:
        return ", ".join(worked)
    return "—" if all(outcome == "n/a" for outcome in variants.values()) else "no"


def general(outcome: str, arch: str) -> str:
    """A refusal without the architecture's name, so that one reason is one line."""
    outcome = re.sub(rf"^{arch}:\s*|\s*\({arch}\)|, not model_type '[^']+'", "", outcome)
    return outcome.replace(f"{arch}'s", "its").replace(arch, "it")


def reasons(results: dict) -> list[str]:
    """One line per distinct reason a variant failed, with the architectures it failed for."""
    seen: dict[str, list[str]] = {}
    for arch, features in results["cells"].items():
        for feature, variants in features.items():
            for variant, outcome in variants.items():
                if outcome in ("ok", "n/a"):
                    continue
                outcome = general(outcome, arch)
                column = COLUMNS[feature].split(" (")[0]
                key = (f"{column}: {outcome}" if len(variants) == 1
                       else f"{column}, {variant}: {outcome}")
                seen.setdefault(key, []).append(arch.removesuffix("ForCausalLM"))
    return [f"- {key} ({', '.join(archs)})" for key, archs in sorted(seen.items())]


def render(results: dict) -> str:
    features = list(COLUMNS)
    lines = [BEGIN, "",
             "| `architectures` | " + " | ".join(COLUMNS[f] for f in features) + " |",
             "|---" * (len(features) + 1) + "|"]
    for arch, cells in results["cells"].items():
        lines.append(f"| `{arch}` | " + " | ".join(cell(cells[f]) for f in features) + " |")
    lines += ["", "Why a variant is missing (the error each raised, or what went wrong):", ""]
    lines += reasons(results)
    lines += ["", END]
    return "\n".join(lines)


def rewrite(doc: str, table: str) -> str:
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:start] + table + doc[end:]


def run(architectures: list[str]) -> dict:
    import torch

    from kvserve.testing.checkpoints import make_checkpoint
    from kvserve.testing.support import FEATURES, greedy, try_feature

    torch.manual_seed(0)
    cells = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in architectures:
            work = Path(tmp) / arch
            path = make_checkpoint(work / "checkpoint", arch)
            plain = greedy(path)
            cells[arch] = {f: try_feature(arch, f, path, work / f, plain) for f in FEATURES}
            print(arch, {f: cell(v) for f, v in cells[arch].items()}, flush=True)
    return cells


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", help="only these (merged into the JSON)")
    parser.add_argument("--check", action="store_true", help="compare the table with the JSON")
    parser.add_argument("--render", action="store_true", help="rewrite the table from the JSON")
    args = parser.parse_args()
    doc = DOC.read_text(encoding="utf-8")
    if args.render:
        DOC.write_text(rewrite(doc, render(json.loads(RESULTS.read_text()))), encoding="utf-8")
        return 0
    if args.check:
        ok = rewrite(doc, render(json.loads(RESULTS.read_text()))) == doc
        print("docs/models.md's support matrix is " + ("current" if ok else "out of date"))
        return 0 if ok else 1
    from kvserve.architectures import ARCHITECTURES

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"cells": {}}
    fresh = run(args.arch or list(ARCHITECTURES))
    results["cells"] = {a: fresh.get(a, results["cells"].get(a)) for a in ARCHITECTURES
                        if a in fresh or a in results["cells"]}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    DOC.write_text(rewrite(doc, render(results)), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
