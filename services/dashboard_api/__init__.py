"""A pure projection of the events stream into queryable state, served over HTTP."""
