"""sampling ops (filled by the registry migration)."""
from __future__ import annotations

from .op import Op

OPS: tuple[Op, ...] = ()
