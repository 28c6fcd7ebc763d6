"""/v1: the simple JSON (or binary) API for curl users."""
