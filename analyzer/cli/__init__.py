"""The `dumpdiff` command line: option parsing, exit codes and error handling, nothing else."""
