"""Errors the trainer raises for bad configuration and for runs that must stop."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and how to fix it.

    Raised before anything is written to the run directory, so a bad command never damages an
    existing run.
    """


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (non-finite loss with ``trainer.on_nan=stop``).

    The last good checkpoint is left intact; the message says where it is.
    """
