"""Where the experiments find things: this checkout's plugin folder and scripts, the fairseq
commands installed beside the running interpreter, and the WikiText-103 sample."""

import os
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[2]
USER_DIR = REPO / "kerple_fairseq"  # what fairseq's --user-dir names
SCRIPTS = REPO / "scripts"
BIN = Path(sys.executable).parent  # fairseq-preprocess, fairseq-train, ...


def sample_places(repo: Path = REPO) -> List[Path]:
    """Where the WikiText-103 sample (the first 2.5 MiB of training text, the complete validation and
    test splits) is looked for, in order: ``$KERPLE_WIKITEXT_DIR``, else ``../shared/data/wikitext-103-sample``
    beside the checkout ``repo``, else ``downloads/wikitext-103-sample`` (the small comparison's download)."""
    if os.environ.get("KERPLE_WIKITEXT_DIR"):
        return [Path(os.environ["KERPLE_WIKITEXT_DIR"])]
    return [repo.parent / "shared" / "data" / "wikitext-103-sample", repo / "downloads" / "wikitext-103-sample"]
