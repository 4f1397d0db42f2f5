"""What both benchmarks share: colours that respect NO_COLOR and pipes, a progress line, the
column alignment of their text tables, and the description of the machine a run was made on."""
from __future__ import annotations

import datetime
import os
import platform
import sys
from typing import Callable

import jax

_CODES = {"red": "\033[31m", "grey": "\033[90m"}


def colour_on(stream=None) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set to anything (no-color.org)."""
    stream = sys.stdout if stream is None else stream
    return not os.environ.get("NO_COLOR") and hasattr(stream, "isatty") and stream.isatty()


def paint(text: str, colour: str, stream=None) -> str:
    """`text` in `colour` ('red' or 'grey') where colour_on(stream), else unchanged."""
    return f"{_CODES[colour]}{text}\033[0m" if colour_on(stream) else text


def aligner(head: tuple, cells: list[tuple], left) -> Callable[[tuple], str]:
    """line(row) for a text table of head and cells: each column as wide as its widest cell,
    the columns at indices in `left` (text) left-aligned, the others (numbers) right-aligned."""
    width = [max(len(c[i]) for c in [*cells, head]) for i in range(len(head))]
    left = set(left)
    return lambda c: "  ".join(s.ljust(w) if i in left else s.rjust(w) for i, (s, w) in enumerate(zip(c, width)))


class Progress:
    """A progress line on stderr (tqdm if it imports), only where stderr is a terminal: a pipe or
    a log file gets no carriage returns or escape codes. write() prints a line above it."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.n, self.bar = total, 0, None
        self.enabled = enabled and sys.stderr.isatty()
        if self.enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, leave=False)
            except ImportError:
                pass

    def step(self, label: str):
        self.n += 1
        if self.bar is not None:
            self.bar.set_description(label)
            self.bar.update(1)
        elif self.enabled:
            print(f"\r\033[K[{self.n}/{self.total}] {label}", end="", file=sys.stderr, flush=True)

    def write(self, msg: str):
        if self.bar is not None:
            self.bar.write(msg)
            return
        self._erase()
        print(msg, flush=True)

    def _erase(self):
        if self.enabled and self.bar is None:
            print("\r\033[K", end="", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        self._erase()


def machine() -> dict:
    """The run's metadata: date, device, versions."""
    device = jax.devices()[0]
    on_gpu = jax.default_backend() == "gpu"
    import jax_lnbwd
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": device.device_kind if on_gpu else f"cpu ({platform.processor() or platform.machine()})",
        "platform": device.platform, "jax": jax.__version__, "jax_lnbwd": jax_lnbwd.__version__,
        "kernels_built_for_cuda": jax_lnbwd.WITH_CUDA, "python": platform.python_version(),
    }
