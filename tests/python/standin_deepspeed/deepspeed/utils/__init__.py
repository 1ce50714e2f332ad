"""Stand-in for deepspeed.utils (see ../../README.md): only pin_memory."""
