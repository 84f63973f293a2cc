"""One per host: registers, heartbeats, runs assigned attempts as real processes, reports."""
