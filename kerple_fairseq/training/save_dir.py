"""``--save-dir`` made when the first checkpoint is saved, not before the data is read.

fairseq-train checks its save directory before anything else (``verify_checkpoint_directory``: it
makes the folder and writes a file there), so a run refused a moment later (a data-bin that is not
one, a bad option of the model) left an empty folder behind. The check now makes what it needs,
writes its file, and removes again the folders it made; fairseq's ``save_checkpoint`` makes the
folder when it saves.
"""

import os

from fairseq import checkpoint_utils


def _leaving_nothing(stock):
    def verify_checkpoint_directory(save_dir: str) -> None:
        made = []
        folder = os.path.abspath(save_dir)
        while folder and not os.path.exists(folder):
            made.append(folder)
            folder = os.path.dirname(folder)
        try:
            stock(save_dir)
        finally:  # also when the folder cannot be written to
            for folder in made:  # the deepest first, each empty again
                os.rmdir(folder)

    verify_checkpoint_directory.kerple_fairseq = True
    return verify_checkpoint_directory


def install_save_dir_made_on_save() -> None:
    if not getattr(checkpoint_utils.verify_checkpoint_directory, "kerple_fairseq", False):
        checkpoint_utils.verify_checkpoint_directory = _leaving_nothing(checkpoint_utils.verify_checkpoint_directory)
