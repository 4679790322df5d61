"""A configuration value checked against its field's type: the one parser of `--set`
strings, TOML values and flag values (plait/config/schema.py's `set_value` calls it).

`steps = 3.5`, `lr = nan`, `sp = 3` are ValueErrors naming the expected type. Standard
library only (the package layer, below config).
"""

from __future__ import annotations

import math
from typing import Any


def coerce_value(value: Any, type_name: str) -> Any:
    """Parse a `--set` string, or check a TOML / flag value, into the type the field holds.

    Raises ValueError naming the expected type: `steps = 3.5` or `lr = nan` never pass."""
    if isinstance(value, str):
        value = _parse_text(value, type_name)
    if value is None:
        if "None" in type_name:
            return None
        raise ValueError("expected a value, got none")
    if "tuple" in type_name:
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ValueError(f"expected a list of names, got {value!r}")
    if "bool" in type_name:
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {value!r}")
    if "int" in type_name and "float" not in type_name:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 4.0 is 4; 3.5 is not an integer
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"expected an integer, got {value!r}")
    if "float" in type_name:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _parse_text(text: str, type_name: str) -> Any:
    """A string (from `--set`) parsed to the field's type; other fields keep the string."""
    text = text.strip()
    if "tuple" in type_name:
        return tuple(s.strip() for s in text.split(",") if s.strip())
    if text.lower() in ("none", "null") and "None" in type_name:
        return None
    if "bool" in type_name:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if "int" in type_name and "float" not in type_name:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if "float" in type_name:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    return text
