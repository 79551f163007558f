"""The one place that prepares for `import paddle`, run by `fastdeploy/__init__.py` before any
submodule (every `import paddle` of the project sits in a submodule, so it comes after this).

- Paddle's C++-extension helpers warn "No ccache found" when `paddle` is imported and again when an
  op is built. ccache only speeds up rebuilding Paddle's own extensions; this project builds its op
  once and caches it (cpu_op_loader), so the warning is noise on every start, benchmark and test run.
- Paddle is not an install requirement (a CPU wheel pinned there would be installed over a user's
  `paddlepaddle-gpu`): entry points call `require_paddle()` to turn its absence into one line.
"""

from __future__ import annotations

import importlib.util
import warnings

CCACHE_WARNING = r"No ccache found"
MISSING_PADDLE = (
    "PaddlePaddle is not installed: install the CPU wheel `paddlepaddle` "
    "(pip install -e \".[cpu]\" does it) or, for CUDA, `paddlepaddle-gpu` from paddlepaddle.org.cn"
)


def quiet_paddle_import_warnings() -> None:
    warnings.filterwarnings("ignore", message=CCACHE_WARNING, category=UserWarning)


def paddle_installed() -> bool:
    try:
        return importlib.util.find_spec("paddle") is not None
    except ImportError:  # a broken or blocked install
        return False


def require_paddle() -> None:
    """ImportError with MISSING_PADDLE when Paddle is absent (without importing it)."""
    if not paddle_installed():
        raise ImportError(MISSING_PADDLE)
