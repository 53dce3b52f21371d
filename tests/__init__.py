"""The repository's own tests that live outside the package (see ``tests/support``)."""
