"""Memory sizes as people write them ("80GB", "80GiB", "512MB") and as the planner prints them."""

from __future__ import annotations

import re

from paratrain.errors import ConfigError

# Decimal units as GPU vendors print them; binary units as torch.cuda.memory and nvidia-smi count.
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]+)\s*$")


def parse_memory(text: str, *, argument: str) -> int:
    """Bytes in a size such as "80GB" (10^9), "80GiB" (2^30), "512MB" or "1.5TB".

    Args:
        argument: How the user passed it (e.g. ``--gpu-memory``), for the error message.

    Raises:
        ConfigError: naming the argument and an example, when the text is not a positive size with a unit.
    """
    match = _SIZE.match(text)
    unit = match and _UNITS.get(match.group(2).upper())
    if not unit or float(match.group(1)) <= 0:
        example = f"{argument} 80GB" if argument.startswith("--") else f"{argument}=80GB"  # an option or a config key
        raise ConfigError(
            f"{argument}={text!r} is not a memory size; write a positive number with a unit, e.g. {example} "
            f"(units: B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)"
        )
    return int(float(match.group(1)) * unit)


def format_bytes(num_bytes: float) -> str:
    """Bytes in binary units, three significant figures: '1.50 GiB', '312 MiB', '12.0 KiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            value = num_bytes / size
            return f"{value:.3g} {unit}" if value >= 100 else f"{value:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def format_seconds(seconds: float) -> str:
    """'412 ms', '3.20 ms', '85 us': durations from microseconds to seconds."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
