"""The data directory's layout lives on the client side (`pwctl.paths`); this re-exports it."""

from pwctl.paths import *  # noqa: F403
from pwctl.paths import __all__ as __all__
