"""Alembic migrations: numbered revisions in `versions/`, applied at server start."""
