"""`pwctl`: a thin Typer + Rich layer over the typed client library (one module per noun)."""
