"""Persistent state: SQLAlchemy models and the engine, upgraded by Alembic at start."""
