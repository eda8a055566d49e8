"""``vmstoolkit info``: what this machine offers."""

from __future__ import annotations

import json
import platform
from typing import Annotated

import typer

from vmstoolkit.errors import NoGPUError
from vmstoolkit.units import format_size


def info_command(
    device: Annotated[int, typer.Option(help="CUDA device to describe.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Describe the GPU (driver, VMM support, granularity, free memory), or say there is none."""
    from vmstoolkit import __version__
    from vmstoolkit.pools.drivers.cuda import device_info

    try:
        info = {"gpu": True, **device_info(device)}
    except NoGPUError as e:
        info = {"gpu": False, "reason": str(e), "driver": "sim"}
    info["vmstoolkit"] = __version__
    info["python"] = platform.python_version()
    if as_json:
        typer.echo(json.dumps(info))
        return
    if not info["gpu"]:
        typer.echo(f"No usable CUDA GPU: {info['reason']}")
        typer.echo("The simulated VMM driver will be used (2 MiB granularity, 141 GiB capacity unless --capacity is given).")
        return
    typer.echo(f"GPU {info['device']}: {info['name']} (compute capability {info['compute_capability']}), "
               f"{info['device_count']} device(s), driver {info['driver_version']}")
    typer.echo(f"VMM supported: {'yes' if info['vmm_supported'] else 'no'}; granularity {format_size(info['granularity'])}")
    typer.echo(f"Memory: {format_size(info['free_bytes'])} free of {format_size(info['total_bytes'])}")
