"""What a long comparison has finished, so that the same command after a kill or a reboot goes on
where it stopped.

Each step of a comparison (training one model, evaluating one checkpoint) writes a record when it
completes: a JSON file beside its outputs holding the step's key (the options that produced the
outputs, with fingerprints of the files it read) and the seconds it took. A later run skips the step
when the record is there with the same key and every output exists; otherwise the step runs again
from its start. A step cut short leaves no record, and a changed option changes the key, so only the
steps it touches are redone (a training redone takes its run's evaluation with it). The key holds
options and data, not the code: after a change to the code that alters results, use another output
directory or remove the records.
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def data_bin_fingerprint(data_bin: Path) -> str:
    """A digest of what training and evaluation read from a fairseq data-bin: its dictionary and its
    training and validation splits."""
    digest = hashlib.sha256()
    for name in ("dict.txt", "train.bin", "train.idx", "valid.bin", "valid.idx"):
        path = data_bin / name
        digest.update(f"{name}:{file_digest(path) if path.is_file() else 'absent'}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Step:
    """One step of a comparison: its ``record`` file, its ``key`` (JSON-serialisable) and the ``outputs`` it writes."""

    record: Path
    key: dict
    outputs: Sequence[Path]

    def finished(self, unchecked: Sequence[str] = ()) -> Optional[float]:
        """The seconds the step took if it finished with this key and its outputs are all there, else None;
        the entries of the key named in ``unchecked`` may differ."""
        try:
            done = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(done, dict) or not isinstance(done.get("key"), dict):
            return None
        recorded, expected = ({k: v for k, v in key.items() if k not in unchecked}
                              for key in (done["key"], json.loads(json.dumps(self.key))))
        if recorded != expected or not all(p.exists() for p in self.outputs):
            return None
        return float(done.get("seconds", 0.0))

    def forget(self) -> None:
        """Remove the record (before the step runs again, so that a run cut short leaves none)."""
        self.record.unlink(missing_ok=True)

    def complete(self, seconds: float, **facts) -> None:
        """Record the step as finished (written whole or not at all), with ``facts`` about it (JSON-serialisable)."""
        partial = self.record.with_name(self.record.name + ".partial")
        partial.write_text(json.dumps({"key": self.key, "seconds": seconds, "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       **facts}, indent=1))
        os.replace(partial, self.record)
