"""weightlift: model weights from disk or another machine into memory, fast, every byte checked."""

from .errors import (
    AuthError,
    CacheError,
    DeviceError,
    FormatError,
    NotFoundError,
    OptionError,
    ProtocolError,
    TransportError,
    WeightliftError,
)

__version__ = "0.1.0"
