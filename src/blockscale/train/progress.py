"""The step progress bar of a training run."""
from __future__ import annotations


class ProgressBar:
    """tqdm when available and wanted, else a silent stand-in; ``log`` prints above the bar."""

    def __init__(self, enabled: bool, total: int, initial: int):
        self.tqdm = None
        if enabled:
            try:
                from tqdm.auto import tqdm
                self.tqdm = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, **postfix):
        if self.tqdm is not None:
            self.tqdm.set_postfix(postfix, refresh=False)
            self.tqdm.update(1)

    def log(self, msg: str):
        if self.tqdm is not None:
            self.tqdm.write(msg)
        else:
            print(msg, flush=True)

    def close(self):
        if self.tqdm is not None:
            self.tqdm.close()


__all__ = ["ProgressBar"]
