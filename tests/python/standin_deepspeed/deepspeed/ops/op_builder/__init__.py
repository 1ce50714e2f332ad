"""Stand-in for deepspeed.ops.op_builder: the builder classes by name."""
from .async_io import AsyncIOBuilder
from .builder import OpBuilder
from .gds import GDSBuilder
from .pin_memory import PinMemoryBuilder
from .utils import UtilsBuilder
