"""Re-render the Markdown table and plots of a recorded ``lowcomm bench --json`` file.

    python benchmarks/render.py docs/bench/resnet18_4w.json

Writes ``<stem>.md`` and ``<stem>.png`` (+ ``_speedup.png`` / ``_accuracy.png``) next to it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lowcomm.bench import report


def main(path: str) -> None:
    result = report.load_json(path)
    src = Path(path)
    src.with_suffix(".md").write_text(report.markdown(result))
    for f in report.plot(result, src.with_suffix(".png")):
        print(f"wrote {f}")
    print(f"wrote {src.with_suffix('.md')}")


if __name__ == "__main__":
    main(sys.argv[1])
