"""The package version, in one place (setup.py, the server's /version and --version read it)."""

__version__ = "0.1.0"
