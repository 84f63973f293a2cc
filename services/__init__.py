"""berth's four services, each runnable as `berth run <name>` or
`python -P -m berth.services.<name>` (installed as `berth.services`: docs/decisions.md)."""
