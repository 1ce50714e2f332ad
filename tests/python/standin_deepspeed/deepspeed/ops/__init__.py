"""Stand-in for deepspeed.ops: __compatible_ops__ from each builder's is_compatible()."""
from . import op_builder

__compatible_ops__ = {
    cls.NAME: cls().is_compatible()
    for cls in (op_builder.AsyncIOBuilder, op_builder.GDSBuilder, op_builder.PinMemoryBuilder,
                op_builder.UtilsBuilder)
}
