"""The `pw` API user programs import (`import pwctl as pw`): slices, compiled functions,
program tracing and futures."""
