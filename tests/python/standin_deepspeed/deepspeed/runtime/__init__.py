"""Stand-in for deepspeed.runtime (see ../../README.md)."""
