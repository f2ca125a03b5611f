"""Bounds of request fields that the controller enforces and `pwctl` checks first, in one place for
both: the controller imports them from here (as it does pwctl.errors), and pwctl never imports
server code. Light on purpose: `pwctl submit --help` shows them."""

from __future__ import annotations

MAX_PRIORITY = 1000  # a job's priority (SubmitJobRequest.priority) is -MAX_PRIORITY..MAX_PRIORITY
MAX_WEIGHT = 1e6  # a job's (and a session's) proportional-share weight is a number in (0, MAX_WEIGHT]
