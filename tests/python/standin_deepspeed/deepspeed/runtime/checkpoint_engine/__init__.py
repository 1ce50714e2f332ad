"""Stand-in for deepspeed.runtime.checkpoint_engine (see ../../../README.md)."""
