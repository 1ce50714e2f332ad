"""Stand-in for DeepSpeed's top-level package (see ../README.md)."""
__version__ = "0.19.6+standin"
