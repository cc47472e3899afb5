"""Errors raised for bad input. All subclass ``ValueError`` so callers can catch one type."""


class LongSpecError(ValueError):
    """Base class of the library's input errors."""


class ConfigError(LongSpecError):
    """A model config is missing, malformed or describes an unsupported architecture."""


class WeightsError(LongSpecError):
    """Weights are missing, truncated, mis-named or of the wrong shape."""
