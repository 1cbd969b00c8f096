"""``colossal benchmark``: every plugin configuration on the GPT workload, as a table."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from colossal.cli.bench.configs import (
    PRECISIONS,
    BenchConfig,
    enumerate_configs,
    filter_configs,
    installed_plugins,
    split_supported,
)
from colossal.cli.bench.gpt import MODEL_SIZES, gpt_config
from colossal.cli.bench.report import build_table, json_document, write_chart, write_json
from colossal.cli.bench.runner import BenchSettings, run_all, settings_dict

__all__ = ["benchmark", "resolve_devices"]

NEEDS_META = (
    "colossal benchmark needs the Booster and its plugins from the colossal meta-package, "
    "which is not installed: pip install colossal"
)


def resolve_devices(gpus: int | None, cpu: bool, nproc: int | None, cuda_count: int) -> int:
    """Check the device options and return the ranks per configuration.

    Raises:
        click.UsageError: Conflicting or missing options, or too few GPUs.
    """
    if gpus is not None and cpu:
        raise click.UsageError("--gpus and --cpu cannot be used together; pick one")
    if nproc is not None and not cpu:
        raise click.UsageError(f"--nproc {nproc} is for CPU runs; add --cpu (or use --gpus N)")
    if cpu:
        nproc = 2 if nproc is None else nproc
        if nproc < 1:
            raise click.UsageError(f"--nproc must be >= 1, got {nproc}")
        return nproc
    if gpus is None:
        raise click.UsageError(
            "choose the devices: --gpus N (CUDA) or --cpu --nproc N (CPU processes, gloo)"
        )
    if gpus < 1:
        raise click.UsageError(f"--gpus must be >= 1, got {gpus}")
    if cuda_count < gpus:
        raise click.UsageError(
            f"--gpus {gpus} needs {gpus} CUDA devices but this machine has {cuda_count}; "
            f"run on CPU processes instead with --cpu --nproc {gpus}"
        )
    return gpus


def _configs(
    devices: int, precisions: tuple[str, ...], pattern: str | None, model_size: str, seq_len: int
) -> tuple[list[BenchConfig], list[tuple[BenchConfig, str]]]:
    """The configurations to run, and those the model cannot take (with the reason)."""
    try:
        plugins = installed_plugins()
    except ModuleNotFoundError as exc:
        if exc.name is not None and not "colossal.booster".startswith(exc.name):
            raise  # something the meta-package needs is missing: show that, not our hint
        raise click.ClickException(NEEDS_META) from None
    try:
        configs = filter_configs(enumerate_configs(devices, plugins, precisions), pattern)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    kept, dropped = split_supported(configs, gpt_config(model_size, seq_len))
    if not kept:
        raise click.UsageError(
            f"the {model_size} model can run none of the selected configurations ("
            + "; ".join(f"{cfg.name}: {why}" for cfg, why in dropped)
            + "); choose a larger --model-size"
        )
    return kept, dropped


@click.command(help="Benchmark every configuration of the installed plugins on a GPT workload.")
@click.option("--gpus", type=int, default=None, help="Ranks per configuration, one GPU each.")
@click.option("--cpu", is_flag=True, help="Run on CPU processes (gloo) instead of GPUs.")
@click.option("--nproc", type=int, default=None, help="CPU processes with --cpu [default: 2].")
@click.option("--filter", "pattern", default=None,
              help="Comma-separated names, globs or substrings, e.g. 'zero*,ddp'.")  # fmt: skip
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True,
              help="Measured steps per configuration.")  # fmt: skip
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--model-size", type=click.Choice(list(MODEL_SIZES)), default="tiny",
              show_default=True)  # fmt: skip
@click.option("--seq-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Samples per rank per step.")  # fmt: skip
@click.option("--precision", "precisions", type=click.Choice(PRECISIONS), multiple=True,
              default=("fp32",), show_default=True, help="Repeat to sweep several.")  # fmt: skip
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds one configuration may take.")  # fmt: skip
@click.option("--output", type=click.Path(dir_okay=False), default=None,
              help="Write the rows as JSON here and a chart next to it (.png).")  # fmt: skip
@click.option("--list", "list_only", is_flag=True, help="List the configurations, run nothing.")
def benchmark(
    gpus: int | None,
    cpu: bool,
    nproc: int | None,
    pattern: str | None,
    steps: int,
    warmup: int,
    model_size: str,
    seq_len: int,
    batch_size: int,
    precisions: tuple[str, ...],
    timeout: float,
    output: str | None,
    list_only: bool,
) -> None:
    """Click entry point of ``colossal benchmark``."""
    import torch

    devices = resolve_devices(gpus, cpu, nproc, torch.cuda.device_count())
    configs, dropped = _configs(devices, precisions, pattern, model_size, seq_len)
    console = Console(highlight=False)
    notes = Console(stderr=True, highlight=False)
    for cfg, why in dropped:
        notes.print(f"skipping {cfg.name} for the {model_size} model: {why}", markup=False)
    if list_only:
        for cfg in configs:
            console.print(f"{cfg.name}: {cfg.plugin}({cfg.plugin_kwargs})"
                          + (f", mixed_precision={cfg.mixed_precision}"
                             if cfg.mixed_precision else "")
                          + (f", model {cfg.workload}" if cfg.workload != "gpt" else ""),
                          markup=False)  # fmt: skip
        return
    try:
        settings = BenchSettings(devices, cpu, steps, warmup, model_size, seq_len, batch_size,
                                 timeout)  # fmt: skip
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    where = f"{devices} CPU processes" if cpu else f"{devices} GPUs"
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"benchmarking on {where}", total=len(configs))

        def done(cfg: BenchConfig, row: dict) -> None:
            progress.advance(task)
            progress.console.print(f"{cfg.name}: {row['status']}", markup=False)

        rows = run_all(configs, settings, on_done=done)
    title = f"colossal benchmark: GPT {model_size}, seq {seq_len}, batch {batch_size}/rank, {where}"
    console.print(build_table(rows, title=title))
    if output is not None:
        doc = json_document(rows, settings_dict(settings))
        json_path = write_json(output, doc)
        chart = write_chart(Path(output).with_suffix(".png"), rows)
        written = f"wrote {json_path}" + (f" and {chart}" if isinstance(chart, Path) else "")
        console.print(written, markup=False)
        if not isinstance(chart, Path):
            console.print(chart, markup=False)  # "[plot]" is an extra, not rich markup
    if any(r["status"] in ("failed", "timeout") for r in rows):
        raise SystemExit(1)
