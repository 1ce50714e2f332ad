from .async_io import AsyncIOBuilder


class GDSBuilder(AsyncIOBuilder):
    BUILD_VAR = "DS_BUILD_GDS"
    NAME = "gds"
