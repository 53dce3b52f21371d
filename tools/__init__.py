"""The repository's tools (not in the wheel): the import-arrows report (``import_arrows.py``)
and the goodput simulator (``goodput/``)."""
