"""Writing an analysis's numbers: each file appears whole or not at all (written beside, then renamed)."""

import csv
import json
import os
from typing import List


def write_csv(path: str, header: List[str], rows) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    os.replace(partial, path)


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def write_json(path: str, value) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(partial, path)
