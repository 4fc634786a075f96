"""Alembic migrations of the service's tables (app.store.tables); run with `kvchat db upgrade`."""
