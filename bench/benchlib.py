"""What the Python benchmarks in bench/ share (imported, not run)."""
import argparse
import re


def size_arg(text):
    """argparse type: "512M", "2G", "4096" (powers of 1024, as fio and dnvme read them)."""
    m = re.fullmatch(r"(\d+)([KMGT]?)", text.strip().upper())
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError("not a size: %r (use e.g. 512M or 2G)" % text)
    return int(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " ")
