"""The only writer of placement: one fenced leader, any number of standbys."""
