"""``vmstoolkit info``: what this machine offers."""

from __future__ import annotations

import json
import platform
from typing import Annotated, Optional

import typer

from vmstoolkit.cli.common import OutputFormat, fail, rows_to_csv
from vmstoolkit.cli.flags import gpu_flag
from vmstoolkit.errors import NoGPUError
from vmstoolkit.units import format_size


def info_command(
    gpu: Annotated[Optional[int], gpu_flag("CUDA device to describe (default 0).")] = None,
    fmt: Annotated[OutputFormat, typer.Option("--format", "-f", help="table: for people; json: one JSON object "
                                              "(one line). csv: the same object as one CSV row.")] = OutputFormat.table,
    device: Annotated[Optional[int], typer.Option("--device", metavar="N", hidden=True,
                                                  help="The old name of --gpu.")] = None,
    as_json: Annotated[bool, typer.Option("--json", hidden=True, help="The old name of --format json.")] = False,
) -> None:
    """Describe the GPU (driver, VMM support, granularity, free memory), or say there is none."""
    from vmstoolkit import __version__
    from vmstoolkit.pools.drivers.cuda import device_info

    if gpu is not None and device is not None and gpu != device:
        fail(f"--gpu {gpu} and --device {device} (its old name) disagree; give --gpu", code=2)
    device = gpu if gpu is not None else (device if device is not None else 0)
    if device < 0:
        fail(f"--gpu must be a device number (0 or more), got {device}", code=2)
    if as_json:
        fmt = OutputFormat.json

    try:
        info = {"gpu": True, **device_info(device)}
    except NoGPUError as e:
        info = {"gpu": False, "reason": str(e), "driver": "sim"}
    info["vmstoolkit"] = __version__
    info["python"] = platform.python_version()
    if fmt is OutputFormat.json:
        typer.echo(json.dumps(info))
        return
    if fmt is OutputFormat.csv:
        typer.echo(rows_to_csv([info]), nl=False)
        return
    if not info["gpu"]:
        typer.echo(f"No usable CUDA GPU: {info['reason']}")
        typer.echo("The simulated VMM driver will be used (2 MiB granularity, 141 GiB capacity unless --capacity is given).")
        return
    typer.echo(f"GPU {info['device']}: {info['name']} (compute capability {info['compute_capability']}), "
               f"{info['device_count']} device(s), driver {info['driver_version']}")
    typer.echo(f"VMM supported: {'yes' if info['vmm_supported'] else 'no'}; granularity {format_size(info['granularity'])}")
    typer.echo(f"Memory: {format_size(info['free_bytes'])} free of {format_size(info['total_bytes'])}")
