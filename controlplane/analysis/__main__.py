"""``python -m controlplane.analysis``: the analysis commands without the server CLI."""

import typer

from controlplane.analysis.cli import register

app = typer.Typer(no_args_is_help=True, help="burstgate request-log analysis")
register(app)

if __name__ == "__main__":
    app()
