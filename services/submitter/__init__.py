"""The only entrance: validates submit messages, assigns job ids, emits JobSubmitted."""
