"""`python -m dspark.cli`: the `dspark` command."""
from dspark.cli import dspark_main

dspark_main()
