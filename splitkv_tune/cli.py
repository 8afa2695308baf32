"""The ``splitkv-tune`` command line: a click group; each command lives in a module of its own."""
import click

from splitkv_tune.cli_batch import batch_table, compare_batch, cross_validate_batches, evaluate_batches, sweep_batches
from splitkv_tune.cli_tables import evaluate, export, plot, select
from splitkv_tune.cli_sweep import restore_storage, sweep, table
from splitkv_tune.cli_tune import bench, compare, env
from splitkv_tune.cli_worker import worker
from splitkv_tune.diff import diff_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="splitkv-tune")
def main() -> None:
    """Tune and benchmark the split-KV FlashAttention kernel; export heuristic tables."""


for command in (bench, sweep, worker, table, restore_storage, compare, compare_batch, sweep_batches, batch_table,
                env, select, evaluate, evaluate_batches, cross_validate_batches, export, plot, diff_command):
    main.add_command(command)


if __name__ == "__main__":
    main()
