"""berth's four services, each runnable as `python -P -m berth.services.<name>` or `berth run <name>`."""
