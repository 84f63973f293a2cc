"""berth's four services, each runnable as `python -m services.<name>` or `berth run <name>`."""
