"""Persistence: SQLAlchemy models, engine creation and repositories.

Nothing here is called on the admission path; the service layer loads config
at start and on change, and writes behind.
"""
