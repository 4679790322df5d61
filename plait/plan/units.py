"""Numbers in units that fit their size: a tiny model's 1.6 M parameters and 14 MB read as
such, not as 0.00 B and 0.0 GB; a 405B model's stay in B and GB."""

from __future__ import annotations

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def _scaled(x: float, prefixes: tuple[tuple[float, str], ...]) -> tuple[float, str]:
    for scale, name in prefixes:
        if abs(x) >= scale:
            return x / scale, name
    return x, ""


def _digits(v: float) -> str:
    """Three significant figures, no exponent."""
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def params(n: float) -> str:
    """A parameter count: 405 B, 8.03 B, 1.62 M, 512 K."""
    v, p = _scaled(float(n), ((1e9, "B"), (1e6, "M"), (1e3, "K")))
    return f"{_digits(v)} {p}".rstrip()


def nbytes(n: float) -> str:
    """Bytes in decimal units (the planner's GB is 1e9): 61.2 GB, 14.2 MB, 512 KB."""
    v, p = _scaled(float(n), _PREFIXES)
    return f"{_digits(v)} {p}B"


def flops_rate(x: float) -> str:
    """FLOP/s: 412 TFLOP/s, 3.25 GFLOP/s."""
    v, p = _scaled(float(x), _PREFIXES)
    return f"{_digits(v)} {p}FLOP/s"
