"""The fault suite: scenarios run against a real stack (tests/faults/harness.py), a fuzz of
every decoder and subject (tests/faults/fuzz.py), and the /proc sampler both it and the
partition bed use (tests/faults/procs.py). The quick form is tests/faults/test_faults.py;
bench/faults.py runs the full form and prints a table."""
