"""``colossal check -i``: versions, version-range agreement, accelerator, kernel registry."""

from __future__ import annotations

import importlib.util

import click
from rich.console import Console
from rich.table import Table

from colossal.cli.installation import (
    accelerator_info,
    check_ranges,
    colossal_distributions,
    runtime_versions,
)

__all__ = ["check", "check_installation"]


def _kernels(console: Console) -> list[str]:
    """Print the kernel registry report; return the problems found."""
    if importlib.util.find_spec("colossal.kernels") is None:
        console.print("kernels: colossal-kernels is not installed (optional)")
        return []
    try:
        from colossal.kernels import format_kernel_report, kernel_report

        rows = kernel_report()
    except Exception as exc:  # noqa: BLE001 - a broken install is what we report
        console.print(f"[red]kernels: colossal-kernels failed to load: {exc}[/red]")
        return [f"colossal-kernels is installed but its registry failed: {exc}"]
    console.print("\n[bold]Kernels[/bold] (which implementation each kernel uses and why)")
    console.print(format_kernel_report(rows), markup=False, highlight=False, soft_wrap=True)
    return []


def check_installation(console: Console | None = None) -> list[str]:
    """Print the installation report.

    Args:
        console: Where to print (a new stdout console by default).

    Returns:
        The problems that make the installation broken (empty when it is fine).
    """
    console = Console(highlight=False, soft_wrap=True) if console is None else console
    problems: list[str] = []
    versions = Table(title="Versions", show_header=False)
    for name, value in runtime_versions().items():
        versions.add_row(name, value)
    console.print(versions)

    dists = colossal_distributions()
    if not dists:
        console.print(
            "colossal packages: none installed as distributions (running from a source tree?); "
            "version ranges cannot be checked"
        )
    else:
        table = Table(title="Colossal packages")
        table.add_column("distribution")
        table.add_column("version")
        for dist in dists:
            table.add_row(dist.name, dist.version)
        console.print(table)
        ranges = Table(title="Declared version ranges")
        for col in ("package", "requires", "installed", "agree"):
            ranges.add_column(col)
        for chk in check_ranges(dists):
            ranges.add_row(chk.dist, chk.requirement, chk.installed or "missing",
                           "yes" if chk.ok else "[red]NO[/red]")  # fmt: skip
            if not chk.ok:
                problems.append(
                    f"{chk.dist} requires {chk.requirement} but "
                    f"{'it is not installed' if chk.installed is None else chk.installed}"
                    f"{'' if chk.installed is None else ' is installed'}; run "
                    f"pip install '{chk.requirement}'"
                )
        console.print(ranges)

    acc = accelerator_info()
    console.print("\n[bold]Accelerator[/bold]")
    if acc.error is not None:
        console.print(f"[red]accelerator: {acc.error}[/red]")
        problems.append(f"get_accelerator() failed: {acc.error}")
    else:
        console.print(f"accelerator: {acc.name} (device {acc.device}, {acc.device_count} visible)")
        mark = "available" if acc.backend_available else "[red]NOT available[/red]"
        console.print(f"communication backend: {acc.backend} ({mark})")
        if not acc.backend_available:
            problems.append(
                f"the {acc.backend} backend of torch.distributed is not available; install a "
                f"torch build with {acc.backend}, or set COLOSSAL_ACCELERATOR=cpu to use gloo"
            )
    problems += _kernels(console)

    if problems:
        console.print("\n[red bold]Broken:[/red bold]")
        for p in problems:
            console.print(f"  - {p}", soft_wrap=True)
    else:
        console.print("\n[green]Installation OK[/green]")
    return problems


@click.command(help="Check the installation (use -i for versions, accelerator and kernels).")
@click.option("-i", "--installation", is_flag=True, help="Report on the installation.")
def check(installation: bool) -> None:
    """Click entry point of ``colossal check``."""
    if not installation:
        raise click.UsageError("nothing to check; use `colossal check -i`")
    if check_installation():
        raise SystemExit(1)
