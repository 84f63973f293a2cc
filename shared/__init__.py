"""Code shared by every berth service: wire messages, the task state machine,
and the NATS / Redis / telemetry plumbing."""
