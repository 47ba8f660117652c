"""`python -m dspark.cli`: the `dspark` command."""
from dspark.cli.main import main_cli

main_cli()
