"""The ``colossal`` console script: ``run``, ``check`` and ``benchmark``.

This is the one place in Colossal that configures logging handlers.
"""

from __future__ import annotations

import logging

import click

from colossal.cli.__about__ import __version__
from colossal.cli.bench.command import benchmark
from colossal.cli.check_command import check
from colossal.cli.run_command import run

__all__ = ["cli", "main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="colossal")
@click.option("-v", "--verbose", is_flag=True, help="Log what the launcher does.")
def cli(verbose: bool) -> None:
    """Colossal: launch distributed jobs, check the installation, benchmark the plugins."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


cli.add_command(run)
cli.add_command(check)
cli.add_command(benchmark)


def main() -> None:
    """Run the ``colossal`` command line."""
    cli(prog_name="colossal")


if __name__ == "__main__":
    main()
