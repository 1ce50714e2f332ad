"""Stand-in for the CPU accelerator's builders (their own classes, same names)."""
from .async_io import AsyncIOBuilder
