from ..op_builder import AsyncIOBuilder
