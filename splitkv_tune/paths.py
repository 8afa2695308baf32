"""Where the shipped data lives: a wheel's copy under the package, else the source tree's."""
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent  # the checkout, for an editable install


def data_dir(name: str) -> Path:
    """``configs`` or ``results``: ``splitkv_tune/data/<name>`` in a wheel, ``<repo>/<name>`` in a checkout."""
    packaged = PACKAGE_DIR / "data" / name
    return packaged if packaged.is_dir() else SOURCE_ROOT / name


def kernel_include_dir() -> Path:
    """The kernels' plain-C++ headers (tunables.h, rules.h, live_plan.h, live_model.h), which
    exports embed: a wheel's ``splitkv_tune/data/include``, else the checkout's
    ``kernels/include``."""
    packaged = PACKAGE_DIR / "data" / "include"
    return packaged if packaged.is_dir() else SOURCE_ROOT / "kernels" / "include"
